"""The Flower side of the round benchmark (``tools/_flower.py``): the job every Flower process
reads gives each Flower client exactly the shard fedfleet's simulation gives the same client, and
the pure helpers (round seconds from the server's marks, the pinned version, training slots)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "mnist-fedavg.toml"


def _tool():
    if "bench_flower_tool" in sys.modules:
        return sys.modules["bench_flower_tool"]
    spec = importlib.util.spec_from_file_location("bench_flower_tool", ROOT / "tools" / "_flower.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _mnist_available() -> bool:
    from edge_agent.data import load_dataset
    from edge_agent.errors import DataError

    try:
        load_dataset("mnist", allow_download=False)
    except DataError:
        return False
    return True


def _check_same_shards(tmp_path: Path, overrides: dict) -> None:
    """Each Flower client's shard (the job file read back, the client prepared as an agent
    prepares itself) is the index set fedfleet's simulation hands agent i (``split_clients``),
    and the shards partition the training split."""
    from broker_server import config as C
    from broker_server.simulate import split_clients

    tool = _tool()
    threads = torch.get_num_threads()
    try:
        path = tool.write_job(tmp_path / "job.json", config=CONFIG, overrides=overrides, train_slots=2,
                              torch_threads=1, slots_dir=tmp_path / "slots", batch_size=32)
        job = tool.load_job(str(path))
    finally:
        torch.set_num_threads(threads)  # load_job pins this process's torch threads
    cfg = C.load(CONFIG, overrides)
    assert (job.cfg.data.dataset, job.cfg.data.clients, job.cfg.data.alpha, job.cfg.run.seed) == (
        cfg.data.dataset, cfg.data.clients, cfg.data.alpha, cfg.run.seed)
    fedfleet = split_clients(job.dataset, cfg)
    flower = [tool.prepare_client(job.cfg, job.dataset, i).indices for i in range(cfg.data.clients)]
    assert len(flower) == len(fedfleet) == cfg.data.clients
    for i, (a, b) in enumerate(zip(flower, fedfleet)):
        assert set(a.tolist()) == set(b.tolist()), f"client {i}"
        assert len(a) == len(b)
    union = np.concatenate(flower)
    assert len(union) == len(np.unique(union)) == len(job.dataset.train.y)  # disjoint and covering
    with pytest.raises(ValueError, match="not one of the job's"):
        tool.prepare_client(job.cfg, job.dataset, cfg.data.clients)


def test_flower_clients_get_fedfleets_shards_tiny_job(tmp_path: Path) -> None:
    _check_same_shards(tmp_path, {("data", "dataset"): "digits", ("data", "clients"): 3, ("server", "quorum"): 3,
                                  ("run", "rounds"): 2})


@pytest.mark.skipif(not _mnist_available(), reason="MNIST files not found (../shared/data or FEDFLEET_DATA)")
def test_flower_clients_get_fedfleets_shards_main_job(tmp_path: Path) -> None:
    """The benchmark's job: MNIST, 10 clients, Dirichlet 0.5, seed 0."""
    _check_same_shards(tmp_path, {("run", "rounds"): 5})


def test_round_seconds_are_the_gaps_between_the_servers_marks() -> None:
    tool = _tool()
    # round 0 marks the start; rounds end at 12.0, 14.5 and 20.0: 2.0, 2.5 and 5.5 s
    got = tool.round_seconds([(2, 14.5), (0, 10.0), (3, 20.0), (1, 12.0)])
    assert [g["round"] for g in got] == [1, 2, 3]
    assert [g["seconds"] for g in got] == pytest.approx([2.0, 2.5, 5.5])
    assert tool.round_seconds([(0, 1.0)]) == []
    with pytest.raises(ValueError, match="rounds 0..R"):
        tool.round_seconds([(0, 1.0), (2, 3.0)])


def test_spec_version_is_the_pinned_prefix() -> None:
    tool = _tool()
    assert tool.spec_version("flwr[simulation]==1.42.*") == "1.42."
    assert tool.spec_version("flwr==1.42.0") == "1.42.0"
    assert tool.spec_version("flwr") == ""


def test_train_slots_hand_out_distinct_slots_and_free_them(tmp_path: Path) -> None:
    tool = _tool()
    slots = tool.TrainSlots(tmp_path, 2)
    with slots.hold() as a:
        with slots.hold() as b:  # a second holder (another open file) cannot take slot a
            assert {a, b} == {0, 1}
        with slots.hold() as c:  # b was freed
            assert c == b
    with slots.hold() as d:
        assert d == 0
    with pytest.raises(ValueError, match=">= 1"):
        tool.TrainSlots(tmp_path, 0)
