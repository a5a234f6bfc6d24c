"""Experiment tracking (:mod:`broker_server.tracking`): a real simulated run (digits, 2 clients,
2 rounds) logged to TensorBoard and to MLflow (a ``file:`` store in tmp), read back with
TensorBoard's EventAccumulator and the MLflow client: every value equals ``metrics.jsonl`` and
the ledger's per-round bytes (queried again with :func:`broker_server.audit.by_round`). A package
asked for but missing stops the run before it starts, naming the install command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from broker_server import cli
from broker_server.audit import by_round, open_ledger
from broker_server.config import from_dict
from broker_server.errors import ConfigError
from broker_server.tracking import _params, check_tracking, round_scalars

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.toml"


def test_round_scalars_take_the_numbers_of_a_metrics_line() -> None:
    m = {"round": 3, "accuracy": 0.5, "loss": None, "skipped": False, "bytes_up": 10, "bytes_down": 20,
         "accuracy_source": "global", "domain_accuracy": {"photo": 0.25}, "rejected_by_reason": {},
         "train_loss": float("nan")}
    assert round_scalars(m) == {"accuracy": 0.5, "skipped": 0.0, "bytes_up": 10.0, "bytes_down": 20.0,
                                "domain_accuracy/photo": 0.25, "ledger/server_up_bytes": 10.0,
                                "ledger/server_down_bytes": 20.0}


def test_tracking_off_by_default_and_the_section_checked() -> None:
    cfg = from_dict({})
    assert not cfg.tracking.tensorboard and not cfg.tracking.mlflow
    check_tracking(cfg)  # nothing asked: nothing imported, no error
    with pytest.raises(ConfigError, match=r"unknown key \[tracking\] tensorbaord"):
        from_dict({"tracking": {"tensorbaord": True}})


def test_the_mlflow_parameters_name_the_broker_without_its_login() -> None:
    """MLflow's parameters are the configuration's keys (TensorBoard gets its config.toml text,
    :meth:`~broker_server.config.Config.to_toml`, which leaves the login out as well)."""
    cfg = from_dict({"broker": {"url": "mqtt://fleet-op:s3cret@broker.lan:1884"}})
    params = _params(cfg)
    assert params["broker.url"] == "mqtt://broker.lan:1884"
    assert not [key for key, text in params.items() if "s3cret" in text or "fleet-op" in text]
    assert "s3cret" not in cfg.to_toml()
    assert _params(from_dict({}))["broker.url"] == ""


@pytest.mark.parametrize("flag, module", [("--tensorboard", "tensorboard"), ("--mlflow", "mlflow")])
def test_a_missing_package_stops_the_run_before_it_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture, flag: str,
                                                          module: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError, as when not installed
    out = tmp_path / "run"
    code = cli.main(["simulate", "--config", str(QUICKSTART), "--rounds", "1", "--out", str(out), flag])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE
    assert f"tracking asked for ([tracking] {module} = true / {flag})" in err
    assert f"the {module} package cannot be imported" in err and "pip install 'fedfleet[tracking]'" in err
    assert not out.exists()


def test_tensorboard_and_mlflow_hold_the_run_metrics_and_ledger_bytes(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install 'fedfleet[tracking]')")
    pytest.importorskip("mlflow", reason="mlflow not installed (pip install 'fedfleet[tracking]')")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = tmp_path / "run"
    uri = (tmp_path / "mlruns").resolve().as_uri()
    code = cli.main(["simulate", "--config", str(QUICKSTART), "--rounds", "2", "--clients", "2", "--out", str(run),
                     "-q", "--tensorboard", "--mlflow", uri])
    assert code == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines] == [1, 2]
    db = open_ledger(run)
    try:
        device = {r["round"]: r for r in by_round(db, "device") if r["round"] is not None}
    finally:
        db.close()
    assert sorted(device) == [0, 1, 2]  # round 0: the joins before round 1
    cumulative, total = [], 0
    for r in (0, 1, 2):
        total += device[r]["up_bytes"] + device[r]["down_bytes"]
        cumulative.append((r, total))

    expected: dict[str, list[tuple[int, float]]] = {
        "accuracy": [(m["round"], m["accuracy"]) for m in lines],
        "loss": [(m["round"], m["loss"]) for m in lines],
        "train_loss": [(m["round"], m["train_loss"]) for m in lines],
        "clients_reported": [(m["round"], m["clients_reported"]) for m in lines],
        "ledger/server_up_bytes": [(m["round"], m["bytes_up"]) for m in lines],
        "ledger/server_down_bytes": [(m["round"], m["bytes_down"]) for m in lines],
        "ledger/device_up_bytes": [(r, device[r]["up_bytes"]) for r in (0, 1, 2)],
        "ledger/device_down_bytes": [(r, device[r]["down_bytes"]) for r in (0, 1, 2)],
        "ledger/device_cumulative_bytes": cumulative,
    }

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    for tag, want in expected.items():
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want], tag
        for (_, g), (_, w) in zip(got, want):
            assert g == pytest.approx(w, rel=1e-6), tag  # event files hold float32

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("fedfleet")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == run.name and runs[0].info.status == "FINISHED"
    rid = runs[0].info.run_id
    for tag, want in expected.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(rid, tag))
        assert got == [(s, float(v)) for s, v in want], tag
    assert runs[0].data.params["data.dataset"] == "digits" and runs[0].data.params["data.clients"] == "2"
