"""A second implementation, in Node.js (tests/interop/decode.js, written from protocol/PROTOCOL.md
alone), decodes the spec's test vectors and a captured federation of every message kind and codec
(chunked with a resend, signed, encrypted, the last will, a per-device round_start with
instructions), and what it decodes equals what Python sent. A change to the wire that the spec
does not describe fails here.

Skips with a reason where node or tests/interop/node_modules is missing, except under CI=true
(conftest.py, ``node_decoder``).
"""

from __future__ import annotations

import json
import queue
import shutil
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

import protocol.channel as channel_mod
from protocol import topics
from protocol.channel import Channel, Received
from protocol.membership import encode_members
from protocol.messages import (
    BODY_FIELDS,
    Envelope,
    Finish,
    Global,
    Join,
    Kind,
    Receipt,
    RoundStart,
    Status,
    Update,
    decode,
    encode,
)
from protocol.security import ChannelSecurity, generate_identity
from protocol.tensors import Codec
from protocol.transport_base import Incoming

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SPEC = ROOT / "protocol" / "PROTOCOL.md"
CODECS = ["fp32", "fp16", "bf16", "int8", "int8-channel", "topk:0.5", "topk:3:fp16", "fp16+zstd",
          "int8-channel+zstd", "fp32+zstd"]


# ------------------------------------------------------------------ an in-memory broker


def _matches(filt: str, topic: str) -> bool:
    f, t = filt.split("/"), topic.split("/")
    for i, level in enumerate(f):
        if level == "#":
            return True
        if i >= len(t) or (level != "+" and level != t[i]):
            return False
    return len(f) == len(t)


class _Bus:
    """Delivers every PUBLISH to the matching subscribers and logs it; ``drop[topic] = n`` loses the
    n-th next delivery on ``topic`` (the log keeps it: it was published)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, bytes]] = []
        self.subs: list[tuple[str, _Transport]] = []
        self.drop: dict[str, int] = {}

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.log.append((topic, bytes(payload)))
        if topic in self.drop:
            self.drop[topic] -= 1
            if self.drop[topic] == 0:
                del self.drop[topic]
                return
        for filt, tr in self.subs:
            if _matches(filt, topic):
                tr.q.put(Incoming(topic, bytes(payload), 1, retain, time.monotonic()))


class _Transport:
    def __init__(self, bus: _Bus, client_id: str) -> None:
        self.bus, self.client_id, self.q = bus, client_id, queue.Queue()

    def subscribe(self, filters, qos=1):
        for f in filters:
            self.bus.subs.append((f, self))

    def publish(self, topic, payload, *, qos=1, retain=False, wait_s=None):
        self.bus.publish(topic, payload, retain)

    def get(self, timeout_s):
        try:
            return self.q.get(timeout=timeout_s) if timeout_s else self.q.get_nowait()
        except queue.Empty:
            return None

    def close(self):
        pass


# ------------------------------------------------------------------ the JSON view of PROTOCOL.md §12


def _view(v):
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"bin": bytes(v).hex()}
    if isinstance(v, np.ndarray):
        from protocol.tensors import dtype_code

        vals = v.astype(np.float64).ravel().tolist() if v.dtype.kind == "f" else v.ravel().tolist()
        return {"dtype": dtype_code(v.dtype), "shape": list(v.shape), "values": vals}
    if isinstance(v, (list, tuple)):
        return [_view(x) for x in v]
    if isinstance(v, dict):
        return {k: _view(x) for k, x in v.items()}
    return v


def _message_view(payload: bytes) -> dict:
    env = decode(payload).envelope
    body = {f: _view(getattr(env.body, f)) for f in BODY_FIELDS[env.kind] if hasattr(env.body, f)}
    # optional fields absent on the wire
    for f in ("extras", "instructions", "members", "member_index", "global_round", "start_round", "update_round"):
        if f in body and body[f] in ({}, None, {"bin": ""}):
            del body[f]
    return {"version": env.version, "kind": int(env.kind), "round": env.round, "sender": env.sender, "seq": env.seq,
            "timestamp_ms": env.timestamp_ms, "body": body}


# ------------------------------------------------------------------ the captured federation


def _model(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.standard_normal((4, 1, 3, 3)).astype(np.float32), rng.standard_normal(4).astype(np.float32),
            np.array(7, np.int64), rng.standard_normal((10, 16)).astype(np.float32)]


MANIFEST = [["conv.weight", [4, 1, 3, 3], "float32"], ["conv.bias", [4], "float32"],
            ["bn.num_batches_tracked", [], "int64"], ["fc.weight", [10, 16], "float32"]]


def _extras(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"prototypes": rng.standard_normal((3, 4)).astype(np.float32),
            "proto_classes": np.array([0, 2, 5], np.int64), "proto_counts": np.array([4, 1, 9], np.int64),
            "f64": rng.standard_normal(5), "f16": rng.standard_normal(3).astype(np.float16),
            "mask": np.array([True, False, True]), "bytes": np.array([0, 255, 7], np.uint8),
            "i32": np.array([-3, 4], np.int32), "i16": np.array([-1], np.int16), "i8": np.array([-128, 127], np.int8)}


def _pump(a: Channel, b: Channel, want, timeout_s: float = 20.0):
    """Receive on both channels until ``want(item)`` holds for an item of ``a``; returns it."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        item = a.receive(0.02)
        if item is not None and want(item):
            return item
        b.receive(0.0)
    raise AssertionError("the awaited message did not arrive")


def _federation(bus: _Bus, fed: str, cid: str, *, secure: bool, expected: dict) -> dict:
    """One federation: join, a round per codec (global, round_start, receipts, update), finish, offline,
    the last will. Returns the public keys the decoder needs."""
    rng = np.random.default_rng(7)
    keys: dict = {}
    s_sec = a_sec = None
    if secure:
        srv, dev = generate_identity("server"), generate_identity(cid)
        s_sec = ChannelSecurity(srv, side="server", peers={cid: dev.public}, epoch=1, replay_state=None,
                                require_encrypted=True)
        a_sec = ChannelSecurity(dev, side="agent", peers={"server": srv.public}, encrypt=True, epoch=3,
                                replay_state=None)
        from cryptography.hazmat.primitives import serialization as ser

        keys = {"server": {"ed25519": srv.public.ed25519.hex(), "x25519": srv.public.x25519.hex()},
                "server_x25519_private": srv.exchange_key.private_bytes(ser.Encoding.Raw, ser.PrivateFormat.Raw,
                                                                        ser.NoEncryption()).hex(),
                "devices": {cid: {"ed25519": dev.public.ed25519.hex(), "x25519": dev.public.x25519.hex()}}}
    server = Channel(_Transport(bus, "server"), node_id="server", side="server", federation=fed, ledger=None,
                     chunk_bytes=900, max_packet_bytes=700, resend_after_s=0.2, security=s_sec,
                     transfer_filter=lambda s: s == cid)
    agent = Channel(_Transport(bus, cid), node_id=cid, side="agent", federation=fed, ledger=None, chunk_bytes=512,
                    resend_after_s=0.2, security=a_sec, transfer_filter=lambda s: s == "server")
    server.transport.subscribe(topics.server_filters(fed))
    agent.transport.subscribe(topics.agent_filters(fed, cid))
    from edge_agent.models import manifest_hash

    mh = manifest_hash([(n, tuple(s), d) for n, s, d in MANIFEST])
    agent.send(topics.status(fed, cid), Status("online"), round=0, retain=True)
    _pump(server, agent, lambda i: isinstance(i, Received) and i.envelope.kind is Kind.STATUS)
    agent.send(topics.up(fed, cid, Kind.JOIN), Join("rpi4", mh, 600, (100, 200, 300), {"cores": 4, "ram_mb": 1024.5,
                                                                                    "virtual": True, "os": "linux"}),
               round=0)
    join = _pump(server, agent, lambda i: isinstance(i, Received) and i.envelope.kind is Kind.JOIN)
    # the accepted join receipt gives the agent its member index (a sixth body field)
    server.send(topics.down_to(fed, cid, Kind.RECEIPT), Receipt(int(Kind.JOIN), join.envelope.seq, True, "",
                                                                join.sha256, 9), round=0, recipient=cid)
    _pump(agent, server, lambda i: isinstance(i, Received) and i.envelope.kind is Kind.RECEIPT)
    model = _model(rng)
    for r, codec_text in enumerate(CODECS, start=1):
        codec = Codec.parse(codec_text)
        server.send(topics.down(fed, Kind.GLOBAL), Global(tuple(model), {"manifest_hash": mh, "share": "all"},
                                                          _extras(rng) if r % 2 else {}), round=r, codec=codec)
        # rounds 1 and 2 name the agent by its member index: a bitmap, then delta varints
        members = {1: encode_members([0, 1, 2, 9]), 2: encode_members([9, 300])}.get(r, b"")
        server.send(topics.down(fed, Kind.ROUND_START),
                    RoundStart(() if members else (cid,), 30.0,
                               {"lr": 0.05, "local_epochs": 1, "update_codec": codec_text, "delta": bool(r % 2),
                                "x": -5}, members=members), round=r)
        glob = _pump(agent, server, lambda i: isinstance(i, Received) and i.envelope.kind is Kind.GLOBAL)
        _pump(agent, server, lambda i: isinstance(i, Received) and i.envelope.kind is Kind.ROUND_START)
        agent.send(topics.up(fed, cid, Kind.RECEIPT), Receipt(int(Kind.GLOBAL), glob.envelope.seq, True, "",
                                                              glob.sha256), round=r)
        got = [np.array(t) for t in glob.envelope.body.tensors]
        local = [t + np.float32(0.01) if t.dtype.kind == "f" else t for t in got]
        delta = bool(r % 2)
        tensors = [lt - g if lt.dtype.kind == "f" else lt for lt, g in zip(local, got, strict=True)] if delta else local
        if r == 3:  # one upload loses its second chunk on the way: the server asks for it again
            bus.drop[topics.up(fed, cid, Kind.UPDATE)] = 2
        agent.send(topics.up(fed, cid, Kind.UPDATE),
                   Update(tuple(tensors), 600, 0.25 + r, {"train_seconds": 1.5, "eval_accuracy": 0.5}, delta,
                          _extras(rng) if r % 3 == 0 else {}), round=r, codec=codec)
        upd = _pump(server, agent, lambda i: isinstance(i, Received) and i.envelope.kind is Kind.UPDATE)
        server.send(topics.down_to(fed, cid, Kind.RECEIPT),
                    Receipt(int(Kind.UPDATE), upd.envelope.seq, r != 2, "" if r != 2 else "round 2 is closed",
                            upd.sha256), round=r, recipient=cid)
        _pump(agent, server, lambda i: isinstance(i, Received) and i.envelope.kind is Kind.RECEIPT)
        sent_back = upd.envelope.body.tensors
        model = [np.array(g + t if delta and t.dtype.kind == "f" else t) for g, t in zip(got, sent_back, strict=True)]
    assert agent.resent_chunks == 1  # the dropped chunk came again, once
    # back after a reconnect: holds the last round's global and round_start, its update answered
    agent.send(topics.status(fed, cid), Status("online", "reconnected", len(CODECS), len(CODECS), 0), round=0,
               retain=True)
    agent.send(topics.status(fed, cid), Status("idle", "round 9: battery low"), round=9)
    server.send(topics.down(fed, Kind.FINISH), Finish("completed", len(CODECS)), round=len(CODECS))
    _pump(agent, server, lambda i: isinstance(i, Received) and i.envelope.kind is Kind.FINISH)
    agent.send(topics.status(fed, cid), Status("offline", "finished"), round=0, retain=True)
    # the last will, as the agent registers it (seq 0), published by the broker when the agent vanishes
    will = encode(Envelope(round=0, sender=cid, seq=0, body=Status("offline", "connection lost"))).payload
    expected[(cid, 0)] = _message_view(will)
    if a_sec is not None:
        will = a_sec.seal(topics.status(fed, cid), will).payload
    bus.publish(topics.status(fed, cid), will, retain=True)
    # a per-device round_start with instructions (a fourth body field), crafted byte by byte from §3
    if not secure:
        body = msgpack.packb([[cid], 30.0, {"lr": 0.1}, {"data_ratio": 0.5, "local_epochs": 2}], use_bin_type=True)
        payload = msgpack.packb([1, 2, 4, "server", 999, 1764420000000, body], use_bin_type=True)
        bus.publish(f"fedfleet/v1/{fed}/down/{cid}/round_start", payload)
        expected[("server", 999)] = {"version": 1, "kind": 2, "round": 4, "sender": "server", "seq": 999,
                                     "timestamp_ms": 1764420000000,
                                     "body": {"selected": [cid], "deadline_s": 30.0, "config": {"lr": 0.1},
                                              "instructions": {"data_ratio": 0.5, "local_epochs": 2}}}
    return keys


@pytest.fixture(scope="module")
def capture(tmp_path_factory, node_decoder):
    """Two federations over an in-memory broker (signed + encrypted, and plain), every PUBLISH logged;
    ``expected`` maps (sender, seq) to the Python view of every envelope Python encoded."""
    expected: dict = {}
    codecs: set[int] = set()
    real_encode = channel_mod.encode

    def recording_encode(env, *args, **kwargs):
        enc = real_encode(env, *args, **kwargs)
        view = _message_view(enc.payload)
        # what Python's decoder returns is what Python sent (header and non-tensor fields)
        assert (view["round"], view["sender"], view["seq"]) == (env.round, env.sender, env.seq)
        for f in BODY_FIELDS[env.kind]:
            sent = getattr(env.body, f, None)
            if not isinstance(sent, (tuple, dict, bytes, memoryview, np.ndarray)) and sent is not None:
                assert view["body"][f] == sent, f
        expected[(env.sender, env.seq)] = view
        codecs.update(_tensors_in(enc.payload))
        return enc

    out = {}
    mp = pytest.MonkeyPatch()
    mp.setattr(channel_mod, "encode", recording_encode)
    try:
        for fed, cid, secure in (("fed-sec", "client-001", True), ("fed-plain", "client-002", False)):
            bus = _Bus()
            expected.clear()
            codecs.clear()
            keys = _federation(bus, fed, cid, secure=secure, expected=expected)
            d = tmp_path_factory.mktemp(fed)
            with open(d / "packets.jsonl", "w") as fh:
                for topic, payload in bus.log:
                    fh.write(json.dumps({"topic": topic, "payload": payload.hex()}) + "\n")
            (d / "keys.json").write_text(json.dumps({**keys, "manifest": MANIFEST}))
            out[fed] = (d, bus.log, dict(expected), set(codecs))
    finally:
        mp.undo()
    return out


def test_node_decodes_every_spec_vector(node_decoder) -> None:
    r = node_decoder("spec", str(SPEC))
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    # at least one check per vector of the spec (message, sealed and tensor vectors), plus its own
    from protocol.test_vectors import MESSAGE_VECTORS, SECURITY_VECTORS, TEST_VECTORS
    assert out["failures"] == 0
    assert out["checks"] >= len(MESSAGE_VECTORS) + len(SECURITY_VECTORS) + len(TEST_VECTORS) + 3


@pytest.mark.parametrize("fed", ["fed-sec", "fed-plain"])
def test_node_decodes_the_captured_federation_as_python_sent_it(capture, node_decoder, fed: str) -> None:
    d, log, expected, codecs = capture[fed]
    r = node_decoder("capture", str(d))
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout)
    got = json.loads((d / "decoded.json").read_text())
    cid = "client-001" if fed == "fed-sec" else "client-002"
    # the envelopes the node decoded (chunks and reassembled inner messages) are exactly those Python
    # encoded, field for field and value for value (lossy tensors as decoded)
    seen = {}
    for e in got["envelopes"]:
        key = (e["sender"], e["seq"])
        assert key not in seen, key
        assert key in expected, key
        assert e == expected[key], key
        seen[key] = e
    assert set(seen) == set(expected)
    # every kind, every codec: counted from the log by Python, reported by the decoder
    kinds = {Kind(msgpack.unpackb(p)[1]).label for _, p in log}
    assert kinds == {k.label for k in Kind} - ({"resend"} - kinds) and "resend" in kinds
    assert set(summary["kinds"]) == kinds
    assert codecs == {0, 1, 2, 3, 4, 0x80, 0x81, 0x83}  # raw, fp16, bf16, int8, topk, raw/fp16/int8 + zstd
    assert set(summary["codecs"]) == {str(c) for c in codecs}
    assert summary["transfers"] >= 5 and summary["receipts_checked"] >= len(CODECS) * 2 + 1
    assert summary["manifest_checked"] == 1
    if fed == "fed-sec":
        assert summary["signed"] == len(log)
        agent_packets = sum(1 for t, _ in log if f"/up/{cid}/" in t or t.endswith(f"/status/{cid}"))
        assert summary["encrypted"] == agent_packets > 0
    else:
        assert summary["signed"] == 0 and ("server", 999) in seen
        assert seen[("server", 999)]["body"]["instructions"] == {"data_ratio": 0.5, "local_epochs": 2}


def _tensors_in(payload: bytes) -> list[int]:
    """Codec numbers of the tensors in an unsealed, whole global/update payload (Python's own reading)."""
    env = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if env[1] not in (3, 4) or len(env) != 7:
        return []
    body = msgpack.unpackb(env[6], raw=False, strict_map_key=False)
    ex = body[2] if env[1] == 3 and len(body) > 2 else body[5] if env[1] == 4 and len(body) > 5 else {}
    return [t[0] for t in body[0]] + [t[0] for t in ex.values()]


WHY = {"kind": "envelope.kind: unknown kind 10", "deadline_str": "body.deadline_s", "dtype": "unknown dtype 10",
       "trailing": "not one msgpack value", "element8": "element 8 is not sec",
       "signature": "signature does not verify", "ciphertext": "sec.check: body"}


@pytest.mark.parametrize("change", ["kind", "deadline_str", "dtype", "trailing", "element8", "signature", "ciphertext"])
def test_a_wire_change_the_spec_does_not_describe_fails_the_decoder(capture, node_decoder, tmp_path,
                                                                   change: str) -> None:
    d, log, _, _ = capture["fed-sec" if change in ("signature", "ciphertext") else "fed-plain"]
    packets = [(t, bytearray(p)) for t, p in log]
    i = next(k for k, (t, p) in enumerate(packets) if t.endswith("/up/client-002/receipt") or
             (change in ("signature", "ciphertext") and "/up/client-001/" in t))
    topic, p = packets[i]
    env = msgpack.unpackb(bytes(p), raw=False)
    if change == "kind":  # an unknown kind number
        env[1] = 10
    elif change == "deadline_str":  # a string where the spec says float64
        i = next(k for k, (t, _) in enumerate(packets) if t.endswith("/down/round_start"))
        topic, p = packets[i]
        env = msgpack.unpackb(bytes(p), raw=False)
        body = msgpack.unpackb(env[6], raw=False)
        body[1] = "30"
        env[6] = msgpack.packb(body, use_bin_type=True)
    elif change == "dtype":  # a dtype number the spec does not list, on the first global
        i = next(k for k, (t, _) in enumerate(packets) if t.endswith("/down/global")
                 and msgpack.unpackb(bytes(packets[k][1]), raw=False)[1] == 3)
        topic, p = packets[i]
        env = msgpack.unpackb(bytes(p), raw=False)
        body = msgpack.unpackb(env[6], raw=False)
        body[0][0][1] = 10
        env[6] = msgpack.packb(body, use_bin_type=True)
    elif change == "trailing":
        pass
    elif change == "element8":  # an 8th envelope element that is not sec: the envelope is closed (§2)
        env.append(1)
    if change == "signature":
        p[-1] ^= 1
        packets[i] = (topic, p)
    elif change == "ciphertext":
        raw = msgpack.unpackb(bytes(p), raw=False)
        assert raw[7][1] == 1  # encrypted
        packets[i] = (topic, bytearray(bytes(p).replace(raw[6], bytes([raw[6][0] ^ 1]) + raw[6][1:], 1)))
    else:
        new = msgpack.packb(env, use_bin_type=True) + (b"\x00" if change == "trailing" else b"")
        packets[i] = (topic, bytearray(new))
    with open(tmp_path / "packets.jsonl", "w") as fh:
        for t, q in packets:
            fh.write(json.dumps({"topic": t, "payload": bytes(q).hex()}) + "\n")
    shutil.copy(d / "keys.json", tmp_path / "keys.json")
    r = node_decoder("capture", str(tmp_path))
    assert r.returncode == 1 and "spec violation" in r.stderr, (r.returncode, r.stdout, r.stderr)
    assert WHY[change] in r.stderr, r.stderr


def test_a_changed_vector_in_the_spec_fails_the_decoder(node_decoder, tmp_path) -> None:
    text = SPEC.read_text(encoding="utf-8")
    # the join vector's num_samples 600 (cd 0258) changed to 601 without changing its printed fields
    bad = text.replace("cd02589364ccc8cd012c81a5636f72657304", "cd02599364ccc8cd012c81a5636f72657304", 1)
    assert bad != text
    (tmp_path / "PROTOCOL.md").write_text(bad, encoding="utf-8")
    r = node_decoder("spec", str(tmp_path / "PROTOCOL.md"))
    assert r.returncode == 1 and "message join" in r.stderr
