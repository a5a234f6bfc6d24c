"""FedDO: the reward, the state and the ratios by hand; a federation in memory (digits, three
devices, three rounds) checked on the wire — each device's ``data_ratio`` is the policy's
max(a_k, 0), it trains on round(d_k·|D_k|) samples, the weights are |S_k|/Σ|S| and the global
is their weighted mean —; a resume from the checkpoint that restores the replay buffer and the
agent bit for bit and keeps learning; ``fedfleet feddo pretrain`` writing a policy the server
loads; a pre-trained policy in a federation of another size: one device more than it was
trained for is an error naming the counts (alone and in a federation), fewer devices run with
the empty slots offline, logged and recorded in every round's line; a policy deployed with other
agent sizes than its own is an error naming both, and the run's learning keys replace the
pre-training's (the optimisers' rates too), each change logged; a policy file that is not one
(garbage, a cut-short file, one with a part missing or of other shapes) is a ValueError naming
the file, which ``fedfleet simulate`` says as its one-line configuration error; ``fedfleet feddo
pretrain --out`` that could not be written (a folder, a path under a file) is refused before
any episode."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.memory_federation import Device, federation_server, run_expecting

from broker_server.checkpoint import CheckpointStore
from broker_server.cli import main
from broker_server.errors import RunError
from broker_server.rl.dsac_t import DSACTAgent, DSACTConfig
from broker_server.server import AggregationServer, ServerSettings
from broker_server.strategies import ClientResult
from broker_server.strategies.fedavg import FedAvg
from broker_server.strategies.feddo import GLOBAL_FEATURES, FedDO, build_state, feddo_reward, ratios_from_action
from edge_agent.agent import EdgeAgent
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.feddo import FedDOClient, subset_indices, subset_size
from edge_agent.models import build_model
from protocol.channel import Channel
from protocol.messages import RoundStart, Update, decode

SMALL = {"hidden": 16, "layers": 2, "rank": 4, "warmup": 1, "batch_size": 2}
#: the agent of SMALL's architecture as FedDO builds it (its critics with LayerNorm, the default)
SMALL_AGENT = {"hidden": (16, 16), "rank": 4, "critic_layer_norm": True}


def test_reward_seed_and_continuous_variants() -> None:
    assert feddo_reward(0.5, 0.5) == 1.0  # the seed's discontinuity: +1 for no change
    assert feddo_reward(0.6, 0.5) == pytest.approx(64 ** 0.1)
    assert feddo_reward(0.5, 0.6) == pytest.approx(-(64 ** 0.1))
    assert feddo_reward(0.5, 0.5, variant="continuous") == 0.0
    assert feddo_reward(0.75, 0.25, variant="continuous") == pytest.approx(64 ** 0.5 - 1) == pytest.approx(7.0)
    assert feddo_reward(0.25, 0.75, variant="continuous") == pytest.approx(-7.0)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        feddo_reward(71.4, 70.0)  # percentages


def test_state_and_ratios_by_hand() -> None:
    s = build_state(np.array([1.0, 4.0, 0.0]), accuracy=0.5, loss=25.0, round_fraction=0.2, active_fraction=2 / 3)
    np.testing.assert_allclose(s, [0.25, 1.0, 0.0, 0.5, 1.0, 0.2, 2 / 3], rtol=1e-6)
    np.testing.assert_array_equal(build_state(np.zeros(2), 0, 0, 0, 0), np.zeros(6))
    d = ratios_from_action(np.array([-0.5, 0.3, -0.1, -0.9]), min_active=2, min_ratio=0.05)
    np.testing.assert_allclose(d, [0.0, 0.3, 0.05, 0.0])  # the largest idle action is made active
    assert subset_size(0.5, 7) == 4 and subset_size(0.001, 7) == 1 and subset_size(0.0, 7) == 0
    idx = subset_indices(10, 4, seed=0, round=2, client_index=1)
    assert len(set(idx.tolist())) == 4 and idx.tolist() == sorted(idx.tolist())


def test_full_mode_asks_every_online_device_for_its_whole_shard_and_averages_as_fedavg() -> None:
    """``mode = "full"``: no decision, d = 1 for every online device, so the round is FedAvg's at
    participation 1.0 (the same members, the same |D_k|-weighted mean)."""
    val = (np.zeros((2, 1, 8, 8), np.float32), np.zeros(2, np.int64))
    s = FedDO(mode="full", validation=val, hidden=16, layers=2, rank=4, warmup=1, batch_size=2)
    ids = ["dev-a", "dev-b", "dev-c"]
    plan = s.configure_round(1, ids, np.random.default_rng(0))
    assert plan.selected == tuple(ids)
    assert {c: plan.instructions[c]["data_ratio"] for c in ids} == {"dev-a": 1.0, "dev-b": 1.0, "dev-c": 1.0}
    # dev-b offline in round 2: the two others, still d = 1; FedAvg at participation 1.0 asks the same two
    plan2 = s.configure_round(2, ["dev-a", "dev-c"], np.random.default_rng(0))
    assert plan2.selected == ("dev-a", "dev-c") and s.ratios == {"dev-a": 1.0, "dev-c": 1.0}
    assert FedAvg(participation_rate=1.0).configure_round(2, ["dev-a", "dev-c"],
                                                          np.random.default_rng(0)).selected == plan2.selected
    # the whole shards (40 and 60 samples) come back: w = 0.4·w_a + 0.6·w_c, by hand and as FedAvg
    current = [np.zeros(3, np.float32)]
    results = [ClientResult("dev-a", (np.array([1.0, 2.0, 3.0], np.float32),), 40, 0.0, {}),
               ClientResult("dev-c", (np.array([6.0, 7.0, 8.0], np.float32),), 60, 0.0, {})]
    s.shard_sizes = {"dev-a": 40, "dev-c": 60}
    assert all(s.validate(r) is None for r in results)  # round(1·|D_k|) = |D_k|
    ours, fedavg = s.aggregate(2, current, results), FedAvg().aggregate(2, current, results)
    assert ours is not None and ours.tensors is not None and fedavg is not None and fedavg.tensors is not None
    np.testing.assert_allclose(ours.tensors[0], [0.4 * 1 + 0.6 * 6, 0.4 * 2 + 0.6 * 7, 0.4 * 3 + 0.6 * 8], rtol=1e-6)
    np.testing.assert_allclose(ours.tensors[0], fedavg.tensors[0], rtol=1e-6)


class Recording(FedDO):
    """FedDO keeping each round's policy action a_t."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.actions: dict[int, np.ndarray] = {}

    def configure_round(self, round, available, rng):
        plan = super().configure_round(round, available, rng)
        self.actions[round] = np.array(self.pending["a"])
        return plan


def _federation(tmp_path, digits, memory_hub, rounds: int = 3):
    sizes = {"dev-a": 40, "dev-b": 70, "dev-c": 90}
    x, y = digits.train.x, digits.train.y
    val = (np.asarray(digits.test.x[:100]), np.asarray(digits.test.y[:100]))

    def model():
        torch.manual_seed(0)
        return build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)

    strategy = Recording(train_config={"lr": 0.05, "batch_size": 16}, validation=val, run_seed=3, **SMALL)
    server = AggregationServer(
        channel=Channel(memory_hub.connect("server"), node_id="server", side="server", federation="mem", ledger=None),
        strategy=strategy, model=model(), test=digits.test,
        settings=ServerSettings(rounds=rounds, quorum=1, round_deadline_s=60, join_timeout_s=30, expected_clients=3),
        run_dir=tmp_path)
    agents, start = [], 0
    for i, (cid, n) in enumerate(sizes.items()):
        agents.append(EdgeAgent(
            channel=Channel(memory_hub.connect(cid), node_id=cid, side="agent", federation="mem", ledger=None),
            model=model(), algorithm=FedDOClient(), x=x[start:start + n], y=y[start:start + n], num_classes=10,
            client_index=i, idle_timeout_s=60, train_defaults=TrainConfig(local_epochs=1, batch_size=16)))
        start += n
    errors: list[BaseException] = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # reported below
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guarded(a.run), daemon=True) for a in agents]
    for t in threads:
        t.start()
    summary = server.run()
    for t in threads:
        t.join(30)
    assert not errors and summary.rounds_completed == rounds
    return server, strategy, sizes


def test_feddo_federation_ratios_samples_and_weights_on_the_wire(tmp_path, digits, memory_hub) -> None:
    server, strategy, sizes = _federation(tmp_path, digits, memory_hub)
    slots = sorted(sizes)
    assert strategy.slots == slots
    msgs = [(m.sender, m.topic, decode(m.payload).envelope) for m in memory_hub.published]
    for r, a in strategy.actions.items():
        # per-device round_starts (a broadcast one naming nobody may go to the unselected devices)
        starts = {t.split("/")[-2]: env.body for s, t, env in msgs
                  if s == "server" and env.round == r and isinstance(env.body, RoundStart)
                  and t.split("/")[-2] in slots}
        want = {c: float(a[i]) for i, c in enumerate(slots) if a[i] > 0}
        if not want:  # no positive action: the largest one, at least min_ratio (quorum 1)
            i = int(np.argmax(a))
            want = {slots[i]: max(float(a[i]), 0.05)}
        assert {c: b.instructions["data_ratio"] for c, b in starts.items()} == pytest.approx(want), r
        ups = {s: env.body for s, t, env in msgs if env.round == r and isinstance(env.body, Update)}
        assert set(ups) == set(want)
        for c, body in ups.items():
            assert body.num_samples == round(want[c] * sizes[c])  # round(d_k·|D_k|)
        line = server.metrics[r - 1]
        total = sum(b.num_samples for b in ups.values())
        assert line["feddo_weights"] == pytest.approx({c: b.num_samples / total for c, b in ups.items()})
        # the round's compute: Σ round(d_k·|D_k|) over the active devices, from the instructions
        assert line["samples_trained"] == total == sum(round(d * sizes[c]) for c, d in want.items())
        assert line["feddo_active"] == len(want)
        assert line["feddo_mean_ratio"] == pytest.approx(np.mean(list(want.values())))
        assert -64 <= line["feddo_reward"] <= 64 and abs(line["feddo_reward"]) >= 1  # the seed variant


def test_a_resumed_feddo_keeps_its_replay_buffer_and_agent_and_learns_on(tmp_path, digits, memory_hub) -> None:
    server, strategy, _ = _federation(tmp_path, digits, memory_hub)
    assert strategy.agent is not None and len(strategy.agent.buffer) == 2  # rounds 1→2, 2→3
    store = CheckpointStore(tmp_path / "checkpoints.sqlite")
    ckpt = store.load()
    store.close()
    assert ckpt is not None and ckpt.round == 3
    val = strategy.validation
    fresh = FedDO(train_config={"lr": 0.05}, validation=val, run_seed=3, **SMALL)
    fresh.load_state_dict(ckpt.strategy_state)
    assert fresh.agent is not None and len(fresh.agent.buffer) == 2
    for a, b in zip(strategy.agent.networks_state()["actor"].values(), fresh.agent.networks_state()["actor"].values(),
                    strict=True):
        assert torch.equal(a, b)
    for a, b in zip(strategy.agent.critics.parameters(), fresh.agent.critics.parameters(), strict=True):
        assert torch.equal(a, b)
    np.testing.assert_array_equal(strategy.agent.buffer.state_dict()["s"], fresh.agent.buffer.state_dict()["s"])
    assert fresh.phi == strategy.phi and fresh.slots == strategy.slots
    # round 4 after the resume: the pending round-3 transition is stored and learned from, as the
    # uninterrupted strategy would
    rng = np.random.default_rng(0)
    p1 = strategy.configure_round(4, strategy.slots, rng)
    p2 = fresh.configure_round(4, fresh.slots, np.random.default_rng(0))
    assert len(fresh.agent.buffer) == 3 and fresh.agent.updates == strategy.agent.updates > 0
    assert dict(p1.instructions) == dict(p2.instructions)


#: A tiny FedDO run (3 devices, 2 rounds of digits, a 16-wide agent of rank 4).
TINY_TOML = """
[run]
name = "pre"
seed = 0
rounds = 2
out = "runs"
[data]
dataset = "digits"
partition = "dirichlet"
alpha = 0.5
clients = 3
[train]
algorithm = "feddo"
local_epochs = 1
batch_size = 32
lr = 0.05
[server]
quorum = 1
[algorithm]
hidden = 16
layers = 2
rank = 4
warmup = 1
batch_size = 2
val_size = 100
"""


def test_a_resume_needs_no_policy_file_and_goes_on_as_the_uninterrupted_run(tmp_path, monkeypatch, capsys) -> None:
    """A run on a policy, cut after round 2; its policy file is then pre-trained again at the same
    path (another device count and width), and later removed: each resume takes the agent from the
    checkpoint, never from the file, and rounds 1-4 are those of the same run left uninterrupted.
    Both runs' summary.json name the policy they started from by its file's SHA-256, and the agent
    they ended with. The first line of each resume (fedfleet simulate's and fedfleet server's)
    says the agent is the checkpoint's, not the file's."""
    import hashlib

    monkeypatch.chdir(tmp_path)
    policy = Path(_policy(tmp_path / "policy.pt", 3))
    started_from = hashlib.sha256(policy.read_bytes()).hexdigest()
    cfg = tmp_path / "feddo.toml"
    cfg.write_text(TINY_TOML + f'policy = "{policy}"\n', encoding="utf-8")
    assert main(["simulate", "--config", str(cfg), "--rounds", "4", "--out", "whole", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["simulate", "--config", str(cfg), "--rounds", "2", "--out", "cut", "--quiet"]) == 0
    head = "fedfleet simulate: digits, 3 clients (dirichlet, α=0.5), feddo"
    assert capsys.readouterr().out.splitlines()[0] == f"{head} (policy {policy}), 2 rounds, unsigned"
    other = DSACTAgent(5 + GLOBAL_FEATURES, 5, DSACTConfig(hidden=(32, 32), rank=4), seed=1)
    other.save_policy(policy, {"num_devices": 5, "global_features": GLOBAL_FEATURES})
    assert main(["simulate", "--resume", "cut", "--rounds", "3", "--quiet"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{head} (agent from the checkpoint of round 2; started from policy {policy}), 3 rounds, unsigned")
    policy.unlink()
    import broker_server.server_main

    monkeypatch.setattr(broker_server.server_main, "serve", lambda *a, **k: 0)  # the first line only
    assert main(["server", "--resume", "cut", "--rounds", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "fedfleet server: digits, 3 clients (dirichlet, α=0.5), feddo (agent from the checkpoint of round 3; started "
        f"from policy {policy}), 4 rounds, unsigned")
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--resume", "cut", "--rounds", "4", "--quiet"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{head} (agent from the checkpoint of round 3; started from policy {policy}), 4 rounds, unsigned")

    def rounds(run: str) -> list[dict]:
        lines = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in m.items() if k.startswith("feddo_") or k == "accuracy"}
                for m in lines if "round" in m]

    whole, cut = rounds("whole"), rounds("cut")
    assert len(whole) == len(cut) == 4 and [m["feddo_replay"] for m in cut] == [0, 1, 2, 3]
    assert cut == whole
    told = {run: json.loads((tmp_path / run / "summary.json").read_text())["strategy"] for run in ("whole", "cut")}
    assert told["cut"] == told["whole"]
    assert told["cut"]["policy"]["file_sha256"] == started_from and told["cut"]["policy"]["path"] == str(policy)
    assert told["cut"]["policy"]["metadata"] == {"num_devices": 3, "global_features": GLOBAL_FEATURES}
    # the agent as round 4 left it: round 4's transition waits for round 5, so 3 stored
    assert told["cut"]["agent"]["replay"] == 3 and told["cut"]["agent"]["devices"] == 3




def test_pretrain_cli_writes_a_policy_the_strategy_loads(tmp_path, capsys) -> None:
    cfg = tmp_path / "feddo.toml"
    cfg.write_text(TINY_TOML, encoding="utf-8")
    out = tmp_path / "policy.pt"
    assert main(["feddo", "pretrain", "--config", str(cfg), "--episodes", "2", "--rounds", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    first, second = text.splitlines()[:2]
    assert first == (f"fedfleet feddo pretrain: digits, 3 devices, 2 episodes x 2 rounds, from an untrained agent -> "
                     f"{out}")
    # a replay batch of 2 against a warm-up of 1 transition: said before the first episode
    assert second == ("fedfleet feddo pretrain: note: [algorithm] batch_size = 2 is more than warmup = 1: the DSAC-T "
                      "updates before the replay buffer holds 2 transitions draw their batch from fewer, with "
                      "replacement (the first from 1)")
    assert "episode   1/2" in text and "episode   2/2" in text and "policy written" in text
    # once the agent learns, each line shows its critics' mean Q (a diverging critic shows there); a
    # legend first, with the entropy's bounds for these 3 devices: at most 3 ln 2 = 2.08, target -3
    assert "at most K ln 2 = 2.08: a random policy; target -K = -3)" in text and "warmup = 1)" in text
    assert all("  Q " in line for line in text.splitlines() if line.startswith("episode"))
    blob = torch.load(out, weights_only=True)
    assert blob["metadata"]["num_devices"] == 3 and blob["metadata"]["episodes"] == 2
    # the pre-training cost is recorded with the policy (a figure, not a bound on it)
    assert isinstance(blob["metadata"]["cpu_seconds"], float) and math.isfinite(blob["metadata"]["cpu_seconds"])
    loaded = FedDO(policy=str(out), validation=(np.zeros((1, 1, 8, 8), np.float32), np.zeros(1, np.int64)),
                   **SMALL)
    assert loaded.num_devices == 3 and loaded.agent is not None and len(loaded.agent.buffer) == 0
    for a, b in zip(blob["agent"]["actor"].values(), loaded.agent.actor.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert not math.isnan(loaded.agent.alpha)


def _policy(path, k: int) -> str:
    """A DSAC-T policy file for ``k`` devices (an untrained agent of SMALL's sizes, as
    ``fedfleet feddo pretrain`` writes one)."""
    agent = DSACTAgent(k + GLOBAL_FEATURES, k, DSACTConfig(**SMALL_AGENT, warmup=1, batch_size=2), seed=0)
    agent.save_policy(path, {"num_devices": k, "global_features": GLOBAL_FEATURES})
    return str(path)


def _loaded(policy: str) -> FedDO:
    return FedDO(policy=policy, validation=(np.zeros((1, 1, 8, 8), np.float32), np.zeros(1, np.int64)), **SMALL)


def test_a_policy_for_three_devices_refuses_a_fourth(tmp_path) -> None:
    s = _loaded(_policy(tmp_path / "k3.pt", 3))
    assert s.num_devices == 3  # num_devices = 0: the policy's
    for cid in ("dev-a", "dev-b", "dev-c", "dev-d"):
        s.on_join(cid, "x86-cpu", 50)
    with pytest.raises(RunError, match=r"trained for 3 devices, but 4 devices have joined; 1 of them \(dev-d\) "
                                       r"would get no slot and never train.*\[data\] clients = 4"):
        s.configure_round(1, ["dev-a", "dev-b", "dev-c", "dev-d"], np.random.default_rng(0))
    # a device joining later than round 1 is refused as well, when it would first get a slot
    late = _loaded(_policy(tmp_path / "k3.pt", 3))
    plan = late.configure_round(1, ["dev-a", "dev-b", "dev-c"], np.random.default_rng(0))
    assert set(plan.selected) <= {"dev-a", "dev-b", "dev-c"} and late.slots == ["dev-a", "dev-b", "dev-c"]
    with pytest.raises(RunError, match=r"trained for 3 devices, but 4 devices have joined; 1 of them \(dev-0\)"):
        late.configure_round(2, ["dev-0", "dev-a", "dev-b", "dev-c"], np.random.default_rng(0))


def test_a_policy_for_three_devices_runs_two_with_its_third_slot_empty_and_says_so(tmp_path, caplog) -> None:
    s = _loaded(_policy(tmp_path / "k3.pt", 3))
    with caplog.at_level("WARNING", logger="broker_server.strategies.feddo"):
        plans = [s.configure_round(r, ["dev-a", "dev-b"], np.random.default_rng(r)) for r in (1, 2)]
    warned = [r.getMessage() for r in caplog.records if "trained for 3 devices" in r.getMessage()]
    assert len(warned) == 1 and "2 have joined: 1 of its slots stay empty" in warned[0]  # once per count
    assert s.slots == ["dev-a", "dev-b"] and all(set(p.selected) <= {"dev-a", "dev-b"} for p in plans)
    # the state keeps the policy's width: 3 drifts + 4 global features
    assert s.state(3).shape == (3 + GLOBAL_FEATURES,)
    m = s.round_metrics()
    assert (m["feddo_slots"], m["feddo_slots_filled"], m["feddo_unslotted"]) == (3, 2, 0)
    # the third device joins: its slot is filled, nothing is refused
    s.configure_round(3, ["dev-a", "dev-b", "dev-c"], np.random.default_rng(3))
    assert s.slots == ["dev-a", "dev-b", "dev-c"] and s.round_metrics()["feddo_slots_filled"] == 3


def test_a_federation_larger_than_its_policy_fails_before_training(tmp_path, digits, memory_hub) -> None:
    """Four devices and a policy for three: the run stops at round 1 with the RunError, no device
    trained, no metrics line written."""
    policy = _policy(tmp_path / "k3.pt", 3)
    val = (np.asarray(digits.test.x[:100]), np.asarray(digits.test.y[:100]))
    strategy = FedDO(policy=policy, validation=val, train_config={"lr": 0.05}, **SMALL)
    devices = {f"dev-{k}": Device(FedDOClient(), digits.train.x[40 * i:40 * i + 40], digits.train.y[40 * i:40 * i + 40])
               for i, k in enumerate("abcd")}
    server = federation_server(tmp_path / "run", memory_hub, strategy, digits.test, rounds=2, clients=4)
    run_expecting(server, memory_hub, devices, RunError, "trained for 3 devices, but 4 devices have joined")
    assert server.metrics == [] and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not any(isinstance(decode(m.payload).envelope.body, Update) for m in memory_hub.published)


@pytest.mark.parametrize("command", ["simulate", "pretrain"])
def test_a_fleet_larger_than_its_policy_is_refused_before_anything_runs(tmp_path, capsys, caplog,
                                                                       command: str) -> None:
    """TINY_TOML's 3 devices and a policy pre-trained for 2 (its data settings recorded, as
    fedfleet feddo pretrain writes them): fedfleet simulate and fedfleet feddo pretrain say it in
    one configuration-error line, alone (no header or banner first, no warning that the policy's
    client count differs), before a broker starts or an episode trains (the round-1 RunError of a
    server stays for real fleets), and write nothing."""
    agent = DSACTAgent(2 + GLOBAL_FEATURES, 2, DSACTConfig(**SMALL_AGENT, warmup=1, batch_size=2), seed=0)
    policy = str(tmp_path / "k2.pt")
    agent.save_policy(policy, {"num_devices": 2, "global_features": GLOBAL_FEATURES, "dataset": "digits",
                               "partition": "dirichlet", "alpha": 0.5, "clients": 2})
    cfg = tmp_path / "feddo.toml"
    cfg.write_text(TINY_TOML + f'policy = "{policy}"\n', encoding="utf-8")
    out = tmp_path / ("run" if command == "simulate" else "policy.pt")
    argv = (["simulate", "--config", str(cfg), "--out", str(out)] if command == "simulate" else
            ["feddo", "pretrain", "--config", str(cfg), "--episodes", "1", "--rounds", "1", "--out", str(out)])
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert lines == [f"fedfleet: configuration error: {cfg}: 3 devices ([data] clients, or --clients), but the "
                     f"policy {policy} serves at most 2 devices: 1 of them would never train. Run 2 devices, or "
                     "pre-train a policy for 3 devices (fedfleet feddo pretrain, without [algorithm] policy)"]
    # nothing ran: no episode, no round, not even the banner or the header
    assert captured.out == "" and not out.exists()
    assert "other data settings" not in caplog.text


def test_a_fleet_within_its_policy_passes_the_size_check(tmp_path) -> None:
    """The check's boundary: a policy for exactly [data] clients devices, and no policy at all
    (an agent sized by round 1), are accepted."""
    from broker_server.config import load as load_config
    from broker_server.runtime import check_fleet_size

    val = (np.zeros((1, 1, 8, 8), np.float32), np.zeros(1, np.int64))
    cfg_path = tmp_path / "feddo.toml"
    cfg_path.write_text(TINY_TOML, encoding="utf-8")
    cfg = load_config(cfg_path)
    check_fleet_size(cfg, _loaded(_policy(tmp_path / "k3.pt", 3)))  # 3 = 3
    check_fleet_size(cfg, FedDO(validation=val, **SMALL))  # no policy: any size
    assert FedDO(validation=val, **SMALL).max_devices is None and _loaded(str(tmp_path / "k3.pt")).max_devices == 3


def test_a_policy_deployed_with_other_sizes_is_an_error_naming_both(tmp_path) -> None:
    policy = _policy(tmp_path / "k3.pt", 3)  # hidden 16 × 2 layers, rank 4
    val = (np.zeros((1, 1, 8, 8), np.float32), np.zeros(1, np.int64))
    with pytest.raises(ValueError, match=r"pre-trained with hidden = 16, layers = 2, rank = 4, critic_layer_norm = "
                                         r"true, but \[algorithm\] asks hidden = 16, layers = 3, rank = 4"):
        FedDO(policy=policy, validation=val, **{**SMALL, "layers": 3})
    with pytest.raises(ValueError, match=r"asks hidden = 256, layers = 3, rank = 96, critic_layer_norm = true "
                                         r"\(256, 3, 96 and true where not set\)"):
        FedDO(policy=policy, validation=val)
    # a policy of DSAC-T's own critics (no LayerNorm, as saved before the key existed) in a run
    # that leaves the key at its default: its critics' weights have no LayerNorm to load into
    plain = tmp_path / "plain.pt"
    reference = DSACTAgent(3 + GLOBAL_FEATURES, 3, DSACTConfig(hidden=(16, 16), rank=4), seed=0)
    reference.save_policy(plain, {"num_devices": 3})
    with pytest.raises(ValueError, match=r"critic_layer_norm = false, but \[algorithm\] asks .*layer_norm = true"):
        FedDO(policy=str(plain), validation=val, **SMALL)
    deployed = FedDO(policy=str(plain), validation=val, **{**SMALL, "critic_layer_norm": False})
    assert deployed.agent is not None and deployed.agent.config.critic_layer_norm is False


def test_a_loaded_policy_goes_on_learning_with_the_runs_learning_keys(tmp_path, caplog) -> None:
    """The policy was pre-trained with lr_critic 3e-4, batch 2, warm-up 1, capacity 100,000; the
    run says lr_actor 5e-4, batch 8, warm-up 5, capacity 50 and leaves lr_critic at its 1e-4."""
    agent = DSACTAgent(3 + GLOBAL_FEATURES, 3, DSACTConfig(**SMALL_AGENT, warmup=1, batch_size=2,
                                                           lr_critic=3e-4), seed=0)
    agent.save_policy(tmp_path / "k3.pt", {"num_devices": 3, "global_features": GLOBAL_FEATURES})
    val = (np.zeros((1, 1, 8, 8), np.float32), np.zeros(1, np.int64))
    with caplog.at_level("INFO", logger="broker_server.strategies.feddo"):
        s = FedDO(policy=str(tmp_path / "k3.pt"), validation=val, hidden=16, layers=2, rank=4, batch_size=8, warmup=5,
                  capacity=50, lr_actor=5e-4)
    assert s.agent is not None
    c = s.agent.config
    assert (c.batch_size, c.warmup, c.capacity, c.lr_actor, c.lr_critic) == (8, 5, 50, 5e-4, 1e-4)
    assert c.hidden == (16, 16) and c.rank == 4 and s.agent.buffer.capacity == 50
    assert [g["lr"] for g in s.agent.actor_opt.param_groups] == [5e-4]
    assert all(g["lr"] == 1e-4 for o in s.agent.critic_opts for g in o.param_groups)
    assert [g["lr"] for g in s.agent.alpha_opt.param_groups] == [3e-4]  # the same in both: unchanged
    said = " ".join(r.getMessage() for r in caplog.records)
    for change in ("batch_size 2 → 8", "warmup 1 → 5", "capacity 100000 → 50", "lr_actor 0.0001 → 0.0005",
                   "lr_critic 0.0003 → 0.0001"):
        assert change in said
    assert "lr_alpha" not in said and "gamma" not in said


def test_a_loaded_policy_draws_the_runs_own_noise(tmp_path) -> None:
    """The networks come from the policy file, the random streams from the run's seed: runs of
    seeds 0 and 1 on one policy act differently on the same state (not both continuing the
    stream the pre-training ended with), a run of seed 0 draws what a fresh agent of seed 0
    with those networks draws, and the deterministic action is the same for every seed."""
    trained = DSACTAgent(3 + GLOBAL_FEATURES, 3, DSACTConfig(**SMALL_AGENT), seed=1000)
    trained.act(np.zeros(3 + GLOBAL_FEATURES, np.float32))  # the pre-training's stream moves on
    trained.rng.random()
    trained.save_policy(tmp_path / "k3.pt", {"num_devices": 3, "global_features": GLOBAL_FEATURES})
    state = np.linspace(-1, 1, 3 + GLOBAL_FEATURES).astype(np.float32)
    a0, _, _ = DSACTAgent.load_policy(tmp_path / "k3.pt", seed=0)
    a1, _, _ = DSACTAgent.load_policy(tmp_path / "k3.pt", seed=1)
    assert not np.array_equal(a0.act(state), a1.act(state))
    assert a0.rng.random() != a1.rng.random()
    fresh = DSACTAgent(3 + GLOBAL_FEATURES, 3, DSACTConfig(**SMALL_AGENT), seed=0)
    fresh.actor.load_state_dict(trained.actor.state_dict())
    again, _, _ = DSACTAgent.load_policy(tmp_path / "k3.pt", seed=0)
    np.testing.assert_array_equal(again.act(state), fresh.act(state))
    assert again.rng.random() == fresh.rng.random()
    np.testing.assert_array_equal(a0.act(state, deterministic=True), a1.act(state, deterministic=True))
    np.testing.assert_array_equal(a0.act(state, deterministic=True), trained.act(state, deterministic=True))


def _damaged(path, how: str) -> str:
    """A file at ``path`` that is no usable policy: ``how`` names the damage."""
    if how == "garbage":  # a pickle cut short: torch.load raises pickle.UnpicklingError
        path.write_bytes(b"garbage")
        return str(path)
    good = _policy(path, 3)
    if how == "cut short":  # a torch zip without its central directory
        path.write_bytes(path.read_bytes()[:3000])
        return good
    blob = torch.load(path, weights_only=True)
    if how == "part missing":
        del blob["agent"]["actor"]
    elif how == "other shapes":  # the state width of 4 devices on an agent of 3
        blob["state_dim"] += 1
    torch.save(blob, path)
    return good


@pytest.mark.parametrize("how", ["garbage", "cut short", "part missing", "other shapes"])
def test_a_damaged_policy_file_is_a_value_error_naming_it(tmp_path, how: str) -> None:
    path = _damaged(tmp_path / "policy.pt", how)
    with pytest.raises(ValueError, match=f"^policy {path}: ") as caught:
        _loaded(path)
    # a file that is no whole zip archive (torch.save writes one) is said to be cut short
    assert ("it is not a whole torch archive (cut short" in str(caught.value)) == (how in ("garbage", "cut short"))


@pytest.mark.parametrize("keep", [500, 10_000, -300, -10])
def test_a_policy_cut_short_anywhere_says_so(tmp_path, keep: int) -> None:
    """A policy file cut at 500 or 10,000 bytes, or 300 or 10 bytes before its end: torch's own
    reason differs (a zip error, or "[Errno 22] Invalid argument"), the message says the file is
    not a whole torch archive either way."""
    full = Path(_policy(tmp_path / "whole.pt", 3)).read_bytes()
    path = tmp_path / "cut.pt"
    path.write_bytes(full[:keep])
    with pytest.raises(ValueError, match=rf"^policy {path}: cannot be read \(.*\); it is not a whole torch archive "
                                         r"\(cut short, or not written by torch\.save\); \[algorithm\] policy must"):
        _loaded(str(path))


class _Planted:
    """An object whose unpickling would touch ``marker`` (as a policy file from elsewhere could
    run any code through pickle)."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (type(self.marker).touch, (self.marker,))


def test_a_policy_file_carrying_code_is_refused_without_running_it(tmp_path) -> None:
    """A policy file is read with torch's restricted unpickler (tensors, containers, numbers): one
    that also carries an object is a ValueError naming the file, and the object's code never ran."""
    path = tmp_path / "policy.pt"
    _policy(path, 3)
    blob = torch.load(path, weights_only=True)
    marker = tmp_path / "ran"
    blob["metadata"]["note"] = _Planted(marker)
    torch.save(blob, path)
    with pytest.raises(ValueError, match=f"^policy {path}: cannot be read .*restricted load refused it: "
                       "Unsupported global") as caught:
        _loaded(str(path))
    assert "weights_only` set to `False`" not in str(caught.value)  # no advice to run the file's code
    assert not marker.exists()


def test_simulate_says_a_damaged_policy_in_one_line(tmp_path, capsys) -> None:
    path = _damaged(tmp_path / "policy.pt", "garbage")
    cfg = tmp_path / "feddo.toml"
    cfg.write_text(TINY_TOML + f'policy = "{path}"\n', encoding="utf-8")
    assert main(["simulate", "--config", str(cfg), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"fedfleet: configuration error: {cfg}: [algorithm] for 'feddo': policy {path}: cannot be read "
                     "(UnpicklingError: a restricted load refused it: Unsupported operand 103); it is not a whole "
                     "torch archive (cut short, or not written by torch.save); [algorithm] policy must name a file "
                     "that fedfleet feddo pretrain wrote"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["a folder", "under a file"])
def test_pretrain_refuses_an_out_it_could_not_write_before_training(tmp_path, capsys, where: str) -> None:
    cfg = tmp_path / "feddo.toml"
    cfg.write_text(TINY_TOML, encoding="utf-8")
    if where == "a folder":
        out, why = tmp_path, f"--out {tmp_path} is a folder: give the policy file's path"
    else:
        (tmp_path / "notes.txt").write_text("x")
        out = tmp_path / "notes.txt" / "policy.pt"
        why = f"--out {out}: {tmp_path / 'notes.txt'} is a file, not a folder"
    assert main(["feddo", "pretrain", "--config", str(cfg), "--episodes", "1", "--rounds", "1", "--out", str(out)]) == 2
    text = capsys.readouterr()
    assert why in text.err and "Traceback" not in text.err
    assert text.out == ""  # the error comes alone: no banner, no episode


@pytest.mark.parametrize(("change", "argv", "why"), [
    ("learn = false\n", ["--episodes", "4", "--rounds", "4"], "[algorithm] learn = false: a pre-training would never "
                                                               "update the agent"),
    ("updates_per_round = 0\n", ["--episodes", "4", "--rounds", "4"], "[algorithm] updates_per_round = 0: a "
                                                                       "pre-training would never update the agent"),
    # TINY_TOML's warm-up of 1 raised to 5: 2 x 2 = 4 transitions, one short of the first update
    ("", ["--episodes", "2", "--rounds", "2"], "--episodes 2 x --rounds 2 = 4 transitions, fewer than the 5 the replay "
                                               "buffer holds before the agent's first update ([algorithm] warmup)"),
    ("num_devices = 2\n", ["--episodes", "1", "--rounds", "2"], "[algorithm] num_devices = 2 but [data] clients = 3: "
                                                                 "the policy would be 2 devices wide"),
    ("", ["--episodes", "1", "--rounds", "2", "--out", " "], "--out is empty"),
], ids=["learn-false", "no-updates", "short-of-warmup", "fewer-slots-than-clients", "empty-out"])
def test_pretrain_refuses_a_policy_that_would_not_learn_or_fit_before_training(tmp_path, capsys, change: str,
                                                                               argv: list[str], why: str) -> None:
    """What would write an untrained agent (no update ever made), one its own configuration's fleet
    could not run, or a file without a name, is a configuration error before any episode: exit 2,
    the reason alone (no banner), no file."""
    cfg = tmp_path / "feddo.toml"
    text = TINY_TOML.replace("warmup = 1\n", "warmup = 5\n") if "warmup" in why else TINY_TOML
    cfg.write_text(text + change, encoding="utf-8")
    out = tmp_path / "policy.pt"
    args = ["feddo", "pretrain", "--config", str(cfg), *argv]
    assert main(args if "--out" in argv else [*args, "--out", str(out)]) == 2
    said = capsys.readouterr()
    assert why in said.err and "Traceback" not in said.err and said.out == ""
    assert list(tmp_path.iterdir()) == [cfg]
    # one transition more and the same warm-up of 5 updates the agent: the check is the exact bound
    if "warmup" in why:
        assert main([*args[:4], "--episodes", "1", "--rounds", "6", "--out", str(out), "-q"]) == 0
        assert DSACTAgent.load_policy(out)[0].updates > 0


def test_a_policy_with_nan_weights_is_neither_written_nor_loaded(tmp_path) -> None:
    """An agent whose weights hold NaN (a diverged training) is not written, naming where; a
    policy file whose tensors were damaged into NaN is refused on loading, naming the tensors."""
    agent = DSACTAgent(3 + GLOBAL_FEATURES, 3, DSACTConfig(**SMALL_AGENT, warmup=1, batch_size=2), seed=0)
    with torch.no_grad():
        next(agent.actor.parameters())[0, 0] = float("nan")
    out = tmp_path / "diverged.pt"
    with pytest.raises(ValueError, match=rf"NaN or infinite values in actor\.\S+ .*not written to {out}"):
        agent.save_policy(out, {"num_devices": 3, "global_features": GLOBAL_FEATURES})
    assert list(tmp_path.iterdir()) == []
    path = Path(_policy(tmp_path / "good.pt", 3))
    blob = torch.load(path, weights_only=True)
    name, weight = next(iter(blob["agent"]["critics"].items()))
    weight.view(-1)[:4] = float("inf")
    torch.save(blob, path)
    with pytest.raises(ValueError, match=rf"^policy {path}: NaN or infinite values in critics\.{re.escape(name)} \("):
        _loaded(str(path))


@pytest.mark.parametrize("there", ["another policy", "the starting policy"])
def test_a_policy_that_cannot_be_written_leaves_the_file_there_before(tmp_path, there: str) -> None:
    """``fedfleet feddo pretrain`` in a process whose files may not exceed 64 KiB (``RLIMIT_FSIZE``:
    a write past it fails as on a full disk) over a good 3-device policy: exit 1 with the reason
    and the episodes' cost, the good file byte for byte as it was, no temporary file left. So
    too where that file is the policy the pre-training started from (its only copy)."""
    import subprocess
    import sys

    toml = TINY_TOML.replace("hidden = 16", "hidden = 128")  # a 128-wide agent: its policy is larger than the limit
    if there == "another policy":
        good = Path(_policy(tmp_path / "policy.pt", 3))
        assert len(good.read_bytes()) < 65_536
    else:  # written here, without the limit: the pre-training reads it and cannot write it again
        good = tmp_path / "policy.pt"
        DSACTAgent(3 + GLOBAL_FEATURES, 3, DSACTConfig(**{**SMALL_AGENT, "hidden": (128, 128)}), seed=0).save_policy(
            good, {"num_devices": 3, "global_features": GLOBAL_FEATURES})
        toml += f'policy = "{good}"\n'
    before = good.read_bytes()
    cfg = tmp_path / "feddo.toml"
    cfg.write_text(toml, encoding="utf-8")
    code = ("import resource, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (65_536, 65_536))\n"
            "from broker_server.cli import main\n"
            f"sys.exit(main(['feddo', 'pretrain', '--config', {str(cfg)!r}, '--episodes', '1', '--rounds', '3', "
            f"'--out', {str(good)!r}, '-q']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    if there == "the starting policy":
        assert done.stdout.startswith(f"fedfleet feddo pretrain: digits, 3 devices, 1 episode x 3 rounds, starting "
                                      f"from the policy {good} (")
        assert done.stdout.splitlines()[0].endswith(f"-> {good} (the starting policy's file: replaced when the "
                                                    "pre-training ends, whole or not at all)")
    assert "pre-training finished (1 episode x 3 rounds, " in done.stderr
    # the episode's progress file could not be written either: said, and the pre-training went on to its end
    assert (f"FedDO pre-training: the progress after episode 1 could not be written to {good}.progress ([Errno 27] "
            "File too large): the pre-training goes on; a stop now starts over") in done.stderr
    assert f"policy {good}: could not be written (" in done.stderr
    assert "the file there before is untouched" in done.stderr
    assert "Traceback" not in done.stderr
    assert good.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["feddo.toml", "policy.pt"]



def _pretrain_until(tmp_path, toml: str, sig: signal.Signals, episode_lines: int,
                    existing: bytes | None = None) -> tuple[int, list[str], Path]:
    """``fedfleet feddo pretrain`` (1,000 episodes of 2 rounds) in a process sent ``sig`` once it
    has printed ``episode_lines`` episode lines: its exit status, every stdout line, the --out
    (holding ``existing`` before it starts, if given)."""
    import subprocess
    import sys

    cfg = tmp_path / "feddo.toml"
    cfg.write_text(toml, encoding="utf-8")
    out = tmp_path / "policy.pt"
    if existing is not None:
        out.write_bytes(existing)
    code = ("import sys\nfrom broker_server.cli import main\n"
            f"sys.exit(main(['feddo', 'pretrain', '--config', {str(cfg)!r}, '--episodes', '1000', '--rounds', '2', "
            f"'--out', {str(out)!r}]))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if sum(x.startswith("episode ") for x in lines) == episode_lines:
                proc.send_signal(sig)
                break
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines += rest.splitlines()
    assert "Traceback" not in err, err
    return proc.returncode, lines, out


def test_ctrl_c_in_pretrain_writes_the_policy_learned_so_far(tmp_path, caplog) -> None:
    """Ctrl-C (SIGINT) during ``fedfleet feddo pretrain`` keeps what the agent learned: exit 130,
    and the policy written with metadata that counts the whole episodes (those printed: a stop
    between two lines is in the next episode), the planned 1,000 and where it stopped; the agent
    file's update count that of the agent. A run that deploys it says it is from a
    stopped pre-training."""
    code, lines, out = _pretrain_until(tmp_path, TINY_TOML, signal.SIGINT, 3)
    assert code == 130, lines
    printed = [x for x in lines if x.startswith("episode ")]
    whole = len(printed)
    assert whole >= 3
    said = [x for x in lines if x.startswith("fedfleet feddo pretrain: stopped ")]
    assert len(said) == 1 and f"the policy learned so far ({whole} of 1000 episodes whole, " in said[0], lines
    progress = tmp_path / "policy.pt.progress"
    assert said[0].endswith(f"was written to {out}; its metadata records where it stopped; the same command goes on "
                            f"after episode {whole} (the progress file {progress}; delete it to start over)")
    agent, meta, _ = DSACTAgent.load_policy(out)
    assert (meta["episodes"], meta["episodes_planned"], meta["interrupted_episode"]) == (whole, 1000, whole + 1)
    assert meta["interrupted_round"] in (0, 1, 2)
    assert agent.updates == meta["updates"] > 0
    caplog.set_level(logging.WARNING)
    _loaded(str(out))
    when = "in" if meta["interrupted_round"] else "before"  # a stop between two episodes: before the next
    assert f"FedDO: the policy {out} is from a pre-training stopped {when} episode {whole + 1}: {whole} of 1000 " \
           "episodes whole" in caplog.text


def test_a_stopped_pretrain_leaves_the_policy_already_at_out(tmp_path) -> None:
    """A file already at --out (an earlier pre-training's policy) is not replaced by a stopped one:
    that policy goes beside it (NAME.stopped.SUFFIX), and the line says both."""
    from broker_server.feddo_pretrain import stopped_policy_path

    before = Path(_policy(tmp_path / "earlier.pt", 3)).read_bytes()
    code, lines, out = _pretrain_until(tmp_path, TINY_TOML, signal.SIGINT, 1, existing=before)
    assert code == 130, lines
    assert out.read_bytes() == before
    beside = stopped_policy_path(out)
    assert beside == tmp_path / "policy.stopped.pt"
    said = [x for x in lines if x.startswith("fedfleet feddo pretrain: stopped ")]
    assert len(said) == 1 and f"was written to {beside} (the file at {out}, there before, is untouched)" in said[0]
    _, meta, _ = DSACTAgent.load_policy(beside)
    assert meta["episodes_planned"] == 1000 and meta["episodes"] >= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier.pt", "feddo.toml", "policy.pt", "policy.pt.progress",
                                                          "policy.stopped.pt"]


def test_sigterm_before_the_first_update_writes_no_policy(tmp_path) -> None:
    """SIGTERM during a pre-training whose agent has not updated yet (warm-up 50 transitions, 2 a
    episode, stopped after episode 1): exit 143, nothing written, and the line says so."""
    code, lines, out = _pretrain_until(tmp_path, TINY_TOML.replace("warmup = 1", "warmup = 50"), signal.SIGTERM, 1)
    assert code == 143, lines
    said = [x for x in lines if x.startswith("fedfleet feddo pretrain: stopped ")]
    progress = tmp_path / "policy.pt.progress"
    whole = sum(x.startswith("episode ") for x in lines)
    assert len(said) == 1 and said[0].endswith(f"before the agent's first DSAC-T update: no policy written ({out} "
                                               f"untouched); the same command goes on after episode {whole} (the "
                                               f"progress file {progress}; delete it to start over)"), lines
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["feddo.toml", "policy.pt.progress"]
    # a stop while the data set loads, before any strategy exists, says the same
    from broker_server.config import load as load_config
    from broker_server.feddo_pretrain import _save_interrupted

    cfg = load_config(tmp_path / "feddo.toml")
    assert _save_interrupted(None, cfg, out, [], 1000, 2, 0, 0.0) == (
        f"fedfleet feddo pretrain: stopped before episode 1, before the agent's first DSAC-T update: no policy written "
        f"({out} untouched)")

def _agent_blob(path: Path) -> dict:
    """A policy file's agent: everything but its metadata (which holds the CPU time)."""
    blob = torch.load(path, weights_only=True)
    return {k: v for k, v in blob.items() if k != "metadata"}


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _stop_after(n: int):
    """An ``on_episode`` that stops the pre-training (as Ctrl-C) once ``n`` episodes are whole."""
    def on_episode(line: dict) -> None:
        if line["episode"] == n:
            raise KeyboardInterrupt
    return on_episode


def test_a_stopped_pretraining_goes_on_to_the_bits_of_one_run_straight_through(tmp_path) -> None:
    """3 episodes straight through, against 1 episode, a stop (Ctrl-C between episodes 1 and 2)
    and the same call again: the second goes on after episode 1 (said to on_start), and its
    policy is the straight run's bit for bit (networks, targets, optimisers, temperature, random
    streams), with the same episode lines; the progress file is removed once the policy is
    written, and the policy's metadata counts the CPU time of both parts and records the
    resume."""
    from broker_server.config import load as load_config
    from broker_server.feddo_pretrain import StartingPoint, pretrain, progress_path, read_progress

    (tmp_path / "feddo.toml").write_text(TINY_TOML, encoding="utf-8")
    cfg = load_config(tmp_path / "feddo.toml")
    straight = pretrain(cfg, episodes=3, rounds=2, out=tmp_path / "straight.pt")
    assert straight.resumed_after == () and not progress_path(tmp_path / "straight.pt").exists()
    out = tmp_path / "resumed.pt"
    starts: list[StartingPoint] = []
    with pytest.raises(KeyboardInterrupt):
        pretrain(cfg, episodes=3, rounds=2, out=out, on_episode=_stop_after(1), on_start=starts.append,
                 on_interrupt=lambda line: None)
    assert progress_path(out) == tmp_path / "resumed.pt.progress" and progress_path(out).is_file()
    interrupted = DSACTAgent.load_policy(out)[1]
    assert interrupted["episodes"] == 1 and interrupted["interrupted_episode"] == 2
    first_part = float(read_progress(progress_path(out))["cpu_seconds"])
    assert first_part > 0
    # a temporary file a kill between a progress write and its rename left (its process gone), and one of a
    # process that runs (this one: a write under way)
    stale, running = tmp_path / ".resumed.pt.progress.4194305.0a1b2c3d.tmp", \
        tmp_path / f".resumed.pt.progress.{os.getpid()}.0a1b2c3d.tmp"
    stale.write_bytes(b"x")
    running.write_bytes(b"x")
    resumed = pretrain(cfg, episodes=3, rounds=2, out=out, on_start=starts.append)
    assert not stale.exists() and running.exists()
    assert [(s.resumed_after, s.progress) for s in starts] == [(0, ""), (1, str(progress_path(out)))]
    assert resumed.resumed_after == (1,)
    assert not progress_path(out).exists()
    assert _same(_agent_blob(out), _agent_blob(tmp_path / "straight.pt"))
    drop = {"seconds"}
    assert [{k: v for k, v in x.items() if k not in drop} for x in resumed.episodes] == \
        [{k: v for k, v in x.items() if k not in drop} for x in straight.episodes]
    meta = torch.load(out, weights_only=True)["metadata"]
    assert meta["episodes"] == 3 and meta["resumed_after"] == [1] and "interrupted_episode" not in meta
    assert meta["cpu_seconds"] == resumed.cpu_seconds > first_part  # the first part's CPU time and the second's
    assert "resumed_after" not in torch.load(tmp_path / "straight.pt", weights_only=True)["metadata"]


def test_a_stop_during_a_progress_write_names_the_episode_the_file_holds(tmp_path, monkeypatch) -> None:
    """The line of a stop says after which episode the same command goes on: the last progress
    written. A stop inside episode 2's progress write, before its rename, leaves episode 1's file
    (after episode 1); one after the rename leaves episode 2's (after episode 2); a resumed run
    stopped before its first write goes on after the episodes it resumed."""
    import broker_server.feddo_pretrain as fp
    from broker_server.config import load as load_config

    (tmp_path / "feddo.toml").write_text(TINY_TOML, encoding="utf-8")
    cfg = load_config(tmp_path / "feddo.toml")
    real = fp.write_atomically

    def stopping(after_rename: bool):
        calls = []

        def write(path, data, **kw):
            calls.append(path)
            if len(calls) == 2 and not after_rename:
                raise KeyboardInterrupt
            real(path, data, **kw)
            if len(calls) == 2:
                raise KeyboardInterrupt
        return write

    for after_rename, episode in ((False, 1), (True, 2)):
        out = tmp_path / f"policy-{episode}.pt"
        said: list[str] = []
        monkeypatch.setattr(fp, "write_atomically", stopping(after_rename))
        with pytest.raises(KeyboardInterrupt):
            fp.pretrain(cfg, episodes=3, rounds=2, out=out, on_interrupt=said.append)
        assert len(fp.read_progress(fp.progress_path(out))["lines"]) == episode
        assert said[0].endswith(f"the same command goes on after episode {episode} (the progress file "
                                f"{fp.progress_path(out)}; delete it to start over)"), said
    monkeypatch.setattr(fp, "write_atomically", real)

    def stop(_start) -> None:
        raise KeyboardInterrupt
    said = []
    with pytest.raises(KeyboardInterrupt):
        fp.pretrain(cfg, episodes=3, rounds=2, out=tmp_path / "policy-2.pt", on_start=stop, on_interrupt=said.append)
    assert said[0].endswith(f"the same command goes on after episode 2 (the progress file "
                            f"{fp.progress_path(tmp_path / 'policy-2.pt')}; delete it to start over)"), said


def test_a_progress_file_of_other_settings_or_more_episodes_is_refused_naming_them(tmp_path, capsys) -> None:
    """A stopped pre-training's progress file (2 whole episodes), then the same command with
    another Dirichlet α and learning rate: refused before any training, naming both settings as
    the file has them and as they are now; with --episodes 1 (fewer than it holds): refused,
    saying what to give; a file that is not a progress file: refused, saying to delete it. The
    file is left as it was each time; with its settings the command goes on (the banner says
    from where) and removes it."""
    from broker_server.config import load as load_config
    from broker_server.feddo_pretrain import pretrain, progress_path

    cfg_path = tmp_path / "feddo.toml"
    cfg_path.write_text(TINY_TOML, encoding="utf-8")
    out = tmp_path / "policy.pt"
    with pytest.raises(KeyboardInterrupt):
        pretrain(load_config(cfg_path), episodes=4, rounds=2, out=out, on_episode=_stop_after(2),
                 on_interrupt=lambda line: None)
    progress = progress_path(out)
    kept = progress.read_bytes()
    other = tmp_path / "other.toml"
    other.write_text(TINY_TOML.replace("alpha = 0.5", "alpha = 0.1").replace("lr = 0.05", "lr = 0.1"),
                     encoding="utf-8")
    args = ["feddo", "pretrain", "--episodes", "4", "--rounds", "2", "--out", str(out)]
    assert main([*args, "--config", str(other)]) == 2
    err = capsys.readouterr().err
    assert (f"the progress file {progress} holds 2 whole episodes of a pre-training with other settings: data.alpha: "
            "0.5 in the progress file, 0.1 now; train.lr: 0.05 in the progress file, 0.1 now. Run it with its settings "
            "to go on, or delete the file to start over") in err
    assert main(["feddo", "pretrain", "--episodes", "1", "--rounds", "2", "--out", str(out), "--config",
                 str(cfg_path)]) == 2
    assert (f"the progress file {progress} holds 2 whole episodes, more than --episodes 1: give --episodes 2 or more "
            "to go on, or delete the file to start over") in capsys.readouterr().err
    assert progress.read_bytes() == kept
    assert main([*args, "--config", str(cfg_path)]) == 0
    said = capsys.readouterr().out
    assert said.splitlines()[0].endswith(f"-> {out}; resuming after episode 2 of 4 (the progress file {progress}; "
                                         "delete it to start over)")
    assert "episode   3/4" in said and "episode   1/4" not in said and not progress.exists()
    progress.write_bytes(b"\x93not a progress file")
    assert main([*args, "--config", str(cfg_path)]) == 2
    assert f"the pre-training's progress file {progress} cannot be read (" in capsys.readouterr().err
    assert progress.read_bytes() == b"\x93not a progress file"
    # one byte of an intact file changed (in its agent): its checksum no longer matches
    damaged = bytearray(kept)
    damaged[len(damaged) // 2] ^= 0x01
    progress.write_bytes(bytes(damaged))
    assert main([*args, "--config", str(cfg_path)]) == 2
    assert (f"the pre-training's progress file {progress} cannot be read (its checksum does not match its content: "
            "the file is damaged): delete it to start over") in capsys.readouterr().err


def test_a_resumed_pretrainings_stops_and_its_finished_policy_are_told_apart(tmp_path, capsys) -> None:
    """A pre-training stopped twice: the resumed one's stop replaces the policy the first stop
    wrote at --out (its own), no NAME.stopped.pt. A configuration naming a starting policy against
    that progress file (an untrained agent's) is refused naming "an untrained agent". A
    pre-training onto its own starting policy stopped after its finished policy was written but
    before the progress file was removed (the starting policy's file, so now another SHA-256 than
    the one the progress file started from): said to be the finished policy, not a pre-training
    of other settings."""
    from broker_server.config import load as load_config
    from broker_server.feddo_pretrain import pretrain, progress_path

    cfg_path = tmp_path / "feddo.toml"
    cfg_path.write_text(TINY_TOML, encoding="utf-8")
    out = tmp_path / "policy.pt"
    cfg = load_config(cfg_path)
    with pytest.raises(KeyboardInterrupt):
        pretrain(cfg, episodes=4, rounds=2, out=out, on_episode=_stop_after(1), on_interrupt=lambda line: None)
    first = DSACTAgent.load_policy(out)[1]
    assert first["interrupted_episode"] == 2
    said: list[str] = []
    with pytest.raises(KeyboardInterrupt):  # resumed, stopped again after episode 2: its own policy replaced
        pretrain(cfg, episodes=4, rounds=2, out=out, on_episode=_stop_after(2), on_interrupt=said.append)
    assert f"was written to {out}; its metadata records where it stopped" in said[0]
    assert DSACTAgent.load_policy(out)[1]["interrupted_episode"] == 3
    assert not (tmp_path / "policy.stopped.pt").exists()
    # the config naming a starting policy, against this progress file of an untrained agent's
    start = Path(_policy(tmp_path / "start.pt", 3))
    onto = tmp_path / "onto.toml"
    onto.write_text(TINY_TOML + f'policy = "{start}"\n', encoding="utf-8")
    assert main(["feddo", "pretrain", "--episodes", "4", "--rounds", "2", "--out", str(out), "--config",
                 str(onto)]) == 2
    assert ("holds 2 whole episodes of a pre-training with other settings: starting policy (SHA-256): an untrained "
            "agent in the progress file, '") in capsys.readouterr().err
    # a pre-training onto its starting policy, killed between the policy's write and the progress file's removal
    cfg = load_config(onto)
    last: dict[str, bytes] = {}

    def keep(line: dict) -> None:  # the progress file as the last episode leaves it
        last["progress"] = progress_path(start).read_bytes()

    pretrain(cfg, episodes=2, rounds=2, out=start, on_episode=keep)
    progress = progress_path(start)
    assert not progress.exists()
    progress.write_bytes(last["progress"])
    assert main(["feddo", "pretrain", "--episodes", "2", "--rounds", "2", "--out", str(start), "--config",
                 str(onto)]) == 2
    assert (f"{start} is already the finished policy of the pre-training in the progress file {progress} (2 episodes; "
            f"the process stopped after writing it, before removing the progress file): delete {progress}, then run "
            f"the command again to pre-train further from {start}") in capsys.readouterr().err


def test_the_validation_set_is_held_out_from_every_devices_training_images(tmp_path, caplog) -> None:
    """SPECS §4.1's held-out validation set: with [data] train_samples below the split's size the
    devices' shards are cut from a stratified subset (``split_dataset``), and the strategy the
    runtime builds draws its val_size images from the rest: the union of the shards and the
    validation images share no index (matched here by pixels, since the set carries no index),
    for FedDO and FedAA alike. With every image on a device the set overlaps them and a warning
    says so."""
    import logging

    from broker_server.config import load as load_config
    from broker_server.runtime import device_training_pool, make_strategy
    from broker_server.strategies.feddo import validation_split
    from edge_agent.data import load_dataset
    from edge_agent.partition import split_dataset

    cfg_path = tmp_path / "feddo.toml"
    # run seed 7, not the stratified subsample's default seed 0: the pool must follow [run] seed
    tiny = TINY_TOML.replace("seed = 0\n", "seed = 7\n")
    cfg_path.write_text(tiny.replace('clients = 3\n', 'clients = 3\ntrain_samples = 600\n'), encoding="utf-8")
    cfg = load_config(cfg_path)
    ds = load_dataset("digits")
    shards = split_dataset(ds, 3, scheme="dirichlet", seed=cfg.run.seed, alpha=0.5, train_samples=600)
    used = np.unique(np.concatenate(shards))
    np.testing.assert_array_equal(used, device_training_pool(cfg, ds))  # the pool is the shards' union
    assert used.size == 600 < len(ds.train.y)
    pixels = {np.asarray(ds.train.x[i], np.float32).tobytes() for i in used}
    for algorithm in ("feddo", "fedaa"):
        raw = tiny.replace('clients = 3\n', 'clients = 3\ntrain_samples = 600\n')
        raw = raw.replace('algorithm = "feddo"', f'algorithm = "{algorithm}"')
        if algorithm == "fedaa":
            raw = raw[:raw.index("[algorithm]")] + "[algorithm]\nval_size = 100\n"
        cfg_path.write_text(raw, encoding="utf-8")
        x, y = make_strategy(load_config(cfg_path), ds).validation
        assert len(y) == 100
        assert not any(np.asarray(row, np.float32).tobytes() in pixels for row in x), algorithm
    # every image on a device: drawn from all of them, said out loud
    with caplog.at_level(logging.WARNING, logger="broker_server.strategies.feddo"):
        x, y = validation_split(ds, {"val_size": 50}, 0, np.arange(len(ds.train.y)))
    assert len(y) == 50 and "drawn from training images the devices also train on" in caplog.text
    # fewer held-out images than val_size: the smaller set, said out loud
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="broker_server.strategies.feddo"):
        x, y = validation_split(ds, {"val_size": 50}, 0, np.arange(len(ds.train.y) - 10))
    assert len(y) == 10 and "has 10 images, not val_size = 50" in caplog.text
    # a val_size above the split itself: the test split (digits: 359 test images), and every training image
    # on a device with more asked than the split has; each the whole split, said out loud
    n_test, n_train = len(ds.test.y), len(ds.train.y)
    for params, n, words in (({"val_size": 100_000, "val_source": "test"}, n_test, "test images in the split"),
                             ({"val_size": 100_000}, n_train, "training images in the split")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="broker_server.strategies.feddo"):
            x, y = validation_split(ds, params, 0, np.arange(n_train))
        assert len(y) == n and f"has {n} images, not val_size = 100000: only {n} {words}" in caplog.text


def test_a_relative_policy_path_that_is_not_there_names_where_it_was_looked_for(tmp_path, monkeypatch) -> None:
    """``policy = "feddo_policy.pt"`` is read from the current folder (README): a run started in
    another folder is told the full path it looked at; an absolute path is named as given."""
    monkeypatch.chdir(tmp_path)
    here = Path.cwd()
    with pytest.raises(ValueError, match=re.escape(f"policy {here / 'feddo_policy.pt'} (given as feddo_policy.pt; a "
                                                   f"relative path is read from the current folder, {here}): cannot "
                                                   "be read (FileNotFoundError: ")):
        _loaded("feddo_policy.pt")
    with pytest.raises(ValueError, match=re.escape(f"policy {tmp_path / 'none.pt'}: cannot be read (")):
        _loaded(str(tmp_path / "none.pt"))


def test_simulate_says_a_relative_policy_is_read_from_the_current_folder(tmp_path, monkeypatch, capsys) -> None:
    """``policy = "feddo_policy.pt"`` in a configuration beside that file, the run started in
    another folder: the run makes the path absolute against the current folder (for its
    config.toml), and the one line saying the file cannot be read names it as given and the folder
    it was read from (a policy given absolute: test_simulate_says_a_damaged_policy_in_one_line)."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "elsewhere").mkdir()
    _policy(tmp_path / "conf" / "feddo_policy.pt", 3)
    cfg = tmp_path / "conf" / "feddo.toml"
    cfg.write_text(TINY_TOML + 'policy = "feddo_policy.pt"\n', encoding="utf-8")
    monkeypatch.chdir(tmp_path / "elsewhere")
    here = Path.cwd()
    assert main(["simulate", "--config", str(cfg), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == [
        f"fedfleet: configuration error: {cfg}: [algorithm] for 'feddo': policy {here / 'feddo_policy.pt'} (given as "
        f"feddo_policy.pt; a relative path is read from the current folder, {here}): cannot be read "
        f"(FileNotFoundError: [Errno 2] No such file or directory: '{here / 'feddo_policy.pt'}'); [algorithm] policy "
        "must name a file that fedfleet feddo pretrain wrote"]
    assert not (tmp_path / "run").exists()


def test_a_simulation_says_its_overlapping_validation_set_once(tmp_path, caplog) -> None:
    """Digits with every training image on a device: the validation set overlaps their training
    data, which the log says once (the configuration check's strategy is the one the run serves
    with: built once), and the run goes on to its 2 rounds."""
    cfg = tmp_path / "feddo.toml"
    cfg.write_text(TINY_TOML, encoding="utf-8")
    caplog.set_level(logging.WARNING)
    assert main(["simulate", "--config", str(cfg), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    said = [r for r in caplog.records if "drawn from training images the devices also train on" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert logging.root.manager.disable == logging.NOTSET  # nothing held the log back
    rounds = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds if "round" in r] == [1, 2]


def test_a_policy_of_other_data_settings_is_said_and_the_same_ones_are_not(tmp_path, caplog) -> None:
    """The data settings a policy records (fedfleet feddo pretrain) against the run's
    (runtime.data_settings): each difference named with both values in one warning; none, no warning."""
    agent = DSACTAgent(3 + GLOBAL_FEATURES, 3, DSACTConfig(**SMALL_AGENT, warmup=1, batch_size=2), seed=0)
    path = tmp_path / "p.pt"
    pre = {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5, "clients": 3}
    agent.save_policy(path, {"num_devices": 3, "global_features": GLOBAL_FEATURES, **pre})
    val = (np.zeros((1, 1, 8, 8), np.float32), np.zeros(1, np.int64))
    caplog.set_level(logging.WARNING)
    FedDO(policy=str(path), validation=val, run_data=pre, **SMALL)
    assert "other data settings" not in caplog.text
    FedDO(policy=str(path), validation=val, run_data={**pre, "alpha": 1.0, "dataset": "mnist"}, **SMALL)
    said = [r.getMessage() for r in caplog.records if "other data settings" in r.getMessage()]
    assert said == [f"FedDO: the policy {path} was pre-trained on other data settings than this run's (dataset "
                    "'digits' there, 'mnist' here; alpha 0.5 there, 1.0 here): its ratios were learnt for another "
                    "federation"]
    # an IID policy of an older pretrain, which recorded an α for any partition, in an IID run: the
    # same federation, no warning (α means nothing without a Dirichlet partition)
    caplog.clear()
    iid = tmp_path / "iid.pt"
    agent.save_policy(iid, {"num_devices": 3, "global_features": GLOBAL_FEATURES, **pre, "partition": "iid"})
    FedDO(policy=str(iid), validation=val, run_data={**pre, "partition": "iid", "alpha": None}, **SMALL)
    assert "other data settings" not in caplog.text


def test_pretrain_records_the_data_settings_a_run_is_compared_with(tmp_path, capsys) -> None:
    """The policy of ``fedfleet feddo pretrain`` carries runtime.data_settings of its configuration,
    the dictionary a deployed run compares (α kept for a Dirichlet partition). Its banner counts in
    the singular where a count is 1."""
    cfg = tmp_path / "feddo.toml"
    cfg.write_text(TINY_TOML.replace("clients = 3", "clients = 1"), encoding="utf-8")
    out = tmp_path / "policy.pt"
    assert main(["feddo", "pretrain", "--config", str(cfg), "--episodes", "1", "--rounds", "1", "--out", str(out)]) == 0
    banner = f"fedfleet feddo pretrain: digits, 1 device, 1 episode x 1 round, from an untrained agent -> {out}\n"
    assert capsys.readouterr().out.startswith(banner)
    _, meta, _ = DSACTAgent.load_policy(out)
    assert {k: meta[k] for k in ("dataset", "partition", "alpha", "clients")} == {
        "dataset": "digits", "partition": "dirichlet", "alpha": 0.5, "clients": 1}


def test_pretrain_from_the_configs_policy_says_so_and_from_scratch_ignores_it(tmp_path, capsys) -> None:
    """A configuration naming ``[algorithm] policy`` (README's flow leaves it there after the first
    pre-training): the pre-training goes on from that policy, and its first line says so with the
    policy's DSAC-T updates; the metadata records the policy it started from, its ``updates``
    counting from the start of the agent. ``--from-scratch`` starts an untrained agent, its first
    line naming the policy it did not read, and the policy is that of a first pre-training."""
    cfg = tmp_path / "feddo.toml"
    cfg.write_text(TINY_TOML, encoding="utf-8")
    first = tmp_path / "feddo_policy.pt"
    assert main(["feddo", "pretrain", "--config", str(cfg), "--episodes", "1", "--rounds", "2", "--out", str(first),
                 "-q"]) == 0
    capsys.readouterr()
    before, meta0, sha = DSACTAgent.load_policy(first)
    assert before.updates > 0 and "started_from" not in meta0
    cfg.write_text(TINY_TOML + f'policy = "{first}"\n', encoding="utf-8")
    again = tmp_path / "p2.pt"
    assert main(["feddo", "pretrain", "--config", str(cfg), "--episodes", "1", "--rounds", "2", "--out", str(again),
                 "-q"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"fedfleet feddo pretrain: digits, 3 devices, 1 episode x 2 rounds, starting from the policy {first} (the "
        f"config's [algorithm] policy; its {before.updates} DSAC-T updates; --from-scratch ignores it) -> {again}")
    agent, meta, _ = DSACTAgent.load_policy(again)
    assert meta["episodes"] == 1 and agent.updates == meta["updates"] == 2 * before.updates
    assert (meta["started_from"], meta["started_from_sha256"], meta["started_from_updates"]) == (
        str(first.resolve()), sha, before.updates)
    scratch = tmp_path / "p3.pt"
    assert main(["feddo", "pretrain", "--config", str(cfg), "--episodes", "1", "--rounds", "2", "--out",
                 str(scratch), "-q", "--from-scratch"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "fedfleet feddo pretrain: digits, 3 devices, 1 episode x 2 rounds, from an untrained agent (--from-scratch: "
        f"the config's [algorithm] policy {first} is not read) -> {scratch}")
    agent, meta, _ = DSACTAgent.load_policy(scratch)
    assert agent.updates == before.updates and "started_from" not in meta
    assert meta["updates"] == meta0["updates"]


def test_pretrain_onto_its_starting_policy_says_it_replaces_it_flushed_before_the_rename(tmp_path, capsys,
                                                                                         monkeypatch) -> None:
    """--out the starting policy's file (by another name too: a relative path from its folder):
    the first line says the file is replaced when the pre-training ends, whole or not at all; the
    new policy is written beside it, flushed to the device, then renamed onto it (a power cut
    leaves one whole file: the old or the new), as is each episode's progress file before it."""
    import protocol.files

    cfg = tmp_path / "feddo.toml"
    start = Path(_policy(tmp_path / "feddo_policy.pt", 3))
    cfg.write_text(TINY_TOML + f'policy = "{start}"\n', encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    calls: list[str] = []
    fsync, replace = protocol.files.os.fsync, protocol.files.os.replace

    def flushed(fd: int) -> None:
        calls.append("fsync")
        fsync(fd)

    def renamed(a, b) -> None:
        calls.append(f"replace {Path(b).name}")
        replace(a, b)

    monkeypatch.setattr(protocol.files.os, "fsync", flushed)
    monkeypatch.setattr(protocol.files.os, "replace", renamed)
    assert main(["feddo", "pretrain", "--config", str(cfg), "--episodes", "1", "--rounds", "2", "--out",
                 "feddo_policy.pt", "-q"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"fedfleet feddo pretrain: digits, 3 devices, 1 episode x 2 rounds, starting from the policy {start} (the "
        "config's [algorithm] policy; its 0 DSAC-T updates; --from-scratch ignores it) -> feddo_policy.pt (the "
        "starting policy's file: replaced when the pre-training ends, whole or not at all)")
    # the episode's progress file, then the policy (the progress file removed once it is written)
    assert calls == ["fsync", "replace feddo_policy.pt.progress", "fsync", "replace feddo_policy.pt"]
    agent, meta, _ = DSACTAgent.load_policy(start)
    assert agent.updates > 0 and meta["started_from"] == str(start.resolve()) and meta["started_from_updates"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["feddo.toml", "feddo_policy.pt"]


def test_pretrain_says_what_a_replay_batch_larger_than_its_buffer_does() -> None:
    """A DSAC-T batch is drawn with replacement: a batch_size above warmup repeats transitions in
    the updates before the buffer holds a batch, and one above all the transitions a pre-training
    stores (the new user's 32 against 1 episode x 3 rounds) in every update; each is said before
    the first episode. None at batch_size <= warmup. The buffer does give such a batch."""
    from broker_server.config import from_dict
    from broker_server.feddo_pretrain import replay_batch_note

    def cfg(warmup: int, batch: int):  # noqa: ANN202
        return from_dict({"data": {"dataset": "digits", "clients": 4}, "train": {"algorithm": "feddo"},
                          "algorithm": {"warmup": warmup, "batch_size": batch}}, "<test>")

    assert replay_batch_note(cfg(3, 32), 1, 3) == (
        "fedfleet feddo pretrain: note: [algorithm] batch_size = 32 is more than the 3 transitions this pre-training "
        "stores in all (--episodes x --rounds): every DSAC-T update draws its 32 from at most 3, with replacement "
        "(each one about 11 times in every batch); lower batch_size, or pre-train more rounds")
    assert replay_batch_note(cfg(32, 64), 10, 75) == (
        "fedfleet feddo pretrain: note: [algorithm] batch_size = 64 is more than warmup = 32: the DSAC-T updates "
        "before the replay buffer holds 64 transitions draw their batch from fewer, with replacement (the first "
        "from 32)")
    assert replay_batch_note(cfg(32, 32), 1, 34) is None
    agent = DSACTAgent(2 + GLOBAL_FEATURES, 2, DSACTConfig(**SMALL_AGENT, warmup=1, batch_size=32), seed=0)
    s = np.zeros(2 + GLOBAL_FEATURES, np.float32)
    agent.observe(s, np.zeros(2, np.float32), 1.0, s, True)
    assert agent.buffer.sample(32, np.random.default_rng(0))["r"].shape[0] == 32
    assert agent.update(1) and agent.updates == 1


def test_the_readme_path_from_the_example_pretrains_and_deploys(tmp_path, monkeypatch, caplog) -> None:
    """README's FedDO steps on a copy of examples/feddo.toml (pre-training shortened to 1 episode of
    34 rounds, 2 more than its warm-up of 32 transitions, so the agent updates): the policy is
    written, deployed by a relative path from the current folder, and the run finishes its 2
    rounds without a data-settings warning (the same federation)."""
    monkeypatch.chdir(tmp_path)
    example = Path(__file__).resolve().parents[2] / "examples" / "feddo.toml"
    (tmp_path / "my-feddo.toml").write_text(example.read_text(encoding="utf-8"), encoding="utf-8")
    assert main(["feddo", "pretrain", "--config", "my-feddo.toml", "--episodes", "1", "--rounds", "34",
                 "--out", "feddo_policy.pt", "-q"]) == 0
    assert DSACTAgent.load_policy("feddo_policy.pt")[0].updates > 0
    with open("my-feddo.toml", "a", encoding="utf-8") as f:
        f.write('policy = "feddo_policy.pt"\n')  # the file ends in its [algorithm] table
    caplog.set_level(logging.INFO)
    assert main(["simulate", "--config", "my-feddo.toml", "--rounds", "2", "--out", "run", "--quiet"]) == 0
    rounds = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds if "round" in r] == [1, 2]
    assert "other data settings" not in caplog.text
    # the run folder's config names the policy by its absolute path, so a --resume started in
    # another folder finds it: 1 more round from a sub-folder
    written = (tmp_path / "run" / "config.toml").read_text(encoding="utf-8")
    assert f'policy = "{tmp_path / "feddo_policy.pt"}"' in written
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["simulate", "--resume", "../run", "--rounds", "3", "--quiet"]) == 0
    rounds = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds if "round" in r] == [1, 2, 3]


def test_a_checkpoint_of_critics_without_layer_norm_is_refused_with_the_key_to_set() -> None:
    """A run checkpointed before critic_layer_norm existed has plain critics (and its checkpoint no
    record of the agent's configuration); resumed with the new default its agent cannot take them:
    a ValueError saying which key to set, not torch's error. A checkpoint that records the agent's
    configuration is rebuilt from that record, whatever [algorithm] says."""
    val = (np.zeros((1, 1, 8, 8), np.float32), np.zeros(1, np.int64))
    old = FedDO(validation=val, **{**SMALL, "critic_layer_norm": False})
    old._ensure_agent(3)
    recorded = old.state_dict()
    assert recorded["agent_config"]["critic_layer_norm"] is False and recorded["state_dim"] == 3 + GLOBAL_FEATURES
    now = FedDO(validation=val, **SMALL)
    now.load_state_dict(recorded)
    assert now.agent is not None and now.agent.to_bytes() == old.agent.to_bytes()
    state = {k: v for k, v in recorded.items() if k not in ("agent_config", "state_dim", "max_devices")}
    with pytest.raises(ValueError, match=r"critic_layer_norm = true\): set these keys in the run folder's "
                                         r"config.toml .*before critic_layer_norm existed .*critic_layer_norm = false"):
        FedDO(validation=val, **SMALL).load_state_dict(state)
    same = FedDO(validation=val, **{**SMALL, "critic_layer_norm": False})
    same.load_state_dict(state)
    assert same.agent is not None and same.agent.to_bytes() == old.agent.to_bytes()
