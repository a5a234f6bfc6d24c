"""The server's evaluation rounds (``[server] eval_every`` = E): the global model is evaluated on
the test split in every E-th round and the last only, and nothing else changes.

* A simulated digits federation over a real broker (FedAvg, 3 devices, 7 rounds, E = 3, through
  the grid harness's :func:`~broker_server.experiments.run_job`): rounds 3, 6 and 7 have an
  ``accuracy`` and a ``loss``, the others neither key; those figures, and every other figure of
  every round but the timings, are those of the same seeded run with E = 1 (the evaluation draws
  from no generator and changes no training); the record's ``final`` is round 7's, its
  ``best_accuracy`` the best of rounds 3, 6, 7, its ``per_round`` accuracy column ``None`` in the
  other rounds; rounds to a target is the first of rounds 3, 6, 7 at or above it, worked out from
  the E = 1 run's every-round accuracies.
* FedDO and FedAA (their ``evaluate`` computes the reward their agent learns from): with E = 3
  every round's line still has their validation accuracy and reward, equal to the E = 1 run's,
  and so are every round's plans (who trains, FedDO's ratios).
* With evaluation overlap, the test split is evaluated three times in 7 rounds (E = 3), and a
  round that is not evaluated holds no training slot.
* A server killed between round 2's checkpoint and its line (round 2 not an evaluation round):
  ``resume`` writes the line without an accuracy, and the lines are an uninterrupted run's.
* ``eval_every`` below 1 is refused by the server settings.
* A line without an accuracy names no ``accuracy_source`` (there is no figure to have one); a
  strategy whose own evaluation gives the accuracy names itself in every round. The end of a run
  names its final accuracy by the source of the line it comes from: the last line with an
  accuracy, a later line without one passing over; NaN (no line had one) is said in words.
* A global model that diverged (FedOpt with server_lr 1e30: its test loss NaN after round 1) is
  said once in a warning, and the end of the run says which rounds were skipped (every device's
  training diverged from it) and where the model diverged.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.memory_federation import (
    Device,
    Killed,
    federation_server,
    kill_before_line,
    run_expecting,
    run_federation,
    start_agents,
)

import broker_server.server as server_mod
from broker_server.checkpoint import CheckpointStore
from broker_server.errors import RunError
from broker_server.experiments import DELIVERY_METRICS, VOLATILE_METRICS, Job, rounds_to_target, run_job, series_lines
from broker_server.server import final_accuracy_source, final_accuracy_text, final_figures, run_troubles_text
from broker_server.strategies.fedaa import FedAA
from broker_server.strategies.fedavg import FedAvg
from broker_server.strategies.feddo import FedDO
from broker_server.strategies.fedopt import FedOpt
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.algorithms.feddo import FedDOClient
from edge_agent.algorithms.fedopt import FedOptClient
from protocol.memory_transport import MemoryBroker

ROUNDS = 7
EVERY = 3
EVALUATED = [3, 6, 7]  # multiples of 3 up to 7, and the last round
#: what a round not evaluated lacks, besides the timings, when compared with the E = 1 run's line
EVALUATION_KEYS = {"accuracy", "loss", "accuracy_source", "test_evaluated"}


def _lines(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _rest(line: dict) -> dict:
    """A metrics line without its timings, its test-split evaluation and its delivery figures
    (a global's receipt that comes after its round closed, on a loaded machine, is counted in
    the next round's ``global_receipts`` and ``bytes_up``: the wire's timing, not the schedule
    these tests compare)."""
    return {k: v for k, v in line.items() if k not in VOLATILE_METRICS | EVALUATION_KEYS | DELIVERY_METRICS}


def _simulated(eval_every: int) -> dict:
    return {
        "run": {"name": "eval-every", "seed": 1, "rounds": ROUNDS},
        "data": {"dataset": "digits", "partition": "iid", "clients": 3},
        "train": {"local_epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5},
        "server": {"quorum": 3, "round_deadline_s": 120.0, "join_timeout_s": 60.0, "eval_every": eval_every},
        "broker": {"kind": "amqtt"},
    }


@pytest.mark.slow
def test_a_simulated_run_evaluates_every_third_round_and_the_last_with_the_every_round_figures(
        tmp_path: Path) -> None:
    every = run_job(Job("e1", _simulated(1)), tmp_path)
    third = run_job(Job("e3", _simulated(EVERY)), tmp_path)
    ref, got = _lines(tmp_path / "runs" / "e1"), _lines(tmp_path / "runs" / "e3")
    assert [m["round"] for m in ref] == [m["round"] for m in got] == list(range(1, ROUNDS + 1))
    assert all(m["test_evaluated"] and m["accuracy"] is not None for m in ref)
    # the keys are absent in the other rounds: no 0, no copy of the last evaluated round's figure
    assert [m["round"] for m in got if "accuracy" in m] == EVALUATED
    assert [m["round"] for m in got if "loss" in m] == EVALUATED
    assert [m["round"] for m in got if m["test_evaluated"]] == EVALUATED
    acc = {m["round"]: m["accuracy"] for m in ref}
    for m in got:
        if m["round"] in EVALUATED:  # the same model, the same test split: the same figures, exactly
            assert (m["accuracy"], m["loss"]) == (acc[m["round"]], ref[m["round"] - 1]["loss"])
    # the training is the same: every round's other figures (train loss, selections, …) agree
    assert [_rest(m) for m in got] == [_rest(m) for m in ref]
    # the record: the last round's figures, the best evaluated round, the column with gaps
    assert third["final"]["accuracy"] == acc[ROUNDS] == every["final"]["accuracy"]
    assert third["best_accuracy"] == max(acc[r] for r in EVALUATED)
    assert third["per_round"]["accuracy"] == [acc[r] if r in EVALUATED else None for r in range(1, ROUNDS + 1)]
    # rounds to a target: the first evaluated round reaching it, from the every-round accuracies
    rows = series_lines(third["per_round"])
    for target in sorted(set(acc.values())):
        want = next((r for r in EVALUATED if acc[r] >= target), None)
        assert rounds_to_target(rows, target) == want == rounds_to_target(got, target)
        true_first = rounds_to_target(ref, target)
        assert true_first is not None and (want is None or 0 <= want - true_first < EVERY)


# ----------------------------------------------------------------------------- in memory

CIDS = ["dev-a", "dev-b", "dev-c"]


def _validation(digits) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(digits.test.x[:100]), np.asarray(digits.test.y[:100])


def _agent_strategy(name: str, digits):
    if name == "feddo":
        return FedDO(train_config={"lr": 0.05, "batch_size": 16}, validation=_validation(digits), run_seed=3,
                     hidden=16, layers=2, rank=4, warmup=1, batch_size=2)
    return FedAA(train_config={"lr": 0.05, "batch_size": 16}, validation=_validation(digits), run_seed=3,
                 hidden=8, warmup=1, batch_size=2)


def _devices(digits, client) -> dict[str, Device]:
    return {cid: Device(client(), digits.train.x[40 * i:40 * i + 40], digits.train.y[40 * i:40 * i + 40])
            for i, cid in enumerate(CIDS)}


def _recording(strategy) -> list[tuple[int, tuple[str, ...], dict]]:
    """(round, selected, instructions) of each plan ``strategy`` makes from now on."""
    plans: list[tuple[int, tuple[str, ...], dict]] = []
    plan_round = strategy.configure_round

    def configure(r, available, rng):
        plan = plan_round(r, available, rng)
        plans.append((r, tuple(plan.selected), {c: dict(v) for c, v in plan.instructions.items()}))
        return plan

    strategy.configure_round = configure
    return plans


@pytest.mark.parametrize("name", ["feddo", "fedaa"])
def test_a_reward_strategy_evaluates_its_validation_set_every_round_whatever_eval_every(
        tmp_path: Path, digits, name: str) -> None:
    prefix = f"{name}_"
    runs = {}
    for every in (1, EVERY):
        torch.manual_seed(0)
        strategy = _agent_strategy(name, digits)
        plans = _recording(strategy)
        client = FedDOClient if name == "feddo" else FedAvgClient
        server = run_federation(tmp_path / f"e{every}", MemoryBroker(), strategy, _devices(digits, client),
                                digits.test, rounds=ROUNDS, eval_every=every)
        assert not server.overlaps_evaluation  # plans_from_evaluation: evaluated before the next plan
        runs[every] = (server.metrics, plans)
    (ref, ref_plans), (got, got_plans) = runs[1], runs[EVERY]
    # the strategy's own figures in every round, the same as with every round evaluated
    for key in (f"{prefix}val_accuracy", f"{prefix}reward"):
        assert all(key in m for m in got), key
        assert [m[key] for m in got] == [m[key] for m in ref], key
    assert got_plans == ref_plans and [r for r, _, _ in got_plans] == list(range(1, ROUNDS + 1))
    assert [m["round"] for m in got if "accuracy" in m] == EVALUATED
    assert [(m["accuracy"], m["loss"]) for m in got if "accuracy" in m] == \
        [(ref[r - 1]["accuracy"], ref[r - 1]["loss"]) for r in EVALUATED]
    assert [_rest(m) for m in got] == [_rest(m) for m in ref]
    assert _lines(tmp_path / f"e{EVERY}") == json.loads(json.dumps(got))


class _Slots:
    """A semaphore of ``n`` training slots that notes the thread of every taker."""

    def __init__(self, n: int) -> None:
        self._sem = threading.Semaphore(n)
        self.takers: list[int] = []

    def __enter__(self) -> _Slots:
        self._sem.acquire()
        self.takers.append(threading.get_ident())
        return self

    def __exit__(self, *exc: object) -> None:
        self._sem.release()


def test_overlapped_rounds_not_evaluated_read_no_test_split_and_hold_no_slot(
        tmp_path: Path, digits, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    score = server_mod.evaluate

    def counted(model, split, **kw):
        calls.append(len(split.y))
        return score(model, split, **kw)

    monkeypatch.setattr(server_mod, "evaluate", counted)
    slots = _Slots(1)
    strategy = FedAvg(participation_rate=1.0, train_config={"lr": 0.05})
    server = run_federation(tmp_path, MemoryBroker(), strategy, _devices(digits, FedAvgClient), digits.test,
                            rounds=ROUNDS, eval_every=EVERY, train_lock=slots, eval_slot=slots)
    assert server.overlaps_evaluation
    assert calls == [len(digits.test.y)] * len(EVALUATED)  # three evaluations of the test split in 7 rounds
    assert [m["round"] for m in server.metrics if "accuracy" in m] == EVALUATED
    # rounds 3 and 6 were evaluated while the next trained, holding a slot; rounds 1, 2, 4, 5 took
    # none (the last, 7, is evaluated after the run's trainings, outside the overlap)
    assert ["evaluate_overlapped" in m["phase_s"] for m in server.metrics] == [True] * (ROUNDS - 1) + [False]
    assert slots.takers.count(threading.get_ident()) == 2
    assert len(slots.takers) == 2 + ROUNDS * len(CIDS)  # and each device's training of each round


def test_resume_writes_a_line_not_evaluated_without_an_accuracy(tmp_path: Path, digits) -> None:
    rounds = 3  # E = 3: round 3 alone is evaluated
    reference = run_federation(tmp_path / "reference", MemoryBroker(), FedAvg(participation_rate=1.0),
                               _devices(digits, FedAvgClient), digits.test, rounds=rounds, eval_every=EVERY)
    run_dir = tmp_path / "run"
    hub = MemoryBroker()
    first = federation_server(run_dir, hub, FedAvg(participation_rate=1.0), digits.test, rounds=rounds,
                              clients=len(CIDS), eval_every=EVERY)
    kill_before_line(first, 2)  # written while round 3 trains, after round 2's checkpoint
    run_expecting(first, hub, _devices(digits, FedAvgClient), Killed)
    first.store.close()
    assert CheckpointStore(run_dir / "checkpoints.sqlite").rounds() == [0, 1, 2]

    hub = MemoryBroker()
    second = federation_server(run_dir, hub, FedAvg(participation_rate=1.0), digits.test, rounds=rounds,
                               clients=len(CIDS), eval_every=EVERY)
    ckpt = second.checkpoints.load()
    assert ckpt is not None and ckpt.round == 2
    second.resume(ckpt)
    written = _lines(run_dir)
    assert [m["round"] for m in written] == [1, 2] and "accuracy" not in written[1] and "loss" not in written[1]
    assert written[1]["test_evaluated"] is False and "evaluate_on_resume" in written[1]["phase_s"]
    _, threads, errors = start_agents(hub, _devices(digits, FedAvgClient))
    second.run()
    for t in threads:
        t.join(30)
    assert not errors, errors
    lines = _lines(run_dir)
    assert [m["round"] for m in lines if "accuracy" in m] == [3]
    drop = VOLATILE_METRICS
    assert [{k: v for k, v in m.items() if k not in drop} for m in lines] == \
        [{k: v for k, v in m.items() if k not in drop} for m in reference.metrics]


@pytest.mark.parametrize("every", [0, -2, 1.5, True])
def test_eval_every_below_one_is_refused(tmp_path: Path, digits, every) -> None:
    with pytest.raises(RunError, match=f"eval_every = {every!r} must be an integer >= 1"):
        federation_server(tmp_path, MemoryBroker(), FedAvg(), digits.test, rounds=3, clients=1, eval_every=every)


class _OwnAccuracy(FedAvg):
    """FedAvg whose own evaluation gives every round's accuracy (a fixed 0.25, loss 2.0)."""

    def evaluate(self, round: int, model: torch.nn.Module) -> dict:
        return {"accuracy": 0.25, "loss": 2.0}


def test_a_line_without_an_accuracy_names_no_source_of_one(tmp_path: Path, digits) -> None:
    rounds = 4  # E = 3: rounds 3 and 4 (the last) are evaluated
    server = run_federation(tmp_path / "fedavg", MemoryBroker(), FedAvg(participation_rate=1.0),
                            _devices(digits, FedAvgClient), digits.test, rounds=rounds, eval_every=EVERY)
    lines = _lines(tmp_path / "fedavg")
    assert lines == json.loads(json.dumps(server.metrics))
    assert [m.get("accuracy_source") for m in lines] == [None, None, "global", "global"]
    assert ["accuracy_source" in m for m in lines] == ["accuracy" in m for m in lines] == [False, False, True, True]
    # the strategy's own accuracy is every round's line's, evaluated test split or not
    own = run_federation(tmp_path / "own", MemoryBroker(), _OwnAccuracy(participation_rate=1.0),
                         _devices(digits, FedAvgClient), digits.test, rounds=rounds, eval_every=EVERY)
    assert [(m["accuracy"], m["loss"], m["accuracy_source"]) for m in own.metrics] == [(0.25, 2.0, "strategy")] * 4
    assert [m["test_evaluated"] for m in own.metrics] == [False, False, True, True]


def test_the_final_accuracy_is_named_by_the_source_of_its_own_line() -> None:
    clients_then_none = [{"round": 1, "accuracy": 0.5, "accuracy_source": "clients"}, {"round": 2}]
    assert final_figures(clients_then_none)[0] == 0.5 and final_accuracy_source(clients_then_none) == "clients"
    # a line written before the key existed is the global model's; no accuracy at all: no source
    assert final_accuracy_source([{"round": 1, "accuracy": 0.5}, {"round": 2, "accuracy": None}]) == "global"
    assert final_accuracy_source([{"round": 1, "accuracy": None, "accuracy_source": "clients"}]) is None
    assert final_accuracy_text(0.83287, "global") == "final test accuracy 0.8329"
    assert final_accuracy_text(0.5, "clients") == \
        "final test accuracy of the devices' own models (mean over clients) 0.5000"
    assert final_accuracy_text(0.25, "strategy") == "final accuracy from the algorithm's own evaluation 0.2500"
    assert final_accuracy_text(float("nan"), None) == final_accuracy_text(None) == "no accuracy was measured"


def test_a_diverged_global_model_is_said_once_and_at_the_end(tmp_path: Path, digits, caplog) -> None:
    """FedOpt with η = 1e30: round 1's global holds weights of order 1e29, its logits overflow and
    its test loss is NaN; every device's training from it diverges (no update sent), so rounds 2
    and 3 are skipped (quorum 1). One warning names round 1; the end-of-run words name both."""
    caplog.set_level("WARNING", logger="broker_server.server")
    server = run_federation(tmp_path, MemoryBroker(), FedOpt(server_lr=1e30, participation_rate=1.0),
                            _devices(digits, FedOptClient), digits.test, rounds=3)
    assert [(m["round"], m["skipped"]) for m in server.metrics] == [(1, False), (2, True), (3, True)]
    said = [r.getMessage() for r in caplog.records if "has diverged" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("round 1: the global model's test loss is nan: ")
    assert run_troubles_text(server.metrics) == "; 2 rounds skipped (2, 3); the global model diverged in round 1 " \
                                                "(test loss nan)"


def test_the_end_of_run_words_for_skipped_rounds_and_divergence() -> None:
    assert run_troubles_text([{"round": 1, "loss": 0.5}, {"round": 2, "loss": 0.4}]) == ""
    lines = [{"round": r, "skipped": True, "loss": 0.5} for r in range(1, 8)]
    assert run_troubles_text(lines) == "; 7 rounds skipped (1, 2, 3, 4, 5, …)"
    assert run_troubles_text([{"round": 1, "loss": 1.0}, {"round": 2, "loss": float("inf")},
                              {"round": 3, "skipped": True, "loss": float("nan")}]) == \
        "; 1 round skipped (3); the global model diverged in round 2 (test loss inf)"
    # a line not evaluated has no loss key; None (resumed lines) is no figure either
    assert run_troubles_text([{"round": 1}, {"round": 2, "loss": None}]) == ""
