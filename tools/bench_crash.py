"""Crash benchmark of fedfleet: a real fleet — ``fedfleet server`` and three
``fedfleet-agent`` processes over an embedded Mosquitto — with one process killed (SIGKILL) or
stopped (SIGTERM) during round 2, and runs on a machine whose ``onnxruntime`` import is broken.
Prints (or writes) Markdown rows.

Usage (from the repository root)::

    python tools/bench_crash.py --out /tmp/crash.md [--work /tmp/crashwork]

A counting relay (a paho subscriber to the federation's topics, started before any fleet
process) records every delivery ``(sender, kind, round, seq)``; each process's ledger is then
read back and compared with it:

* *ledger rows missing*: messages the relay saw a process publish that have no ``sent`` row in
  that process's ledger (its last will, published by the broker, is left out); *extra*: ``sent``
  rows the relay never saw;
* *updates lost*: over the rounds the server closed, devices whose update got an accepted receipt
  minus the updates the round's metrics say were aggregated (``clients_reported``);
* *dup. aggregated*: per closed round, ``clients_reported`` beyond the number of distinct devices
  whose update for that round the relay saw;
* *finished*: the server exited 0 with every configured round in ``summary.json``;
* *clean close*: :func:`protocol.ledger.ledger_closed_cleanly` of the stopped process's ledger.

The broken-runtime runs put a folder first on ``PYTHONPATH`` (server and agents) holding a fake
``onnxruntime`` package whose ``__init__`` raises ImportError, OSError, RuntimeError, or calls
``os.abort()``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import paho.mqtt.client as mqtt  # noqa: E402

from broker_server import config as config_mod  # noqa: E402
from broker_server.embedded_broker import EmbeddedBroker, mosquitto_available  # noqa: E402
from broker_server.metrics_file import read_metrics  # noqa: E402
from broker_server.server_main import agent_command  # noqa: E402
from protocol.ledger import ledger_closed_cleanly  # noqa: E402
from protocol.messages import Kind, Receipt, decode  # noqa: E402

CLIENTS, ROUNDS = 3, 4
CONFIG = f"""
[run]
name = "crash"
seed = 0
rounds = {ROUNDS}
[data]
dataset = "digits"
partition = "iid"
clients = {CLIENTS}
[train]
algorithm = "fedavg"
local_epochs = 1
batch_size = 16
lr = 0.05
momentum = 0.5
[server]
quorum = 2
round_deadline_s = 20.0
join_timeout_s = 120.0
"""
SHIMS = {
    "ImportError": 'raise ImportError("simulated: DLL load failed")',
    "OSError": 'raise OSError("simulated: libonnxruntime.so.1: cannot open shared object file")',
    "RuntimeError": 'raise RuntimeError("simulated: ABI version mismatch")',
    "abort()": "import os\nos.abort()",
}


class Relay:
    """Subscriber to ``fedfleet/v1/FED/#``: every delivery as ``(sender, kind, round, seq, body)``."""

    def __init__(self, host: str, port: int, federation: str) -> None:
        self.seen: list[tuple[str, str, int, int, object]] = []
        self.topics: list[str] = []
        self._lock = threading.Lock()
        done = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"relay-{federation}")
        self.client.on_connect = lambda c, *a: c.subscribe(f"fedfleet/v1/{federation}/#", qos=1)
        self.client.on_subscribe = lambda *a: done.set()
        self.client.on_message = self._on_message
        self.client.connect(host, port)
        self.client.loop_start()
        if not done.wait(30):
            raise RuntimeError("relay: no SUBACK")

    def _on_message(self, client, userdata, msg) -> None:
        if msg.payload:
            env = decode(bytes(msg.payload)).envelope
            with self._lock:
                self.seen.append((env.sender, env.kind.label, env.round, env.seq, env.body))
                self.topics.append(msg.topic)

    def snapshot(self) -> list[tuple[str, str, int, int, object]]:
        with self._lock:
            return list(self.seen)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _wait(cond, bound_s: float) -> bool:
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return bool(cond())


def _sent_rows(path: Path) -> set[tuple[str, int]]:
    if not path.is_file():
        return set()
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return {(n, s) for n, s in db.execute(
            "SELECT node, seq FROM messages WHERE event = 'sent' AND reason != 'control'")}
    finally:
        db.close()


def _metrics(run: Path) -> list[dict]:
    p = run / "metrics.jsonl"
    return read_metrics(p) if p.is_file() else []  # a crashed run's half-written last line dropped


def run_fleet(work: Path, broker: EmbeddedBroker, name: str, *, target: str | None = None,
              sig: signal.Signals | None = None, shim: str | None = None) -> dict:
    """One fleet run; ``target`` ("server" or "client-002") gets ``sig`` when round 2 starts."""
    federation = name
    run = work / federation
    cfg_path = work / f"{name}.toml"
    cfg_path.write_text(CONFIG, encoding="utf-8")
    cfg = config_mod.load(cfg_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if shim is not None:
        pkg = work / f"shim-{name}" / "onnxruntime"
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text(SHIMS[shim] + "\n", encoding="utf-8")
        env["PYTHONPATH"] = os.pathsep.join([str(pkg.parent), env["PYTHONPATH"]])
    relay = Relay(broker.host, broker.port, federation)
    t0 = time.monotonic()
    logs = {}
    procs: dict[str, subprocess.Popen] = {}

    def start(node: str, argv: list[str]) -> None:
        logs[node] = open(work / f"{name}-{node}.log", "w+", encoding="utf-8")  # noqa: SIM115
        procs[node] = subprocess.Popen(argv, cwd=REPO, env=env, stdout=logs[node], stderr=subprocess.STDOUT)

    start("server", [sys.executable, "-m", "broker_server.cli", "server", "--config", str(cfg_path),
                     "--broker", broker.url, "--out", str(run)])
    words = shlex.split(agent_command(cfg, broker.url, federation))[1:]
    for i in range(CLIENTS):
        cid = f"client-{i:03d}"
        argv = [w.replace("DEVICE_ID", cid).replace(f"i/{CLIENTS}", f"{i}/{CLIENTS}") for w in words]
        start(cid, [sys.executable, "-m", "edge_agent.cli", *argv, "--out", str(work / f"{name}-{cid}")])
    stopped_rc = None
    try:
        if target is not None:
            ok = _wait(lambda: any(k == "round_start" and r == 2 for _, k, r, _, _ in relay.snapshot()), 600)
            if not ok:
                raise RuntimeError(f"{name}: round 2 never started")
            if target != "server":  # the device confirmed round 2's global: it is training now
                _wait(lambda: any(s == target and k == "receipt" and r == 2 for s, k, r, _, _ in relay.snapshot()),
                      60)
            procs[target].send_signal(sig)
            stopped_rc = procs[target].wait(timeout=300)
        if target == "server":  # the devices wait for a server that is gone: stop them
            for node, p in procs.items():
                if node != "server":
                    p.send_signal(signal.SIGTERM)
        server_rc = procs["server"].wait(timeout=900)
        agent_rcs = {n: p.wait(timeout=300) for n, p in procs.items() if n != "server"}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs.values():
            f.close()
    ledgers = {"server": run / "ledger.sqlite",
               **{f"client-{i:03d}": work / f"{name}-client-{i:03d}" / "ledger.sqlite" for i in range(CLIENTS)}}
    everything = {n: _sent_rows(p) for n, p in ledgers.items()}
    _wait(lambda: {(s, q) for s, _, _, q, _ in relay.snapshot()} >= set().union(*everything.values()), 30)
    seen = relay.snapshot()
    topics = list(relay.topics[:len(seen)])
    relay.close()
    missing = extra = 0
    for node, rows in everything.items():
        published = {(s, q) for s, k, _, q, _ in seen if s == node and not (k == "status" and q == 0)}  # no will
        missing += len(published - rows)
        extra += len(rows - published)
    metrics = _metrics(run)
    closed = {m["round"]: m for m in metrics}
    accepted: dict[int, set[str]] = {}  # round -> devices (receipt topics) whose update was accepted
    updates: dict[int, set[str]] = {}
    for (s, k, r, _q, body), topic in zip(seen, topics, strict=True):
        if k == "receipt" and isinstance(body, Receipt) and body.ref_kind == Kind.UPDATE and body.accepted:
            accepted.setdefault(r, set()).add(topic)  # down/{client}/receipt: the topic names the device
        if k == "update":
            updates.setdefault(r, set()).add(s)
    lost = sum(len(accepted.get(r, ())) - m["clients_reported"] for r, m in closed.items() if not m["skipped"])
    dup = sum(max(0, m["clients_reported"] - len(updates.get(r, ()))) for r, m in closed.items())
    summary_path = run / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    target_ledger = ledgers.get(target) if target else None
    logs_text = {n: (work / f"{name}-{n}.log").read_text(errors="replace") for n in procs}
    return {
        "name": name, "target": target, "signal": sig.name if sig else None, "shim": shim,
        "stopped_rc": stopped_rc, "server_rc": server_rc, "agent_rcs": agent_rcs,
        "rounds": f"{summary.get('rounds_completed', len(metrics))}/{ROUNDS}",
        "finished": server_rc == 0 and summary.get("rounds_completed") == ROUNDS,
        "lost": lost, "dup": dup, "duplicates_refused": sum(m.get("duplicates", 0) for m in metrics),
        "missing": missing, "extra": extra, "relay_messages": len(seen),
        "clean_close": None if target_ledger is None else ledger_closed_cleanly(target_ledger),
        "ort": summary.get("optional_runtimes", {}).get("onnxruntime"),
        "onnx_error": summary.get("onnx_error"),
        "fallback_logged": sum("fallback: onnxruntime cannot be used" in logs_text[n] for n in logs_text
                               if n != "server"),
        "seconds": round(time.monotonic() - t0, 1),
    }


def _row(r: dict) -> str:
    if r["shim"]:
        what = f"onnxruntime import {r['shim']} (server + 3 devices)"
        note = (f"summary.json: onnxruntime unavailable, reason `{(r['ort'] or {}).get('reason')}`; "
                f"server onnx_error set: {bool(r['onnx_error'])}; devices printing the join fallback: "
                f"{r['fallback_logged']}/{CLIENTS}")
    else:
        what = f"{r['signal']} of {'the server' if r['target'] == 'server' else 'a device (' + r['target'] + ')'}" \
               " in round 2"
        note = (f"exit status {r['stopped_rc']}; its ledger closed cleanly: {r['clean_close']}"
                + ("; devices then stopped with SIGTERM" if r["target"] == "server" else ""))
    failed = sum(1 for n, rc in r["agent_rcs"].items() if rc != 0 and n != r["target"]
                 and not (r["target"] == "server" and rc == 128 + signal.SIGTERM))
    return (f"| {what} | {r['rounds']} | {'yes' if r['finished'] else 'no'} | {r['lost']} | {r['dup']} | "
            f"{r['missing']} / {r['extra']} of {r['relay_messages']} | {failed} | {note} | {r['seconds']:.0f} |")


HEADER = ("| scenario | rounds | finished | updates lost | dup. aggregated | ledger rows missing / extra "
          "vs relay | other agents failed | notes | wall s |\n|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the Markdown rows here (default: stdout)")
    ap.add_argument("--work", help="folder for the run folders and logs (default: a temporary one)")
    ap.add_argument("--only", nargs="*", help="scenario names to run (default: all)")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="fedfleet-crash-"))
    work.mkdir(parents=True, exist_ok=True)
    scenarios = [
        ("device-kill", {"target": "client-002", "sig": signal.SIGKILL}),
        ("device-term", {"target": "client-002", "sig": signal.SIGTERM}),
        ("server-kill", {"target": "server", "sig": signal.SIGKILL}),
        ("server-term", {"target": "server", "sig": signal.SIGTERM}),
        *[(f"ort-{k.strip('()').lower()}", {"shim": k}) for k in SHIMS],
    ]
    rows, results = [], []
    kind = "mosquitto" if mosquitto_available() else "amqtt"
    with EmbeddedBroker(kind=kind, workdir=work / "broker") as broker:
        for name, kw in scenarios:
            if args.only and name not in args.only:
                continue
            res = run_fleet(work, broker, name, **kw)
            results.append(res)
            rows.append(_row(res))
            print(rows[-1], flush=True)
    text = (f"Broker: embedded {kind}. {CLIENTS} devices (`fedfleet-agent`), `fedfleet server`, scikit-learn "
            f"digits, {ROUNDS} rounds, quorum 2, round deadline 20 s.\n\n" + HEADER + "\n" + "\n".join(rows) + "\n")
    (work / "results.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
