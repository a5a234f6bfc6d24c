"""Grids of simulated federations, for the papers' reproduction protocols (``tools/reproduce_*.py``).

Each job is one whole run through :func:`broker_server.simulate.simulate`: a real broker, the
agents' and server's real code, the byte ledger. A grid runs its jobs in worker processes (one
torch thread each), appends one JSON line per finished job to ``results.jsonl`` and skips jobs
already there, so an interrupted reproduction resumes where it stopped.

What a job reports (:func:`run_job`):

- the last round's metrics line and the best round's accuracy, and ``client_test`` (which data
  the client figures were measured on: ``[data] client_test``);
- wire bytes per client per round on the device links (``up``/``down``; MQTT headers, topic and
  envelope included; control packets, which carry no round, are not), the mean payload of an
  update and of a global, and the mean bytes of each update body field (``tensors``,
  ``extras.prototypes`` …) from the sender's ledger rows;
- with ``ensemble=True``: the accuracy and macro-F1 of the ensemble that averages every
  client's class probabilities (softmax of its own model's scores) on the evaluation split
  (FedMCP++'s "GAcc"/"GF1", SPECS.md §5.5).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """One run of a grid.

    Attributes:
        key: unique name, also the run folder's name (``/`` become ``__``), e.g.
            ``"mnist/c10/fedavg/s0"``.
        config: the configuration as parsed TOML (``{"run": {...}, "data": {...}, ...}``).
        ensemble: also compute the ensemble accuracy of the clients' own models (GAcc).
        tags: free labels copied into the result (data set, method, seed …).
    """

    key: str
    config: dict
    ensemble: bool = False
    tags: dict = field(default_factory=dict)


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
    res = simulate(cfg, run_dir=run_dir, agent_hook=lambda i, a: agents.append(a))
    seconds = time.monotonic() - t0
    audit = load_run(run_dir)
    last = dict(res.metrics[-1]) if res.metrics else {}
    accs = [m["accuracy"] for m in res.metrics if m.get("accuracy") is not None]
    out = {"key": job.key, "client_test": cfg.data.client_test, **job.tags, "rounds": res.rounds_completed,
           "clients": cfg.data.clients,
           "seconds": round(seconds, 1), "final": last, "best_accuracy": max(accs) if accs else None,
           **_device_bytes_per_client_round(audit.rows, cfg.data.clients, max(1, res.rounds_completed))}
    if job.ensemble:
        ds = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir or None,
                          domain_train_cap=cfg.data.domain_train_cap, domain_test_cap=cfg.data.domain_test_cap)
        split = client_eval_split(cfg.replace("server", client_eval=True), ds)
        out.update(ensemble_scores(sorted(agents, key=lambda a: a.client_id), split.x, split.y))
    return out


def _worker(job: Job, out_dir: str) -> dict:
    logging.basicConfig(level=logging.WARNING)
    try:
        return run_job(job, out_dir)
    except Exception as exc:  # recorded, the grid goes on
        return {"key": job.key, **job.tags, "error": f"{type(exc).__name__}: {exc}"}


def load_results(out_dir: str | Path) -> dict[str, dict]:
    """``results.jsonl`` of a grid folder as key → record (later lines win); ``{}`` if absent."""
    path = Path(out_dir) / "results.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            out[rec["key"]] = rec
    return out


def _die_with_parent() -> None:
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


def run_grid(jobs: Iterable[Job], out_dir: str | Path, *, workers: int = 2,
             on_result: Callable[[dict], None] | None = None) -> dict[str, dict]:
    """Run every job not yet in ``out_dir/results.jsonl`` in ``workers`` processes.

    A job that failed earlier (its record has ``error``) is run again. The workers die with
    this process (Linux): killing a reproduction stops its cells too.

    Returns:
        key → result record for every job of the grid (new and earlier ones).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = {k: v for k, v in load_results(out).items() if "error" not in v}
    todo = [j for j in jobs if j.key not in done]
    keys = {j.key for j in jobs} | set(done)
    if todo:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=ctx, initializer=_die_with_parent) as pool, \
                open(out / "results.jsonl", "a", encoding="utf-8") as f:
            futures = {pool.submit(_worker, j, str(out)): j for j in todo}
            for fut in as_completed(futures):
                rec = fut.result()
                f.write(json.dumps(rec) + "\n")
                f.flush()
                done[rec["key"]] = rec
                if on_result is not None:
                    on_result(rec)
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
