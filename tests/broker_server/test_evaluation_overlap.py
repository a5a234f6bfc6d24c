"""Evaluation overlap (``[server] overlap_evaluation``): round r is evaluated while the devices
train round r+1, with the figures of a run that evaluates before opening the next round.

* The same seeded FedAvg federation (four digits devices, participation 0.5, three rounds) with
  overlap on and off: identical selections and identical lines but for the timing fields, the
  first two rounds' evaluations overlapped (``phase_s`` says so), the last not; each line's
  accuracy and loss are those of its round's checkpointed model evaluated here (a second
  computation). Again with the lossy fp16 global codec, which changes the live model when the
  next round opens: the evaluation is of the round's own model all the same.
* A strategy declaring ``plans_from_evaluation`` finds the previous round's line written when its
  next round is planned; one that does not, under ``auto``, finds it missing (the overlap).
* A server killed between round 2's checkpoint and its line: ``resume`` writes the line from the
  checkpointed model, and the resumed run has one line per round, identical to an uninterrupted
  run's. A round that fails before the previous round was evaluated still gets that line written.
* With one training slot shared by the agents and the server's evaluation, a training and an
  evaluation never run at once, and every overlapped evaluation ran holding the slot.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from helpers.memory_federation import (
    Device,
    Killed,
    digits_model,
    federation_server,
    kill_before_line,
    run_expecting,
    run_federation,
    start_agents,
)

import broker_server.server as server_mod
from broker_server.checkpoint import CheckpointStore
from broker_server.errors import ConfigError, RunError
from broker_server.experiments import VOLATILE_METRICS
from broker_server.server import evaluate
from broker_server.strategies import Strategy, check_strategy_class, get_strategy_class, list_strategies
from broker_server.strategies.fedavg import FedAvg
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.state import load_arrays
from protocol.memory_transport import MemoryBroker

CIDS = [f"dev-{k}" for k in "abcd"]
ROUNDS = 3


def _devices(digits) -> dict[str, Device]:
    return {cid: Device(FedAvgClient(), digits.train.x[30 * i:30 * i + 30], digits.train.y[30 * i:30 * i + 30])
            for i, cid in enumerate(CIDS)}


def _strategy(cls=FedAvg, **kw) -> FedAvg:
    return cls(participation_rate=0.5, train_config={"lr": 0.05}, **kw)


def _recording(strategy) -> list[tuple[int, tuple[str, ...]]]:
    """The (round, selected) of each plan ``strategy`` makes from now on."""
    picks: list[tuple[int, tuple[str, ...]]] = []
    plan_round = strategy.configure_round

    def configure(r, available, rng):
        plan = plan_round(r, available, rng)
        picks.append((r, tuple(plan.selected)))
        return plan

    strategy.configure_round = configure
    return picks


def _figures(line: dict) -> dict:
    """A metrics line without its timing fields."""
    return {k: v for k, v in line.items() if k not in VOLATILE_METRICS}


def _lines(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _checkpointed_scores(run_dir: Path, test) -> dict[int, tuple[float, float]]:
    """Round → (accuracy, loss) of its checkpointed global model, evaluated here."""
    store = CheckpointStore(run_dir / "checkpoints.sqlite")
    try:
        out = {}
        for r in store.rounds():
            if r == 0:
                continue
            model = digits_model()
            ckpt = store.load(r)
            assert ckpt is not None
            load_arrays(model, ckpt.tensors)
            out[r] = evaluate(model, test, batch_size=256)
        return out
    finally:
        store.close()


@pytest.mark.parametrize("codec", ["fp32", "fp16"])
def test_overlap_on_and_off_give_the_same_figures(tmp_path: Path, digits, codec: str) -> None:
    runs = {}
    for mode in ("auto", "off"):
        strategy = _strategy()
        picks = _recording(strategy)
        server = run_federation(tmp_path / mode, MemoryBroker(), strategy, _devices(digits), digits.test,
                                rounds=ROUNDS, overlap_evaluation=mode, global_codec=codec)
        runs[mode] = (server, picks)
    on, off = runs["auto"][0], runs["off"][0]
    assert on.overlaps_evaluation and not off.overlaps_evaluation
    assert runs["auto"][1] == runs["off"][1] and [r for r, _ in runs["auto"][1]] == [1, 2, 3]
    assert all(len(sel) == 2 for _, sel in runs["auto"][1])  # 0.5 of 4: the generator chose
    assert [_figures(m) for m in on.metrics] == [_figures(m) for m in off.metrics]
    for server in (on, off):  # the file holds the lines in round order, as the server kept them
        assert _lines(server.run_dir) == json.loads(json.dumps(server.metrics))
    assert [m["round"] for m in on.metrics] == [1, 2, 3]
    # rounds 1 and 2 evaluated while the next trained, the last not; without overlap none
    assert ["evaluate_overlapped" in m["phase_s"] for m in on.metrics] == [True, True, False]
    assert ["evaluate_prev" in m["phase_s"] for m in on.metrics] == [False, True, True]
    assert all("evaluate" in m["phase_s"] and "evaluate_overlapped" not in m["phase_s"] for m in off.metrics)
    # each line scores its own round's model (the checkpoint), not the next round's live one
    scores = _checkpointed_scores(on.run_dir, digits.test)
    assert [(m["accuracy"], m["loss"]) for m in on.metrics] == [scores[r] for r in (1, 2, 3)]
    # consecutive rounds' ends: ended_s increases, and an overlapped round ends inside the next one
    ends = [m["ended_s"] for m in on.metrics]
    assert ends == sorted(ends)


class _Reading(FedAvg):
    """FedAvg that notes, when it plans round r, which rounds' lines ``metrics.jsonl`` holds."""

    plans_from_evaluation = True

    def __init__(self, run_dir: Path, **kw) -> None:
        super().__init__(**kw)
        self.run_dir = run_dir
        self.seen: list[tuple[int, list[int]]] = []

    def configure_round(self, round, available, rng):
        self.seen.append((round, [m["round"] for m in _lines(self.run_dir)]))
        return super().configure_round(round, available, rng)


class _NotReading(_Reading):
    plans_from_evaluation = False


def test_a_strategy_that_plans_from_evaluation_is_never_overlapped(tmp_path: Path, digits) -> None:
    reading = _strategy(_Reading, run_dir=tmp_path / "reads")
    server = run_federation(tmp_path / "reads", MemoryBroker(), reading, _devices(digits), digits.test,
                            rounds=ROUNDS, overlap_evaluation="auto")
    assert not server.overlaps_evaluation
    assert reading.seen == [(1, []), (2, [1]), (3, [1, 2])]
    assert all("evaluate" in m["phase_s"] and "evaluate_overlapped" not in m["phase_s"] for m in server.metrics)
    # the same strategy, not declaring it: round r-1's line comes after round r is planned
    other = _strategy(_NotReading, run_dir=tmp_path / "free")
    run_federation(tmp_path / "free", MemoryBroker(), other, _devices(digits), digits.test, rounds=ROUNDS,
                   overlap_evaluation="auto")
    assert other.seen == [(1, []), (2, []), (3, [1])]


def test_the_shipped_strategies_that_evaluate_declare_it() -> None:
    """FedDO's and FedAA's ``evaluate`` computes their agent's reward: no overlap for them. Every
    shipped strategy overriding ``evaluate`` declares it (an undeclared one would be evaluated
    after its checkpoint and next plan)."""
    assert get_strategy_class("feddo").plans_from_evaluation and get_strategy_class("fedaa").plans_from_evaluation
    assert not get_strategy_class("fedavg").plans_from_evaluation
    for name in list_strategies():
        cls = get_strategy_class(name)
        owner = next(k for k in cls.__mro__ if "evaluate" in k.__dict__)
        if owner is not Strategy:
            assert cls.plans_from_evaluation, name


def test_plans_from_evaluation_must_be_a_bool() -> None:
    class Vague(FedAvg):
        plans_from_evaluation = "yes"  # type: ignore[assignment]

    with pytest.raises(ConfigError, match="plans_from_evaluation = 'yes'"):
        check_strategy_class(Vague, "vague")


def test_overlap_setting_is_checked(tmp_path: Path, digits) -> None:
    with pytest.raises(RunError, match="overlap_evaluation = 'on' is not one of auto, off"):
        federation_server(tmp_path, MemoryBroker(), _strategy(), digits.test, rounds=1, clients=1,
                          overlap_evaluation="on")


def test_resume_writes_the_line_a_crash_left_unwritten(tmp_path: Path, digits) -> None:
    reference_strategy = _strategy()
    reference_picks = _recording(reference_strategy)
    reference = run_federation(tmp_path / "reference", MemoryBroker(), reference_strategy, _devices(digits),
                               digits.test, rounds=ROUNDS)

    run_dir = tmp_path / "run"
    hub = MemoryBroker()
    first_strategy = _strategy()
    picks = _recording(first_strategy)
    first = federation_server(run_dir, hub, first_strategy, digits.test, rounds=ROUNDS, clients=len(CIDS))
    kill_before_line(first, 2)  # written while round 3 trains, after round 2's checkpoint
    run_expecting(first, hub, _devices(digits), Killed)
    first.store.close()
    assert [m["round"] for m in _lines(run_dir)] == [1]
    assert CheckpointStore(run_dir / "checkpoints.sqlite").rounds() == [0, 1, 2]

    hub = MemoryBroker()
    second_strategy = _strategy()
    picks_after = _recording(second_strategy)
    second = federation_server(run_dir, hub, second_strategy, digits.test, rounds=ROUNDS, clients=len(CIDS))
    ckpt = second.checkpoints.load()
    assert ckpt is not None and ckpt.round == 2
    second.resume(ckpt)
    assert [m["round"] for m in _lines(run_dir)] == [1, 2]
    _, threads, errors = start_agents(hub, _devices(digits))
    second.run()
    for t in threads:
        t.join(30)
    assert not errors, errors

    lines = _lines(run_dir)
    assert [m["round"] for m in lines] == [1, 2, 3]  # one line per completed round
    assert "evaluate_on_resume" in lines[1]["phase_s"]
    # the run's time goes on counting across the resume, from the last line kept
    assert lines[0]["ended_s"] < lines[1]["ended_s"] < lines[2]["ended_s"]
    # round 3 was planned before the crash and again after the resume: the same devices both times
    assert picks == reference_picks and picks_after == reference_picks[2:]
    assert [_figures(m) for m in lines] == [_figures(m) for m in reference.metrics]
    scores = _checkpointed_scores(run_dir, digits.test)
    assert (lines[1]["accuracy"], lines[1]["loss"]) == scores[2]


class _FailsAtRound3(FedAvg):
    def configure_round(self, round, available, rng):
        if round == 3:
            raise RunError("planning round 3 failed")
        return super().configure_round(round, available, rng)


def test_a_failing_round_still_writes_the_line_it_was_to_evaluate(tmp_path: Path, digits) -> None:
    hub = MemoryBroker()
    server = federation_server(tmp_path, hub, _strategy(_FailsAtRound3), digits.test, rounds=ROUNDS,
                               clients=len(CIDS))
    run_expecting(server, hub, _devices(digits), RunError, "planning round 3 failed")
    lines = _lines(tmp_path)
    assert [m["round"] for m in lines] == [1, 2]
    scores = _checkpointed_scores(tmp_path, digits.test)
    assert [(m["accuracy"], m["loss"]) for m in lines] == [scores[1], scores[2]]


class _Slots:
    """A semaphore of ``n`` training slots that knows which threads hold one."""

    def __init__(self, n: int) -> None:
        self._sem = threading.Semaphore(n)
        self._lock = threading.Lock()
        self.holders: set[int] = set()

    def __enter__(self) -> _Slots:
        self._sem.acquire()
        with self._lock:
            self.holders.add(threading.get_ident())
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.holders.discard(threading.get_ident())
        self._sem.release()

    def held_here(self) -> bool:
        with self._lock:
            return threading.get_ident() in self.holders


def test_an_overlapped_evaluation_holds_a_training_slot(tmp_path: Path, digits,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    slots = _Slots(1)
    lock = threading.Lock()
    busy = [0, 0]  # now, most at once: trainings and server evaluations
    evaluations: list[bool] = []  # per evaluation of the test split: did its thread hold a slot?

    def counted(fn):
        def run(*args, **kw):
            with lock:
                busy[0] += 1
                busy[1] = max(busy)
            try:
                return fn(*args, **kw)
            finally:
                with lock:
                    busy[0] -= 1
        return run

    score = counted(evaluate)

    def evaluate_noting(model, split, **kw):
        evaluations.append(slots.held_here())
        return score(model, split, **kw)

    monkeypatch.setattr(server_mod, "evaluate", evaluate_noting)
    devices = _devices(digits)
    for d in devices.values():
        d.algorithm.local_round = counted(d.algorithm.local_round)
    server = run_federation(tmp_path, MemoryBroker(), _strategy(), devices, digits.test, rounds=ROUNDS,
                            train_lock=slots, eval_slot=slots)
    assert ["evaluate_overlapped" in m["phase_s"] for m in server.metrics] == [True, True, False]
    # rounds 1 and 2 evaluated holding the slot, the last (nothing trains then) without it
    assert evaluations == [True, True, False]
    assert busy[1] == 1  # never a training and an evaluation at once
    assert all(m["phase_s"]["slot_wait"] >= 0 for m in server.metrics[:2])
