"""The algorithm plug-in plumbing end to end over a broker: a partial model share, named extras
both ways, algorithm hyperparameters from ``[algorithm]`` reaching the clients, the strategy's
round metrics, validation refusals, and client-side evaluation.

The toy algorithm ("plumbing-probe") is registered here: each client uploads the backbone only
and ``extras = {"count": [n_k], "echo": the global "total" it received}``; the server sums the
counts into ``total`` and broadcasts it in the next round's ``global``. So the value a client
echoes in round r must equal Σ n_k of round r−1, which the test checks from metrics.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers.federation import small_config

from broker_server.errors import ConfigError
from broker_server.simulate import simulate
from broker_server.strategies import register_strategy
from broker_server.strategies.fedavg import FedAvg
from edge_agent.algorithms import load_shared, register_client_algorithm, shared_arrays, shared_indices
from edge_agent.algorithms._base import LocalResult
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.models import build_model


@register_client_algorithm("plumbing-probe")
class ProbeClient(FedAvgClient):
    share = "backbone"

    def local_round(self, model, global_tensors, x, y, config, *, round, client_index, device, client_id="",
                    params=None, global_extras=None):
        load_shared(model, global_tensors, self.share)
        echo = np.asarray(global_extras.get("total", np.zeros(1, np.int64)), dtype=np.int64)
        return LocalResult(tensors=shared_arrays(model, self.share), num_samples=int(y.shape[0]), train_loss=0.0,
                           metrics={"probe_scale": float(params.get("probe_scale", -1))},
                           extras={"count": np.array([len(y)], np.int64), "echo": echo})


@register_strategy("plumbing-probe")
class ProbeStrategy(FedAvg):
    share = "backbone"

    def __init__(self, *, probe_scale: float = 1.0, **kw) -> None:
        super().__init__(**kw)
        self.probe_scale = probe_scale
        self.total = np.zeros(1, np.int64)
        self.echoes: dict = {}
        self.scales: list = []

    def configure_round(self, round, available, rng):
        plan = super().configure_round(round, available, rng)
        return type(plan)(selected=plan.selected, config={**plan.config, "probe_scale": self.probe_scale})

    def validate(self, result):
        if set(result.extras) != {"count", "echo"}:
            return f"extras {sorted(result.extras)} != ['count', 'echo']"
        return None

    def aggregate(self, round, current, results):
        self.echoes = {r.client_id: int(r.extras["echo"][0]) for r in results}
        self.scales = sorted({r.metrics["probe_scale"] for r in results})
        self.total = np.array([sum(int(r.extras["count"][0]) for r in results)], np.int64)
        return super().aggregate(round, current, results)

    def global_extras(self):
        return {"total": self.total}

    def round_metrics(self):
        return {"probe_total": int(self.total[0]), "probe_echoes": self.echoes, "probe_scales": self.scales}


def test_shared_indices_of_the_light_cnn() -> None:
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    names = list(model.state_dict())
    assert shared_indices(names, "all") == tuple(range(len(names)))
    assert shared_indices(names, "none") == ()
    assert [names[i] for i in shared_indices(names, "backbone")] == [n for n in names if n.startswith("backbone.")]
    with pytest.raises(ValueError):
        shared_indices(names, "head")


def test_probe_federation(tmp_path: Path) -> None:
    cfg = small_config(run={"rounds": 3}, server={"client_eval": True, "client_eval_max": 200},
                       algorithm={"probe_scale": 2.5}, train={"algorithm": "plumbing-probe"})
    res = simulate(cfg, run_dir=tmp_path / "run")
    assert res.rounds_completed == 3
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    parts = json.loads((tmp_path / "run" / "partition.json").read_text())
    n_total = sum(c["samples"] for c in parts["clients"])
    for m in metrics:
        assert m["share"] == "backbone"
        assert m["probe_total"] == n_total  # every client reported (quorum 2 of 3, all selected)
        assert m["probe_scales"] == [2.5]  # the [algorithm] value reached every client via round_start
        assert 0.0 <= m["client_accuracy_worst"] <= m["client_accuracy_mean"] <= 1.0
        assert m["clients_evaluated"] == 3
    assert set(metrics[0]["probe_echoes"].values()) == {0}  # round 1: no global extras yet
    assert set(metrics[1]["probe_echoes"].values()) == {n_total}  # round 2 echoes round 1's total
    # the ledger: uploads carry only the backbone (6 of 8 LightCNN tensors) plus the two extras
    import sqlite3

    con = sqlite3.connect(tmp_path / "run" / "ledger.sqlite")
    rows = con.execute("select fields from messages where side='agent' and kind='update' and event='sent'").fetchall()
    assert rows
    for (fields,) in rows:
        f = json.loads(fields)
        assert {"extras.count", "extras.echo"} <= set(f)
        # 6 backbone tensors of the light CNN, raw fp32: the tensors field holds exactly their bytes + headers
        assert f["tensors"] < 4 * 105_216 + 200
    backbone = 4 * sum(int(np.prod(s)) for n, s in [(n, t.shape) for n, t in
                       build_model("lightcnn", in_channels=1, image_size=8, num_classes=10).state_dict().items()]
                       if n.startswith("backbone."))
    raw = con.execute("select raw_bytes from messages where side='agent' and kind='update' and event='sent'").fetchall()
    assert {r for (r,) in raw} == {backbone + 8 + 8}  # + the two int64 extras


def test_unknown_algorithm_parameter_is_a_config_error(tmp_path: Path) -> None:
    cfg = small_config(algorithm={"no_such_knob": 1})
    with pytest.raises(ConfigError, match="no_such_knob"):
        simulate(cfg, run_dir=tmp_path / "run")


def test_train_samples_partitions_a_stratified_subset() -> None:
    from broker_server.config import from_dict
    from broker_server.simulate import split_clients
    from edge_agent.data import load_dataset

    ds = load_dataset("digits")
    cfg = from_dict({"run": {"seed": 3}, "data": {"dataset": "digits", "partition": "iid", "clients": 4,
                                                  "train_samples": 400}})
    parts = split_clients(ds, cfg)
    flat = np.concatenate(parts)
    assert [len(p) for p in parts] == [100] * 4 and len(set(flat.tolist())) == 400
    n_c = np.bincount(ds.train.y, minlength=10)
    got = np.bincount(ds.train.y[flat], minlength=10)
    quota = np.floor(400 * n_c / len(ds.train.y))  # largest-remainder apportionment: each class within one
    assert np.all((got - quota >= 0) & (got - quota <= 1)) and got.sum() == 400
    whole = split_clients(ds, cfg.replace("data", train_samples=0))
    assert sum(len(p) for p in whole) == len(ds.train.y)


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml")),
                         ids=lambda p: p.name)
def test_every_example_config_builds_its_algorithm(path: Path) -> None:
    """Each shipped example parses, and its [algorithm] table is accepted by both halves."""
    from broker_server.config import load
    from broker_server.runtime import make_client_algorithm, make_strategy
    from edge_agent.data import load_dataset

    cfg = load(path)
    ds = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir or None,
                      domain_train_cap=cfg.data.domain_train_cap, domain_test_cap=cfg.data.domain_test_cap)
    strategy = make_strategy(cfg, ds)
    client = make_client_algorithm(cfg, ds)
    assert strategy.name == client.name == cfg.train.algorithm


@register_client_algorithm("plumbing-nan")
class DivergingClient(FedAvgClient):
    """Client 0's local training 'diverges' (NaN weights); the others are FedAvg."""

    def local_round(self, model, global_tensors, x, y, config, *, round, client_index, device, client_id="",
                    params=None, global_extras=None):
        res = super().local_round(model, global_tensors, x, y, config, round=round, client_index=client_index,
                                  device=device)
        if client_index == 0:
            return LocalResult(tensors=tuple(np.full_like(t, np.nan) for t in res.tensors),
                               num_samples=res.num_samples, train_loss=float("nan"))
        return res


@register_strategy("plumbing-nan")
class DivergingStrategy(FedAvg):
    pass


def test_a_diverged_client_withdraws_and_the_round_does_not_wait_for_the_deadline(tmp_path: Path) -> None:
    """A client whose training diverges withdraws (``idle``) instead of uploading NaN: each round
    closes on the other two reports. The deadline (1 h) is far beyond pytest's timeout, so the
    run finishing at all shows that no round waited for it."""
    cfg = small_config(run={"rounds": 2}, server={"round_deadline_s": 3600.0}, train={"algorithm": "plumbing-nan"})
    res = simulate(cfg, run_dir=tmp_path / "run")
    assert res.rounds_completed == 2
    for m in res.metrics:
        assert m["withdrawn"] == 1 and m["clients_reported"] == 2 and m["invalid"] == 0
        assert m["accuracy"] > 0.3  # the NaN update was never aggregated
    import sqlite3

    con = sqlite3.connect(tmp_path / "run" / "ledger.sqlite")
    n = con.execute("select count(*) from messages where side='agent' and kind='update' and client='client-000' "
                    "and event='sent'").fetchone()[0]
    assert n == 0  # nothing non-finite went on the wire


@register_client_algorithm("plumbing-refused")
class RefusedClient(FedAvgClient):
    pass


@register_strategy("plumbing-refused")
class RefusingStrategy(FedAvg):
    """Refuses client-000's updates (as a strategy's validate does for a malformed upload)."""

    def validate(self, result):
        return "refused by the test" if result.client_id == "client-000" else None


def test_a_refused_update_is_not_awaited_until_the_deadline(tmp_path: Path) -> None:
    """A refused update settles its client for the round: each round closes on the other two
    reports. The deadline (1 h) is far beyond pytest's timeout, so the run finishing at all
    shows that no round waited for it."""
    cfg = small_config(run={"rounds": 2}, server={"round_deadline_s": 3600.0}, train={"algorithm": "plumbing-refused"})
    res = simulate(cfg, run_dir=tmp_path / "run")
    assert res.rounds_completed == 2
    for m in res.metrics:
        assert m["invalid"] == 1 and m["clients_reported"] == 2


def test_partial_share_switches_client_eval_on_and_skips_the_onnx_export(tmp_path: Path) -> None:
    res = simulate(small_config(run={"rounds": 1}, train={"algorithm": "local"}), run_dir=tmp_path / "run")
    m = res.metrics[-1]
    assert m["accuracy_source"] == "clients" and m["clients_evaluated"] == 3
    assert m["accuracy"] == pytest.approx(m["client_accuracy_mean"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "onnx_skipped" in summary and "onnx_accuracy" not in summary
    assert not (tmp_path / "run" / "model_final.pt").exists()  # share = none: the server trained nothing


def test_extras_codec_applies_to_the_global_extras_too(tmp_path: Path) -> None:
    import sqlite3

    cfg = small_config(run={"rounds": 2}, train={"algorithm": "fedmcp"}, algorithm={"proxy_size": 100},
                       protocol={"extras_codec": "int8"})
    simulate(cfg, run_dir=tmp_path / "run")
    con = sqlite3.connect(tmp_path / "run" / "ledger.sqlite")
    rows = con.execute("select fields, codec from messages where side='server' and kind='global' and event='sent' "
                       "and round=2").fetchall()
    fields = json.loads(rows[0][0])
    # teacher soft predictions [100, 10]: 1,000 int8 values + a scale, not 4,000 fp32 bytes
    assert 1000 < fields["extras.teacher_soft_predictions"] < 1100
    assert "teacher_soft_predictions=int8" in rows[0][1]


def test_a_bad_algorithm_table_leaves_no_run_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        simulate(small_config(algorithm={"no_such_knob": 1}), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
