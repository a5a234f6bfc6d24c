"""Returning-devices benchmark of fedfleet ("devices that come back" and "refusals that
say what was refused"): a real fleet — ``fedfleet server`` and three ``fedfleet-agent``
processes over an embedded Mosquitto — in which one device loses its link as round 2 opens and
comes back, vanishes during round 2 (SIGKILL: its last will; SIGTERM: its own offline status),
or sends an update whose body cannot be decoded. Prints (or writes) Markdown rows in the format
of ``tools/bench_crash.py`` (same counting relay, same figures), for ``benchmarks/reliability.md``.

Usage (from the repository root)::

    python tools/bench_return.py --out /tmp/return.md [--work /tmp/returnwork] [--only back-mid-round]

Scenarios (4 rounds, quorum 2, round deadline 60 s, ``[server] offline_grace_s`` = 5 s):

* ``back-mid-round``: client-002 reaches the broker through a TCP relay. When round 2's
  ``global`` reaches the relay on its way to client-002, the relay drops it, closes client-002's
  connection (no DISCONNECT: the broker publishes its last will) and refuses new connections for
  3 s, so that global and the round_start after it never reach the device; paho then reconnects
  and the agent says ``online``;
* ``will-mid-round`` / ``offline-mid-round``: client-002 gets SIGKILL / SIGTERM once it
  confirmed round 2's global (it is training);
* ``refused-at-decode``: client-000 runs with a ``sitecustomize`` that replaces the body of its
  first update with one byte that is no msgpack (``0xc1``), header intact.

Figures (as in ``tools/bench_crash.py``): *ledger rows missing / extra* against the counting
relay (a subscriber started before the fleet); *updates lost*: devices whose update got an
accepted receipt minus the round's ``clients_reported``; *dup. aggregated*: ``clients_reported``
beyond the distinct devices whose update the relay saw; *finished*; plus what round 2 says
(``clients_reported``, ``dropped``, ``resent_to``, its seconds against the 60 s deadline) and,
for the refused update, the receipts the device got and the copies it sent.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_crash import CLIENTS, CONFIG, ROUNDS, Relay, _metrics, _sent_rows, _wait  # noqa: E402

from broker_server import config as config_mod  # noqa: E402
from broker_server.embedded_broker import EmbeddedBroker, mosquitto_available  # noqa: E402
from broker_server.server_main import agent_command  # noqa: E402
from protocol.messages import Kind, Receipt, decode, read_header  # noqa: E402

GRACE_S = 5.0
DEADLINE_S = 60.0
BLACKOUT_S = 3.0

GARBLE = '''
import msgpack
import protocol.transport as _t

_real = _t.MqttTransport.publish
_done = []


def publish(self, topic, payload, **kw):
    if topic.endswith("/update") and not _done:
        _done.append(1)
        payload = msgpack.packb([*msgpack.unpackb(payload, raw=False)[:6], b"\\xc1"], use_bin_type=True)
    return _real(self, topic, payload, **kw)


_t.MqttTransport.publish = publish
'''


class HeaderRelay(Relay):
    """The counting relay of ``tools/bench_crash.py``, which also counts a payload whose body does
    not decode, by its header (``body`` = ``None``)."""

    def _on_message(self, client, userdata, msg) -> None:
        if not msg.payload:
            return
        item: tuple[str, str, int, int, object]
        try:
            env = decode(bytes(msg.payload)).envelope
            item = (env.sender, env.kind.label, env.round, env.seq, env.body)
        except Exception:  # noqa: BLE001 - a refused payload: its header, if any
            header = read_header(bytes(msg.payload))
            if header is None:
                return
            item = (header[2], header[0].label, header[1], header[3], None)
        with self._lock:
            self.seen.append(item)
            self.topics.append(msg.topic)


class GateRelay:
    """TCP relay 127.0.0.1:port → broker; :meth:`blackout` closes its connections and refuses
    new ones for a while (a link that is down). ``cut_on``/``cut_at``: black out for ``blackout_s``
    when the ``cut_at``-th broker→device read holding ``cut_on`` arrives (that read is not
    forwarded: the message it starts is lost with the link)."""

    def __init__(self, target_port: int, *, cut_on: bytes = b"", cut_at: int = 0, blackout_s: float = 0.0) -> None:
        self.cut_on, self.cut_at, self.blackout_s = cut_on, cut_at, blackout_s
        self.hits = 0
        self.target = ("127.0.0.1", target_port)
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(0.2)
        self.port = self.srv.getsockname()[1]
        self.open_at = 0.0
        self.cuts = 0
        self.refused = 0
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.srv.accept()
            except (TimeoutError, OSError):
                continue
            if time.monotonic() < self.open_at:
                self.refused += 1
                c.close()
                continue
            try:
                b = socket.create_connection(self.target, timeout=2)
                b.settimeout(None)
                c.settimeout(None)
            except OSError:
                c.close()
                continue
            with self._lock:
                self._socks += [c, b]
            for src, dst, down in ((c, b, False), (b, c, True)):
                threading.Thread(target=self._pump, args=(src, dst, down), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        try:
            while data := src.recv(65536):
                if down and self.cut_on and self.cut_on in data:
                    self.hits += 1
                    if self.hits == self.cut_at:
                        self.blackout(self.blackout_s)
                        return
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def blackout(self, seconds: float) -> None:
        self.open_at = time.monotonic() + seconds
        with self._lock:
            socks, self._socks = self._socks, []
        self.cuts += 1
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self.srv.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            s.close()


def run_fleet(work: Path, broker: EmbeddedBroker, name: str) -> dict:
    """One fleet run of scenario ``name`` (see the module docstring)."""
    federation = name
    run = work / federation
    cfg_path = work / f"{name}.toml"
    cfg_path.write_text(CONFIG.replace("round_deadline_s = 20.0", f"round_deadline_s = {DEADLINE_S}\n"
                                       f"offline_grace_s = {GRACE_S}"), encoding="utf-8")
    cfg = config_mod.load(cfg_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    assert broker.port is not None  # a started broker
    relay = HeaderRelay(broker.host, broker.port, federation)
    # round 2's global is the second read holding its topic that reaches client-002
    gate = GateRelay(broker.port, cut_on=f"{federation}/down/global".encode(), cut_at=2,
                     blackout_s=BLACKOUT_S) if name == "back-mid-round" else None
    t0 = time.monotonic()
    logs, procs = {}, {}

    def start(node: str, argv: list[str], node_env: dict) -> None:
        logs[node] = open(work / f"{name}-{node}.log", "w+", encoding="utf-8")  # noqa: SIM115
        procs[node] = subprocess.Popen(argv, cwd=REPO, env=node_env, stdout=logs[node], stderr=subprocess.STDOUT)

    start("server", [sys.executable, "-m", "broker_server.cli", "server", "--config", str(cfg_path),
                     "--broker", broker.url, "--out", str(run)], env)
    words = shlex.split(agent_command(cfg, broker.url, federation))[1:]
    for i in range(CLIENTS):
        cid = f"client-{i:03d}"
        argv = [w.replace("DEVICE_ID", cid).replace(f"i/{CLIENTS}", f"{i}/{CLIENTS}") for w in words]
        node_env = dict(env)
        if gate is not None and cid == "client-002":
            argv = [w.replace(broker.url, f"mqtt://127.0.0.1:{gate.port}") for w in argv]
        if name == "refused-at-decode" and cid == "client-000":
            shim = work / f"shim-{name}"
            shim.mkdir(parents=True, exist_ok=True)
            (shim / "sitecustomize.py").write_text(GARBLE, encoding="utf-8")
            node_env["PYTHONPATH"] = os.pathsep.join([str(shim), env["PYTHONPATH"]])
        start(cid, [sys.executable, "-m", "edge_agent.cli", *argv, "--out", str(work / f"{name}-{cid}")], node_env)
    stopped_rc = None
    target = "client-002" if name in ("will-mid-round", "offline-mid-round") else None
    try:
        if target is not None:
            ok = _wait(lambda: any(s == target and k == "receipt" and r == 2 for s, k, r, _, _ in relay.snapshot()),
                       600)
            if not ok:
                raise RuntimeError(f"{name}: {target} never confirmed round 2's global")
            procs[target].send_signal(signal.SIGKILL if name == "will-mid-round" else signal.SIGTERM)
            stopped_rc = procs[target].wait(timeout=300)
        server_rc = procs["server"].wait(timeout=900)
        agent_rcs = {n: p.wait(timeout=300) for n, p in procs.items() if n != "server"}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs.values():
            f.close()
        if gate is not None:
            gate.close()
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
    accepted: dict[int, set[str]] = {}
    updates: dict[int, set[str]] = {}
    refusals_to_000 = 0
    for (s, k, r, _q, body), topic in zip(seen, topics, strict=True):
        if k == "receipt" and isinstance(body, Receipt) and body.ref_kind == Kind.UPDATE:
            if body.accepted:
                accepted.setdefault(r, set()).add(topic)
            elif topic.endswith("/client-000/receipt") and r == 1:
                refusals_to_000 += 1
        if k == "update":
            updates.setdefault(r, set()).add(s)
    lost = sum(len(accepted.get(r, ())) - m["clients_reported"] for r, m in closed.items() if not m["skipped"])
    dup = sum(max(0, m["clients_reported"] - len(updates.get(r, ()))) for r, m in closed.items())
    summary_path = run / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    r2 = closed.get(2, {})
    return {
        "name": name, "stopped_rc": stopped_rc, "server_rc": server_rc, "agent_rcs": agent_rcs, "target": target,
        "rounds": f"{summary.get('rounds_completed', len(metrics))}/{ROUNDS}",
        "finished": server_rc == 0 and summary.get("rounds_completed") == ROUNDS,
        "lost": lost, "dup": dup, "missing": missing, "extra": extra, "relay_messages": len(seen),
        "round2": {k: r2.get(k) for k in ("clients_reported", "dropped", "resent_to", "unreported", "seconds",
                                          "skipped")},
        "round1": {k: closed.get(1, {}).get(k) for k in ("clients_reported", "invalid", "rejected_by_reason",
                                                          "seconds")},
        "refusals": summary.get("refusals"),
        "client000_round1_updates_sent": sum(1 for s, k, r, _, _ in seen if s == "client-000" and k == "update"
                                             and r == 1),
        "client000_round1_refusals": refusals_to_000,
        "gate": None if gate is None else {"cuts": gate.cuts, "refused_connects": gate.refused},
        "seconds": round(time.monotonic() - t0, 1),
    }


TITLES = {"back-mid-round": "device back mid-round (client-002's link breaks as round 2's global reaches it, down 3 s)",
          "will-mid-round": "last will mid-round (SIGKILL of client-002 in round 2)",
          "offline-mid-round": "offline status mid-round (SIGTERM of client-002 in round 2)",
          "refused-at-decode": "update refused at decode (client-000's round-1 body is 0xc1)"}


def _row(r: dict) -> str:
    r2, r1 = r["round2"], r["round1"]
    sec = f"{r2['seconds']:.1f}" if isinstance(r2.get("seconds"), (int, float)) else "?"
    if r["name"] == "refused-at-decode":
        sec1 = f"{r1['seconds']:.1f}" if isinstance(r1.get("seconds"), (int, float)) else "?"
        note = (f"round 1: {r1['clients_reported']} reported, invalid {r1['invalid']} "
                f"{json.dumps(r1['rejected_by_reason'])}, closed after {sec1} s (deadline {DEADLINE_S:g} s); "
                f"client-000 got {r['client000_round1_refusals']} refusal receipt(s) and sent "
                f"{r['client000_round1_updates_sent']} round-1 update(s)")
    else:
        note = (f"round 2: {r2['clients_reported']} reported, dropped {r2['dropped']}, re-sent to "
                f"{r2['resent_to']}, closed after {sec} s (deadline {DEADLINE_S:g} s, grace {GRACE_S:g} s)")
        if r["gate"]:
            note += f"; link cut {r['gate']['cuts']}x, {r['gate']['refused_connects']} reconnects refused while down"
        if r["stopped_rc"] is not None:
            note += f"; exit status {r['stopped_rc']}"
    failed = sum(1 for n, rc in r["agent_rcs"].items() if rc != 0 and n != r["target"])
    return (f"| {TITLES[r['name']]} | {r['rounds']} | {'yes' if r['finished'] else 'no'} | {r['lost']} | "
            f"{r['dup']} | {r['missing']} / {r['extra']} of {r['relay_messages']} | {failed} | {note} | "
            f"{r['seconds']:.0f} |")


HEADER = ("| scenario | rounds | finished | updates lost | dup. aggregated | ledger rows missing / extra "
          "vs relay | other agents failed | notes | wall s |\n|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the Markdown rows here (default: stdout)")
    ap.add_argument("--work", help="folder for the run folders and logs (default: a temporary one)")
    ap.add_argument("--only", nargs="*", choices=list(TITLES), help="scenario names to run (default: all)")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="fedfleet-return-"))
    work.mkdir(parents=True, exist_ok=True)
    kind = "mosquitto" if mosquitto_available() else "amqtt"
    rows, results = [], []
    with EmbeddedBroker(kind=kind, workdir=work / "broker") as broker:
        for name in TITLES:
            if args.only and name not in args.only:
                continue
            res = run_fleet(work, broker, name)
            results.append(res)
            rows.append(_row(res))
            print(rows[-1], flush=True)
    text = (f"Broker: embedded {kind}. {CLIENTS} devices (`fedfleet-agent`), `fedfleet server`, scikit-learn "
            f"digits, {ROUNDS} rounds, quorum 2, round deadline {DEADLINE_S:g} s, offline_grace_s {GRACE_S:g} s.\n\n"
            + HEADER + "\n" + "\n".join(rows) + "\n")
    (work / "results.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
