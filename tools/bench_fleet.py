"""Fleet-simulation benchmark of fedfleet: how many virtual agents one machine carries, what each
costs in memory and threads, how fast rounds go, and what a mixed Pi/Jetson/x86 fleet would take
per round on its own hardware and links. Writes a Markdown report.

Usage (from the repository root, in the project venv)::

    python tools/bench_fleet.py --out benchmarks/fleet.md                 # the full run (~20 min, 2 cores)
    python tools/bench_fleet.py --quick --out /tmp/fleet-quick.md         # smoke run (~2 min)

Every case is one :func:`broker_server.simulate.simulate` run, in process, in a **fresh child
process** (this same file with ``--child``), so that peak RSS (``VmHWM``) belongs to that case
alone. The embedded broker is Mosquitto when installed (else amqtt). Settings of every case:
IID partition, 1 local epoch, batch 32, lr 0.05, ``[agents] train_slots = 1`` (one agent trains
at a time), quorum = every client, a generous deadline (a round closes when all clients reported).

What is measured in the child (a sampler thread, every 0.1 s; connections every 0.5 s):

- **peak RSS**: ``VmHWM`` of ``/proc/self/status`` at the end (the kernel's high-water mark), and
  the sampled maximum of ``psutil`` RSS; the broker child's RSS is sampled separately;
- **RSS per virtual agent**: (peak RSS of the N-agent case − peak RSS of the 1-agent case on the
  same data set) / (N − 1); the 1-agent case holds the interpreter, torch, the data set, the
  server, the broker link and one agent;
- **threads**: peak ``threading.active_count()`` (Python threads: agent threads, paho network
  threads, the server, the sampler) and peak OS threads (``psutil`` ``num_threads``: adds torch's
  intra-op pool and native threads), and Python threads still alive after ``simulate`` returned;
- **MQTT connections**: ESTABLISHED TCP connections from this process to the broker's listening
  port, counted with ``psutil`` (expected: agents + 1 for the server);
- **wall time per round** from ``metrics.jsonl`` (``seconds``), **rounds per minute** = 60 / mean
  round time (steady state: rounds 2..R; round 1 also pays torch's one-time start-up, about 5 s
  on the first training call of the process), setup time (start of ``simulate`` to the start of
  round 1: broker start, data load and partition, N MQTT connects, joins);
- **ledger rows per round**: rows whose ``round`` column is r, and rows written during round r's
  wall-clock window (this adds MQTT control packets, which the ledger records with round NULL);
- **training time** of each client in each round on this host (the agent's
  ``algorithm.local_round`` wrapped through ``simulate``'s ``agent_hook``);
- **data shards**: bytes of every agent's training tensor and whether it shares memory with the
  cached data set (``np.may_share_memory``).

Mixed-profile cases (``rpi4=0.4,jetson-orin-nano=0.4,x86-cpu=0.2`` with ``emulate_link = true``):
per profile, the emulated link seconds per round (``summary.json`` ``emulated_link_s`` ÷ rounds),
the update codec and payload bytes per client (agent-side ledger rows), and the simulated round
time of that fleet on its own hardware — see :func:`simulated_round_time` for how.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make protocol/, edge_agent/, broker_server/ importable
    sys.path.insert(0, str(REPO))

MIX = "rpi4=0.4,jetson-orin-nano=0.4,x86-cpu=0.2"
#: This host's peak FP32 throughput relative to the x86-cpu reference profile (972.8 GFLOP/s), an
#: estimate for the sensitivity column: 2 vCPUs x 2.6 GHz (BogoMIPS 5200) x 64 FP32 FLOP/cycle
#: (two AVX-512 FMA units) = 332.8 GFLOP/s -> 0.34. Unverified (a KVM guest; the FMA unit count is
#: assumed), hence only a second column next to the host-as-reference one.
HOST_PEAK_REL = 0.34


# ============================================================================================
# child: one simulate() run, measured


class Sampler(threading.Thread):
    """Samples this process (RSS, threads, broker connections) and the broker child (RSS)."""

    def __init__(self, period_s: float = 0.1) -> None:
        super().__init__(name="bench-sampler", daemon=True)
        import psutil

        self.psutil = psutil
        self.proc = psutil.Process()
        self.period_s = period_s
        self.stop_evt = threading.Event()
        self.peak_rss = 0
        self.peak_py_threads = 0
        self.peak_os_threads = 0
        self.peak_conns = 0
        self.peak_broker_side_conns = 0
        self.peak_broker_rss = 0
        self.broker_port: int | None = None
        self.broker_pid: int | None = None
        self.broker_name = ""
        self.broker_cpu_s = 0.0
        self.samples = 0

    def _find_broker(self) -> None:
        for ch in self.proc.children(recursive=True):
            try:
                for c in ch.net_connections(kind="tcp"):
                    if c.status == self.psutil.CONN_LISTEN:
                        self.broker_port, self.broker_pid, self.broker_name = c.laddr.port, ch.pid, ch.name()
                        return
            except (self.psutil.Error, OSError):
                continue

    def sample_conns(self) -> None:
        if self.broker_port is None:
            self._find_broker()
        if self.broker_port is None:
            return
        try:
            mine = sum(1 for c in self.proc.net_connections(kind="tcp")
                       if c.status == self.psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port == self.broker_port)
            self.peak_conns = max(self.peak_conns, mine)
            b = self.psutil.Process(self.broker_pid)
            theirs = sum(1 for c in b.net_connections(kind="tcp")
                         if c.status == self.psutil.CONN_ESTABLISHED and c.laddr.port == self.broker_port)
            self.peak_broker_side_conns = max(self.peak_broker_side_conns, theirs)
            self.peak_broker_rss = max(self.peak_broker_rss, b.memory_info().rss)
            t = b.cpu_times()
            self.broker_cpu_s = t.user + t.system
        except (self.psutil.Error, OSError):
            self.broker_port = None  # the broker went away (end of the run) or another one started

    def run(self) -> None:
        n = 0
        while not self.stop_evt.is_set():
            try:
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
                self.peak_os_threads = max(self.peak_os_threads, self.proc.num_threads())
            except self.psutil.Error:
                pass
            self.peak_py_threads = max(self.peak_py_threads, threading.active_count())
            if n % 5 == 0:
                self.sample_conns()
            n += 1
            self.samples += 1
            self.stop_evt.wait(self.period_s)

    def stop(self) -> None:
        self.stop_evt.set()
        self.join(5)


def _vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def case_config(spec: dict):
    from broker_server import config as config_mod

    n = spec["clients"]
    raw = {
        "run": {"name": spec["name"], "seed": spec.get("seed", 0), "rounds": spec["rounds"]},
        "data": {"dataset": spec["dataset"], "partition": "iid", "clients": n, "min_samples": 5},
        "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "server": {"quorum": n, "round_deadline_s": float(spec.get("deadline_s", 900.0)),
                   "join_timeout_s": 300.0},
        "broker": {"kind": spec.get("broker", "auto")},
        "agents": {"train_slots": 1, "profile": spec.get("profile", "x86-cpu"),
                   "emulate_link": bool(spec.get("emulate_link", False))},
    }
    return config_mod.from_dict(raw, f"<bench {spec['name']}>")


def ledger_stats(run_dir: Path, windows: dict[int, tuple[float, float]]) -> dict:
    """Rows per round (by the ``round`` column and by wall-clock window), totals, and the
    message-level global/update rows of each client (for the mixed-profile analysis)."""
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    out: dict[str, Any] = {"rows_total": db.execute("SELECT count(*) FROM messages").fetchone()[0]}
    out["rows_by_round"] = {str(r if r is not None else "null"): c for r, c in
                            db.execute("SELECT round, count(*) FROM messages GROUP BY round")}
    out["rows_control"] = db.execute("SELECT count(*) FROM messages WHERE reason='control'").fetchone()[0]
    out["rows_by_window"] = {str(r): db.execute("SELECT count(*) FROM messages WHERE ts >= ? AND ts < ?",
                                                (a, b)).fetchone()[0] for r, (a, b) in windows.items()}
    out["rows_by_round_side"] = {f"{r}/{s}": c for r, s, c in db.execute(
        "SELECT round, side, count(*) FROM messages WHERE round >= 1 GROUP BY round, side")}
    msg = "((event='sent' AND transfer_id IS NULL) OR (event='message' AND side='agent' AND kind='update'))"
    out["updates"] = [dict(zip(("client", "round", "codec", "payload_bytes", "raw_bytes", "chunks"), r)) for r in
                      db.execute(f"SELECT client, round, codec, payload_bytes, raw_bytes, chunk_count FROM messages "
                                 f"WHERE side='agent' AND kind='update' AND {msg} ORDER BY client, round")]
    out["globals_received"] = [dict(zip(("client", "round", "payload_bytes", "chunks"), r)) for r in db.execute(
        "SELECT client, round, payload_bytes, chunk_count FROM messages WHERE side='agent' AND kind='global' "
        "AND ((event='received' AND transfer_id IS NULL) OR event='message') ORDER BY client, round")]
    update_cols = ("client", "round", "event", "codec", "payload_bytes")
    out["server_update_rows"] = [dict(zip(update_cols, r)) for r in db.execute(
        "SELECT client, round, event, codec, payload_bytes FROM messages WHERE side='server' AND kind='update' "
        "AND ((event='received' AND transfer_id IS NULL) OR event='message')")]
    out["global_sent"] = [dict(zip(("round", "codec", "payload_bytes", "chunks"), r)) for r in db.execute(
        "SELECT round, codec, payload_bytes, chunk_count FROM messages WHERE side='server' AND kind='global' "
        "AND ((event='sent' AND transfer_id IS NULL) OR event='message')")]
    db.close()
    out["ledger_file_bytes"] = sum(p.stat().st_size for p in run_dir.glob("ledger.sqlite*"))
    return out


def child_main(spec_path: Path, result_path: Path) -> None:
    import logging

    import numpy as np
    import psutil

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(spec_path.read_text())
    cfg = case_config(spec)

    from broker_server.metrics_file import read_metrics
    from broker_server.server import evaluate
    from broker_server.simulate import assign_profiles, simulate
    from edge_agent.data import load_dataset

    proc = psutil.Process()
    ds = load_dataset(cfg.data.dataset)  # cached: simulate() gets the same object
    rss_before = proc.memory_info().rss
    train_s: dict[tuple[str, int], float] = {}
    shards = {"bytes": 0, "shares_memory_with_dataset": 0, "agents": 0}
    profiles_of: dict[str, str] = {}

    def hook(i: int, agent) -> None:
        orig = agent.algorithm.local_round
        cid = agent.client_id

        def timed(*args, **kw):
            t = time.perf_counter()
            try:
                return orig(*args, **kw)
            finally:
                train_s[(cid, int(kw.get("round", 0)))] = time.perf_counter() - t

        agent.algorithm.local_round = timed
        x = agent.x.numpy()
        shared = bool(np.may_share_memory(x, ds.train.x))
        # what the agent holds of its own: a shared data set costs it only its index array and labels
        own = agent.y.numpy().nbytes + (0 if agent.indices is None else agent.indices.numpy().nbytes)
        shards["bytes"] += own + (0 if shared else x.nbytes)
        shards["shares_memory_with_dataset"] += int(shared)
        shards["agents"] += 1
        profiles_of[cid] = agent.profile

    ends: dict[int, tuple[float, float, float]] = {}  # round -> (monotonic end, wall end, seconds)

    def on_round(m: dict) -> None:
        ends[m["round"]] = (time.monotonic(), time.time(), m["seconds"])

    sampler = Sampler()
    sampler.start()
    cpu0 = proc.cpu_times()
    load0 = os.getloadavg()
    t0 = time.monotonic()
    res = simulate(cfg, run_dir=spec["run_dir"], agent_hook=hook, on_round=on_round)
    t_end = time.monotonic()
    sampler.stop()
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    py_threads_after = threading.active_count()
    cpu1 = proc.cpu_times()
    vm_hwm = _vm_hwm_bytes()
    run_dir = Path(res.run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = read_metrics(run_dir / "metrics.jsonl")
    windows = {r: (wall - s, wall) for r, (_, wall, s) in ends.items()}
    first = min(ends)
    setup_s = (ends[first][0] - ends[first][2]) - t0
    # the server's per-round evaluation cost on this host (the final model on the test split)
    import torch

    from broker_server.runtime import device_model

    model = device_model(ds, 0)
    model.load_state_dict(torch.load(run_dir / "model_final.pt"))
    te = time.perf_counter()
    evaluate(model, ds.test, batch_size=cfg.server.eval_batch_size)
    eval_s = time.perf_counter() - te
    out = {
        "spec": spec, "ok": True,
        "clients": cfg.data.clients, "dataset": ds.name, "train_samples": int(len(ds.train.y)),
        "broker": res.broker, "broker_process": sampler.broker_name,
        "rss_before_simulate": rss_before, "vm_hwm": vm_hwm, "peak_rss_sampled": sampler.peak_rss,
        "broker_peak_rss": sampler.peak_broker_rss, "broker_cpu_s": sampler.broker_cpu_s,
        "peak_py_threads": sampler.peak_py_threads, "peak_os_threads": sampler.peak_os_threads,
        "py_threads_after": py_threads_after, "threads_left_after_run": left[:20],
        "peak_conns": sampler.peak_conns, "peak_broker_side_conns": sampler.peak_broker_side_conns,
        "wall_s": t_end - t0, "setup_s": setup_s, "seconds_reported": res.seconds,
        "cpu_s": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
        "loadavg_before": load0, "loadavg_after": os.getloadavg(),
        "round_seconds": [m["seconds"] for m in metrics],
        "clients_reported": [m["clients_reported"] for m in metrics],
        "skipped": [m["skipped"] for m in metrics],
        "accuracy": [m.get("accuracy") for m in metrics],
        "bytes_up": [m["bytes_up"] for m in metrics], "bytes_down": [m["bytes_down"] for m in metrics],
        "agent_errors": summary.get("agent_errors", []),
        "profiles": summary.get("profiles"), "emulated_link_s": summary.get("emulated_link_s"),
        "assigned_profiles": assign_profiles(cfg.agents.profile_mix(), cfg.data.clients, cfg.run.seed),
        "profile_of_client": profiles_of,
        "train_s": {f"{c}/{r}": s for (c, r), s in sorted(train_s.items())},
        "shards": shards, "dataset_train_bytes": int(ds.train.x.nbytes + ds.train.y.nbytes),
        "eval_s": eval_s,
        "ledger": ledger_stats(run_dir, windows),
    }
    result_path.write_text(json.dumps(out, indent=1))


# ============================================================================================
# parent: run the cases, analyse, write the report


def run_case(spec: dict, work: Path, timeout_s: float) -> dict:
    name = spec["name"]
    spec = {**spec, "run_dir": str(work / "runs" / name)}
    if Path(spec["run_dir"]).exists():
        shutil.rmtree(spec["run_dir"])
    spec_path, result_path, log_path = work / f"{name}.spec.json", work / f"{name}.result.json", work / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    t = time.monotonic()
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {spec['clients']} agents, {spec['dataset']}, "
          f"{spec['rounds']} rounds, profile {spec.get('profile', 'x86-cpu')}"
          f"{', link emulation' if spec.get('emulate_link') else ''}"
          f"{''.join(f', {k}={v}' for k, v in spec.get('env', {}).items())} …", flush=True)
    env = {**os.environ, "FEDFLEET_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **spec.get("env", {})}
    try:
        with open(log_path, "w") as log:
            rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path),
                                 "--result", str(result_path)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                timeout=timeout_s, cwd=REPO).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    wall = time.monotonic() - t
    if rc != 0 or not result_path.exists():
        tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
        print(f"    FAILED ({rc}) after {wall:.0f} s; log tail:\n{tail}", flush=True)
        return {"spec": spec, "ok": False, "rc": rc, "log_tail": tail, "wall_s": wall}
    r = json.loads(result_path.read_text())
    print(f"    done in {wall:.0f} s: peak RSS {r['vm_hwm'] / 2**20:,.0f} MiB, rounds "
          f"{', '.join(f'{s:.1f}' for s in r['round_seconds'])} s, clients "
          f"{r['clients_reported']}, conns {r['peak_conns']}, py threads {r['peak_py_threads']}", flush=True)
    return r


def mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def steady(r: dict) -> list[float]:
    s = r["round_seconds"]
    return s[1:] if len(s) > 1 else s


def link_s(profile: str, nbytes: int, direction: str) -> float:
    from edge_agent.profiles import get_profile, link_time_s

    return link_time_s(get_profile(profile), int(nbytes), direction)


def simulated_round_time(r: dict, host_rel: float) -> dict:
    """How long one round would take on the real fleet: for each round r ≥ 2 (round 1 holds the
    process's one-time torch start-up in whichever client trained first),

        T_r = max over clients c of  down_s(c, r) + train_s(c, r) + up_s(c, r)

    - ``down_s`` = :func:`edge_agent.profiles.link_time_s` (profile of c, bytes of the global
      message c received in round r — the agent-side ledger row's ``payload_bytes``, the figure the
      agent's link emulation used, "down"); ``up_s`` likewise for c's update message, "up".
      Recomputed independently of the agent and checked against ``summary.json``.
    - ``train_s`` = (c's measured ``local_round`` seconds on this host) × ``host_rel`` ÷ the
      profile's ``relative_compute_speed`` (x86-cpu = 1.0). ``host_rel`` = this host's speed
      relative to the x86-cpu reference: 1.0 (this host counts as the reference) or
      :data:`HOST_PEAK_REL`.

    Every device trains in parallel on its own hardware (unlike the simulation's train_slots = 1),
    the broker fans the global model out to all devices at once, and the server's aggregation and
    evaluation are not included (``eval_s`` is reported next to it).
    """
    from edge_agent.profiles import get_profile

    prof = r["profile_of_client"]
    speed = {p: get_profile(p).relative_compute_speed for p in set(prof.values())}
    down = {(g["client"], g["round"]): g["payload_bytes"] for g in r["ledger"]["globals_received"]}
    up = {(u["client"], u["round"]): u["payload_bytes"] for u in r["ledger"]["updates"]}
    rounds = sorted({rd for _, rd in down})
    per_round = {}
    link_total: dict[str, float] = defaultdict(float)
    for rd in rounds:
        best = None
        for c, p in prof.items():
            d = link_s(p, down.get((c, rd), 0), "down") if (c, rd) in down else 0.0
            u = link_s(p, up.get((c, rd), 0), "up") if (c, rd) in up else 0.0
            link_total[c] += d + u
            tr = r["train_s"].get(f"{c}/{rd}", 0.0) * host_rel / speed[p]
            tot = d + tr + u
            if best is None or tot > best["total_s"]:
                best = {"client": c, "profile": p, "down_s": d, "train_s": tr, "up_s": u, "total_s": tot}
        per_round[rd] = best
    emulated = r.get("emulated_link_s") or {}
    check = max((abs(link_total[c] - emulated[c]) for c in emulated), default=float("nan"))
    return {"per_round": per_round, "link_check_max_abs_diff_s": check}


def ledger_link_s(run_dir: Path) -> dict[str, tuple[float, float]]:
    """Per client: (Σ of the ledger's ``link_s`` over every agent-side row, Σ over the global and
    update rows of rounds ≥ 1); empty when the ledger has no such column or the run is gone."""
    path = run_dir / "ledger.sqlite"
    if not path.exists():
        return {}
    db = sqlite3.connect(path)
    try:
        cols = {row[1] for row in db.execute("PRAGMA table_info(messages)")}
        if "link_s" not in cols:
            return {}
        return {c: (a, g) for c, a, g in db.execute(
            "SELECT node, sum(link_s), sum(CASE WHEN kind IN ('global', 'update') AND round >= 1 THEN link_s ELSE 0 "
            "END) "
            "FROM messages WHERE side='agent' GROUP BY node")}
    finally:
        db.close()


def per_profile(r: dict) -> dict[str, dict]:
    """Per profile: agents, emulated link s per round (mean, min, max over clients), update codec
    and payload bytes per client per round, host training seconds per client per round."""
    rounds = len(r["round_seconds"])
    prof = r["profile_of_client"]
    out: dict[str, dict] = {}
    for p in sorted(set(prof.values())):
        clients = [c for c, q in prof.items() if q == p]
        link = [r["emulated_link_s"][c] / rounds for c in clients] if r.get("emulated_link_s") else []
        ups = [u for u in r["ledger"]["updates"] if prof.get(u["client"]) == p]
        downs = [g for g in r["ledger"]["globals_received"] if prof.get(g["client"]) == p]
        trains = [s for k, s in r["train_s"].items() if prof.get(k.split("/")[0]) == p and not k.endswith("/1")]
        out[p] = {
            "agents": len(clients),
            "link_mean": statistics.mean(link) if link else float("nan"),
            "link_min": min(link) if link else float("nan"), "link_max": max(link) if link else float("nan"),
            "codecs": sorted({u["codec"] for u in ups}),
            "update_bytes": statistics.mean(u["payload_bytes"] for u in ups) if ups else float("nan"),
            "update_raw": statistics.mean(u["raw_bytes"] for u in ups) if ups else float("nan"),
            "update_chunks": sorted({u["chunks"] for u in ups}, key=lambda x: (x is None, x)),
            "global_bytes": statistics.mean(g["payload_bytes"] for g in downs) if downs else float("nan"),
            "global_chunks": sorted({g["chunks"] for g in downs}, key=lambda x: (x is None, x)),
            "train_host_s": statistics.median(trains) if trains else float("nan"),
        }
    return out


def machine_info() -> dict[str, str]:
    import numpy as np
    import psutil
    import torch

    cpu = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    out = {"CPU": f"{cpu}, {os.cpu_count()} logical cores", "RAM": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
           "OS": f"{platform.system()} {platform.release()}", "Python": platform.python_version(),
           "torch": f"{torch.__version__} (intra-op threads {torch.get_num_threads()})", "numpy": np.__version__}
    try:
        import paho.mqtt

        out["paho-mqtt"] = paho.mqtt.__version__
    except ImportError:
        pass
    mosq = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/usr/local/sbin:/sbin")
    if mosq:
        try:
            p = subprocess.run([mosq, "-h"], capture_output=True, text=True, timeout=10)
            out["broker"] = next((x for x in (p.stdout + p.stderr).splitlines() if "version" in x), mosq).strip()
        except (OSError, subprocess.SubprocessError):
            out["broker"] = mosq
    else:
        out["broker"] = "amqtt (mosquitto not installed)"
    try:
        out["open files limit"] = str(__import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE)[0])
    except (ImportError, OSError):
        pass
    return out


def code_label() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "protocol", "edge_agent", "broker_server",
                                "firmware_profiles"], cwd=REPO, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return f"{head}{' + uncommitted changes in the packages' if dirty else ' (packages as committed)'}"
    except (OSError, subprocess.SubprocessError):
        return "?"


def scale_table(rs: list[dict], base: dict | None, ref: dict | None) -> list[str]:
    lines = [
        "| agents | rounds done, clients reported | peak RSS MiB (VmHWM) | Δ vs 1 agent MiB | MiB per agent | "
        "broker RSS MiB | Python threads peak / after | OS threads peak | MQTT conns (expected) | setup s | "
        "round 1 s | rounds 2..R mean s | rounds/min (steady) | rounds/min (all) | CPU s per round | "
        "ledger rows/round (round col) | rows/round (wall window) | shard MiB (copies) | load avg 1 min before / "
        "after |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |"]
    for r in rs:
        if not r["ok"]:
            lines.append(f"| {r['spec']['clients']} | FAILED ({r.get('rc')}) | | | | | | | | | | | | | | | | | |")
            continue
        n = r["clients"]
        d = r["vm_hwm"] - base["vm_hwm"] if base and base is not r else None
        per = d / (n - 1) if d is not None and n > 1 else None
        st = steady(r)
        rr = [str(r2) for r2 in range(1, len(r["round_seconds"]) + 1)]
        rows_col = statistics.mean(r["ledger"]["rows_by_round"].get(k, 0) for k in rr)
        rows_win = statistics.mean(r["ledger"]["rows_by_window"].get(k, 0) for k in rr)
        lines.append(
            f"| {n} | {len(r['round_seconds'])}, {'/'.join(map(str, r['clients_reported']))} | {mib(r['vm_hwm'])} | "
            f"{mib(d) if d is not None else '—'} | {f'{per / 2**20:.2f}' if per is not None else '—'} | "
            f"{mib(r['broker_peak_rss'])} | {r['peak_py_threads']} / {r['py_threads_after']} | "
            f"{r['peak_os_threads']} | {r['peak_conns']} ({n + 1}){'' if r['peak_conns'] == n + 1 else ' ≠'} | "
            f"{r['setup_s']:.1f} | {r['round_seconds'][0]:.2f} | {statistics.mean(st):.2f} | "
            f"{60 / statistics.mean(st):.1f} | {60 * len(r['round_seconds']) / sum(r['round_seconds']):.1f} | "
            f"{r['cpu_s'] / len(r['round_seconds']):.1f} | {rows_col:,.0f} | {rows_win:,.0f} | "
            f"{r['shards']['bytes'] / 2**20:,.1f} ({r['shards']['agents'] - r['shards']['shares_memory_with_dataset']}"
            f"/{r['shards']['agents']}) | {r['loadavg_before'][0]:.1f} / {r['loadavg_after'][0]:.1f} |")
    if ref is not None and ref["ok"]:
        lines += ["", f"Ratios against the {ref['clients']}-agent case (side by side, same run):", "",
                  "| agents | agents × | peak RSS × | Δ RSS × | steady round time × | round time per agent × | "
                  "ledger rows/round × | Python threads × |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
                                                              "---: |"]
        rref = statistics.mean(steady(ref))
        dref = ref["vm_hwm"] - base["vm_hwm"] if base else None
        rowsref = statistics.mean(ref["ledger"]["rows_by_round"].get(str(k), 0)
                                  for k in range(1, len(ref["round_seconds"]) + 1))
        for r in rs:
            if not r["ok"] or r["clients"] <= 1:
                continue
            n, st = r["clients"], statistics.mean(steady(r))
            dd = r["vm_hwm"] - base["vm_hwm"] if base else None
            rows = statistics.mean(r["ledger"]["rows_by_round"].get(str(k), 0)
                                   for k in range(1, len(r["round_seconds"]) + 1))
            lines.append(
                f"| {n} | {n / ref['clients']:.1f} | {r['vm_hwm'] / ref['vm_hwm']:.2f} | "
                f"{(dd / dref) if dref and dd is not None else float('nan'):.2f} | {st / rref:.2f} | "
                f"{(st / n) / (rref / ref['clients']):.2f} | {rows / rowsref:.2f} | "
                f"{r['peak_py_threads'] / ref['peak_py_threads']:.2f} |")
    return lines


def mixed_section(r: dict, host_rel_primary: float) -> list[str]:
    from edge_agent.profiles import get_profile

    n, rounds = r["clients"], len(r["round_seconds"])
    lines = [f"### Mixed fleet: {n} agents on {r['dataset']}, `{r['spec']['profile']}`, `emulate_link = true`", ""]
    if not r["ok"]:
        return lines + [f"FAILED ({r.get('rc')}).", ""]
    lines += [f"Assigned profiles (`assign_profiles`, seed 0): {json.dumps(r['profiles'])}. Rounds {rounds}, "
              f"clients reported {r['clients_reported']}, wall time per round "
              f"{', '.join(f'{s:.2f}' for s in r['round_seconds'])} s (with link emulation sleeping on the agent "
              f"threads), peak RSS {mib(r['vm_hwm'])} MiB, MQTT connections {r['peak_conns']} (expected {n + 1}).", "",
              "| profile | agents | update codec (agent-side ledger) | update payload bytes / client / round | "
              "÷ fp32 raw | update chunks | global payload bytes received | global chunks | emulated link s / round "
              "(mean; min–max) | link model: up kbit/s, down kbit/s, RTT ms, loss % | host train s / round "
              "(median, rounds ≥ 2) | relative_compute_speed |",
              "| --- | ---: | --- | ---: | ---: | --- | ---: | --- | ---: | --- | ---: | ---: |"]
    pp = per_profile(r)
    for p, s in pp.items():
        prof = get_profile(p)
        lk = prof.link
        lines.append(
            f"| {p} | {s['agents']} | {', '.join(s['codecs'])} | {s['update_bytes']:,.0f} | "
            f"{s['update_bytes'] / s['update_raw']:.3f} | "
            f"{', '.join('none' if c is None else str(c) for c in s['update_chunks'])} | "
            f"{s['global_bytes']:,.0f} | {', '.join('none' if c is None else str(c) for c in s['global_chunks'])} | "
            f"{s['link_mean']:.3f} ({s['link_min']:.3f}–{s['link_max']:.3f}) | "
            f"{lk.uplink_kbps:g}, {lk.downlink_kbps:g}, {lk.rtt_ms:g}, {lk.loss_percent:g} | {s['train_host_s']:.3f} | "
            f"{prof.relative_compute_speed:g} |")
    fp32 = [s["update_bytes"] for p, s in pp.items() if s["codecs"] == ["fp32"]]
    if "rpi4" in pp and fp32:
        lines += ["", f"rpi4 update ÷ x86-cpu (fp32) update payload: {pp['rpi4']['update_bytes'] / fp32[0]:.3f}."]
    srv = r["ledger"]["server_update_rows"]
    empty = sum(1 for s in srv if not s["codec"])
    lines += ["", f"Server-side `received` update rows with an empty `codec` column: {empty} of {len(srv)} "
                  + ("(receivers record the codec as well)." if empty == 0
                     else "(the codec is recorded only on the sending side rows).")]
    g = r["ledger"]["global_sent"]
    if g:
        lines += [f"Global model as sent by the server: codec {sorted({x['codec'] for x in g})}, "
                  f"{g[0]['payload_bytes']:,} payload bytes, chunks {g[0]['chunks'] or 'none'} (the server's chunk "
                  "size "
                  f"is the smallest of the fleet's profiles)."]
    lines += ["", "**Simulated round time** (\"how long would a round take on this fleet?\"): for each round r ≥ 2, "
              "T_r = max over clients of down_s + train_s + up_s, where down_s / up_s = `link_time_s(profile, "
              "payload bytes of the global / update message in the agent-side ledger, direction)` "
              "= bytes·8 / (kbit/s·1000) / (1 − loss) + RTT, and train_s = this host's measured `local_round` "
              "seconds for that client and round × host_rel ÷ the profile's `relative_compute_speed`. Devices train "
              "in parallel on their own hardware; the broker fans the global model out at once; server aggregation "
              f"and evaluation excluded (evaluation of the test split on this host: {r['eval_s']:.2f} s per round). "
              "host_rel = 1.0 counts this host as the x86-cpu reference (a pessimistic bound if the host is slower "
              f"than the reference); host_rel = {HOST_PEAK_REL} scales by the estimated peak FLOP/s of this host.", "",
              "| round | host_rel | straggler (profile) | down s | train s | up s | T_r s |",
              "| ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for hr in (host_rel_primary, HOST_PEAK_REL):
        sim = simulated_round_time(r, hr)
        for rd, b in sim["per_round"].items():
            if rd < 2 and len(sim["per_round"]) > 1:
                continue
            lines.append(f"| {rd} | {hr:g} | {b['client']} ({b['profile']}) | {b['down_s']:.3f} | {b['train_s']:.2f} | "
                         f"{b['up_s']:.3f} | {b['total_s']:.2f} |")
    med = []
    for p, s in pp.items():
        prof = get_profile(p)
        d, u = link_s(p, round(s["global_bytes"]), "down"), link_s(p, round(s["update_bytes"]), "up")
        med.append((d + s["train_host_s"] / prof.relative_compute_speed + u, p, d, s["train_host_s"] /
                    prof.relative_compute_speed, u))
    t, p, d, tr, u = max(med)
    lines += ["", "With each profile's *median* host training time (rounds ≥ 2) instead of each client's own — "
                  "robust to "
                  f"a load spike on this shared machine hitting one client — the slowest profile is {p}: "
                  f"{d:.3f} + {tr:.2f} + {u:.3f} = **{t:.2f} s** per round (host_rel = 1.0; "
                  f"{d + tr * HOST_PEAK_REL + u:.2f} s with host_rel = {HOST_PEAK_REL})."]
    sim = simulated_round_time(r, host_rel_primary)
    led = ledger_link_s(Path(r["spec"]["run_dir"]))
    if led:
        em = r["emulated_link_s"] or {}
        lines += ["", "Two link-time figures for the same run: the seconds the agent's link emulation slept "
                  "(`summary.json` `emulated_link_s`: whole global and update messages, payload bytes, one RTT per "
                  "message), and the ledger's per-packet `link_s` column (every agent-side MQTT packet, whole "
                  "packet bytes, one RTT per packet, so a chunked global pays one RTT per chunk):", "",
                  "| profile | emulated s / client / round | ledger link_s, global + update rows, / client / round | "
                  "ratio | ledger link_s, every agent row (joins, status, receipts included) ÷ rounds |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for p in sorted(set(r["profile_of_client"].values())):
            cs = [c for c, q in r["profile_of_client"].items() if q == p]
            every = statistics.mean(led.get(c, (0.0, 0.0))[0] for c in cs) / rounds
            gu = statistics.mean(led.get(c, (0.0, 0.0))[1] for c in cs) / rounds
            b = statistics.mean(em[c] for c in cs) / rounds if em else float("nan")
            lines.append(f"| {p} | {b:.3f} | {gu:.3f} | {gu / b if b else float('nan'):.2f} | {every:.3f} |")
    lines += ["", "Independent check of the link model: |Σ recomputed link s − summary.json emulated_link_s|, "
                  "largest over "
                  f"clients: {sim['link_check_max_abs_diff_s']:.4f} s (summary values are rounded to 1 ms)."]
    # per-profile simulated time (the slowest client of each profile, mean over rounds ≥ 2)
    prof = r["profile_of_client"]
    lines += ["", "Per profile, the slowest client's down + train + up (host_rel = 1.0, mean over rounds ≥ 2):", "",
              "| profile | down s | train s | up s | total s |", "| --- | ---: | ---: | ---: | ---: |"]
    down = {(g["client"], g["round"]): g["payload_bytes"] for g in r["ledger"]["globals_received"]}
    up = {(u["client"], u["round"]): u["payload_bytes"] for u in r["ledger"]["updates"]}
    for p in sorted(set(prof.values())):
        speed = get_profile(p).relative_compute_speed
        acc = []
        for rd in range(2, rounds + 1):
            worst = max(((link_s(p, down[(c, rd)], "down"),
                          r["train_s"].get(f"{c}/{rd}", 0.0) * host_rel_primary / speed,
                          link_s(p, up[(c, rd)], "up")) for c, q in prof.items()
                         if q == p and (c, rd) in down and (c, rd) in up), key=sum, default=None)
            if worst:
                acc.append(worst)
        if acc:
            m = [statistics.mean(x[i] for x in acc) for i in range(3)]
            lines.append(f"| {p} | {m[0]:.3f} | {m[1]:.2f} | {m[2]:.3f} | {sum(m):.2f} |")
    return lines + [""]


def write_report(out: Path, results: dict[str, list[dict]], mixed: list[dict], meta: dict) -> None:
    """The Markdown report from the cases' results and ``meta`` (argv, started, total_s,
    load_start, load_end, rounds, machine, code)."""
    started, total_s, machine = meta["started"], meta["total_s"], meta["machine"]
    one = next((r for r in results.get("digits", []) if r["ok"] and r["clients"] == 1), None)
    warmup = (f"here round 1 − mean of rounds 2..R of the 1-agent digits case = "
              f"{one['round_seconds'][0] - statistics.mean(steady(one)):.1f} s" if one else "a few seconds")
    load_start, load_end = meta["load_start"], meta["load_end"]
    L = ["# fedfleet fleet-simulation benchmark", "",
         f"Produced by `python tools/bench_fleet.py {' '.join(meta['argv'])}` on {started} "
         f"(total {total_s:.0f} s); code {meta['code']}.", "",
         "Benchmarks, not tests. Every case is one in-process `simulate(...)` run in a fresh child process (so "
         "VmHWM is that case's own peak). The machine may be shared with other jobs: load average "
         f"{'/'.join(f'{x:.2f}' for x in load_start)} at the start, {'/'.join(f'{x:.2f}' for x in load_end)} at the "
         "end; each case's own load averages are in the JSON results. Times are noisy; memory, threads, "
         "connections and ledger rows are not.", "",
         "| machine | |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in machine.items()], "",
         "Settings of every case: IID partition, `local_epochs` 1, `batch_size` 32, `lr` 0.05, "
         f"{meta['rounds']} rounds, `[agents] train_slots` 1 (one agent trains at a time), quorum = every client, "
         "round deadline 900 s, `join_timeout_s` 300, `min_samples` 5 (the default 10 refuses IID shards of "
         "digits beyond 143 clients), seed 0, embedded broker (Mosquitto when installed), fp32 both ways, "
         "the light CNN (`lightcnn`).", "",
         "Columns: *peak RSS* = VmHWM of the simulating process (server + every agent + paho threads; the broker "
         "is a separate process, its peak RSS sampled alongside); *Δ vs 1 agent* = peak RSS − peak RSS of the "
         "1-agent case on the same data set; *MiB per agent* = Δ / (N − 1); *Python threads peak / after* = peak "
         "`threading.active_count()` during the run (the benchmark's sampler thread included) / threads alive "
         "after `simulate` returned (2 = the main thread and the ledgers' one timed-commit thread, a daemon "
         "shared by every ledger of the process and idle once they are closed: nothing leaked; the names of any "
         "others are in the case's JSON, `threads_left_after_run`); *MQTT conns* = ESTABLISHED TCP "
         "connections of the process to the broker port (peak, sampled every 0.5 s); *round 1* also pays torch's "
         f"one-time start-up in the process's first training call ({warmup}); *rounds/min (steady)* = 60 / mean "
         "of rounds 2..R; *CPU s per round* = process user+sys CPU over the whole run ÷ rounds (2 cores = at most "
         "120 CPU s per wall minute); *ledger rows/round (round col)* counts rows tagged with the round; "
         "*(wall window)* counts rows written during the round, which adds MQTT control packets (PUBACK, "
         "PINGREQ … — the ledger writes them with round NULL); *shard MiB (copies)* = Σ bytes the agents hold of "
         "their own for training (x when it is a copy, y, the shard's index array; an agent on the shared cached "
         "data set gathers its x only while it trains), with how many x are copies, not the cached data set.", ""]
    for ds, rs in results.items():
        if not rs:
            continue
        base = next((r for r in rs if r["ok"] and r["clients"] == 1), None)
        ref = next((r for r in rs if r["ok"] and r["clients"] == 10), None)
        L += [f"## {ds}", ""]
        ok = [r for r in rs if r["ok"]]
        if ok:
            r0 = ok[0]
            L += [f"{r0['train_samples']:,} training samples (an IID shard of N clients holds about "
                  f"{r0['train_samples']:,} / N); data set in memory (train x + y) "
                  f"{r0['dataset_train_bytes'] / 2**20:,.1f} MiB.", ""]
        L += scale_table(rs, base, ref) + [""]
        for r in rs:
            if r["ok"] and r["agent_errors"]:
                L.append(f"- {r['clients']} agents: agent errors {r['agent_errors'][:3]}")
        L.append("")
    alloc = [(g, r) for g, rs in results.items() if "MALLOC" in g for r in rs if r["ok"]]
    if alloc:
        L += ["## Allocator experiment: the same cases with `MALLOC_ARENA_MAX=2`", "",
              "glibc gives each thread that allocates its own malloc arena (up to 8 × cores); with two threads per "
              "agent, freed model-sized buffers can stay spread over many arenas. Same cases, same settings, only "
              "the environment variable differs:", "",
              "| case | peak RSS MiB, default | peak RSS MiB, MALLOC_ARENA_MAX=2 | ratio | MiB per agent, default | "
              "MiB per agent, MALLOC_ARENA_MAX=2 | steady round s, default | steady round s, arenas 2 |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for g, r in alloc:
            ds = g.split(",")[0]
            dflt = next((x for x in results.get(ds, []) if x["ok"] and x["clients"] == r["clients"]), None)
            b_d = next((x for x in results.get(ds, []) if x["ok"] and x["clients"] == 1), None)
            b_a = next((x for _, x in alloc if x["dataset"] == r["dataset"] and x["clients"] == 1), None)
            if dflt is None:
                continue
            n = r["clients"]
            per_d = (dflt["vm_hwm"] - b_d["vm_hwm"]) / (n - 1) / 2**20 if b_d and n > 1 else float("nan")
            per_a = (r["vm_hwm"] - b_a["vm_hwm"]) / (n - 1) / 2**20 if b_a and n > 1 else float("nan")
            L.append(f"| {r['dataset']}, {n} agents | {mib(dflt['vm_hwm'])} | {mib(r['vm_hwm'])} | "
                     f"{r['vm_hwm'] / dflt['vm_hwm']:.2f} | {per_d:.2f} | {per_a:.2f} | "
                     f"{statistics.mean(steady(dflt)):.2f} | {statistics.mean(steady(r)):.2f} |")
        L.append("")
    if mixed:
        L += ["## Mixed-profile fleets with link emulation", ""]
        for r in mixed:
            L += mixed_section(r, 1.0)
    # verdict
    L += ["## Per agent, in short", ""]
    for ds, rs in results.items():
        ok = [r for r in rs if r["ok"] and r["clients"] >= 10]
        base = next((r for r in rs if r["ok"] and r["clients"] == 1), None)
        if not ok or base is None:
            continue
        per = [(r["vm_hwm"] - base["vm_hwm"]) / (r["clients"] - 1) / 2**20 for r in ok]
        thr = [(r["peak_py_threads"] - base["peak_py_threads"]) / (r["clients"] - 1) for r in ok]
        osthr = [(r["peak_os_threads"] - base["peak_os_threads"]) / (r["clients"] - 1) for r in ok]
        rows = [statistics.mean(r["ledger"]["rows_by_round"].get(str(k), 0)
                                for k in range(1, len(r["round_seconds"]) + 1))
                / r["clients"] for r in ok]
        L.append(f"- {ds} (N = {', '.join(str(r['clients']) for r in ok)}): {min(per):.2f}–{max(per):.2f} MiB RSS, "
                 f"{min(thr):.1f}–{max(thr):.1f} Python threads (the agent's own and paho's network thread), "
                 f"{min(osthr):.1f}–{max(osthr):.1f} OS threads, 1 MQTT connection "
                 f"({'every case' if all(r['peak_conns'] == r['clients'] + 1 for r in ok) else 'NOT every case'}: "
                 f"agents + 1), {min(rows):.2f}–{max(rows):.2f} ledger rows per round (round column) per agent.")
    L += [""]
    L += ["## Does \"≥ 100 agents on 2 cores / 24 GB\" hold?", ""]
    verdicts = []
    for ds, rs in results.items():
        for r in rs:
            if r["spec"]["clients"] < 100:
                continue
            if not r["ok"]:
                verdicts.append(f"- {ds}, {r['spec']['clients']} agents: **no** — the run failed ({r.get('rc')}).")
                continue
            n = r["clients"]
            full = all(c == n for c in r["clients_reported"]) and not any(r["skipped"])
            total = r["vm_hwm"] + r["broker_peak_rss"]
            verdicts.append(
                f"- {ds}, {n} agents: {'**yes**' if full and total < 24 * 2**30 else '**no**'} — "
                f"{len(r['round_seconds'])} rounds, every round with {'all' if full else 'NOT all'} {n} clients, "
                f"{r['peak_conns']} MQTT connections, peak RSS {mib(r['vm_hwm'])} MiB + broker "
                f"{mib(r['broker_peak_rss'])} "
                f"MiB = {total / 2**30:.2f} GiB of 24 GiB ({100 * total / (24 * 2**30):.1f} %), "
                f"{statistics.mean(steady(r)):.1f} s per steady round ({60 / statistics.mean(steady(r)):.1f} "
                "rounds/min).")
    L += verdicts + [""]
    out.write_text("\n".join(L) + "\n", encoding="utf-8")


def _legacy_meta(md: Path, saved: dict) -> dict:
    """Meta of a results file written before ``meta`` was saved: from the report it produced."""
    import re

    text = md.read_text(encoding="utf-8")
    m = re.search(r"Produced by `python tools/bench_fleet.py (.*?)` on (.*?) \(total (\d+) s\); code (.*?)\.\n", text)
    loads = re.search(r"load average ([0-9./]+) at the start, ([0-9./]+) at the\s+end", text)
    first = next(r for rs in saved["results"].values() for r in rs if r.get("ok"))
    return {"argv": m.group(1).split(), "started": m.group(2), "total_s": float(m.group(3)), "code": m.group(4),
            "load_start": [float(x) for x in loads.group(1).split("/")],
            "load_end": [float(x) for x in loads.group(2).split("/")],
            "rounds": first["spec"]["rounds"], "machine": machine_info()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "fleet.md")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-fleet"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--digits-sizes", default="1,10,50,100,150,200")
    ap.add_argument("--mnist-sizes", default="1,10,50,100")
    ap.add_argument("--mixed", default="digits:50,mnist:50", help="DATASET:N,… for the mixed-profile runs ('' = none)")
    ap.add_argument("--malloc", default="mnist:1,mnist:50",
                    help="DATASET:N,… rerun with MALLOC_ARENA_MAX=2 (glibc allocator experiment; '' = none)")
    ap.add_argument("--broker", default="auto", choices=("auto", "mosquitto", "amqtt"))
    ap.add_argument("--case-timeout-s", type=float, default=1800.0)
    ap.add_argument("--quick", action="store_true", help="smoke run: digits 1,10; mixed digits:10; 2 rounds")
    ap.add_argument("--from-json", type=Path, help="rebuild the report from a saved all-results.json (no runs)")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child_main(args.child, args.result)
        return 0
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        write_report(args.out, saved["results"], saved["mixed"], saved.get("meta") or _legacy_meta(args.out, saved))
        print(args.out.read_text())
        return 0
    if args.quick:
        args.digits_sizes, args.mnist_sizes, args.mixed = "1,10", "", "digits:10"
        args.rounds, args.malloc = 2, "digits:1,digits:10"
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M")
    t0 = time.monotonic()
    load_start = os.getloadavg()
    machine = machine_info()
    code_start = code_label()
    results: dict[str, list[dict]] = {}
    for ds, sizes in (("digits", args.digits_sizes), ("mnist", args.mnist_sizes)):
        ns = [int(x) for x in sizes.split(",") if x.strip()]
        results[ds] = [run_case({"name": f"{ds}-{n}", "dataset": ds, "clients": n, "rounds": args.rounds,
                                 "broker": args.broker}, args.work, args.case_timeout_s) for n in ns]
    mixed = []
    for item in [x for x in args.mixed.split(",") if x.strip()]:
        ds, n = item.split(":")
        mixed.append(run_case({"name": f"mixed-{ds}-{n}", "dataset": ds, "clients": int(n), "rounds": args.rounds,
                               "broker": args.broker, "profile": MIX, "emulate_link": True},
                              args.work, args.case_timeout_s))
    for item in [x for x in args.malloc.split(",") if x.strip()]:
        ds, n = item.split(":")
        results.setdefault(f"{ds}, MALLOC_ARENA_MAX=2", []).append(run_case(
            {"name": f"malloc-{ds}-{n}", "dataset": ds, "clients": int(n), "rounds": args.rounds, "broker": args.broker,
             "env": {"MALLOC_ARENA_MAX": "2"}}, args.work, args.case_timeout_s))
    code_end = code_label()
    meta = {"argv": sys.argv[1:], "started": started, "total_s": time.monotonic() - t0, "load_start": load_start,
            "load_end": os.getloadavg(), "rounds": args.rounds, "machine": machine,
            "code": code_start if code_end == code_start else f"{code_start} at the start, {code_end} at the end"}
    (args.work / "all-results.json").write_text(json.dumps({"results": results, "mixed": mixed, "meta": meta},
                                                           indent=1))
    write_report(args.out, results, mixed, meta)
    print(f"\nwrote {args.out}")
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
