"""Oort: the utility, the scores and the selection by hand; a federation in memory (digits, four
devices on two firmware profiles, two rounds) whose picks equal the hand computation of Oort's
ranking from the utilities the devices reported on the wire."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers.memory_federation import Device, run_federation, wire

from broker_server.strategies.oort import Oort, oort_scores, preferred_duration
from edge_agent.algorithms.oort import OortClient, statistical_utility
from protocol.membership import decode_members
from protocol.messages import Kind, Receipt, RoundStart, Update


def test_statistical_utility_is_size_times_rms_loss() -> None:
    assert statistical_utility(np.array([1.0, 2.0, 2.0])) == pytest.approx(3 * math.sqrt(9 / 3))
    assert statistical_utility(np.zeros(0)) == 0.0


def test_scores_and_preferred_duration_by_hand() -> None:
    assert preferred_duration([5.0, 1.0, 3.0, 2.0], 10.0) == 1.0  # index ⌊4·0.1⌋ = 0
    assert preferred_duration([5.0, 1.0, 3.0, 2.0], 60.0) == 3.0  # index 2
    assert preferred_duration([5.0], 100.0) == math.inf
    arms = {"a": {"reward": 2.0, "duration": 1.0, "time_stamp": 1.0, "count": 1.0},
            "b": {"reward": 6.0, "duration": 2.0, "time_stamp": 2.0, "count": 1.0},
            "c": {"reward": 9.0, "duration": 1.0, "time_stamp": 0.0, "count": 0.0}}  # unexplored
    s = oort_scores(arms, ["a", "b", "c"], t=3, prefer=1.0)
    lo, rng = 2.0 * 0.999, 6.0 - 2.0 * 0.999  # clip: sorted[min(⌊2·0.98⌋, 1)] = 6
    assert set(s) == {"a", "b"}
    assert s["a"] == pytest.approx((2.0 - lo) / rng + math.sqrt(0.1 * math.log(3) / 1))
    assert s["b"] == pytest.approx(((6.0 - lo) / rng + math.sqrt(0.1 * math.log(3) / 2)) * (1.0 / 2.0) ** 2)


def test_oort_federation_picks_the_hand_computed_ranking(tmp_path, digits, memory_hub) -> None:
    sizes = {"dev-a": 30, "dev-b": 50, "dev-c": 40, "dev-d": 60}
    profiles = {"dev-a": "x86-cpu", "dev-b": "x86-cpu", "dev-c": "rpi4", "dev-d": "x86-cpu"}
    devices, start = {}, 0
    for cid, n in sizes.items():
        devices[cid] = Device(OortClient(), digits.train.x[start:start + n], digits.train.y[start:start + n],
                              profiles[cid])
        start += n
    # ε fixed at 0.5, a cut-off just above the runner-up, a window of one: every pick is determined
    strategy = Oort(participation_rate=0.5, train_config={"lr": 0.05}, exploration=0.5, exploration_decay=1.0,
                    exploration_min=0.5, cut_off_util=1.0001, sample_window=1.0)
    server = run_federation(tmp_path, memory_hub, strategy, devices, digits.test, rounds=2)
    msgs = wire(memory_hub)
    # the broadcast names the picks by member index (each device's from its join receipt)
    by_index = {env.body.member_index: t.split("/")[-2] for s, t, env in msgs
                if s == "server" and isinstance(env.body, Receipt) and env.body.ref_kind == Kind.JOIN}
    picked = {r: {c for s, _, env in msgs if s == "server" and env.round == r and isinstance(env.body, RoundStart)
                  for c in (*env.body.selected,
                            *(by_index[i] for i in (decode_members(env.body.members) if env.body.members else ())))}
              for r in (1, 2)}
    # profile durations |D|·1e-3 s / relative speed: a 0.03, b 0.05, c 0.04/0.05 = 0.8, d 0.06;
    # T = the 10th percentile = 0.03. Round 1 explores only (⌊2·0.5⌋ = 1 exploit slot, none explored):
    # prior |D|·(T/dur)² when slower than T: a 30, b 18, c 0.056, d 15 → the top two
    assert picked[1] == {"dev-a", "dev-b"}
    ups = {s: env.body for s, t, env in msgs if env.round == 1 and isinstance(env.body, Update)}
    u = {c: float(ups[c].metrics["oort_utility"]) for c in ("dev-a", "dev-b")}
    lo = min(u.values()) * 0.999
    rng = max(max(u.values()) - lo, 1e-4)
    bonus = math.sqrt(0.1 * math.log(2) / 1)
    score = {"dev-a": (u["dev-a"] - lo) / rng + bonus, "dev-b": ((u["dev-b"] - lo) / rng + bonus) * (0.03 / 0.05) ** 2}
    assert server.metrics[1]["oort_scores"] == pytest.approx(score)
    best = max(score, key=score.get)
    # one exploited (the best score), one explored (dev-d's prior 15 beats dev-c's 0.056)
    assert picked[2] == {best, "dev-d"}
    assert server.metrics[1]["oort_explore"] == ["dev-d"] and server.metrics[1]["oort_exploit"] == [best]
