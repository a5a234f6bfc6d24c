"""Protocol benchmark of fedfleet: codec speed, per-message overhead, update codecs on a real
FedAvg run, and bytes on the wire against Flower. Writes a Markdown report.

Usage (from the repository root, in the project venv)::

    python tools/bench_protocol.py --out benchmarks/protocol.md          # the full run (~15 min, 2 cores)
    python tools/bench_protocol.py --quick --out /tmp/protocol-quick.md   # smoke run (~3 min)

Parts (every figure is measured in this run; comparisons are ratios of figures measured side by
side, never against numbers from elsewhere):

1. **Encode/decode throughput** of one float32 tensor of 10,000 values (40 KB) and of 11.2 M
   values (44.8 MB) as an ``update`` message through :func:`protocol.messages.encode` /
   :func:`protocol.messages.decode`, against a plain numpy copy of the same bytes (``np.copyto``
   into a preallocated array, and ``arr.copy()`` which also allocates). Median of ``--reps``
   repetitions (``time.perf_counter``). MB = 10^6 bytes of tensor values.
2. **Overhead** of one soft-prediction ``update`` ([1000, 10] + [10, 64] float32 = 42,560 bytes of
   tensor values) from ``client-007`` at QoS 1: envelope bytes, body framing bytes and MQTT
   PUBLISH framing (:func:`protocol.mqtt_bytes.publish_size`), all counted from the encoded bytes.
3. **Update codecs on a real FedAvg run** (``examples/mnist-fedavg.toml``: MNIST, 10 clients,
   Dirichlet α = 0.5, 1 local epoch, same seed): one :func:`broker_server.simulate.simulate` run
   per codec, in process, with ``delta`` and ``error_feedback`` on. Every run goes through a
   byte-counting TCP relay in front of the embedded broker, so the ledger's device totals are
   checked against the bytes that crossed the sockets.
4. **Flower comparison**: the same FedAvg (same model, data, partition, seed, local training code,
   rounds) with Flower's legacy gRPC ``start_server`` / ``start_client`` in separate processes on
   127.0.0.1, the clients' connections routed through the same kind of relay. Flower runs from its
   own venv (``--flower-venv``, default ``/tmp/flwr-venv``: created with ``python3.11 -m venv``
   and ``pip install "flwr[simulation]==1.42.*"`` when missing, reused otherwise); torch and
   fedfleet are taken from this interpreter by path (:mod:`tools._flower`, shared with
   ``tools/bench_round.py``, which also runs Flower's simulation engine and deployment mode).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomllib

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make protocol/, edge_agent/, broker_server/ importable
    sys.path.insert(0, str(REPO))

from tools import _flower  # noqa: E402  (REPO on sys.path first)
from tools.counting_relay import CountingRelay  # noqa: E402

EXAMPLE_CONFIG = REPO / "examples" / "mnist-fedavg.toml"
DEFAULT_CODECS = ("fp32", "fp16", "int8", "topk:0.1", "int8+zstd")
DEFAULT_FLOWER_VENV = "/tmp/flwr-venv"
SOFT_TOPIC = "fedfleet/v1/fed-a/up/client-007/update"
SOFT_SENDER = "client-007"
SOFT_TENSOR_BYTES = 42_560  # [1000, 10] + [10, 64] float32
SMALL_FLOATS = 10_000       # 40 KB of float32
LARGE_FLOATS = 11_200_000   # 44.8 MB of float32


# --------------------------------------------------------------------------------------------
# Helpers


def _median_s(fn: Callable[[], Any], reps: int) -> float:
    """Median wall time of ``fn()`` over ``reps`` calls after one warm-up call (seconds)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _profile_top(fn: Callable[[], Any], calls: int, top: int = 6) -> list[tuple[str, float, float]]:
    """The functions ``fn`` spends its own time in (cProfile ``tottime``), largest first.

    Returns:
        Up to ``top`` tuples ``(function, seconds per call of fn, share of the profiled time)``.
        Profiling inflates Python-level calls relative to C calls; shares are indicative.
    """
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    stats = pstats.Stats(pr).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values()) or 1.0
    rows = []
    for (file, _line, name), (_cc, _nc, tt, _ct, _callers) in stats.items():
        if name == "<lambda>" or "disable" in name:
            continue
        where = name if file == "~" else f"{Path(file).parent.name}/{Path(file).name}:{name}"
        rows.append((where, tt / calls, tt / total))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def _versions() -> dict[str, str]:
    import msgpack
    import numpy as np
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
           "msgpack": ".".join(map(str, msgpack.version))}
    for mod in ("zstandard", "paho.mqtt"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            out[mod] = getattr(m, "__version__", "?")
        except ImportError:
            out[mod] = "not installed"
    mosq = shutil.which("mosquitto")
    if mosq:
        try:
            r = subprocess.run([mosq, "-h"], capture_output=True, text=True, timeout=10)
            line = next((x for x in (r.stdout + r.stderr).splitlines() if "version" in x), "")
            out["mosquitto"] = line.strip()
        except (OSError, subprocess.SubprocessError):
            out["mosquitto"] = mosq
    return out


def _code_label() -> str:
    """The commit of the code measured, and whether its packages differ from that commit."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "protocol", "edge_agent",
                                "broker_server", "examples"], capture_output=True, text=True, timeout=30,
                               check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return f"{REPO} (not a git checkout)"
    return f"commit {head}" + (f" with {len(dirty)} uncommitted changes under protocol/, edge_agent/, "
                               "broker_server/, examples/" if dirty else ", clean")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _fmt_int(n: int | float) -> str:
    return f"{int(round(n)):,}"


# --------------------------------------------------------------------------------------------
# Part 1: encode/decode throughput


def bench_throughput(reps: int) -> list[dict[str, Any]]:
    """Encode/decode of an ``update`` with one float32 tensor, against numpy copies.

    Returns:
        One dict per size: ``floats``, ``tensor_bytes``, ``payload_bytes``, seconds (median) of
        ``copyto_s`` (``np.copyto`` into a preallocated array), ``copy_s`` (``arr.copy()``),
        ``encode_s``, ``decode_s``; ``decoded_is_view`` (the decoded tensor shares memory with the
        payload); ``profile`` (``"encode"``/``"decode"`` → :func:`_profile_top`); for the large
        case ``bytes_copy_s`` (one copy into a new ``bytes`` object).
    """
    import numpy as np

    from protocol.messages import Envelope, Update, decode, encode, now_ms

    rng = np.random.default_rng(0)
    rows = []
    for n in (SMALL_FLOATS, LARGE_FLOATS):
        arr = rng.standard_normal(n, dtype=np.float32)
        dst = np.empty_like(arr)
        env = Envelope(round=1, sender=SOFT_SENDER, seq=1, timestamp_ms=now_ms(),
                       body=Update(tensors=(arr,), num_samples=6000, train_loss=0.5))
        payload = encode(env).payload
        back = decode(payload).envelope.body.tensors[0]
        if not np.array_equal(back, arr):
            raise RuntimeError("decode(encode(x)) != x")
        # more repetitions for the small case: a single call is a few microseconds
        r = reps if n == LARGE_FLOATS else max(reps, 200)
        # the lambdas run inside _median_s/_profile_top, within this iteration; the defaults bind
        # this iteration's arrays explicitly all the same
        row = {
            "floats": n, "tensor_bytes": arr.nbytes, "payload_bytes": len(payload),
            "copyto_s": _median_s(lambda dst=dst, arr=arr: np.copyto(dst, arr), r),
            "copy_s": _median_s(lambda arr=arr: arr.copy(), r),
            "encode_s": _median_s(lambda env=env: encode(env), r),
            "decode_s": _median_s(lambda payload=payload: decode(payload), r),
        }
        # Is the decoded tensor a view on the payload (zero-copy) or a copy?
        row["decoded_is_view"] = bool(np.shares_memory(back, np.frombuffer(payload, dtype=np.uint8)))
        # Where the time goes: the functions encode()/decode() spend their own time in.
        calls = reps if n == LARGE_FLOATS else 500
        row["profile"] = {"encode": _profile_top(lambda env=env: encode(env), calls),
                          "decode": _profile_top(lambda payload=payload: decode(payload), calls)}
        if n == LARGE_FLOATS:
            row["bytes_copy_s"] = _median_s(lambda arr=arr: bytes(memoryview(arr)), reps)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# Part 2: per-message overhead


def bench_overhead() -> dict[str, Any]:
    """Byte split of one soft-prediction ``update`` (two float32 tensors, 42,560 value bytes).

    Returns:
        ``payload_bytes``, ``envelope_bytes``, ``body_bytes``, ``framing_bytes`` (body − 42,560),
        ``field_bytes`` (body field → bytes), ``mqtt_header_bytes`` (PUBLISH fixed header, topic
        length prefix and packet id; no topic), ``topic_bytes``, ``packet_bytes`` (whole PUBLISH).
    """
    import numpy as np

    from protocol.messages import Envelope, Update, encode, now_ms
    from protocol.mqtt_bytes import publish_size

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((1000, 10), dtype=np.float32)
    protos = rng.standard_normal((10, 64), dtype=np.float32)
    if logits.nbytes + protos.nbytes != SOFT_TENSOR_BYTES:
        raise RuntimeError("soft-prediction tensors are not 42,560 bytes")
    env = Envelope(round=3, sender=SOFT_SENDER, seq=7, timestamp_ms=now_ms(),
                   body=Update(tensors=(logits, protos), num_samples=1000, train_loss=0.4321))
    enc = encode(env)
    ps = publish_size(SOFT_TOPIC, len(enc.payload), qos=1)
    return {"payload_bytes": len(enc.payload), "envelope_bytes": enc.envelope_bytes, "body_bytes": enc.body_bytes,
            "framing_bytes": enc.body_bytes - SOFT_TENSOR_BYTES, "field_bytes": dict(enc.field_bytes),
            "mqtt_header_bytes": ps.header_bytes, "topic_bytes": ps.topic_bytes, "packet_bytes": ps.packet_bytes}


# --------------------------------------------------------------------------------------------
# Part 3: update codecs on a real FedAvg run


def _fedavg_config(rounds: int, codec: str, data_dir: str | None):
    from broker_server import config as config_mod

    raw = tomllib.loads(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
    raw["run"]["rounds"] = rounds
    raw["protocol"].update(update_codec=codec, delta=True, error_feedback=True)
    if data_dir:
        raw["data"]["data_dir"] = data_dir
    return config_mod.from_dict(raw, f"{EXAMPLE_CONFIG.name} (rounds={rounds}, update_codec={codec}, delta, EF)")


def _round_up_bytes(report: dict[str, Any], run_dir: Path, rounds: int) -> list[int]:
    """Device-link uplink wire bytes of rounds 1..rounds (the audit's ``by_round``; the ledger
    directly if this audit version lacks it)."""
    per = {r.get("round"): r.get("up_bytes") for r in report.get("by_round", []) if isinstance(r, dict)}
    if all(isinstance(per.get(r), int) for r in range(1, rounds + 1)):
        return [per[r] for r in range(1, rounds + 1)]
    import sqlite3

    db = sqlite3.connect(run_dir / "ledger.sqlite")
    try:
        out = []
        for r in range(1, rounds + 1):
            (v,) = db.execute("SELECT COALESCE(SUM(mqtt_header_bytes + topic_bytes + payload_bytes - unsent_bytes), 0) "
                              "FROM messages WHERE side='agent' AND event='sent' AND direction='up' AND round=?",
                              (r,)).fetchone()
            out.append(int(v))
        return out
    finally:
        db.close()


def bench_codecs(codecs: list[str], rounds: int, work: Path, data_dir: str | None) -> list[dict[str, Any]]:
    """One FedAvg run per update codec through a counting relay.

    Returns:
        One dict per codec: ``codec``, ``final_accuracy`` (fraction), ``accuracy_curve``,
        ``round_up_bytes`` (device-link uplink wire bytes of each round, from the audit),
        ``device_up_wire_bytes`` / ``device_down_wire_bytes`` / ``device_wire_bytes`` (whole run,
        audit device view, control packets included), ``relay_agent_bytes`` (both directions of
        the agents' connections as counted by the relay), ``relay_server_bytes``, ``seconds``,
        ``broker``.
    """
    from broker_server.audit import audit_report
    from broker_server.embedded_broker import EmbeddedBroker
    from broker_server.simulate import simulate

    out = []
    for codec in codecs:
        cfg = _fedavg_config(rounds, codec, data_dir)
        tag = codec.replace(":", "_").replace("+", "_")
        run_dir = work / f"fedfleet-{tag}"
        with EmbeddedBroker(kind="auto", workdir=work / f"broker-{tag}") as broker:
            relay = CountingRelay(broker.port)
            try:
                t0 = time.perf_counter()
                res = simulate(cfg, broker_url=f"mqtt://127.0.0.1:{relay.port}", run_dir=run_dir, on_round=None)
                seconds = time.perf_counter() - t0
            finally:
                relay.close()
            broker_kind = broker.kind
        wire = relay.bytes_per_node()
        server_bytes = sum(n for (node, _), n in wire.items() if node == "server")
        agent_bytes = sum(n for (node, _), n in wire.items() if node != "server")
        report = audit_report(run_dir)
        dev = report["totals"]["device"]
        row = {
            "codec": codec, "final_accuracy": res.final_accuracy, "rounds": res.rounds_completed,
            "accuracy_curve": [m.get("accuracy") for m in res.metrics],
            "round_up_bytes": _round_up_bytes(report, run_dir, res.rounds_completed),
            "device_up_wire_bytes": dev["up"]["wire_bytes"], "device_down_wire_bytes": dev["down"]["wire_bytes"],
            "device_wire_bytes": dev["all"]["wire_bytes"], "relay_agent_bytes": agent_bytes,
            "relay_server_bytes": server_bytes, "seconds": seconds, "broker": broker_kind,
        }
        print(f"  {codec:<10} acc {row['final_accuracy']:.4f}  update bytes/round "
              f"{statistics.mean(row['round_up_bytes']):,.0f}  relay==ledger "
              f"{agent_bytes == row['device_wire_bytes']}  {seconds:.0f} s", flush=True)
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------
# Part 4: Flower


def bench_flower(flower_venv: str, rounds: int, work: Path, data_dir: str | None,
                 timeout_s: float = 900.0) -> dict[str, Any]:
    """Flower FedAvg with its legacy gRPC server and one client process per configured client
    (:func:`tools._flower.run_legacy`, every client training at once), the clients' connections
    through a counting relay.

    Returns:
        ``ok`` False with ``why`` when Flower cannot run; else ``flwr_version``, ``accuracy_curve``
        (the server's evaluation after rounds 1..R), ``final_accuracy``, ``relay_up_bytes``
        (clients → server), ``relay_down_bytes``, ``connections``, ``seconds``.
    """
    from broker_server import config as config_mod

    if not flower_venv:
        return {"ok": False, "why": "no Flower venv (--flower-venv '')"}
    try:
        venv = _flower.ensure_venv(Path(flower_venv), log=lambda m: print("  " + m, flush=True))
    except RuntimeError as exc:
        return {"ok": False, "why": str(exc)}
    overrides: dict[tuple[str, str], Any] = {("run", "rounds"): rounds}
    if data_dir:
        overrides[("data", "data_dir")] = data_dir
    cfg = config_mod.load(EXAMPLE_CONFIG, overrides)
    fdir = work.resolve() / "flower"
    job = _flower.write_job(fdir / "job.json", config=EXAMPLE_CONFIG, overrides=overrides, train_slots=0,
                            torch_threads=1, slots_dir=None, batch_size=_flower.agent_batch_size(cfg))
    relays: list[CountingRelay] = []

    def via_relay(port: int) -> int:
        relays.append(CountingRelay(port))
        return relays[-1].port

    try:
        res = _flower.run_legacy(venv, job, fdir, rounds=rounds, clients=cfg.data.clients, torch_threads=1,
                                 client_port=via_relay, timeout_s=timeout_s)
    finally:
        for r in relays:
            r.close()
    if not res["ok"]:
        return res
    relay = relays[0]
    curve = [r["accuracy"] for r in res["rounds"]]
    return {"ok": True, "flwr_version": venv.version, "accuracy_curve": curve, "final_accuracy": curve[-1],
            "relay_up_bytes": relay.total_bytes("up"), "relay_down_bytes": relay.total_bytes("down"),
            "connections": relay.connections, "seconds": res["wall_s"],
            "client_exit_codes": res["client_exit_codes"]}


def _model_bytes() -> int:
    """Bytes of the light CNN's float32 state for MNIST (what FedAvg sends each way per client)."""
    from edge_agent.models import build_model
    from edge_agent.state import state_arrays

    return sum(a.nbytes for a in state_arrays(build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)))


# --------------------------------------------------------------------------------------------
# Report


def render(meta: dict[str, Any], thr: list[dict] | None, ovh: dict | None, codecs: list[dict] | None,
           flower: dict | None) -> str:
    """The Markdown report."""
    L: list[str] = []
    v = meta["versions"]
    L += ["# fedfleet protocol benchmark", "",
          f"Produced by `{meta['command']}` on {meta['date']} (total {meta['total_s']:.0f} s), measuring "
          f"fedfleet at {meta['code']}.", "",
          "Benchmarks, not tests: every comparison is a ratio of figures measured side by side in this one run. "
          "The machine was shared with other jobs while it ran, so absolute times are noisy; ratios less so.", "",
          "| machine | |", "| --- | --- |",
          f"| CPU | {meta['cpu']}, {meta['cores']} cores |",
          f"| OS | {meta['os']} |",
          f"| Python | {v['python']} |", f"| torch | {v['torch']} |", f"| numpy | {v['numpy']} |",
          f"| msgpack | {v['msgpack']} |", f"| zstandard | {v.get('zstandard')} |",
          f"| paho-mqtt | {v.get('paho.mqtt')} |", f"| broker | {v.get('mosquitto', 'amqtt')} |"]
    if flower and flower.get("ok"):
        L.append(f"| flwr (separate venv) | {flower['flwr_version']} |")
    L.append("")

    if thr is not None:
        L += ["## 1. Encode/decode throughput", "",
              "One `update` message carrying one float32 tensor, through `protocol.messages.encode` / `decode` "
              f"(median of {meta['reps']} repetitions for the large tensor, ≥ 200 for the small one). "
              "MB/s = 10⁶ tensor bytes per second. Ratios are the numpy copy's time over the codec's time "
              "(1.0 = as fast as a copy). `np.copyto` copies into a preallocated array (a pure memcpy); "
              "`arr.copy()` also allocates, as encode and decode must.", "",
              "| tensor | payload bytes | np.copyto MB/s | arr.copy() MB/s | encode MB/s | decode MB/s "
              "| encode ÷ copyto | decode ÷ copyto | encode ÷ copy() | decode ÷ copy() |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in thr:
            mb = r["tensor_bytes"] / 1e6
            name = f"{r['floats']:,} floats ({mb:.2f} MB)" if mb < 1 else f"{r['floats']:,} floats ({mb:.1f} MB)"
            L.append(f"| {name} | {_fmt_int(r['payload_bytes'])} | {mb / r['copyto_s']:,.0f} | {mb / r['copy_s']:,.0f} "
                     f"| {mb / r['encode_s']:,.0f} | {mb / r['decode_s']:,.0f} "
                     f"| {r['copyto_s'] / r['encode_s']:.2f}× | {r['copyto_s'] / r['decode_s']:.2f}× "
                     f"| {r['copy_s'] / r['encode_s']:.2f}× | {r['copy_s'] / r['decode_s']:.2f}× |")
        big = thr[-1]
        L += ["", "Decoded tensor a view on the payload (no copy): " +
              ", ".join(f"{r['tensor_bytes'] / 1e6:g} MB {'yes' if r['decoded_is_view'] else 'no'}" for r in thr) +
              f". Reference: one copy of the {big['tensor_bytes'] / 1e6:.1f} MB into a new `bytes` object "
              f"(`bytes(arr)`) takes {big['bytes_copy_s'] * 1e3:.1f} ms = {big['bytes_copy_s'] / big['copyto_s']:.1f}× "
              f"an `np.copyto` ({big['copyto_s'] * 1e3:.1f} ms) and {big['bytes_copy_s'] / big['copy_s']:.1f}× an "
              f"`arr.copy()` ({big['copy_s'] * 1e3:.1f} ms).", "",
              "Where the time goes (cProfile of the same calls, own time per call of the function named, largest "
              "first; profiling inflates Python-level calls, so read the shares as indicative):", "",
              "| case | function | µs per message | share |", "| --- | --- | ---: | ---: |"]
        for r in thr:
            size = f"{r['tensor_bytes'] / 1e6:g} MB"
            for op in ("encode", "decode"):
                for i, (fn_name, sec, share) in enumerate(r["profile"][op]):
                    case = f"{op} {size}" if i == 0 else ""
                    L.append(f"| {case} | `{fn_name}` | {sec * 1e6:,.1f} | {share:.0%} |")
        L.append("")
        for r in thr:
            mb = r["tensor_bytes"] / 1e6
            ratio, ratio_alloc = r["copyto_s"] / r["decode_s"], r["copy_s"] / r["decode_s"]
            verdict = lambda x: "met" if x >= 0.5 else "not met"  # noqa: E731
            L.append(f"- **Target decode ≥ 0.5× memcpy, {mb:g} MB:** against `np.copyto` {verdict(ratio)} "
                     f"({ratio:.2f}×, {ratio / 0.5:.2f} of the target); against `arr.copy()` {verdict(ratio_alloc)} "
                     f"({ratio_alloc:.2f}×).")
        L.append("")

    if ovh is not None:
        env_hdr = ovh["envelope_bytes"] + ovh["mqtt_header_bytes"]
        with_topic = env_hdr + ovh["topic_bytes"]
        L += ["## 2. Overhead of a soft-prediction message", "",
              f"One `update` with a [1000, 10] and a [10, 64] float32 tensor ({SOFT_TENSOR_BYTES:,} tensor bytes) "
              f"from `{SOFT_SENDER}` on `{SOFT_TOPIC}` at QoS 1 (MQTT 3.1.1; round 3, seq 7, a current "
              "`timestamp_ms`, `num_samples` 1000, empty `metrics`). Bytes counted from the encoded payload and "
              "`mqtt_bytes.publish_size`.", "",
              "| part | bytes |", "| --- | ---: |",
              f"| tensor values | {SOFT_TENSOR_BYTES:,} |",
              f"| body framing (body − tensor values) | {ovh['framing_bytes']} |",
              f"| envelope (payload − body) | {ovh['envelope_bytes']} |",
              f"| MQTT header (fixed header + topic length + packet id), topic excluded | {ovh['mqtt_header_bytes']} |",
              f"| MQTT topic | {ovh['topic_bytes']} |",
              f"| **envelope + MQTT header, without topic** | **{env_hdr}** |",
              f"| **envelope + MQTT header + topic** | **{with_topic}** |",
              f"| whole PUBLISH packet | {ovh['packet_bytes']:,} |",
              f"| all overhead (packet − tensor values) | {ovh['packet_bytes'] - SOFT_TENSOR_BYTES} "
              f"({(ovh['packet_bytes'] - SOFT_TENSOR_BYTES) / ovh['packet_bytes']:.2%} of the packet) |", "",
              "Body fields: " + ", ".join(f"{k} {b}" for k, b in ovh["field_bytes"].items()) +
              " bytes (+ 1 byte of body array header); the tensors field's "
              f"{ovh['field_bytes'].get('tensors', 0) - SOFT_TENSOR_BYTES} "
              "bytes beyond the values are each tensor's `[codec, dtype, shape, bin header]`.", "",
              "- **Target envelope + MQTT header ≤ 64 bytes:** without the topic "
              f"{'met' if env_hdr <= 64 else 'not met'} "
              f"({env_hdr} bytes, {64 - env_hdr:+d} to spare); with the {ovh['topic_bytes']}-byte topic counted "
              f"{'met' if with_topic <= 64 else 'not met'} ({with_topic} bytes, {with_topic - 64:+d} over)."
              if with_topic > 64 else
              f"- **Target envelope + MQTT header ≤ 64 bytes:** met both without the topic ({env_hdr} bytes) and "
              f"with it ({with_topic} bytes).", ""]

    if codecs:
        base = next((c for c in codecs if c["codec"] == "fp32"), codecs[0])
        b_up = statistics.mean(base["round_up_bytes"])
        rounds = base["rounds"]
        L += ["## 3. Update codecs on a real FedAvg run", "",
              f"`examples/mnist-fedavg.toml` (MNIST, 10 clients, Dirichlet α = 0.5, 1 local epoch, batch 32, "
              f"lr 0.05, momentum 0.5, seed 0) for **{rounds} round{'s' if rounds != 1 else ''}**, one `simulate(cfg, "
              "run_dir=…, on_round=None)` "
              f"per codec in this process, `[protocol] update_codec` as listed, `delta = true`, "
              f"`error_feedback = true`, global model sent fp32. Broker: {base['broker']}, reached through a "
              "byte-counting TCP relay. *Update bytes/round* = device-link uplink wire bytes (MQTT framing + topic "
              "+ payload of the agents' uplink messages) of each round from `audit_report(run_dir)`, averaged over "
              "the rounds: the ten `update` messages of the round.", "",
              "| update codec | update bytes/round | per client | fp32 ÷ codec | final accuracy | Δ vs fp32 (pp) "
              "| device wire bytes, whole run | relay = ledger | run s |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | :---: | ---: |"]
        for c in codecs:
            up = statistics.mean(c["round_up_bytes"])
            L.append(f"| {c['codec']} | {_fmt_int(up)} | {_fmt_int(up / 10)} | {b_up / up:.2f}× | "
                     f"{c['final_accuracy']:.4f} | {(c['final_accuracy'] - base['final_accuracy']) * 100:+.2f} | "
                     f"{_fmt_int(c['device_wire_bytes'])} | "
                     + ("yes" if c["relay_agent_bytes"] == c["device_wire_bytes"]
                        else "NO (" + _fmt_int(c["relay_agent_bytes"]) + ")") + " "
                     f"| {c['seconds']:.0f} |")
        L += ["", "Accuracy after each round:", "",
              "| update codec | " + " | ".join(f"r{i + 1}" for i in range(rounds)) + " |",
              "| --- |" + " ---: |" * rounds]
        for c in codecs:
            L.append(f"| {c['codec']} | " + " | ".join(f"{a:.4f}" for a in c["accuracy_curve"]) + " |")
        L.append("")
        i8 = next((c for c in codecs if c["codec"] == "int8"), None)
        if i8 is not None:
            ratio = b_up / statistics.mean(i8["round_up_bytes"])
            dpp = (i8["final_accuracy"] - base["final_accuracy"]) * 100
            ok_b, ok_a = ratio >= 3.9, abs(dpp) <= 0.5
            L.append(f"- **Target int8 ≥ 3.9× fewer update bytes than fp32 within 0.5 pp:** "
                     f"{'met' if ok_b and ok_a else 'not met'} — bytes {ratio:.3f}× "
                     f"({'met' if ok_b else 'not met'}, {ratio - 3.9:+.3f} vs 3.9), accuracy {dpp:+.2f} pp "
                     f"({'met' if ok_a else 'not met'}, |Δ| {abs(dpp):.2f} vs 0.5), after {rounds} "
                     f"round{'s' if rounds != 1 else ''}.")
            L.append("")

    if flower is not None:
        L += ["## 4. Flower comparison", ""]
        if not flower.get("ok"):
            L += ["Not measured: " + flower["why"].replace("\n", " "), ""]
        elif codecs:
            ff = next((c for c in codecs if c["codec"] == "fp32"), None)
            rounds = ff["rounds"] if ff else 0
            f_total = flower["relay_up_bytes"] + flower["relay_down_bytes"]
            values = 2 * 10 * meta["model_bytes"]
            L += [f"Flower {flower['flwr_version']} in its own venv (`python3.11 -m venv` + `pip install "
                  f"\"{_flower.FLWR_SPEC}\"`, `tools/_flower.py`; torch and fedfleet imported from the project venv "
                  "by path), "
                  "legacy gRPC bidi transport: "
                  "`flwr.server.start_server` (deprecated since 1.13, still shipped in `flwr.compat`) in one process "
                  f"and {flower['connections']} `flwr.client.start_client` processes on 127.0.0.1, each client's "
                  "TCP connection through the same kind of counting relay. Same FedAvg: fedfleet's server model as "
                  "the initial global model (`initial_parameters`, so no client is asked for weights), each client "
                  "prepared as a fedfleet agent prepares itself (same Dirichlet shard, model, client algorithm), "
                  "and `FedAvgClient.local_round` (same shuffling seeds) inside a `NumPyClient`; "
                  "`fraction_evaluate = 0` (no federated evaluation, as "
                  "fedfleet evaluates on the server only); accuracy from centralised evaluation on the server. "
                  f"fedfleet: the fp32 run of part 3 (delta on: same tensor sizes), bytes of the agents' MQTT "
                  "connections counted by the relay (equal to the ledger's device-view totals, see part 3). Both "
                  "whole-run totals (connection set-up, join/registration, teardown included) divided by the "
                  f"{rounds} round{'s' if rounds != 1 else ''}; relay bytes are the TCP payload stream (MQTT, resp. "
                  "HTTP/2 + gRPC + protobuf), "
                  "not IP/TCP headers.", "",
                  "*Beyond values* = total minus the tensor values that must cross anyway: per round each of the 10 "
                  f"clients downloads and uploads the {_fmt_int(meta['model_bytes'])} bytes of float32 weights "
                  f"({_fmt_int(values)} bytes per round).", "",
                  "| system | up bytes/round | down bytes/round | total bytes/round | Flower ÷ fedfleet "
                  "| beyond values/round | Flower ÷ fedfleet | final accuracy |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
            if ff:
                f_up = ff["device_up_wire_bytes"] / rounds
                f_dn = ff["device_down_wire_bytes"] / rounds
                ff_tot = ff["relay_agent_bytes"] / rounds
                fl_tot = f_total / rounds
                L.append(f"| fedfleet fp32 (MQTT, {ff['broker']}) | {_fmt_int(f_up)} | {_fmt_int(f_dn)} | "
                         f"{_fmt_int(ff_tot)} | 1.00× | {_fmt_int(ff_tot - values)} | 1.00× | "
                         f"{ff['final_accuracy']:.4f} |")
                L.append(f"| Flower (gRPC bidi) | {_fmt_int(flower['relay_up_bytes'] / rounds)} | "
                         f"{_fmt_int(flower['relay_down_bytes'] / rounds)} | {_fmt_int(fl_tot)} | "
                         f"{fl_tot / ff_tot:.3f}× | {_fmt_int(fl_tot - values)} | "
                         f"{(fl_tot - values) / (ff_tot - values):.2f}× | {flower['final_accuracy']:.4f} |")
                L += ["", "Per direction, Flower ÷ fedfleet: up "
                          f"{flower['relay_up_bytes'] / ff['device_up_wire_bytes']:.3f}×, "
                      f"down {flower['relay_down_bytes'] / ff['device_down_wire_bytes']:.3f}×. Flower accuracy by "
                      "round "
                      "(rounds 1..R): " + ", ".join(f"{a:.4f}" for a in flower["accuracy_curve"]) +
                      f". Flower wall time {flower['seconds']:.0f} s (10 client processes training at once), "
                      f"fedfleet {ff['seconds']:.0f} s (one trainer at a time).", ""]
    return "\n".join(L) + "\n"


# --------------------------------------------------------------------------------------------
# Main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke mode: few repetitions, 1 round, codecs fp32 and int8")
    p.add_argument("--out", default="benchmarks/protocol.md", help="the Markdown report (default %(default)s)")
    p.add_argument("--rounds", type=int, default=None, help="FedAvg rounds for parts 3 and 4 (default 5; --quick 1)")
    p.add_argument("--reps", type=int, default=None, help="repetitions for part 1 (default 9; --quick 3)")
    p.add_argument("--codecs", default=None, help=f"comma-separated update codecs (default {','.join(DEFAULT_CODECS)})")
    p.add_argument("--parts", default="1,2,3,4", help="which parts to run (default %(default)s)")
    p.add_argument("--flower-venv", default=DEFAULT_FLOWER_VENV,
                   help="Flower's venv, created when missing ('' skips part 4; default %(default)s)")
    p.add_argument("--data-dir", default=None, help="data folder (default: fedfleet's search order)")
    p.add_argument("--work", default=None, help="scratch folder for run folders and logs (default: a new /tmp folder)")
    p.add_argument("--code-label", default=None,
                   help="what code was measured, for the report (default: the git commit and its state)")
    ns = p.parse_args(argv)

    rounds = ns.rounds or (1 if ns.quick else 5)
    reps = ns.reps or (3 if ns.quick else 9)
    codecs = ns.codecs.split(",") if ns.codecs else (["fp32", "int8"] if ns.quick else list(DEFAULT_CODECS))
    if "fp32" not in codecs:
        codecs.insert(0, "fp32")  # the reference of every ratio
    parts = {int(x) for x in ns.parts.split(",") if x}
    work = Path(ns.work) if ns.work else Path(tempfile.mkdtemp(prefix="fedfleet-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    import logging

    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    print(f"bench_protocol: scratch folder {work}", flush=True)
    thr = ovh = codec_rows = flower = None
    if 1 in parts:
        print("part 1: encode/decode throughput", flush=True)
        thr = bench_throughput(reps)
    if 2 in parts:
        print("part 2: overhead", flush=True)
        ovh = bench_overhead()
    if 3 in parts:
        print(f"part 3: FedAvg, {rounds} rounds, codecs {', '.join(codecs)}", flush=True)
        codec_rows = bench_codecs(codecs, rounds, work, ns.data_dir)
    if 4 in parts:
        print(f"part 4: Flower, {rounds} rounds", flush=True)
        flower = bench_flower(ns.flower_venv, rounds, work, ns.data_dir)
        print("  " + (f"Flower bytes up {flower['relay_up_bytes']:,} down {flower['relay_down_bytes']:,}, "
                      f"acc {flower['final_accuracy']:.4f}" if flower.get("ok") else "skipped: " + flower["why"]),
              flush=True)
    meta = {"command": shlex.join(["python", "tools/bench_protocol.py", *(sys.argv[1:] if argv is None else argv)]),
            "date": time.strftime("%Y-%m-%d %H:%M"), "total_s": time.perf_counter() - t0, "cores": os.cpu_count(),
            "cpu": _cpu_model(), "os": f"{platform.system()} {platform.release()}", "versions": _versions(),
            "reps": reps, "model_bytes": _model_bytes(), "code": ns.code_label or _code_label()}
    text = render(meta, thr, ovh, codec_rows, flower)
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    (work / "results.json").write_text(json.dumps({"meta": meta, "throughput": thr, "overhead": ovh,
                                                   "codecs": codec_rows, "flower": flower}, indent=1, default=str))
    print(f"bench_protocol: wrote {out} ({meta['total_s']:.0f} s; raw figures in {work / 'results.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
