"""Grids of simulated federations, for the papers' reproduction protocols (``tools/reproduce_*.py``).

Each job is one whole run through :func:`broker_server.simulate.simulate`: a real broker, the
agents' and server's real code, the byte ledger. A grid runs its jobs in worker processes (one
torch thread each), appends one JSON line per finished job to ``results.jsonl`` and skips jobs
already there, so an interrupted reproduction resumes where it stopped.

What a job reports (:func:`run_job`):

- the last round's metrics line (the last round is always evaluated, whatever ``[server]
  eval_every``) and the best evaluated round's accuracy, and ``client_test`` (which data the
  client figures were measured on: ``[data] client_test``);
- ``per_round``: the run's per-round figures, column by column (:func:`round_series`), so that a
  report made from the records alone (a fresh checkout has no ``runs/`` folders) still has the
  curves, rounds to a target and per-round mechanism figures (:func:`read_metrics` falls back to
  them);
- wire bytes per client per round on the device links (``up``/``down``; MQTT headers, topic and
  envelope included; control packets, which carry no round, are not), the mean payload of an
  update and of a global, and the mean bytes of each update body field (``tensors``,
  ``extras.prototypes`` …) from the sender's ledger rows;
- with ``ensemble=True``: the accuracy and macro-F1 of the ensemble that averages every
  client's class probabilities (softmax of its own model's scores) on the evaluation split
  (FedMCP++'s "GAcc"/"GF1", SPECS.md §5.5).

Each new record also carries ``config_sha256`` (:func:`config_fingerprint`: the job's
configuration without its data folder, a path inside the grid folder counted relative to it) and
what the caller stamps on it (the scripts: the code's commit, :func:`code_commit`). A resumed
grid refuses a record whose fingerprint differs from its job's configuration (the cell would be
skipped with another configuration's numbers); records written before the fingerprint existed
are taken as they are. An unfinished last line of ``results.jsonl`` (a write cut short) is left
out, and cut off before the next record is appended; any other unreadable line is an error
(:class:`RecordsError`).

The second half is the harness the ``tools/reproduce_*.py`` scripts share: the data folder
default (:func:`default_data_dir`), option parsing of comma lists (:func:`int_list`,
:func:`name_list`), the estimate-then-grid loop (:func:`run_with_estimate`), the re-run check
(:func:`verify_records`), the ``--out`` check (:func:`check_out_dir`) and the scripts' exit
(:func:`script_exit`), per-round metrics (:func:`read_metrics`, :func:`rounds_to_target`,
:func:`attach_round_series`) and
mean ± std formatting (:func:`pm`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from protocol.files import write_atomically

from .metrics_file import restore_non_finite, strict_json
from .run_lock import hold_run_folder

log = logging.getLogger(__name__)


#: Record fields a job's tags may not set: the cell's key (a tag ``key`` used to replace it in the
#: record, which broke resuming), the failure mark and the configuration fingerprint.
RESERVED_TAGS = frozenset({"key", "error", "config_sha256"})


@dataclass(frozen=True)
class Job:
    """One run of a grid.

    Attributes:
        key: unique name, also the run folder's name (``/`` become ``__``), e.g.
            ``"mnist/c10/fedavg/s0"``.
        config: the configuration as parsed TOML (``{"run": {...}, "data": {...}, ...}``).
        ensemble: also compute the ensemble accuracy of the clients' own models (GAcc).
        tags: free labels copied into the result (data set, method, seed …); not
            :data:`RESERVED_TAGS`.
    """

    key: str
    config: dict
    ensemble: bool = False
    tags: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Refuse tags that would overwrite the record's identity or status.

        Raises:
            ValueError: a tag named ``key``, ``error`` or ``config_sha256`` (:data:`RESERVED_TAGS`).
        """
        taken = sorted(RESERVED_TAGS & set(self.tags))
        if taken:
            raise ValueError(f"job {self.key!r}: tags {taken} are reserved for the record's own fields")


def _device_bytes_per_client_round(rows: list[dict], clients: int, rounds: int) -> dict[str, float]:
    from .audit import by_round, whole_message

    per_round = [r for r in by_round(rows, "device") if r["round"] is not None and r["round"] >= 1]
    up = sum(r["up_bytes"] for r in per_round)
    down = sum(r["down_bytes"] for r in per_round)
    denom = max(1, clients * rounds)
    updates = [r["payload_bytes"] for r in rows
               if r.get("side") == "agent" and r.get("kind") == "update" and whole_message(r)]
    fields: dict[str, list[int]] = {}
    for r in rows:
        if r.get("side") == "agent" and r.get("kind") == "update" and whole_message(r) and r.get("fields"):
            for name, n in json.loads(r["fields"]).items():
                fields.setdefault(name, []).append(int(n))
    globals_ = [r["payload_bytes"] for r in rows
                if r.get("side") == "server" and r.get("kind") == "global" and whole_message(r)]
    return {"up_bytes_per_client_round": up / denom, "down_bytes_per_client_round": down / denom,
            "update_payload_bytes_mean": float(np.mean(updates)) if updates else 0.0,
            "global_payload_bytes_mean": float(np.mean(globals_)) if globals_ else 0.0,
            "update_field_bytes_mean": {k: float(np.mean(v)) for k, v in sorted(fields.items())}}


def ensemble_scores(agents: Sequence[Any], x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Accuracy and macro-F1 of the average of the agents' class probabilities on ``(x, y)``.

    Args:
        agents: :class:`~edge_agent.agent.EdgeAgent` objects after a run (their models and
            algorithms are each device's final private state).
        x: float32 [M, C, H, W]; y: int64 [M].

    Returns:
        ``{"ensemble_accuracy": fraction, "ensemble_macro_f1": fraction}``.

    Raises:
        ValueError: ``agents`` is empty.
    """
    import torch

    from edge_agent.agent import macro_f1
    from edge_agent.algorithms import predict_scores

    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    total = None
    with torch.inference_mode():
        for a in agents:
            a.model.eval()
            probs = torch.cat([torch.softmax(predict_scores(a.algorithm, a.model, xt[s:s + 1000]), 1)
                               for s in range(0, len(xt), 1000)])
            total = probs if total is None else total + probs
    if total is None:
        raise ValueError("ensemble_scores: no agents to ensemble")
    pred = total.argmax(1).numpy()
    return {"ensemble_accuracy": float((pred == y).mean()), "ensemble_macro_f1": macro_f1(y, pred)}


def run_job(job: Job, out_dir: str | Path) -> dict:
    """Run one job (in this process) and return its result record.

    Raises:
        ConfigError, DataError, BrokerStartError: from :func:`~broker_server.simulate.simulate`.
    """
    import torch

    from edge_agent.data import load_dataset

    from .audit import load_run
    from .config import from_dict
    from .runtime import client_eval_split
    from .simulate import simulate

    torch.set_num_threads(1)
    cfg = from_dict(job.config, f"<{job.key}>")
    run_dir = Path(out_dir) / "runs" / job.key.replace("/", "__")
    if run_dir.exists():  # a run interrupted before it reached results.jsonl: start it afresh
        import shutil

        shutil.rmtree(run_dir)
    agents: list = []
    t0 = time.monotonic()
    def keep(i: int, a: Any) -> None:
        a.keep_model = job.ensemble  # the ensemble reads every client's own model after the run
        agents.append(a)

    res = simulate(cfg, run_dir=run_dir, agent_hook=keep)
    seconds = time.monotonic() - t0
    audit = load_run(run_dir)
    last = dict(res.metrics[-1]) if res.metrics else {}
    accs = [m["accuracy"] for m in res.metrics if m.get("accuracy") is not None]
    out = {"key": job.key, "client_test": cfg.data.client_test, **job.tags, "rounds": res.rounds_completed,
           "clients": cfg.data.clients,
           "seconds": round(seconds, 1), "final": last, "best_accuracy": max(accs) if accs else None,
           **_device_bytes_per_client_round(audit.rows, cfg.data.clients, max(1, res.rounds_completed)),
           "per_round": round_series(res.metrics)}
    if job.ensemble:
        ds = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir or None,
                          domain_train_cap=cfg.data.domain_train_cap, domain_test_cap=cfg.data.domain_test_cap)
        split = client_eval_split(cfg.replace("server", client_eval=True), ds)
        out.update(ensemble_scores(sorted(agents, key=lambda a: a.client_id), split.x, split.y))
    return out


def _worker(job: Job, out_dir: str) -> dict:
    """One cell in a worker process: its record, with the worker's numerics
    (:func:`broker_server.numerics.fingerprint`) as ``machine``; an exception becomes the record's
    ``error``."""
    from .numerics import fingerprint

    logging.basicConfig(level=logging.WARNING)
    try:
        rec = run_job(job, out_dir)
        return {**rec, "machine": fingerprint()}
    except Exception as exc:  # recorded, the grid goes on
        return {"key": job.key, **job.tags, "error": f"{type(exc).__name__}: {exc}"}


def records_cost(results: dict[str, dict]) -> str:
    """One line on what the records on hand cost to make: the number of finished cells and the sum
    of their own wall seconds (each cell a process with one torch thread, so the sum is close to
    the CPU time of the grid, whatever the number of workers or invocations that made it)."""
    secs = [float(r["seconds"]) for r in results.values() if "error" not in r and "seconds" in r]
    if not secs:
        return "No finished cell on record."
    return (f"The {len(secs)} finished cells on record took {sum(secs) / 3600:.2f} cell-hours in all (the sum of "
            f"each cell's wall time, one torch thread per cell; {sum(secs) / len(secs):.0f} s per cell on average).")


class RecordsError(ValueError):
    """A grid folder's records cannot be used as they are: a line of ``results.jsonl`` that is not
    a record (other than an unfinished last one), or a record made with another configuration.
    The message names the file, the line or cell, and what to do."""


class GridStopped(Exception):
    """A grid stopped at its stop time (:data:`STOP_AT_ENV`): the cells that ran are on record,
    the others were not started (each would have ended after the stop time). The same command
    resumes the grid."""


#: Environment variable: a Unix time (seconds) by which a grid should be done. :func:`run_grid`
#: starts a cell only when it is expected to end by then (:data:`STOP_MARGIN` × the mean time of
#: the recorded cells like it, :func:`like_cells_seconds`; 0 while none is), lets the running ones
#: finish, and raises :class:`GridStopped` when it left cells unstarted. Set by
#: ``tools/grid_queue.py --hours`` so that a session's grid ends with its last cells finished
#: instead of killed at the deadline.
STOP_AT_ENV = "FEDFLEET_GRID_STOP_AT"
#: how much longer than the mean cell a cell is allowed for, when deciding whether it ends in time
STOP_MARGIN = 1.25
#: exit status of a reproduction script whose grid stopped at its stop time (EX_TEMPFAIL: the
#: same command goes on)
EXIT_STOPPED = 75


def grid_stop_at(environ: dict[str, str] | None = None) -> float | None:
    """The stop time of :data:`STOP_AT_ENV` (Unix seconds), or ``None`` when unset.

    Raises:
        ValueError: a value that is not a number of seconds.
    """
    text = (os.environ if environ is None else environ).get(STOP_AT_ENV, "").strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{STOP_AT_ENV} must be a Unix time in seconds, got {text!r}") from None


def ends_after_stop(stop_at: float | None, seconds: Sequence[float]) -> bool:
    """Whether a task started now, expected to take :data:`STOP_MARGIN` × the mean of ``seconds``
    (earlier tasks of its kind; 0 when there are none), would end after ``stop_at`` (Unix
    seconds; ``None``: no stop time, never)."""
    expected = STOP_MARGIN * sum(seconds) / len(seconds) if seconds else 0.0
    return stop_at is not None and time.time() + expected > stop_at


#: The tags that make cells alike in time, most telling first: a cell is expected to take as long
#: as the recorded cells sharing all of them, else the first of them (see :func:`like_cells_seconds`).
TIME_TAGS = ("method", "dataset")


def like_cells_seconds(job: Job, done: Mapping[str, dict], mine: Collection[str]) -> list[float]:
    """The seconds (wall, per cell) of the recorded cells ``job`` is expected to take like, for
    :func:`ends_after_stop`: the finished records among ``mine`` (the grid's keys) that share all
    of ``job``'s :data:`TIME_TAGS` (same method on the same data set), else its method alone, else
    all of ``mine``'s records, else every record of the folder (another budget's or data set's
    cells, while none of these is on record); ``[]`` when nothing is recorded.

    A grid's methods differ several-fold in time (a FedDO run that also trains the whole fleet
    takes about twice a FedAvg run): the grid-wide mean would start a long cell that then runs
    past the stop time.

    Args:
        job: the cell to be started; its ``tags`` name its method and data set (none: the grid mean).
        done: key → record of the finished cells (records with ``error`` are skipped).
        mine: the keys of this grid's jobs.
    """
    ok = {k: r for k, r in done.items() if "error" not in r}
    ours = [r for k, r in ok.items() if k in mine]
    tags = [t for t in TIME_TAGS if t in job.tags]
    for n in range(len(tags), 0, -1):
        alike = [r for r in ours if all(r.get(t) == job.tags[t] for t in tags[:n])]
        if alike:
            return [float(r.get("seconds", 0.0)) for r in alike]
    return [float(r.get("seconds", 0.0)) for r in (ours or ok.values())]


#: ``results.jsonl`` files whose unfinished last line was already reported (reported once each).
_WARNED_TAILS: set[tuple[str, int]] = set()


def _read_records(path: Path) -> list[dict]:
    """The records of a ``results.jsonl``, in file order. An unreadable **last** line is the trace
    of a write cut short (a killed process, a power cut: a partial line, or NUL bytes): it is left
    out, with a warning (once per file and size); its cell is not on record and runs again.

    Raises:
        RecordsError: any other line that is not a JSON object with a ``key`` (a damaged file:
            the message names the line).
    """
    text = path.read_text(encoding="utf-8", errors="replace")
    numbered = [(i, line) for i, line in enumerate(text.split("\n"), 1) if line.strip().strip("\x00")]
    out = []
    for n, (i, line) in enumerate(numbered):
        try:
            rec = _parse_record(line)
        except ValueError as exc:
            if n == len(numbered) - 1:
                stamp = (str(path), len(text))
                if stamp not in _WARNED_TAILS:
                    _WARNED_TAILS.add(stamp)
                    log.warning("%s: line %d is unfinished (%s); left out: its cell is not on record and runs "
                                "again", path, i, exc)
                break
            raise RecordsError(f"{path}: line {i} is not a record ({exc}); only the last line may be unfinished: "
                               "mend or remove that line") from None
        out.append(rec)
    return out


def _parse_record(line: str) -> dict:
    """One ``results.jsonl`` line as a record (its non-finite numbers restored,
    :func:`~broker_server.metrics_file.restore_non_finite`).

    Raises:
        ValueError: not JSON, not an object with a ``key``, or a malformed ``non_finite`` table.
    """
    rec = json.loads(line)
    if not isinstance(rec, dict) or not isinstance(rec.get("key"), str):
        raise ValueError("not an object with a 'key'")
    if (bad := restore_non_finite(rec)) is not None:  # strict JSON: a NaN loss is null, named
        raise ValueError(bad)
    return rec


def _mend_tail(path: Path) -> None:
    """Make ``results.jsonl`` end at a whole record before records are appended: an unfinished
    last line (see :func:`_read_records`) is cut off, a whole last record without its newline
    gets one. A missing file is left missing."""
    if not path.exists():
        return
    data = path.read_bytes()
    body = data.rstrip(b"\n\r\t \x00")
    if not body:
        if data:
            path.write_bytes(b"")
        return
    start = body.rfind(b"\n") + 1
    try:  # the test _read_records applies: a line it leaves out as unfinished is cut off here
        _parse_record(body[start:].decode("utf-8"))
        whole = True
    except ValueError:
        whole = False
    with open(path, "r+b") as f:
        if whole:
            f.truncate(len(body))
            f.seek(len(body))
            f.write(b"\n")
        else:
            log.warning("%s: cutting off an unfinished last line (%d bytes)", path, len(data) - start)
            f.truncate(start)


def load_results(out_dir: str | Path) -> dict[str, dict]:
    """``results.jsonl`` of a grid folder as key → record (later lines win); ``{}`` if absent.

    An unfinished last line (a write cut short) is left out with a warning (:func:`_read_records`).

    Raises:
        RecordsError: another line is not a record.
    """
    path = Path(out_dir) / "results.jsonl"
    if not path.exists():
        return {}
    return {rec["key"]: rec for rec in _read_records(path)}


def _inside(value: str, root: str) -> str | None:
    """``value`` as ``OUT/<path relative to root>`` when it is a path (it holds a ``/``) inside the
    folder ``root`` (an absolute, normalised path), else ``None``."""
    if "/" not in value:
        return None
    path = os.path.abspath(value)
    if path == root or not path.startswith(root + os.sep):
        return None
    return "OUT/" + Path(os.path.relpath(path, root)).as_posix()


def config_fingerprint(config: dict, out_dir: str | Path | None = None) -> str:
    """SHA-256 (hex) of a job's configuration as canonical JSON (sorted keys), without
    ``[data] data_dir``: the same cell read from another checkout's data folder keeps its
    fingerprint (the data files themselves are not fingerprinted).

    With ``out_dir`` (the grid folder), a table value that is a path inside it (a FedDO cell's
    pre-trained policy, ``OUT/policies/…``) counts as its path relative to that folder, so the
    fingerprint is the same however the folder is spelt (relative or absolute) and wherever it is
    moved or copied to."""
    cfg = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    if isinstance(cfg.get("data"), dict):
        cfg["data"].pop("data_dir", None)
    if out_dir is not None:
        root = os.path.abspath(out_dir)
        for table in cfg.values():
            if isinstance(table, dict):
                for k, v in table.items():
                    if isinstance(v, str) and (rel := _inside(v, root)) is not None:
                        table[k] = rel
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def die_with_parent() -> None:
    """Worker initializer: on Linux, ask the kernel to SIGKILL this worker when the grid's
    process dies (``prctl(PR_SET_PDEATHSIG)``), so a killed reproduction leaves no orphan
    training a cell whose result nobody records; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError as exc:  # no libc by that name: the worker just lives on, as elsewhere
        log.debug("prctl(PR_SET_PDEATHSIG) unavailable: %s", exc)


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """Stop a pool now, for an interrupted grid (Ctrl-C): cancel the jobs not started and end the
    workers' running ones (SIGTERM, then SIGKILL for a worker still alive 10 s later; each
    worker's broker has a watchdog that ends it with its worker). Without this, leaving the
    pool's ``with`` block on an exception waits for every queued job to finish, records none of
    them, and the grid goes on long after Ctrl-C."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    # a worker the pool started while it was being shut down is ended too
    procs += [p for p in (getattr(pool, "_processes", None) or {}).values() if p not in procs]
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(10)
        if proc.is_alive():  # SIGTERM not honoured within 10 s (a loaded machine, a long teardown)
            proc.kill()
            proc.join()


def records_of_other_configs(jobs: Iterable[Job], out_dir: str | Path, records: dict[str, dict] | None = None,
                             ) -> list[str]:
    """The keys of ``jobs`` whose finished record in ``out_dir`` was made with another configuration
    than the job's (``config_sha256`` differs from :func:`config_fingerprint` of the job's config,
    with or without the grid folder); records without a fingerprint (made before it existed) and
    failed records are not counted. ``records`` (default: :func:`load_results` of ``out_dir``)
    saves a second read."""
    out = Path(out_dir)
    done = {k: v for k, v in (load_results(out) if records is None else records).items() if "error" not in v}
    return [j.key for j in jobs if j.key in done and "config_sha256" in done[j.key]
            and done[j.key]["config_sha256"] not in (config_fingerprint(j.config, out), config_fingerprint(j.config))]


def check_report_records(jobs: Iterable[Job], out_dir: str | Path) -> None:
    """``--report-only``: refuse to describe records with options they were not made with.

    The report's protocol section and its cells come from the command line's options; a record
    of the same key made with other options (another ``--rounds``, ``--train-samples``, …) would be
    reported under a protocol it did not run.

    Raises:
        RecordsError: some records' ``config_sha256`` differ from the jobs' configurations (the
            message names how many and the first, and asks for the grid's own options).
    """
    bad = records_of_other_configs(jobs, out_dir)
    if bad:
        raise RecordsError(f"{Path(out_dir) / 'results.jsonl'}: {len(bad)} record(s) (first {bad[0]!r}) were made "
                           "with other options than these (config_sha256 differs): pass the options the grid was "
                           "run with (its report's 'Command' line) so the report describes what ran")


#: the CPU numerics a grid's workers can run with (:func:`run_grid`)
NUMERICS = ("portable", "native")


@contextlib.contextmanager
def pinned_numerics(numerics: str) -> Iterator[dict[str, str]]:
    """With ``"portable"``: :data:`~broker_server.numerics.PORTABLE_ENV` in ``os.environ`` for the
    block (processes started in it inherit it; :func:`~broker_server.numerics.pin_portable`, which
    applies nothing, with a warning, where the CPU cannot run them), the earlier values put back
    afterwards; with ``"native"``: ``os.environ`` as it is. Yields the settings applied."""
    from .numerics import PORTABLE_ENV, pin_portable

    saved = {k: os.environ.get(k) for k in PORTABLE_ENV}
    try:
        yield pin_portable() if numerics == "portable" else {}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_grid(jobs: Iterable[Job], out_dir: str | Path, *, workers: int = 2,
             on_result: Callable[[dict], None] | None = None, stamp: dict | None = None,
             numerics: str = "portable") -> dict[str, dict]:
    """Run every job not yet in ``out_dir/results.jsonl`` in ``workers`` processes.

    With ``numerics = "portable"`` (the default) the workers load torch with
    :data:`broker_server.numerics.PORTABLE_ENV`, so a cell gives the same bits on any x86-64 AVX2
    machine; ``"native"`` leaves the kernels to the machine. Each new record carries the worker's
    ``machine`` fingerprint (:func:`broker_server.numerics.fingerprint`); a cell that ran native
    although portable was asked (a CPU without AVX2) is logged as a warning.

    With :data:`STOP_AT_ENV` set, a cell starts only when it is expected to end by that time
    (:data:`STOP_MARGIN` × the mean seconds of the recorded cells like it, same method and data set
    first: :func:`like_cells_seconds`; a later cell that fits starts where an earlier one would
    not); the running ones finish and are recorded, and :class:`GridStopped` is raised when
    cells were left unstarted.

    A job that failed earlier (its record has ``error``) is run again. Each new record gets
    ``config_sha256`` (:func:`config_fingerprint` with ``out_dir``, so the grid folder's spelling
    does not count) and the entries of ``stamp`` (e.g. ``{"commit": code_commit(root)}``); a
    record made before the folder was left out of the fingerprint is taken when it matches the
    configuration as spelt now. An unfinished last line of ``results.jsonl`` is cut off first
    (its cell runs again). The workers die with this process (Linux): killing a reproduction
    stops its cells too; on an exception here (Ctrl-C) they are stopped (:func:`stop_pool`) and
    the exception goes on.

    Returns:
        key → result record for every job of the grid (new and earlier ones).

    The call holds the grid folder's lock (:mod:`broker_server.run_lock`): a second grid in the
    same folder meanwhile is refused at once (each cell's run folder is locked by its simulation).

    Raises:
        RunFolderBusy: another process (a grid) holds ``out_dir``.
        RecordsError: a finished record's ``config_sha256`` differs from its job's configuration
            (the grid folder holds another configuration's cell under that key: use a fresh
            folder, or remove that record), or a line of ``results.jsonl`` is not a record.
        GridStopped: the stop time (:data:`STOP_AT_ENV`) left cells unstarted.
        ValueError: ``numerics`` unknown, or :data:`STOP_AT_ENV` not a number.
    """
    stop_at = grid_stop_at()
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with hold_run_folder(out, "a reproduction grid"):  # two grids in one folder would run and append the same cells
        return _run_grid(list(jobs), out, stop_at, workers=workers, on_result=on_result, stamp=stamp,
                         numerics=numerics)


def _run_grid(jobs: list[Job], out: Path, stop_at: float | None, *, workers: int,
              on_result: Callable[[dict], None] | None, stamp: dict | None, numerics: str) -> dict[str, dict]:
    """:func:`run_grid` in the grid folder ``out``, whose lock this process holds."""
    _mend_tail(out / "results.jsonl")
    done = {k: v for k, v in load_results(out).items() if "error" not in v}
    mismatched = records_of_other_configs(jobs, out, done)
    if mismatched:
        raise RecordsError(f"{out / 'results.jsonl'}: the record of {mismatched[0]!r} was made with another "
                           "configuration (config_sha256 differs); use a fresh output folder or remove that record")
    todo = [j for j in jobs if j.key not in done]
    keys = {j.key for j in jobs} | set(done)
    if todo:
        ctx = multiprocessing.get_context("spawn")
        # the workers are spawned inside this block and load torch with the portable settings
        # (broker_server.numerics): the records re-run to the same bits on another machine
        with pinned_numerics(numerics) as pinned, \
                ProcessPoolExecutor(max_workers=max(1, workers), mp_context=ctx, initializer=die_with_parent) as pool, \
                open(out / "results.jsonl", "a", encoding="utf-8") as f:
            # cells are handed out as workers free up, so that a stop time can hold back the rest
            waiting, running = list(todo), dict[Future[dict], Job]()
            mine = {j.key for j in jobs}
            try:
                while waiting or running:
                    while len(running) < max(1, workers):
                        # the first waiting cell expected to end by the stop time (a shorter method's
                        # cell may still fit where a longer one would not)
                        fits = next((j for j in waiting if stop_at is None
                                     or not ends_after_stop(stop_at, like_cells_seconds(j, done, mine))), None)
                        if fits is None:
                            break
                        waiting.remove(fits)
                        running[pool.submit(_worker, fits, str(out))] = fits
                    if not running:
                        break
                    finished, _ = wait(running, return_when=FIRST_COMPLETED)
                    # the cells that ended well are recorded before a failed future's exception
                    # (a worker that died) goes on: one ending beside it is not lost
                    for fut in sorted(finished, key=lambda f: f.exception() is not None):
                        job = running.pop(fut)
                        rec = {**fut.result(), "config_sha256": config_fingerprint(job.config, out), **(stamp or {})}
                        if pinned and "error" not in rec and rec.get("machine", {}).get("numerics") != "portable":
                            log.warning("%s ran with native CPU numerics (%s): its numbers re-run bit for bit only "
                                        "on this kind of machine", rec["key"], rec.get("machine"))
                        f.write(strict_json(rec) + "\n")
                        f.flush()
                        done[rec["key"]] = rec
                        if on_result is not None:
                            on_result(rec)
            except BaseException:
                stop_pool(pool)
                raise
            if waiting:
                raise GridStopped(f"{out}: {len(waiting)} cell(s) not started: each would have ended after the "
                                  f"stop time ({STOP_AT_ENV}); the {len(todo) - len(waiting)} that ran are on record, "
                                  "and the same command goes on")
    return {k: v for k, v in done.items() if k in keys}


def failed_runs_section(results: dict[str, dict]) -> list[str]:
    """Markdown lines listing the runs whose record holds an ``error`` (``[]`` when none)."""
    errors = [r for r in results.values() if "error" in r]
    if not errors:
        return []
    return ["## Runs that failed", ""] + [f"- {r['key']}: {r['error']}" for r in errors] + [""]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population standard deviation (``np.std``, ddof 0) of ``values``; NaN for none."""
    if not values:
        return float("nan"), float("nan")
    a = np.asarray(values, dtype=float)
    return float(a.mean()), float(a.std())


# ------------------------------------------------------------------------------------------
# The harness of the reproduction scripts (tools/reproduce_*.py)

#: Keys of a round's metrics line that measure time, not the computation (left out of re-run checks).
VOLATILE_METRICS = frozenset({"seconds", "ended_s", "phase_s", "clients_train_s", "train_seconds"})


def code_commit(root: str | Path) -> str:
    """The short commit of the checkout at ``root``, with ``+dirty`` when tracked files other
    than ``benchmarks/`` (the records and reports, which are data, not code) differ from it;
    ``"unknown"`` outside a git checkout (or without git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks"], cwd=root, capture_output=True, text=True,
                               check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def default_data_dir(root: str | Path, given: str = "") -> str:
    """The data folder of a reproduction: ``given``, else ``$FEDFLEET_DATA``, else
    ``<root>/../shared/data`` when it exists, else ``""`` (the loaders' own search)."""
    data_dir = given or os.environ.get("FEDFLEET_DATA", "")
    if not data_dir and (Path(root).parent / "shared" / "data").is_dir():
        data_dir = str(Path(root).parent / "shared" / "data")
    return data_dir


def int_list(parser: argparse.ArgumentParser, option: str, text: str, minimum: int = 0) -> list[int]:
    """Comma-separated integers of ``option``, each ≥ ``minimum``; otherwise ``parser.error``
    (exit 2) naming the option and what it got."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"{option} takes comma-separated integers, got {text!r}")
    if not values or min(values) < minimum:
        parser.error(f"{option} needs at least one integer, each >= {minimum}; got {text!r}")
    return values


def name_list(parser: argparse.ArgumentParser, option: str, text: str, known: Iterable[str]) -> list[str]:
    """Comma-separated names of ``option`` (empty items dropped), each one of ``known``;
    otherwise ``parser.error`` (exit 2) naming the unknown ones and listing the known."""
    names = [n for n in text.split(",") if n]
    allowed = list(known)
    unknown = [n for n in names if n not in allowed]
    if unknown:
        parser.error(f"{option}: unknown {unknown}; known: {allowed}")
    return names


def check_out_dir(parser: argparse.ArgumentParser, out: str | Path, *, report_only: bool,
                  report: str | Path | None = None, estimate_only: bool = False, verify: int = 0) -> None:
    """Check a reproduction's ``--out`` (and ``--report``) before any cell runs; otherwise
    ``parser.error`` (exit 2) saying what is wrong. A grid needs a folder it can create and append
    ``results.jsonl`` to (made here when missing); ``--report-only`` needs a folder holding
    ``results.jsonl`` (a report of no records, over the committed one, is never what was meant:
    a mistyped folder); the report needs a file path whose folder can be written. Modes that
    exclude each other are refused rather than one of them left out without a word:
    ``--report-only`` (runs no cell) with ``--estimate-only`` or ``--verify K``, and
    ``--estimate-only`` (stops after its estimate) with ``--verify K``."""
    if report_only and (estimate_only or verify):
        parser.error("--report-only runs no cell: it does not go with "
                     f"{'--estimate-only' if estimate_only else f'--verify {verify}'} (run that without --report-only)")
    if estimate_only and verify:
        parser.error(f"--estimate-only stops after its estimate: --verify {verify} would not run (run it on its own)")
    path = Path(out)
    if path.exists() and not path.is_dir():
        parser.error(f"--out {out}: is a file, not a folder")
    if report_only:
        if not (path / "results.jsonl").is_file():
            parser.error(f"--report-only: {path / 'results.jsonl'} does not exist (no records to report; "
                         "is --out the grid's folder?)")
    else:
        try:
            path.mkdir(parents=True, exist_ok=True)
            with open(path / "results.jsonl", "a", encoding="utf-8"):
                pass
        except OSError as exc:
            parser.error(f"--out {out}: cannot write the records there ({exc.strerror or exc})")
    if report is not None:
        target = Path(report)
        if target.is_dir():
            parser.error(f"--report {report}: is a folder, not a file")
        folder = next((q for q in [target.parent, *target.parent.parents] if q.exists()), Path("."))
        if not folder.is_dir() or not os.access(folder, os.W_OK) or (target.exists()
                                                                       and not os.access(target, os.W_OK)):
            parser.error(f"--report {report}: cannot be written (its folder {folder} is not writable)")


def script_exit(main: Callable[[], int]) -> int:
    """Run a reproduction script's ``main`` and return its exit status, with a one-line message on
    standard error instead of a traceback for what a user can fix: Ctrl-C (status 130; the cells
    finished so far are on record and the same command resumes), unusable records
    (:class:`RecordsError`, status 1) and a grid stopped at its stop time (:class:`GridStopped`,
    status :data:`EXIT_STOPPED`)."""
    try:
        return main()
    except KeyboardInterrupt:
        print("interrupted: the finished cells are in OUT/results.jsonl; the same command resumes the grid",
              file=sys.stderr)
        return 130
    except RecordsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except GridStopped as exc:
        print(f"stopped: {exc}", file=sys.stderr)
        return EXIT_STOPPED


#: The longest list a per-round field may be to be kept in a record's ``per_round`` (per-device
#: lists of a 100-device fleet over hundreds of rounds would make records megabytes long).
SERIES_LIST_MAX = 64


def _series_value(v: Any) -> bool:
    """Whether a metrics value goes into :func:`round_series`: a number, a bool, ``None``, or a list
    of at most :data:`SERIES_LIST_MAX` numbers."""
    if v is None or isinstance(v, (bool, int, float)):
        return True
    return (isinstance(v, list) and len(v) <= SERIES_LIST_MAX
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v))


def round_series(lines: Sequence[dict]) -> dict[str, list]:
    """A run's per-round metrics lines as columns: ``{"round": [1, 2, …], "accuracy": [...], …}``.

    Kept: every field whose value in each round is a number, a bool, ``None`` or a list of at most
    :data:`SERIES_LIST_MAX` numbers (a round without the field gives ``None``: e.g. the
    ``accuracy`` of a round not evaluated, ``[server] eval_every``); left out: strings,
    dicts, longer lists and the timings (:data:`VOLATILE_METRICS`). :func:`series_lines` turns the
    columns back into lines. ``{}`` for no lines.
    """
    names: list[str] = []
    for m in lines:
        names += [k for k in m if k not in names]
    keep = [k for k in names if k not in VOLATILE_METRICS and all(_series_value(m.get(k)) for m in lines)]
    return {k: [m.get(k) for m in lines] for k in keep} if lines else {}


def series_lines(series: dict[str, list]) -> list[dict]:
    """The inverse of :func:`round_series`: one dict per round, fields that were ``None`` in a
    round left out of that round's dict."""
    n = max((len(v) for v in series.values()), default=0)
    return [{k: v[i] for k, v in series.items() if i < len(v) and v[i] is not None} for i in range(n)]


def _run_metrics(out: Path, key: str) -> Path:
    """``OUT/runs/<key with / → __>/metrics.jsonl``: where grid cell ``key``'s run wrote its rounds."""
    return out / "runs" / key.replace("/", "__") / "metrics.jsonl"


def read_metrics(out_dir: str | Path, key: str) -> list[dict]:
    """The per-round metrics lines of grid cell ``key``: its run folder's ``metrics.jsonl`` when
    on disk, otherwise the record's own ``per_round`` columns (from ``OUT/results.jsonl``,
    :func:`series_lines`; the fields :func:`round_series` keeps); ``[]`` when neither is there (a
    record made before records carried their rounds, and its run folder gone).

    Raises:
        AuditError: the run folder's ``metrics.jsonl`` is unreadable or holds a line that is not a
            JSON object.
    """
    from .audit._load import read_metrics as read_metrics_file

    path = _run_metrics(Path(out_dir), key)
    if path.is_file():
        return read_metrics_file(path)
    rec = _records(Path(out_dir)).get(key) or {}
    return series_lines(rec.get("per_round") or {})


def has_rounds(out_dir: str | Path, key: str) -> bool:
    """Whether :func:`read_metrics` has the rounds of cell ``key`` (its run folder or its record's
    ``per_round``); a report prints "not recorded" rather than "never" when it has not."""
    return bool(read_metrics(out_dir, key))


def _records(out: Path) -> dict[str, dict]:
    """:func:`load_results` of ``out``, read again only when ``results.jsonl`` changed (size or
    modification time), for the per-cell lookups of :func:`read_metrics`."""
    path = out / "results.jsonl"
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}
    stamp = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if _RECORDS_CACHE.get("stamp") != stamp:
        _RECORDS_CACHE.update(stamp=stamp, records=load_results(out))
    return _RECORDS_CACHE["records"]


_RECORDS_CACHE: dict[str, Any] = {}


def attach_round_series(out_dir: str | Path) -> int:
    """Give every finished record of ``OUT/results.jsonl`` that lacks ``per_round`` the columns of
    its run folder's ``metrics.jsonl`` (:func:`round_series`), rewriting the file in place (through
    a temporary file and a rename, so an interruption leaves the old file whole). For records made
    by code from before records carried their rounds while their run folders are still on disk.

    Returns:
        The number of records given their rounds (0: the file is left untouched).
    """
    from .audit._load import read_metrics as read_metrics_file

    out = Path(out_dir)
    path = out / "results.jsonl"
    if not path.exists():
        return 0
    lines = _read_records(path)
    added = 0
    for rec in lines:
        if "error" in rec or rec.get("per_round"):
            continue
        metrics = _run_metrics(out, rec["key"])
        if metrics.is_file():
            rec["per_round"] = round_series(read_metrics_file(metrics))
            added += 1
    if added:
        write_atomically(path, "".join(strict_json(r) + "\n" for r in lines).encode("utf-8"))
    return added


def rounds_to_target(lines: Sequence[dict], target: float,
                     metric: str | Callable[[dict], float | None] = "accuracy") -> int | None:
    """The first round whose ``metric`` reaches ``target`` (same unit, e.g. a fraction), or
    ``None`` (never, or no lines). ``metric``: a field name, or a function of a metrics line
    (``None`` where the line has no figure).

    Only the lines that have the figure count: with ``[server] eval_every`` = E > 1 the global
    model is evaluated in every E-th round and the last only (the other lines have no
    ``accuracy``, ``loss`` or per-domain figures), so the round returned is the first
    *evaluated* one at or above ``target``: the true first round lies in the E − 1 rounds before
    it at most (resolution E rounds)."""
    figure = metric if callable(metric) else (lambda m: m.get(metric))
    for m in lines:
        v = figure(m)
        if v is not None and v >= target:
            return int(m["round"])
    return None


#: What a report prints for a figure that needs a cell's rounds when they are not recorded (a record
#: made before records carried ``per_round``, whose run folder is gone): never "never".
NOT_RECORDED = "n/r"


def cell_rounds_to_target(out_dir: str | Path, key: str, target: float,
                          metric: str | Callable[[dict], float | None] = "accuracy") -> int | str | None:
    """:func:`rounds_to_target` of grid cell ``key``'s rounds (:func:`read_metrics`): the first
    round whose ``metric`` reaches ``target``, ``None`` when none did, :data:`NOT_RECORDED` when
    the cell's rounds are not on hand, or none of them carries the figure (a record whose lines
    hold no ``metric``: *never* would claim the figure was measured and stayed below)."""
    lines = read_metrics(out_dir, key)
    figure = metric if callable(metric) else (lambda m: m.get(metric))
    if not any(figure(m) is not None for m in lines):
        return NOT_RECORDED
    return rounds_to_target(lines, target, metric)


def hits_text(hits: Sequence[int | str | None]) -> str:
    """Per-seed rounds to a target as ``"3 · never · n/r"``-style text: a round, *never*
    (``None``) or :data:`NOT_RECORDED`, joined by `` · `` (a ``/`` would run into ``n/r``)."""
    return " · ".join("never" if h is None else str(h) for h in hits)


def report_header(title: str, script: str, commit: str, records: Iterable[dict], *, committed: str = "") -> list[str]:
    """The opening Markdown lines of a reproduction report: ``# title``, which script at which
    commit generated it, from which records (``committed``: where they are kept in the
    repository, e.g. ``benchmarks/results/feddo.jsonl``, a grid folder's ``results.jsonl`` once
    merged; ``""``: the run folder's ``results.jsonl`` alone), and the commits the finished
    ``records`` were made at (``not recorded`` for a record without one; ``–`` when there are
    none)."""
    made = sorted({str(r.get("commit", "not recorded")) for r in records})
    where = f"`{committed}` (a grid folder's `results.jsonl`)" if committed else "`results.jsonl`"
    return [f"# {title}", "",
            f"Generated by `{script}` at commit `{commit}` from the records in {where} "
            f"(made at {', '.join(f'`{c}`' for c in made) or '–'}); every number below was measured there.", ""]


def pm(values: Sequence[float | None], scale: float = 100.0, digits: int = 2, *, plain_single: bool = False) -> str:
    """``"mean ± std"`` (population std, :func:`mean_std`) of ``values`` × ``scale`` with
    ``digits`` decimals; ``None`` entries are left out; ``"–"`` when none is left. With
    ``plain_single``, one value is printed without ``± 0``."""
    vals = [float(v) * scale for v in values if v is not None]
    m, s = mean_std(vals)
    if m != m:
        return "–"
    return f"{m:.{digits}f}" if plain_single and len(values) == 1 else f"{m:.{digits}f} ± {s:.{digits}f}"


#: :func:`claim_verdict` of a positive mean within the spread of its paired differences
NOISY_VERDICT = "not reproduced (a positive mean within the spread: mean ≤ std of the paired differences)"


def within_spread(mean: float, std: float, n: int) -> bool:
    """Whether a mean of ``n`` paired differences is no larger than their std (``n`` ≥ 2): the pairs
    disagree on its sign or size as much as they agree (the rule of :func:`claim_verdict`)."""
    return n >= 2 and mean <= std


def claim_verdict(measured: float, claimed: float | None, std: float = 0.0, seeds: int = 1) -> str:
    """A paper claim's verdict from the measured paired gain (pp; per seed, or per setting and
    seed): *reproduced* (the mean reaches the paper's gain ``claimed``; with no margin given, any
    gain), *direction only* (positive, smaller), *not reproduced* (zero or negative); ``"no data"``
    for NaN. A positive mean no larger than the std of the paired differences (``seeds`` ≥ 2
    differences) is *not reproduced*, with that said, however large: the pairs disagree on its
    sign or size as much as they agree, so they show neither the paper's gain nor its direction."""
    if measured != measured:
        return "no data"
    if measured <= 0:
        return "not reproduced"
    if within_spread(measured, std, seeds):
        return NOISY_VERDICT
    return "reproduced" if claimed is None or measured >= claimed else "direction only"


def run_with_estimate(jobs: Sequence[Job], out_dir: str | Path, *, workers: int, estimate_only: bool = False,
                      on_result: Callable[[dict], None] | None = None, note: str = "",
                      stamp: dict | None = None) -> float:
    """The reproduction loop: print a CPU estimate for the jobs not yet on record, then, unless
    ``estimate_only``, run the whole grid (:func:`run_grid`; what is on record is skipped).

    The estimate: with ``estimate_only``, the first job not yet on record runs alone and its time
    × the number still to run is printed (``note`` says how cells differ); on a fresh grid (none
    of ``jobs`` on record) the grid starts at once on every worker and the first cell to finish
    gives that line (a cell run alone first would leave the other workers idle for a cell's time:
    10–15 minutes of a core for a ResNet8 or FedOCP cell); on a resumed grid the mean time of the
    cells of ``jobs`` already on record stands in for it.

    Returns:
        Wall seconds of this call.
    """
    t0 = time.monotonic()
    done = {k: r for k, r in load_results(out_dir).items() if "error" not in r}
    todo = [j for j in jobs if j.key not in done]
    recorded = [float(done[j.key].get("seconds", 0.0)) for j in jobs if j.key in done]
    tail = f" ({note})" if note else ""
    if not todo:
        print(f"all {len(jobs)} cells on record in {out_dir}", flush=True)
    elif recorded and not estimate_only:
        secs = sum(recorded) / len(recorded)
        from .text import plural

        cells = plural(len(recorded), "cell")
        print(f"{cells} on record (mean {secs:.0f} s); {len(todo)} to run ≈ "
              f"{secs * len(todo) / 3600:.1f} CPU-hours, ≈ {secs * len(todo) / max(1, workers) / 3600:.1f} h wall "
              f"on {workers} workers" + tail, flush=True)
    else:
        def estimate(first: dict) -> None:
            secs = float(first.get("seconds", 0.0))
            rest = len(todo) - 1
            together = "" if estimate_only or workers < 2 or len(todo) < 2 else \
                f" (the first of {min(workers, len(todo))} started together to end: the estimate is low)"
            print(f"first cell {secs:.0f} s{together}; {rest} more cells ≈ {secs * rest / 3600:.1f} CPU-hours, "
                  f"≈ {secs * rest / max(1, workers) / 3600:.1f} h wall on {workers} workers" + tail, flush=True)

        if estimate_only:
            estimate(run_grid([todo[0]], out_dir, workers=1, on_result=on_result, stamp=stamp)[todo[0].key])
        else:  # every worker at once; the first cell that finishes without an error gives the line
            told: list[bool] = []
            caller = on_result

            def on_result(rec: dict) -> None:
                if caller is not None:
                    caller(rec)
                if not told and "error" not in rec:
                    told.append(True)
                    estimate(rec)

    if not estimate_only:
        run_grid(jobs, out_dir, workers=workers, on_result=on_result, stamp=stamp)
    return time.monotonic() - t0


def final_differences(a: dict, b: dict) -> list[str]:
    """The keys of two records' last-round metrics (``final``) whose values differ, timings
    (:data:`VOLATILE_METRICS`) left out; ``["final"]`` when one record has none. When both records
    carry their rounds (``per_round``), a column that both have and that differs in any round is
    named too, as ``per_round.<field>`` (a re-run that ends equal but got there otherwise). A NaN
    equals a NaN here (a diverged cell re-run to the same NaN loss is the same result), at any
    depth of a value."""
    fa, fb = a.get("final"), b.get("final")
    if not fa or not fb:
        return ["final"]
    diff = sorted(k for k in set(fa) | set(fb) if k not in VOLATILE_METRICS and not _same(fa.get(k), fb.get(k)))
    ra, rb = a.get("per_round") or {}, b.get("per_round") or {}
    return diff + sorted(f"per_round.{k}" for k in set(ra) & set(rb) if not _same(ra[k], rb[k]))


def _same(x: Any, y: Any) -> bool:
    """``x == y`` with NaN equal to NaN, inside lists and dicts too."""
    if isinstance(x, float) and isinstance(y, float) and x != x and y != y:
        return True
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same(u, v) for u, v in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    return bool(x == y)


#: Metrics of the wire's delivery, not of the training: a resend under load (a receipt late by
#: more than the resend interval) changes them and nothing the devices computed.
DELIVERY_METRICS = frozenset({"bytes_up", "bytes_down", "duplicates", "late", "global_receipts", "global_resends",
                              "global_delivery", "resent_to", "round_start_resends", "round_start_asks",
                              "unsolicited", "early", "undeliverable",
                              "broker_refusals"})


def delivery_only(differences: Sequence[str]) -> bool:
    """Whether every name of :func:`final_differences` is a delivery metric
    (:data:`DELIVERY_METRICS`, also as ``per_round.<name>``): the training figures are equal."""
    return bool(differences) and all(d.removeprefix("per_round.") in DELIVERY_METRICS for d in differences)


def metrics_only_in_one(a: dict, b: dict) -> list[str]:
    """Last-round metric names that only one of two records has (a metric the code added or
    dropped since the record was made), timings left out; such a name is reported, not counted
    as a different value."""
    fa, fb = a.get("final") or {}, b.get("final") or {}
    return sorted(k for k in set(fa) ^ set(fb) if k not in VOLATILE_METRICS)


def verify_records(jobs: Sequence[Job], out_dir: str | Path, k: int, *, workers: int, commit: str,
                   headline: Callable[[dict], object]) -> list[str]:
    """Re-run the first ``k`` finished records of ``out_dir`` that are cells of ``jobs`` (into a
    temporary folder inside ``out_dir``) and compare each re-run with its record: the headline
    figure (``headline(record)``) and every last-round metric but the timings.

    The lines are also written to ``out_dir/verify.md`` (:data:`VERIFY_FILE`), so a later
    ``--report-only`` keeps the check (:func:`earlier_verify`), and the per-cell lines are printed
    under a count of the cells that came out the same.

    Returns:
        Markdown lines: which commit made the records and which made the re-runs, then one line
        per cell, ``same`` only when every compared metric is equal.
    """
    from .numerics import fingerprint_differences

    recorded = [r for r in load_results(out_dir).values() if "error" not in r]
    by_key = {j.key: j for j in jobs}
    recorded = [r for r in recorded if r["key"] in by_key][:k]
    made = sorted({str(r.get("commit", "not recorded")) for r in recorded})
    again: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        for numerics in NUMERICS:  # each record re-runs with its own numerics (no fingerprint: portable)
            same = [r for r in recorded if ((r.get("machine") or {}).get("numerics") or "portable") == numerics]
            if same:
                again.update(run_grid([by_key[r["key"]] for r in same], Path(tmp) / numerics, workers=workers,
                                      numerics=numerics))
    machine = next((b["machine"] for b in again.values() if b.get("machine")), None)
    lines = [f"Re-ran {len(recorded)} recorded cells at commit `{commit}`"
             + (f" on {machine_text(machine)}" if machine else "") + "; the records were made at "
             f"{', '.join(f'`{c}`' for c in made) or '–'}. *same* = every last-round metric equal (timings left "
             "out); each cell re-runs with its record's CPU numerics (broker_server/numerics.py), and where a cell "
             "differs while the two runs' numerics differ too, the line says how: then equal bits are not expected "
             "even from equal code. *same training; the wire differs*: only delivery figures differ (bytes, resends, "
             "duplicates: a receipt that came late on a loaded machine), every figure of the training is equal.", ""]
    for r in recorded:
        b = again.get(r["key"], {})
        one_side = metrics_only_in_one(r, b) if "error" not in b else []
        diff = ([k for k in final_differences(r, b) if k not in one_side] if "error" not in b
                else ["error: " + str(b["error"])])
        why = fingerprint_differences(r.get("machine"), b.get("machine"))
        wire = delivery_only(diff)
        verdict = "same" if not diff else "same training; the wire differs" if wire else "**differs**"
        lines.append(f"- {r['key']}: recorded {headline(r)}, re-run {headline(b)} → {verdict}"
                     + (f" ({', '.join(diff[:6])}{' …' if len(diff) > 6 else ''})" if diff else "")
                     + (f"; metrics in only one of the two: {', '.join(one_side)}" if one_side else "")
                     + (f"; numerics differ: {why}" if why and diff and not wire else ""))
    path = Path(out_dir) / VERIFY_FILE
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cells = [x for x in lines if x.startswith("- ")]
    n_same = sum(1 for x in cells if re.search(r"→ same(;|$)", x))  # a metric only one side has is no difference
    print(f"re-run check ({path}): {n_same} of {len(cells)} cells the same",
          *cells, sep="\n", flush=True)
    return lines


def machine_text(machine: dict) -> str:
    """``"portable numerics (AMD EPYC, torch 2.14.1)"``: a :func:`~broker_server.numerics.fingerprint`
    in a few words."""
    return f"{machine.get('numerics')} numerics ({machine.get('cpu')}, torch {machine.get('torch')})"


def numerics_line(results: dict[str, dict]) -> str:
    """One report line on the CPU numerics of the finished records: how many were made with
    portable numerics (they re-run to the same bits on any x86-64 AVX2 machine,
    :mod:`broker_server.numerics`) and, for the others, on which machines."""
    ok = [r for r in results.values() if "error" not in r]
    if not ok:
        return ""
    from .numerics import portable_record

    portable = sum(1 for r in ok if portable_record(r.get("machine")))
    others: dict[str, int] = {}
    for r in ok:
        m = r.get("machine")
        if not portable_record(m):
            name = (f"native on {m.get('cpu')} ({m.get('cpu_capability')})" if m and m.get("numerics") != "portable"
                    else "portable before numpy was pinned" if m else "no machine fingerprint")
            others[name] = others.get(name, 0) + 1
    line = (f"{portable} of {len(ok)} records were made with portable CPU numerics (the same bits on any x86-64 "
            "AVX2 machine)")
    if others:
        line += "; the others re-run to the same bits only on the machine kind that made them: " + ", ".join(
            f"{n} {name}" for name, n in sorted(others.items()))
    return line + "."


#: where :func:`verify_records` keeps its lines in the grid folder.
VERIFY_FILE = "verify.md"


def earlier_verify(out_dir: str | Path) -> list[str]:
    """The re-run check of an earlier invocation (``out_dir/verify.md``, :func:`verify_records`)
    as report lines under a line saying where they come from; ``[]`` when there is none."""
    path = Path(out_dir) / VERIFY_FILE
    if not path.is_file():
        return []
    return [f"(From an earlier invocation, `OUT/{VERIFY_FILE}`.)", "", *path.read_text(encoding="utf-8").splitlines()]
