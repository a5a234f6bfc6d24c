"""Down bytes per device per round beyond the global's tensor values, with 10, 100 and 1,000
selected devices: ``round_start`` naming every selected id (``selected``, before) against naming
them by member index (``members``, after). No training, no broker: the round's messages are built
by the server's own code (:meth:`broker_server.server.AggregationServer._round_starts` over a
registry of joined devices that read member sets), encoded by :func:`protocol.messages.encode`,
and priced as the ledger prices them: payload + topic + MQTT PUBLISH framing at QoS 1
(:func:`protocol.mqtt_bytes.publish_size`, MQTT 3.1.1).

What one device downloads in a round besides the tensor values:

* the ``global`` broadcast's packet minus its raw tensor values (envelope, ``meta``, tensor headers,
  topic, MQTT header; the main job's light CNN for 1×28×28 MNIST, fp32);
* the ``round_start`` broadcast's packet (every device of the federation downloads it);
* a selected device also the receipt of its update (``down/{client}/receipt``).

Two fleets per size: every joined device selected (participation 1.0, the main job), and one in
ten selected (participation 0.1: ``10·m`` joined, every tenth chosen, the worst spread for the
bitmap). Client ids are ``client-000``, ``client-001`` …, as ``simulate`` names them; the round
config is the main job's (``examples/mnist-fedavg.toml``).

Usage: ``python tools/bench_round_start.py --out benchmarks/round_start.md``
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from broker_server.server import AggregationServer, ServerSettings  # noqa: E402
from broker_server.strategies.fedavg import FedAvg  # noqa: E402
from edge_agent.data import ArraySplit  # noqa: E402
from edge_agent.models import build_model  # noqa: E402
from edge_agent.state import state_arrays  # noqa: E402
from protocol import topics  # noqa: E402
from protocol.channel import Channel  # noqa: E402
from protocol.membership import JOIN_INFO_KEY  # noqa: E402
from protocol.memory_transport import MemoryBroker  # noqa: E402
from protocol.messages import Envelope, Global, Join, Kind, Receipt, RoundStart, encode, now_ms  # noqa: E402
from protocol.mqtt_bytes import publish_size  # noqa: E402

FED = "mnist-fedavg"
CONFIG = {"lr": 0.05, "local_epochs": 1, "batch_size": 32, "momentum": 0.5, "update_codec": "fp32"}
DEADLINE_S = 300.0
SIZES = (10, 100, 1000)


def packet(topic: str, body, *, round: int = 5, seq: int = 1000) -> tuple[int, int]:
    """(ledger-priced bytes of the PUBLISH: topic + MQTT header + payload, raw tensor bytes)."""
    enc = encode(Envelope(round=round, sender="server", seq=seq, body=body, timestamp_ms=now_ms()))
    return publish_size(topic, len(enc.payload), 1).packet_bytes, enc.raw_tensor_bytes


def server_with(joined: list[str], tmp: Path) -> AggregationServer:
    """An AggregationServer on a memory broker whose registry holds ``joined`` (in that order),
    every one announcing that it reads member sets."""
    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    srv = AggregationServer(
        channel=Channel(MemoryBroker().connect("server", keep_sent=False), node_id="server", side="server",
                        federation=FED, ledger=None),
        strategy=FedAvg(), model=model,
        test=ArraySplit(np.zeros((1, 1, 28, 28), np.float32), np.zeros(1, np.int64), 10),
        settings=ServerSettings(rounds=1, round_deadline_s=DEADLINE_S), run_dir=tmp)
    join = Join(profile="rpi4", manifest_hash=srv.manifest_hash, num_samples=6000, class_histogram=(600,) * 10,
                info={JOIN_INFO_KEY: True})
    for cid in joined:
        srv.devices.admit(cid, join, round=0, now=0.0)
    return srv


def measure(m: int, spread: int, tmp: Path) -> dict:
    """Per-device down bytes of one round with ``m`` selected among ``m·spread`` joined devices."""
    joined = [f"client-{i:03d}" for i in range(m * spread)]
    selected = tuple(joined[::spread])
    srv = server_with(joined, tmp)
    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    glob = Global(tensors=tuple(state_arrays(model)), meta={"manifest_hash": srv.manifest_hash, "share": "all"})
    g_packet, g_raw = packet(topics.down(FED, Kind.GLOBAL), glob)
    g_over = g_packet - g_raw
    receipt, _ = packet(topics.down_to(FED, selected[-1], Kind.RECEIPT),
                        Receipt(int(Kind.UPDATE), 40, True, "", bytes(32)))
    before, _ = packet(topics.down(FED, Kind.ROUND_START), RoundStart(selected, DEADLINE_S, CONFIG))
    starts = srv._round_starts(selected, dict(CONFIG), {})
    assert len(starts) == 1 and starts[0][0] is None, "one broadcast"
    after_msg = starts[0][1]
    assert after_msg.selected == () and after_msg.members, "every selected device named by index"
    after, _ = packet(topics.down(FED, Kind.ROUND_START), after_msg)
    return {"m": m, "joined": len(joined), "global_overhead": g_over, "receipt": receipt,
            "round_start_before": before, "round_start_after": after, "members_bytes": len(after_msg.members),
            "form": "bitmap" if after_msg.members[0] == 0 else "deltas",
            "selected_before": g_over + before + receipt, "selected_after": g_over + after + receipt,
            "unselected_before": g_over + before, "unselected_after": g_over + after}


def report(rows: list[dict]) -> str:
    lines = [
        "# round_start: down bytes per device per round",
        "",
        "Produced by `python tools/bench_round_start.py --out benchmarks/round_start.md` (byte counts, not "
        "times: the same on any machine). Bytes as the ledger prices a PUBLISH: payload + topic + MQTT header "
        "(QoS 1, MQTT 3.1.1), messages encoded by `protocol.messages.encode`, the broadcast `round_start` built "
        "by the server's own `_round_starts` over a registry of devices that read member sets. Unsigned "
        "messages (signing adds the same 66–75 bytes of `sec` to either form).",
        "",
        "Per device and round, beyond the global's tensor values: the `global` packet minus its raw tensor "
        "bytes (light CNN for MNIST, fp32), the `round_start` broadcast, and for a selected device the receipt "
        "of its update. *before*: `round_start.selected` lists every selected id; *after*: `members` names "
        "them by member index (the shorter of a bitmap and delta varints).",
        "",
        "| selected | joined | form | members B | round_start before B | round_start after B "
        "| selected device before B | selected device after B | unselected device after B |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['m']:,} | {r['joined']:,} | {r['form']} | {r['members_bytes']:,} "
                     f"| {r['round_start_before']:,} | {r['round_start_after']:,} | {r['selected_before']:,} "
                     f"| {r['selected_after']:,} | {r['unselected_after']:,} |")
    g, rc = rows[0]["global_overhead"], rows[0]["receipt"]
    lines += ["", f"The `global`'s share: {g} B (envelope, `meta`, 8 tensor headers, topic, MQTT header); the "
                  f"update receipt: {rc} B. Goal: ≤ 1,000 B per device with 1,000 selected."]
    lines += ["", "## The designs compared at 1,000 selected", "",
              "Bytes of the membership part alone (what grows with the fleet). A filter's false positives are "
              "harmless to the model (the server refuses an update from a device it did not select) but each one "
              "is a device training a round for nothing: expected wasted trainings per round = FP rate × "
              "(joined − selected). The entropy bound is log₂ C(joined, selected) bits: no exact broadcast "
              "encoding is shorter.", "",
              "| design | exact | 1,000 of 1,000 B | 1,000 of 10,000 B | wasted trainings per round at 10,000 |",
              "| --- | --- | ---: | ---: | ---: |"]
    for name, exact, dense, sparse, waste in designs(1000):
        lines.append(f"| {name} | {exact} | {dense} | {sparse} | {waste} |")
    fixed = rows[2]["selected_after"] - rows[2]["members_bytes"] - 2
    own, _ = packet(topics.down_to(FED, "client-9999", Kind.ROUND_START), RoundStart(("client-9999",), DEADLINE_S,
                                                                                      CONFIG))
    lines += ["", f"A selected device's fixed share besides the set is {fixed} B at 1,000 of 1,000 (the global's "
                  f"overhead, the round_start's envelope, deadline and config, the receipt), so 1,000 of 10,000 "
                  f"exceeds 1,000 B with any exact broadcast (the entropy bound alone is "
                  f"{math.ceil(entropy_bits(10_000, 1000) / 8):,} B, a 1 % Bloom filter "
                  f"{math.ceil(-1000 * math.log(0.01) / math.log(2) ** 2 / 8):,} B); there only per-device "
                  f"addressing stays below it: a `round_start` on `down/{{client}}/round_start` naming its one "
                  f"device is {own} B, so {g + own + rc:,} B for a selected device and {g:,} B for the others, at "
                  f"the price of one PUBLISH per selected device from the server instead of one."]
    return "\n".join(lines) + "\n"


def entropy_bits(n: int, m: int) -> float:
    """log₂ C(n, m): the fewest bits that tell every m-subset of n apart."""
    return (math.lgamma(n + 1) - math.lgamma(m + 1) - math.lgamma(n - m + 1)) / math.log(2)


def designs(m: int) -> list[tuple[str, str, str, str, str]]:
    """(design, exact?, bytes at m of m, bytes at m of 10·m, wasted trainings at 10·m) for the report."""
    from protocol.membership import bitmap_form, deltas_form, encode_members

    dense, sparse = list(range(m)), list(range(0, 10 * m, 10))
    ids = sum(len(f"client-{i:03d}") + 1 for i in sparse)
    bloom_bits = -m * math.log(0.01) / math.log(2) ** 2  # optimal Bloom filter at 1 % false positives
    xor8 = 1.23 * m  # xor filter, 8-bit fingerprints: 1.23 bytes per key, FP 1/256
    out = [
        ("ids in `selected` (before)", "yes", f"{sum(len(f'client-{i:03d}') + 1 for i in dense):,}", f"{ids:,}", "0"),
        ("bitmap over member indices", "yes", f"{len(bitmap_form(dense)):,}", f"{len(bitmap_form(sparse)):,}", "0"),
        ("delta varints of member indices", "yes", f"{len(deltas_form(dense)):,}", f"{len(deltas_form(sparse)):,}",
         "0"),
        ("**members** (the shorter of the two; chosen)", "yes", f"{len(encode_members(dense)):,}",
         f"{len(encode_members(sparse)):,}", "0"),
        ("entropy bound of any exact set", "yes", "0", f"{math.ceil(entropy_bits(10 * m, m) / 8):,}", "0"),
        ("Bloom filter, 1 % false positives", "no", f"{math.ceil(bloom_bits / 8):,}", f"{math.ceil(bloom_bits / 8):,}",
         f"{0.01 * 9 * m:g}"),
        ("xor filter, 8-bit fingerprints (FP 1/256)", "no", f"{math.ceil(xor8):,}", f"{math.ceil(xor8):,}",
         f"{9 * m / 256:.1f}"),
        ("selection rule (seed + hash threshold)", "yes", "≈ 10", "≈ 10", "0, but only for the server's own "
         "uniform sampling: Oort and other strategies choose their own devices"),
    ]
    return out


#: the heading of the section of the same file that ``tools/bench_global_delivery.py`` writes
DELIVERY_SECTION = "## Who downloads the global"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/round_start.md", help="the Markdown report (default %(default)s)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spread in (1, 10):
            for m in SIZES:
                rows.append(measure(m, spread, Path(tmp)))
    text = report(rows)
    out = Path(args.out)
    # the section tools/bench_global_delivery.py measures (simulations) stays as it was
    old = out.read_text(encoding="utf-8") if out.exists() else ""
    kept = old.find(DELIVERY_SECTION)
    out.write_text(text + ("\n" + old[kept:] if kept >= 0 else ""), encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
