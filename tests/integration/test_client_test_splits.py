"""``[data] client_test = "local"`` in a real federation (digits, the pathological 2 classes per
client, FedProto over an embedded broker) and in a ``fedfleet-agent`` process:

- client 0 holds classes {0, 1} only and is evaluated on exactly its held-out samples of
  classes {0, 1}; every device's local test size is the hand-computed per-class rounding;
- the round's ``client_accuracy_weighted`` is Σ a_k·M_k / Σ M_k of the updates that travelled;
- ``partition.json`` records the held-out indices (disjoint from what each device trained on),
  ``summary.json`` and every metrics line name the protocol, and a resumed run's recomputed split
  is checked against the record;
- a fresh process assembling the agent from the printed ``fedfleet-agent`` command line gets the
  same training rows and the same local test set as the virtual agent.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.federation import Spy, read_metrics, read_summary, small_config, spied

from broker_server.embedded_broker import EmbeddedBroker
from broker_server.errors import ConfigError
from broker_server.server_main import agent_command
from broker_server.simulate import check_partition_record, client_data, partition_record, simulate
from edge_agent.data import load_dataset

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

# digits' training split (the fixed 80/20 split of the 1,797 images) holds, per class 0..9,
# 142 146 142 146 145 146 145 143 139 144 images. 2 classes per client, 5 clients: client i holds
# classes 2i, 2i+1 entirely. Held out per class: floor(0.25·n + 1/2) → 142: 36, 146: 37, 145: 36,
# 143: 36, 139: 35, 144: 36; so the local test sets hold 36+37, 36+37, 36+37, 36+36, 35+36 images.
LOCAL_TEST_SIZES = [73, 73, 73, 72, 71]
TRAIN_SIZES = [142 + 146 - 73, 142 + 146 - 73, 145 + 146 - 73, 145 + 143 - 72, 139 + 144 - 71]


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path_factory.mktemp("broker")) as b:
        yield b


def _federation(broker: EmbeddedBroker, run_dir: Path, cfg):
    """``simulate(cfg)`` with a spy on the broker; (result, spy, virtual agents by shard)."""
    agents: dict = {}
    spy = Spy(broker.host, broker.port)
    try:
        res = simulate(cfg, broker_url=broker.url, run_dir=run_dir, agent_hook=lambda i, a: agents.__setitem__(i, a))
        time.sleep(0.3)  # the last deliveries reach the spy
    finally:
        spy.close()
    return res, spy, agents


@pytest.fixture(scope="module")
def run(broker, tmp_path_factory):
    """One FedProto round, 2 classes per client, local test sets; (result, spy, agents, cfg)."""
    cfg = small_config(run={"rounds": 1, "seed": 3},
                       data={"partition": "classes", "classes_per_client": 2, "clients": 5, "min_samples": 1,
                             "client_test": "local", "client_test_fraction": 0.25},
                       train={"algorithm": "fedproto"}, server={"quorum": 5})
    return (*_federation(broker, tmp_path_factory.mktemp("classes") / "run", cfg), cfg)


def test_a_client_holding_classes_0_and_1_is_evaluated_on_them_only(run) -> None:
    res, spy, agents, _ = run
    a0 = agents[0]
    assert sorted(set(a0.y.tolist())) == [0, 1]
    assert sorted(set(a0.eval_y.tolist())) == [0, 1]
    assert np.bincount(a0.eval_y).tolist() == [36, 37]
    assert [len(agents[i].eval_y) for i in range(5)] == LOCAL_TEST_SIZES
    assert [len(agents[i].y) for i in range(5)] == TRAIN_SIZES
    updates, _ = spied(spy)
    got = {cid: u.metrics["eval_samples"] for cid, u in updates[1].items()}
    assert got == {f"client-{i:03d}": n for i, n in enumerate(LOCAL_TEST_SIZES)}
    assert {cid: u.num_samples for cid, u in updates[1].items()} == {
        f"client-{i:03d}": n for i, n in enumerate(TRAIN_SIZES)}


def test_the_weighted_mean_is_what_the_updates_carried(run) -> None:
    res, spy, _, _ = run
    updates, _ = spied(spy)
    ups = list(updates[1].values())
    correct = sum(u.metrics["eval_accuracy"] * u.metrics["eval_samples"] for u in ups)
    m = read_metrics(res.run_dir)[-1]
    assert m["client_test"] == "local"
    assert m["client_eval_samples"] == sum(LOCAL_TEST_SIZES) == 362
    assert m["client_accuracy_weighted"] == pytest.approx(correct / 362)
    assert m["client_accuracy_mean"] == pytest.approx(np.mean([u.metrics["eval_accuracy"] for u in ups]))
    assert m["client_accuracy_worst"] == pytest.approx(min(u.metrics["eval_accuracy"] for u in ups))
    summary = read_summary(res.run_dir)
    assert (summary["client_test"], summary["client_test_fraction"]) == ("local", 0.25)


def test_partition_json_records_the_held_out_sets_and_resume_checks_them(run) -> None:
    res, _, agents, cfg = run
    path = res.run_dir / "partition.json"
    rec = json.loads(path.read_text())
    assert (rec["client_test"], rec["client_test_fraction"]) == ("local", 0.25)
    ds = load_dataset("digits")
    for i, entry in enumerate(rec["clients"]):
        held = np.asarray(entry["test_indices"])
        assert entry["test_samples"] == held.size == LOCAL_TEST_SIZES[i]
        assert entry["samples"] == TRAIN_SIZES[i]
        assert np.intersect1d(held, agents[i].indices.numpy()).size == 0
        assert np.array_equal(ds.train.y[held], agents[i].eval_y)
        assert entry["test_histogram"] == np.bincount(ds.train.y[held], minlength=10).tolist()
    now = partition_record(ds, cfg, client_data(ds, cfg))
    check_partition_record(path, now)  # the same configuration recomputes the same split
    moved = copy.deepcopy(now)
    moved["clients"][2]["test_indices"][0] += 1
    with pytest.raises(ConfigError, match="client 2's samples differ"):
        check_partition_record(path, moved)
    shared = cfg.replace("data", client_test="shared")
    with pytest.raises(ConfigError, match="records client_test = 'local'"):
        check_partition_record(path, partition_record(ds, shared, client_data(ds, shared)))


_CHILD = """
import json, sys
from edge_agent.assembly import prepare_agent
from edge_agent.cli import agent_spec, build_parser
args = build_parser().parse_args(sys.argv[1:])
spec = agent_spec(args, {})
prepared = prepare_agent(spec, spec.load_dataset())
print(json.dumps({"train": prepared.indices.tolist(), "eval_y": prepared.eval_split.y.tolist(),
                  "eval_x_sum": float(prepared.eval_split.x.astype("float64").sum()),
                  "announced": {k: str(v) for k, v in prepared.info.items()}}))
"""


def test_a_fresh_agent_process_takes_the_virtual_agents_split(broker, tmp_path) -> None:
    """A Dirichlet(0.5) federation (the command-line agent does not take the 'classes' scheme):
    each virtual agent's training rows and local test set, against a new Python process that
    parses the printed ``fedfleet-agent`` command for that shard and assembles its agent."""
    cfg = small_config(run={"rounds": 1, "seed": 11},
                       data={"partition": "dirichlet", "alpha": 0.5, "clients": 3, "client_test": "local",
                             "client_test_fraction": 0.3},
                       train={"algorithm": "fedproto"}, server={"quorum": 3})
    res, _, agents = _federation(broker, tmp_path / "run", cfg)
    rec = json.loads((res.run_dir / "partition.json").read_text())
    words = shlex.split(agent_command(cfg, broker.url, res.federation))
    assert words[words.index("--client-test") + 1:words.index("--client-test") + 4] == [
        "local", "--client-test-fraction", "0.3"]
    ds = load_dataset("digits")
    for shard in range(3):
        argv = [f"{shard}/3" if w == "i/3" else w.replace("DEVICE_ID", f"pi-{shard}") for w in words[1:]]
        out = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        child = json.loads(out.stdout.strip().splitlines()[-1])
        virtual = agents[shard]
        assert child["train"] == virtual.indices.tolist()
        assert child["eval_y"] == virtual.eval_y.tolist()
        held = rec["clients"][shard]["test_indices"]
        assert child["eval_y"] == ds.train.y[held].tolist()
        assert child["eval_x_sum"] == pytest.approx(float(ds.train.x[held].astype(np.float64).sum()), rel=1e-12)
        assert child["eval_x_sum"] == pytest.approx(float(virtual.eval_x.numpy().astype(np.float64).sum()),
                                                    rel=1e-12)
        assert {k: child["announced"][k] for k in ("client_test", "client_test_fraction", "seed", "alpha")} == {
            "client_test": "local", "client_test_fraction": "0.3", "seed": "11", "alpha": "0.5"}
