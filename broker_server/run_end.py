"""``--resume`` of a run with no round left to run.

A run folder whose latest checkpoint is that of round ``[run] rounds`` (or later) and whose
``metrics.jsonl`` has that round's line has finished its rounds. ``fedfleet simulate --resume``
and ``fedfleet server --resume`` then start no broker and no agents:

* its final files are there (``summary.json`` records those rounds): nothing is resumed and
  nothing in the folder is written (:func:`nothing_to_resume` is the line said);
* the process stopped while finishing (after the last round's metrics line and checkpoint,
  before ``summary.json``): :func:`write_final_files` writes what the end of a run writes —
  ``model_final.pt`` and ``model_final.onnx``
  (:func:`broker_server.server.write_final_model`, as :meth:`AggregationServer.run
  <broker_server.server.AggregationServer.run>` does after its last round) and
  ``summary.json`` — from the last checkpoint and ``metrics.jsonl``. The ``finish`` message the
  end of a run publishes is not sent (no broker is started): agents of a real fleet still
  waiting for it stop at their ``--idle-timeout-s``. The ledger is not opened: its rows are
  those the run wrote.

A run that has not ended, its checkpoint past ``[run] rounds`` (``--rounds 1`` on a run
interrupted after round 2 of 20), is refused before anything is started or written: its
final files would say it ended after rounds it has gone beyond (:func:`rounds_below_done_text`).
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent.data import Dataset
from edge_agent.optional_runtime import report as optional_runtimes
from edge_agent.state import load_arrays

from .checkpoint import CheckpointError, CheckpointStore
from .config import Config
from .errors import ConfigError
from .metrics_file import METRICS_NAME, missing_line, missing_line_text, read_metrics
from .persistence import RunStore, read_summary, write_summary
from .runtime import make_strategy, server_model
from .server import RunSummary, final_accuracy_source, final_accuracy_text, final_figures, write_final_model
from .text import plural

log = logging.getLogger(__name__)

__all__ = ["FinalFiles", "FinishedRun", "config_rounds", "finished_run", "finishing_line", "last_checkpoint_round",
           "nothing_to_resume", "planned_rounds", "refusals_from_metrics", "rounds_below_done_text", "summary_record",
           "write_final_files"]


def last_checkpoint_round(path: Path) -> int | None:
    """The latest round with a checkpoint in ``path`` (a run's ``checkpoints.sqlite``), read
    without writing to it (:meth:`CheckpointStore.latest_round
    <broker_server.checkpoint.CheckpointStore.latest_round>`); ``None``: no file, or no checkpoint.

    Raises:
        ConfigError: the file is not a readable checkpoint store.
    """
    try:
        return CheckpointStore.latest_round(path)
    except CheckpointError as exc:
        raise ConfigError(f"--resume: {exc}") from None


def summary_record(cfg: Config, ds: Dataset, *, federation: str, final_accuracy: float, rounds_completed: int,
                   seconds: float, broker: str, refusals: dict, onnx: dict, strategy: Any = None,
                   **extra: Any) -> dict:
    """``summary.json``'s content, the keys every way a run ends shares (:func:`~broker_server.
    simulate.simulate`, :func:`~broker_server.server_main.run_server`, :func:`write_final_files`):
    the federation, final accuracy, rounds, ``seconds`` (wall, this session), broker, data set,
    clients and ``client_test`` (with its fraction under ``"local"``), the optional runtimes'
    state, ``refusals``; ``strategy``'s :meth:`~broker_server.strategies.Strategy.run_summary`
    under ``strategy`` where it has one; then the caller's ``extra`` keys, then ``onnx``'s
    (``onnx_*``)."""
    d = cfg.data
    own: dict[str, Any] = {}
    if strategy is not None:
        try:
            if (told := strategy.run_summary()):
                own["strategy"] = json.loads(json.dumps(told))  # JSON values only, checked here
        except Exception as exc:  # noqa: BLE001 - a user's strategy: the record says why it is missing
            log.warning("the strategy's run summary is not recorded: %s: %s", type(exc).__name__, exc)
            own["strategy_summary_error"] = f"{type(exc).__name__}: {exc}"
    return {"federation": federation, "final_accuracy": final_accuracy, "rounds_completed": rounds_completed,
            "seconds": seconds, "broker": broker, "dataset": ds.name, "clients": d.clients,
            "client_test": d.client_test,
            "client_test_fraction": d.client_test_fraction if d.client_test == "local" else None,
            "optional_runtimes": optional_runtimes(), "refusals": refusals, **own, **extra, **onnx}


@dataclass(frozen=True)
class FinishedRun:
    """A run folder whose rounds are all done (:func:`finished_run`).

    Attributes:
        run_dir: the run folder.
        rounds: rounds done (the latest checkpoint's round).
        metrics: ``metrics.jsonl``'s lines of rounds ``1..rounds``, parsed.
        summary: ``summary.json``, parsed, when it records those rounds; ``None``: the final
            files are still to be written (:func:`write_final_files`).
    """

    run_dir: Path
    rounds: int
    metrics: list[dict]
    summary: dict | None

    @property
    def complete(self) -> bool:
        """Whether the run's final files are written (nothing is left to do)."""
        return self.summary is not None


def resume_metrics(run_dir: str | Path) -> list[dict]:
    """``metrics.jsonl`` of the run folder ``--resume`` continues (``[]`` without the file), read
    before anything is started or written, so that a file the resume cannot go on from is
    refused while the folder (its ledger, its configuration) is as the run left it.

    Raises:
        ConfigError: the file cannot be read; a line before the last is damaged
            (:func:`~broker_server.metrics_file.read_metrics`: ``PATH:LINE``, what to do); or it
            lacks the line of the last checkpoint's round, which that checkpoint cannot give
            back (:func:`~broker_server.metrics_file.missing_line`); or ``checkpoints.sqlite``
            is not a file, cannot be read, or holds no checkpoint while the file has lines.
    """
    out = Path(run_dir)
    path = out / METRICS_NAME
    try:
        lines = read_metrics(path)
    except FileNotFoundError:
        lines = []
    except ValueError as exc:  # names the file and the line
        raise ConfigError(f"--resume: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"--resume: cannot read {path}: {exc}") from None
    store = out / "checkpoints.sqlite"
    if store.exists() and not store.is_file():
        raise ConfigError(f"--resume: {store} is not a file (a checkpoint store is one SQLite file)")
    try:
        latest = CheckpointStore.latest_meta(store)
    except CheckpointError as exc:
        raise ConfigError(f"--resume: {exc}") from None
    if latest is None and lines:
        raise ConfigError(f"--resume: {store} holds no checkpoint, but {path} has the lines of "
                          f"{plural(len(lines), 'round')}: the store was emptied or replaced; restore it (a resume "
                          "would start the run again over its records)")
    if latest is not None and missing_line(lines, *latest):
        raise ConfigError(f"--resume: {missing_line_text(path, latest[0])}")
    return lines


def finished_run(run_dir: str | Path, rounds: int, *, given: str | None = None,
                 planned: int | None = None) -> FinishedRun | None:
    """The run in ``run_dir`` when its rounds are all done: its latest checkpoint is of round
    ``rounds`` (``[run] rounds``) or later and ``metrics.jsonl`` has that round's line. ``None``:
    rounds are left to run, there is no checkpoint, or the last round's line is still to be
    completed from its checkpoint (evaluation overlap; a resume does that with its fleet).
    Reads only.

    A run that has done more than ``rounds`` rounds (its checkpoint) without ending (no
    ``summary.json`` recording them: it was interrupted, or stopped while finishing) is refused
    (:func:`rounds_below_done_text`): its final files would be written as if it had ended after
    ``rounds``; one that ended is returned (nothing is resumed, :func:`nothing_to_resume`).
    ``given`` and ``planned`` word that refusal (see :func:`rounds_below_done_text`).

    Raises:
        ConfigError: ``checkpoints.sqlite`` or ``metrics.jsonl`` cannot be read; ``rounds`` is
            below the rounds done by a run that did not end.
    """
    out = Path(run_dir)
    last = last_checkpoint_round(out / "checkpoints.sqlite")
    if last is None or last < rounds:
        return None
    metrics = [m for m in resume_metrics(out) if m["round"] <= last]
    has_line = any(m["round"] == last for m in metrics)
    summary = None
    try:
        recorded = read_summary(out)
        if int(recorded.get("rounds_completed", -1)) >= last:
            summary = recorded
    except (OSError, ValueError, TypeError):  # absent, cut short or not a summary: written again
        pass
    if last > rounds and (summary is None or not has_line):
        raise ConfigError(rounds_below_done_text(out, last, rounds, given=given, planned=planned))
    if not has_line:
        return None
    return FinishedRun(run_dir=out, rounds=last, metrics=metrics, summary=summary)


def rounds_below_done_text(run_dir: Path, done: int, rounds: int, *, given: str | None = None,
                           planned: int | None = None) -> str:
    """Why a resume of ``run_dir`` with ``rounds`` rounds, below the ``done`` rounds it has a
    checkpoint of, is refused: ``given`` is how the rounds were given (``"--rounds 1"``; ``None``:
    ``[run] rounds = N``, and the advice names ``[run] rounds``, else ``--rounds``); ``planned``:
    the rounds the run itself was to run (its own ``config.toml``), named as the value to leave
    when it is not below ``done``."""
    what = given or f"[run] rounds = {rounds}"
    fix = "--rounds" if given else "[run] rounds"
    leave = f" (or none: the run's {planned})" if planned is not None and planned >= done else ""
    return f"{what} is below the {plural(done, 'round')} {run_dir} has done; give {fix} ≥ {done}{leave}"


def nothing_to_resume(fin: FinishedRun, rounds: int, command: str, kept: list[str] | None = None) -> str:
    """The one line ``fedfleet COMMAND --resume`` says of a run with nothing left to do
    (``fin.complete``): its rounds, its final accuracy, and how to run more rounds; for
    ``simulate``, ``kept`` (:func:`~broker_server.simulate.kept_device_state`: what its devices
    keep between rounds) adds that more rounds start that afresh, since a finished simulation's
    device state file is removed."""
    n = fin.rounds
    done = f"{'its' if n == 1 else 'all'} {plural(n, 'round')}"
    if n > rounds:
        done += f" ([run] rounds is {rounds})"
    acc = (fin.summary or {}).get("final_accuracy")
    figure = (f"{final_accuracy_text(acc, final_accuracy_source(fin.metrics))}; "
              if isinstance(acc, (int, float)) and not isinstance(acc, bool) else "")
    afresh = (f", where its simulated devices start {' and '.join(kept)} afresh: a finished run keeps no device "
              "state" if kept and command == "simulate" else "")
    return (f"fedfleet {command}: run {fin.run_dir} has finished {done}; nothing to resume ({figure}more rounds: "
            f"fedfleet {command} --resume {shlex.quote(str(fin.run_dir))} --rounds {n + 1} or more{afresh})")


def config_rounds(path: str | Path) -> int | None:
    """``[run] rounds`` as the configuration file ``path`` gives it (``None``: not given, or the
    file cannot be read): what a run's own ``config.toml`` says when ``--rounds`` overrides it."""
    from .config import tomllib

    try:
        rounds = tomllib.loads(Path(path).read_text(encoding="utf-8")).get("run", {}).get("rounds")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, AttributeError):
        return None
    return rounds if isinstance(rounds, int) and not isinstance(rounds, bool) else None


def planned_rounds(run_dir: str | Path) -> int | None:
    """The rounds the run in ``run_dir`` was started (or last resumed) for: its own
    ``config.toml``'s ``[run] rounds`` (:func:`config_rounds`)."""
    return config_rounds(Path(run_dir) / "config.toml")


def finishing_line(fin: FinishedRun, rounds: int, command: str, written: list[str] | None = None) -> str:
    """What ``fedfleet COMMAND --resume`` says of a run whose rounds were done but whose final
    files were not: before writing them (``written`` ``None``), or after (the names,
    :attr:`FinalFiles.written`). A run that had finished its own rounds stopped while finishing;
    one stopped before them (its ``config.toml``, :func:`planned_rounds`) and resumed with as many
    rounds as it has done is ended there."""
    if written is None:
        what = "writing them"
    else:
        what = "wrote " + ", ".join(written[:-1]) + (" and " if len(written) > 1 else "") + written[-1]
    planned = planned_rounds(fin.run_dir)
    if planned is not None and planned > fin.rounds:
        why = (f"stopped after round {fin.rounds} of the {planned} it was to run, and is ended there ({rounds} rounds "
               "asked)")
    else:
        why = f"had finished {fin.rounds} of {rounds} rounds but not its final files (stopped while finishing)"
    return (f"fedfleet {command}: run {fin.run_dir} {why}: {what} from the checkpoint of round {fin.rounds} and "
            "metrics.jsonl, without a broker or agents")


def refusals_from_metrics(metrics: list[dict]) -> dict:
    """``summary.json``'s ``refusals`` (:meth:`AggregationServer.refusal_totals
    <broker_server.server.AggregationServer.refusal_totals>`'s keys) summed over the rounds'
    metrics lines: ``invalid`` and ``rejected_by_reason``, ``late``, ``duplicates``,
    ``unsolicited``, ``early`` and ``dropped`` (round → ids)."""
    by_reason: dict[str, int] = {}
    for m in metrics:
        for code, count in (m.get("rejected_by_reason") or {}).items():
            by_reason[code] = by_reason.get(code, 0) + int(count)
    return {"invalid": sum(int(m.get("invalid") or 0) for m in metrics), "rejected_by_reason": by_reason,
            "late": sum(int(m.get("late") or 0) for m in metrics),
            "duplicates": sum(int(m.get("duplicates") or 0) for m in metrics),
            "unsolicited": sum(int(m.get("unsolicited") or 0) for m in metrics),
            "early": sum(int(m.get("early") or 0) for m in metrics),
            "dropped": {str(m["round"]): m["dropped"] for m in metrics if m.get("dropped")}}


@dataclass(frozen=True)
class FinalFiles:
    """What :func:`write_final_files` wrote.

    Attributes:
        summary: the run's :class:`~broker_server.server.RunSummary` (rounds, final figures, metrics).
        record: the ``summary.json`` content.
        written: the names of the files written, in the order written.
    """

    summary: RunSummary
    record: dict
    written: list[str]


def write_final_files(cfg: Config, ds: Dataset, fin: FinishedRun, *, federation: str, broker: str,
                      extra: dict[str, Any] | None = None) -> FinalFiles:
    """Write the final files of ``fin``'s run (its rounds done, its final files not): the
    final global model of its last checkpoint as ``model_final.pt`` / ``model_final.onnx``
    (:func:`~broker_server.server.write_final_model` of ``cfg``'s server model and algorithm)
    and ``summary.json``: the keys :func:`~broker_server.simulate.simulate` and
    :func:`~broker_server.server_main.run_server` write (``refusals``:
    :func:`refusals_from_metrics`; ``seconds``: this call's), then ``extra``, and
    ``finished_on_resume`` saying that only these files were written now.

    Returns:
        :class:`FinalFiles`.

    Raises:
        ConfigError: the checkpoint does not fit ``cfg``'s model.
    """
    from edge_agent.errors import ModelError

    t0 = time.monotonic()
    store = RunStore(fin.run_dir)
    try:
        ckpt = store.checkpoints.load(fin.rounds)
    finally:
        store.close()
    if ckpt is None:  # finished_run read it a moment ago
        raise ConfigError(f"--resume {fin.run_dir}: the checkpoint of round {fin.rounds} disappeared")
    strategy = make_strategy(cfg, ds, resuming=True)
    model = server_model(cfg, ds)
    try:
        load_arrays(model, ckpt.tensors)
    except ModelError as exc:
        raise ConfigError(f"--resume {fin.run_dir}: the checkpoint of round {fin.rounds} does not fit "
                          f"{cfg.source}'s [model]: {exc}") from None
    onnx = write_final_model(store, model, share=strategy.share, algorithm=strategy.name, test=ds.test)
    written = (["model_final.pt"] if strategy.share != "none" else []) + (
        ["model_final.onnx"] if "onnx_accuracy" in onnx else [])
    acc, loss = final_figures(fin.metrics)
    try:  # the strategy as the run ended, for its record in summary.json
        strategy.load_state_dict(ckpt.strategy_state)
    except Exception as exc:  # noqa: BLE001 - the final files are written all the same, without that record
        log.warning("the checkpoint of round %d does not restore the strategy (%s: %s): summary.json has no "
                    "strategy record", fin.rounds, type(exc).__name__, exc)
        strategy_done = None
    else:
        strategy_done = strategy
    record = summary_record(
        cfg, ds, federation=federation, final_accuracy=acc, rounds_completed=fin.rounds,
        seconds=time.monotonic() - t0, broker=broker, refusals=refusals_from_metrics(fin.metrics), onnx=onnx,
        strategy=strategy_done,
        **(extra or {}),
        finished_on_resume=(f"the rounds were all done (checkpoint of round {fin.rounds}) but the final files "
                            "were not: written now from that checkpoint and metrics.jsonl, without a broker "
                            "or agents"))
    write_summary(fin.run_dir, record)
    return FinalFiles(RunSummary(fin.rounds, acc, loss, fin.metrics), record, [*written, "summary.json"])
