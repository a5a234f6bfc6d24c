"""Resumes that are refused.

- A checkpoint whose strategy state the strategy cannot take back: ``AggregationServer.resume``
  raises a RunError naming the round, the strategy and the strategy's reason (the CLI prints it
  as one line, exit 1), and leaves the server as it was: no round, no model, no metrics taken
  from it.
- Another seed, client count or partition setting than the run's ``partition.json`` records
  (``--seed 7``, an edited ``config.toml``): refused before the data set is loaded, the message
  naming the setting, both values, where the new one came from and that a resumed run keeps it.
- ``--rounds`` below the rounds a run that has not ended has done (``--rounds 1`` after round 2
  of 20): refused, nothing written (no final files as if it had ended after round 1).

The run folders here are made by hand (configuration, partition, checkpoints, metrics lines): the
refusals come before any broker or agent.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from helpers.memory_federation import Device, federation_server, run_federation

from broker_server import cli
from broker_server.checkpoint import Checkpoint, CheckpointStore
from broker_server.config import load
from broker_server.errors import ConfigError, RunError
from broker_server.metrics_file import metrics_line
from broker_server.server_main import run_server
from broker_server.simulate import check_partition_record, client_data, partition_record, simulate
from broker_server.strategies.fedavg import FedAvg
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.data import load_dataset
from edge_agent.state import state_arrays
from protocol.memory_transport import MemoryBroker


class _Counting(FedAvg):
    """FedAvg keeping a round counter in its checkpointed state."""

    name = "counting"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.rounds_seen = 0

    def aggregate(self, round, current, results):
        self.rounds_seen += 1
        return super().aggregate(round, current, results)

    def state_dict(self) -> dict:
        return {"rounds_seen": self.rounds_seen}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.rounds_seen = int(state["rounds_seen"])


class _Renamed(_Counting):
    """Reads the counter under another key, as a later version might: the checkpoint lacks it."""

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.rounds_seen = int(state["rounds_aggregated"])


class _Refusing(_Counting):
    def load_state_dict(self, state: dict) -> None:
        raise ValueError("this checkpoint was written for 5 devices, the run has 2")


@pytest.mark.parametrize(("strategy", "reason"), [
    (_Renamed, "KeyError: 'rounds_aggregated'"),
    (_Refusing, "this checkpoint was written for 5 devices, the run has 2"),
])
def test_a_state_the_strategy_cannot_take_is_a_run_error_and_changes_nothing(tmp_path: Path, digits, strategy,
                                                                              reason) -> None:
    devices = {f"dev-{i}": Device(FedAvgClient(), digits.train.x[50 * i:50 * i + 50],
                                  digits.train.y[50 * i:50 * i + 50]) for i in range(2)}
    first = run_federation(tmp_path, MemoryBroker(), _Counting(participation_rate=1.0), devices, digits.test,
                           rounds=2)
    assert first.strategy.rounds_seen == 2
    first.store.close()
    again = federation_server(tmp_path, MemoryBroker(), strategy(participation_rate=1.0), digits.test, rounds=3,
                              clients=2)
    ckpt = again.checkpoints.load()
    assert ckpt is not None and ckpt.round == 2 and ckpt.strategy_state == {"rounds_seen": 2}
    before = [np.array(a) for a in state_arrays(again.model)]
    with pytest.raises(RunError) as err:
        again.resume(ckpt)
    assert str(err.value) == (f"the checkpoint of round 2 in {tmp_path}: strategy 'counting' cannot restore its state "
                              f"from it ({reason})")
    assert again.round == 0 and again.strategy.rounds_seen == 0 and again.metrics == []
    assert all(np.array_equal(a, b) for a, b in zip(before, state_arrays(again.model), strict=True))


QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"


def _interrupted_run(tmp_path: Path, *, done: int = 2, rounds: int = 20, summary: bool = False) -> Path:
    """A 3-client quickstart run folder of ``rounds`` rounds with the checkpoints of rounds
    0..``done`` and their metrics lines, as one interrupted after round ``done`` leaves it
    (``summary``: a ``summary.json`` of those rounds too, as a run that ended there)."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = load(QUICKSTART, {("run", "rounds"): rounds, ("data", "clients"): 3})
    (run / "config.toml").write_text(cfg.to_toml(), encoding="utf-8")
    ds = load_dataset("digits")
    (run / "partition.json").write_text(json.dumps(partition_record(ds, cfg, client_data(ds, cfg)), indent=1),
                                        encoding="utf-8")
    store = CheckpointStore(run / "checkpoints.sqlite")
    for r in range(done + 1):
        store.save(Checkpoint(round=r, tensors=[], strategy_state={}, rng_state={}, registry=[], meta={}))
    store.close()
    (run / "metrics.jsonl").write_text("".join(metrics_line({"round": r, "accuracy": 0.5 + r / 100, "loss": 1.0})
                                               for r in range(1, done + 1)), encoding="utf-8")
    if summary:
        (run / "summary.json").write_text(json.dumps({"rounds_completed": done, "final_accuracy": 0.52}))
    return run


def _files(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


KEEPS_SEED = "a resumed run keeps its seed (its split, initial model and training draws come from it)"


@pytest.mark.parametrize("command", ["simulate", "server"])
def test_another_seed_on_resume_is_refused_naming_both_seeds(tmp_path: Path, command: str,
                                                            capsys: pytest.CaptureFixture) -> None:
    """``--seed 7`` on a run of seed 0 was refused as "client 0's samples differ (another NumPy
    version, or changed data?)": now by name, before the data set is loaded."""
    run = _interrupted_run(tmp_path)
    files = _files(run)
    assert cli.main([command, "--resume", str(run), "--seed", "7", "--rounds", "3"]) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"fedfleet: configuration error: --resume: {run / 'partition.json'} records seed 0, the "
                              f"configuration gives 7 (--seed 7): {KEEPS_SEED}; resume without --seed\n")
    assert cli.main([command, "--resume", str(run), "--clients", "4"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (
        f"fedfleet: configuration error: --resume: {run / 'partition.json'} records 3 clients, the configuration "
        "gives 4 (--clients 4): a resumed run keeps its clients (each one's shard is the one it trained on); resume "
        "without --clients\n")
    assert _files(run) == files


@pytest.mark.parametrize(("edit", "said"), [
    ({("run", "seed"): 3}, f"records seed 0, the configuration gives 3 ({{cfg}}): {KEEPS_SEED}; set [run] seed back "
                           "to 0 in {cfg}"),
    ({("data", "partition"): "iid"}, "records [data] partition = 'dirichlet', the configuration gives 'iid' ({cfg}): "
                                     "a resumed run keeps the settings its split came from; set [data] partition "
                                     'back to "dirichlet" in {cfg}'),
    ({("data", "alpha"): 0.5}, "records [data] alpha = 1.0, the configuration gives 0.5 ({cfg}): a resumed run keeps "
                               "the settings its split came from; set [data] alpha back to 1.0 in {cfg}"),
    ({("data", "dataset"): "usps"}, "records [data] dataset = 'digits', the configuration gives 'usps' ({cfg}): a "
                                    'resumed run keeps the settings its split came from; set [data] dataset back to '
                                    '"digits" in {cfg}'),
    ({("data", "train_samples"): 500}, "records [data] train_samples = 0, the configuration gives 500 ({cfg}): a "
                                       "resumed run keeps the settings its split came from; set [data] train_samples "
                                       "back to 0 in {cfg}"),
    ({("data", "min_samples"): 5}, "records [data] min_samples = 10, the configuration gives 5 ({cfg}): a resumed run "
                                   "keeps the settings its split came from; set [data] min_samples back to 10 in "
                                   "{cfg}"),
], ids=["seed", "partition", "alpha", "dataset", "train_samples", "min_samples"])
def test_a_partition_setting_changed_in_the_runs_config_is_named(tmp_path: Path, edit: dict, said: str,
                                                                 capsys: pytest.CaptureFixture) -> None:
    run = _interrupted_run(tmp_path)
    cfg_path = run / "config.toml"
    cfg_path.write_text(load(cfg_path, edit).to_toml(), encoding="utf-8")
    files = _files(run)
    assert cli.main(["simulate", "-q", "--resume", str(run)]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (f"fedfleet: configuration error: --resume: {run / 'partition.json'} "
                                       f"{said.format(cfg=cfg_path)}\n")
    # the Python entry points refuse it as well, before the data set is loaded
    for entry in (lambda c: simulate(c, run_dir=run, resume=True), lambda c: run_server(c, run_dir=run, resume=True)):
        with pytest.raises(ConfigError) as exc:
            entry(load(cfg_path))
        assert str(exc.value) == f"--resume: {run / 'partition.json'} {said.format(cfg=cfg_path)}"
    assert _files(run) == files


def test_an_older_partition_json_names_the_settings_it_does_not_record(tmp_path: Path) -> None:
    """A ``partition.json`` written before the split's settings were recorded: a split that
    differs names those settings among the possible causes (those of its scheme and data set)."""
    run = _interrupted_run(tmp_path)
    path = run / "partition.json"
    old = json.loads(path.read_text())
    for key in ("train_samples", "min_samples", "classes_per_client", "domain_clients", "domain_train_cap",
                "domain_test_cap"):
        del old[key]
    path.write_text(json.dumps(old))
    ds = load_dataset("digits")
    cfg = load(run / "config.toml", {("data", "train_samples"): 500})
    with pytest.raises(ConfigError) as exc:
        check_partition_record(path, partition_record(ds, cfg, client_data(ds, cfg)))
    assert str(exc.value) == (
        f"--resume: client 0's samples differ from those recorded in {path} (another NumPy version, changed data, or "
        "a changed [data] train_samples, [data] min_samples, which this partition.json, written by an earlier "
        "version, does not record?): the run cannot continue on another split")


@pytest.mark.parametrize("command", ["simulate", "server"])
def test_rounds_below_those_done_are_refused_and_nothing_is_written(tmp_path: Path, command: str,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """``--rounds 1`` on a run interrupted after round 2 of 20 wrote summary.json and the final
    model as if the run had ended ("had finished 2 of 1 rounds … stopped while finishing")."""
    run = _interrupted_run(tmp_path)
    files = _files(run)
    assert cli.main([command, "--resume", str(run), "--rounds", "1"]) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"fedfleet: configuration error: --rounds 1 is below the 2 rounds {run} has done; give "
                              "--rounds ≥ 2 (or none: the run's 20)\n")
    assert _files(run) == files  # no summary.json, no model_final.*
    # the run's own config.toml saying fewer rounds than it did (edited): named as such
    cfg_path = run / "config.toml"
    cfg_path.write_text(load(cfg_path, {("run", "rounds"): 1}).to_toml(), encoding="utf-8")
    files = _files(run)
    assert cli.main([command, "--resume", str(run)]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (f"fedfleet: configuration error: [run] rounds = 1 in {cfg_path} is below the "
                                       f"2 rounds {run} has done; give --rounds ≥ 2\n")
    entry = simulate if command == "simulate" else run_server
    with pytest.raises(ConfigError) as exc:
        entry(load(cfg_path), run_dir=run, resume=True)
    assert str(exc.value) == f"[run] rounds = 1 is below the 2 rounds {run} has done; give [run] rounds ≥ 2"
    assert _files(run) == files


def test_a_run_resumed_with_as_many_rounds_as_it_has_done_is_said_ended_there(tmp_path: Path) -> None:
    """A run interrupted after round 2 of 20, resumed with --rounds 2, is ended at round 2 (its
    final files written from that checkpoint): the line says it stopped after round 2 of the 20 it
    was to run, not that it stopped while finishing; a run whose own config.toml says 2 rounds
    (it did stop while finishing) is said so, as before."""
    from broker_server.run_end import FinishedRun, finished_run, finishing_line

    run = _interrupted_run(tmp_path)
    fin = finished_run(run, 2)
    assert isinstance(fin, FinishedRun) and fin.rounds == 2 and fin.summary is None
    assert finishing_line(fin, 2, "simulate") == (
        f"fedfleet simulate: run {run} stopped after round 2 of the 20 it was to run, and is ended there (2 rounds "
        "asked): writing them from the checkpoint of round 2 and metrics.jsonl, without a broker or agents")
    (tmp_path / "finishing").mkdir()
    finishing = _interrupted_run(tmp_path / "finishing", rounds=2)
    fin = finished_run(finishing, 2)
    assert fin is not None and finishing_line(fin, 2, "server", ["summary.json", "model_final.pt"]) == (
        f"fedfleet server: run {finishing} had finished 2 of 2 rounds but not its final files (stopped while "
        "finishing): wrote summary.json and model_final.pt from the checkpoint of round 2 and metrics.jsonl, without "
        "a broker or agents")


def test_rounds_below_those_of_a_run_that_ended_only_say_nothing_is_left(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    """A run that ended (its summary.json records its rounds) has nothing to resume whatever
    ``--rounds`` says: one line, nothing written, as before."""
    run = _interrupted_run(tmp_path, rounds=2, summary=True)
    files = _files(run)
    assert cli.main(["simulate", "--resume", str(run), "--rounds", "1"]) == cli.EXIT_OK
    assert capsys.readouterr().out.startswith(f"fedfleet simulate: run {run} has finished all 2 rounds ([run] rounds "
                                              "is 1); nothing to resume (")
    assert _files(run) == files
