"""Size-limit scenarios: a federation over a broker with a packet or message size
limit, or whose devices have a small limit of their own, behind a relay that parses the MQTT
stream, so a test (and ``tools/bench_size_limits.py``) can check what the run, the ledger and
the wire agree on.

:class:`tools.counting_relay.CountingRelay` forwards 127.0.0.1:port to the broker and counts, per connection
and direction, bytes and whole MQTT packets by type (PUBLISH counted with and without the DUP
flag); a packet cut by a closed connection counts as ``partial``.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from broker_server.embedded_broker import EmbeddedBroker
from broker_server.simulate import simulate
from edge_agent.agent import EdgeAgent
from helpers.federation import read_metrics, small_config
from tools.counting_relay import CountingRelay


@dataclass
class Outcome:
    """What one size-limit run gave.

    Attributes:
        rounds: rounds completed; ``reported``: updates accepted per round; ``receipts``: global
        receipts per round; ``reached_none``: rounds whose global reached no device; ``agent_errors``:
        agents that failed; ``deliveries``: (side, delivery) -> sent PUBLISH rows; ``ledger_publish``:
        node -> PUBLISH rows it sent (first transmissions + PUBLISH-DUP rows); ``wire_publish``: the
        relay's count of PUBLISH packets from that node (a cut one included); ``dup_publish``:
        node -> PUBLISH-DUP rows (paho's retransmissions); ``connects``: node -> CONNECT rows;
        ``max_down``: node -> largest PUBLISH the broker delivered to it (bytes);
        ``refusal_reasons``: distinct reasons of refused rows; ``seconds``: wall time;
        ``round_seconds``: each round's ``seconds`` (metrics.jsonl); ``global_resends``: each
        round's globals sent again because no device confirmed them.
    """

    rounds: int = 0
    reported: list[int] = field(default_factory=list)
    receipts: list[int] = field(default_factory=list)
    reached_none: list[int] = field(default_factory=list)
    agent_errors: int = 0
    deliveries: dict[tuple[str, str], int] = field(default_factory=dict)
    ledger_publish: dict[str, int] = field(default_factory=dict)
    wire_publish: dict[str, int] = field(default_factory=dict)
    dup_publish: dict[str, int] = field(default_factory=dict)
    connects: dict[str, int] = field(default_factory=dict)
    max_down: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    refusal_reasons: list[str] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0
    round_seconds: list[float] = field(default_factory=list)
    global_resends: list[int] = field(default_factory=list)


def tiny_profile(folder: Path, max_packet_bytes: int = 20_000, chunk_bytes: int = 16_384) -> str:
    """Write firmware profile ``tiny-mqtt`` (the x86-cpu one with an MQTT limit of
    ``max_packet_bytes``) into ``folder``; return its name. Put ``folder`` first in FEDFLEET_PROFILES."""
    from edge_agent.profiles import SHIPPED_DIR

    text = (Path(SHIPPED_DIR) / "x86-cpu.toml").read_text()
    lines = []
    for line in text.splitlines():
        if line.startswith("name = "):
            line = 'name = "tiny-mqtt"'
        elif line.startswith("max_packet_bytes = "):
            line = f"max_packet_bytes = {max_packet_bytes}"
        elif line.startswith("chunk_bytes = "):
            line = f"chunk_bytes = {chunk_bytes}"
        lines.append(line)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny-mqtt.toml").write_text("\n".join(lines) + "\n")
    return "tiny-mqtt"


def run_size_limit(work: Path, *, kind: str = "mosquitto", broker_lines: tuple[str, ...] = (),
                   mqtt_version: str = "auto", declared: int = 0, profile: str = "x86-cpu",
                   rounds: int = 2, deadline_s: float = 40.0, server: dict | None = None,
                   protocol: dict | None = None, agent_hook: Callable[[int, EdgeAgent], None] | None = None) -> Outcome:
    """One digits federation (3 agents, quorum 2) through a :class:`tools.counting_relay.CountingRelay` to a broker of
    ``kind`` with ``broker_lines`` in its config; ``declared`` is ``[protocol] max_packet_bytes``;
    ``server`` / ``protocol`` are more ``[server]`` / ``[protocol]`` keys; ``agent_hook`` is
    :func:`~broker_server.simulate.simulate`'s."""
    out = Outcome()
    t0 = time.monotonic()
    with EmbeddedBroker(kind=kind, workdir=work / "broker", extra_config=broker_lines) as broker:
        relay = CountingRelay(broker.port)
        try:
            cfg = small_config(run={"rounds": rounds}, broker={"mqtt_version": mqtt_version, "keepalive_s": 5},
                               server={"round_deadline_s": deadline_s, **(server or {})},
                               protocol={"max_packet_bytes": declared, **(protocol or {})},
                               agents={"profile": profile})
            try:
                res = simulate(cfg, broker_url=f"mqtt://127.0.0.1:{relay.port}", run_dir=work / "run",
                               agent_hook=agent_hook)
                out.rounds = res.rounds_completed
            except Exception as exc:  # the row says the run did not finish, and why
                out.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            relay.close()  # joins its pump threads: every byte it carried is counted
        wire = relay.per_node()
    out.seconds = time.monotonic() - t0
    run = work / "run"
    if (run / "metrics.jsonl").exists():
        ms = read_metrics(run)
        out.reported = [m["clients_reported"] for m in ms]
        out.duplicates = sum(m.get("duplicates", 0) for m in ms)
        out.receipts = [m["global_receipts"] for m in ms]
        out.reached_none = [m["round"] for m in ms if m.get("global_reached_no_device")]
        out.round_seconds = [m["seconds"] for m in ms]
        out.global_resends = [m.get("global_resends", 0) for m in ms]
    summary = run / "summary.json"
    if summary.exists():
        import json

        out.agent_errors = len(json.loads(summary.read_text()).get("agent_errors") or [])
    db = sqlite3.connect(run / "ledger.sqlite")
    out.deliveries = {(s, d): n for s, d, n in db.execute(
        "SELECT side, delivery, COUNT(*) FROM messages WHERE event='sent' AND reason != 'control' GROUP BY 1, 2")}
    for node, n in db.execute("SELECT node, COUNT(*) FROM messages WHERE event='sent' AND (reason != 'control' "
                              "OR kind = 'PUBLISH-DUP') GROUP BY node"):
        out.ledger_publish[node] = n
    for node, n in db.execute("SELECT node, COUNT(*) FROM messages WHERE kind='PUBLISH-DUP' AND event='sent' "
                              "GROUP BY node"):
        out.dup_publish[node] = n
    for node, n in db.execute("SELECT node, COUNT(*) FROM messages WHERE kind='CONNECT' GROUP BY node"):
        out.connects[node] = n
    out.refusal_reasons = [r for (r,) in db.execute(
        "SELECT DISTINCT reason FROM messages WHERE delivery='refused' OR kind='undeliverable'")]
    db.close()
    for node, ways in wire.items():
        out.wire_publish[node] = ways["up"]["PUBLISH"] + ways["up"]["PUBLISH-DUP"] + ways["up"]["partial"]
        out.max_down[node] = ways["down"]["max_down"]
    return out
