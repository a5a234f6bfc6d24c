"""Size limits of the broker and of the devices: one federation per class, each through
a relay that parses the MQTT stream. Writes the rows of ``benchmarks/reliability.md`` §
"Size limits" (Markdown, to stdout or ``--out``).

Usage (from the repository root; needs /usr/sbin/mosquitto for all rows but the amqtt one)::

    python tools/bench_size_limits.py --out /tmp/size-limits.md     # ~2–4 min on 2 cores
    python tools/bench_size_limits.py --only message_size_limit      # the rows whose class names it

Each row is ``tests/helpers/size_limits.run_size_limit`` (the driver of
``tests/integration/test_size_limits.py``): the digits federation (3 agents, quorum 2, 2 rounds,
~55 KB globals and updates) with a 20,000-byte limit. Figures:

* *updates not counted*: 3 × rounds − updates the server counted (``clients_reported``): lost, or
  past the round's deadline;
* *duplicated*: updates the server saw again and did not count (``duplicates``);
* *ledger rows missing / not on the wire*: PUBLISH packets the relay saw from a node and the node's
  ledger lacks (sent rows + PUBLISH-DUP rows), summed over nodes (target 0) / ledger PUBLISH rows the
  relay never saw (handed to paho on a link the broker then cut, and withdrawn as oversize before
  paho re-sent them: their rows say ``refused`` or ``handed``);
* *refused / handed*: ``sent`` ledger rows the broker refused / never acknowledged;
* *DUP re-sends*: paho's retransmissions after reconnects (PUBLISH-DUP rows);
* *CONNECTs*: most CONNECT packets of one node (1 = never reconnected);
* *round s*: each round's seconds (its deadline is 40 s); *global re-sends*: globals sent again
  because no device confirmed them in time (``[server] global_confirm_s``, 10 s).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from helpers.size_limits import run_size_limit, tiny_profile  # noqa: E402

LIMIT = 20_000
ROUNDS = 2
SCENARIOS = [  # (label, broker kind, broker config lines, mqtt_version, declared, device limit)
    ("broker `max_packet_size`", "mosquitto", (f"max_packet_size {LIMIT}",), "5", 0, False),
    ("broker `max_packet_size`, undeclared", "mosquitto", (f"max_packet_size {LIMIT}",), "3.1.1", 0, False),
    ("broker `max_packet_size`, declared in `[protocol]`", "mosquitto", (f"max_packet_size {LIMIT}",), "3.1.1",
     LIMIT, False),
    ("broker `message_size_limit`", "mosquitto", (f"message_size_limit {LIMIT}",), "5", 0, False),
    ("broker `message_size_limit`, undeclared", "mosquitto", (f"message_size_limit {LIMIT}",), "3.1.1", 0, False),
    ("broker `message_size_limit`, undeclared, `max_queued_messages 1000`", "mosquitto",
     (f"message_size_limit {LIMIT}", "max_queued_messages 1000"), "3.1.1", 0, False),
    ("device limit (profile, join, CONNECT)", "mosquitto", (), "5", 0, True),
    ("device limit (profile, join)", "amqtt", (), "auto", 0, True),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the Markdown here (default: stdout)")
    ap.add_argument("--only", default="", help="run only the rows whose class contains this text")
    args = ap.parse_args(argv)
    import logging
    import os

    logging.basicConfig(level=logging.ERROR)
    commit = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h"], capture_output=True,
                            text=True).stdout.strip()
    rows = []
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fedfleet-size-") as tmp:
        prof_dir = Path(tmp) / "profiles"
        tiny_profile(prof_dir, max_packet_bytes=LIMIT)
        from edge_agent.profiles import SHIPPED_DIR

        for i, (label, kind, lines, version, declared, device) in enumerate(SCENARIOS):
            if args.only not in label:
                continue
            os.environ["FEDFLEET_PROFILES"] = f"{prof_dir}:{SHIPPED_DIR}"
            out = run_size_limit(Path(tmp) / f"s{i}", kind=kind, broker_lines=lines, mqtt_version=version,
                                 declared=declared, profile="tiny-mqtt" if device else "x86-cpu", rounds=ROUNDS)
            missing = sum(max(0, n - out.ledger_publish.get(node, 0)) for node, n in out.wire_publish.items())
            extra = sum(max(0, out.ledger_publish.get(node, 0) - n) for node, n in out.wire_publish.items())
            refused = sum(n for (_, d), n in out.deliveries.items() if d == "refused")
            handed = sum(n for (_, d), n in out.deliveries.items() if d == "handed")
            finished = out.error == "" and out.rounds == ROUNDS and out.agent_errors == 0
            mqtt = {"5": "5", "3.1.1": "3.1.1", "auto": "3.1.1 (fallback)"}[version]
            rows.append(f"| {label} | {kind} | {mqtt} | {ROUNDS * 3 - sum(out.reported)} | {out.duplicates} | "
                        f"{missing} / {extra} | {refused} | {handed} | {sum(out.dup_publish.values())} | "
                        f"{max(out.connects.values(), default=0)} | {'yes' if finished else 'no: ' + out.error} | "
                        f"{out.reported} | {', '.join(f'{x:.1f}' for x in out.round_seconds)} | "
                        f"{out.global_resends} | {out.seconds:.0f} |")
            print(rows[-1], file=sys.stderr, flush=True)
    text = [
        "## Size limits of the broker and of the devices",
        "",
        f"Generated by `python tools/bench_size_limits.py{' --only ' + repr(args.only) if args.only else ''}` at "
        f"{commit} in {(time.monotonic() - t_all) / 60:.1f} min; "
        f"each row one run of the digits federation (3 agents, quorum 2, {ROUNDS} rounds, ~55 KB globals and "
        f"updates) against a {LIMIT:,}-byte limit, every connection through a relay that parses the MQTT stream "
        "(driver: `tests/helpers/size_limits.py`, the one of `tests/integration/test_size_limits.py`).",
        "",
        "| class | broker | MQTT | updates not counted | duplicated | ledger rows missing / not on the wire vs relay | "
        "refused rows | handed, never acked | DUP re-sends | max CONNECTs of a node | run finished | "
        "updates per round | round s | global re-sends | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    md = "\n".join(text)
    if args.out:
        Path(args.out).write_text(md, encoding="utf-8")
    else:
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
