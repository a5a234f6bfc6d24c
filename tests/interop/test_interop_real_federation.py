"""The Node.js decoder reads a real federation: ``simulate`` with the embedded broker, a
quickstart-sized configuration (digits, 2 clients, 2 rounds), signing and encryption on, bf16
globals, int8-channel+zstd delta updates, chunked transfers. Every PUBLISH the server and the
agents made is captured; the decoder verifies and decrypts each, reassembles the transfers,
checks every receipt's sha256 against what it acknowledges, and decodes exactly the envelopes
Python encoded, value for value."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

import protocol.channel as channel_mod
from broker_server import config as config_mod
from broker_server.simulate import simulate
from protocol.messages import BODY_FIELDS, decode
from protocol.security import load_identity, load_public
from protocol.transport import MqttTransport

pytestmark = pytest.mark.slow


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


def test_node_decodes_a_signed_encrypted_chunked_federation(tmp_path: Path, node_decoder, monkeypatch) -> None:
    cfg = config_mod.from_dict({
        "run": {"name": "interop", "seed": 1, "rounds": 2},
        "data": {"dataset": "digits", "partition": "iid", "clients": 2},
        "train": {"local_epochs": 1, "batch_size": 16, "lr": 0.05},
        "server": {"quorum": 2, "round_deadline_s": 120.0, "join_timeout_s": 60.0},
        "broker": {"kind": "amqtt"},
        "protocol": {"global_codec": "bf16", "update_codec": "int8-channel+zstd", "delta": True,
                     "chunk_bytes": 4096},
        "security": {"sign": True, "encrypt": True},
    }, "<test>")
    packets: list[tuple[str, bytes]] = []
    expected: dict = {}
    lock = threading.Lock()
    real_publish, real_encode = MqttTransport.publish, channel_mod.encode

    def publish(self, topic, payload, **kw):
        with lock:
            packets.append((topic, bytes(payload)))
        return real_publish(self, topic, payload, **kw)

    def encode(env, *args, **kwargs):
        enc = real_encode(env, *args, **kwargs)
        with lock:  # the first encoding of a (sender, seq) is the one sent (a size estimate may follow)
            expected.setdefault((env.sender, env.seq), _message_view(enc.payload))
        return enc

    monkeypatch.setattr(MqttTransport, "publish", publish)
    monkeypatch.setattr(channel_mod, "encode", encode)
    run_dir = tmp_path / "run"
    res = simulate(cfg, run_dir=run_dir)
    monkeypatch.undo()
    assert res.rounds_completed == 2

    keys_root = run_dir / "keys"
    server = load_identity(keys_root / "server")
    from cryptography.hazmat.primitives import serialization as ser

    devices = {}
    for d in sorted(keys_root.iterdir()):
        if d.name != "server":
            pub = load_public(next(d.glob("*.pub")))
            devices[pub.id] = {"ed25519": pub.ed25519.hex(), "x25519": pub.x25519.hex()}
    assert len(devices) == 2
    out = tmp_path / "capture"
    out.mkdir()
    with open(out / "packets.jsonl", "w") as fh:
        for topic, payload in packets:
            fh.write(json.dumps({"topic": topic, "payload": payload.hex()}) + "\n")
    (out / "keys.json").write_text(json.dumps({
        "server": {"ed25519": server.public.ed25519.hex(), "x25519": server.public.x25519.hex()},
        "server_x25519_private": server.exchange_key.private_bytes(ser.Encoding.Raw, ser.PrivateFormat.Raw,
                                                                   ser.NoEncryption()).hex(),
        "devices": devices}))
    r = node_decoder("capture", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout)
    got = json.loads((out / "decoded.json").read_text())
    keys = set()
    for e in got["envelopes"]:
        key = (e["sender"], e["seq"])
        assert key not in keys and e == expected[key], key
        keys.add(key)
    assert keys == set(expected)
    # signed throughout; every device message encrypted, none of the server's
    device_packets = sum(1 for t, _ in packets if "/up/" in t or "/status/" in t)
    assert summary["signed"] == len(packets) and summary["encrypted"] == device_packets > 0
    assert {"round_start", "receipt", "status", "finish", "chunk"} <= set(summary["kinds"])
    whole = {m["message"]["kind"] for m in got["messages"]}
    assert whole == {1, 2, 3, 4, 5, 6, 7}  # every kind but chunk and resend, as whole messages
    assert all(m["chunked"] for m in got["messages"] if m["message"]["kind"] in (3, 4))
    # two globals and four updates, each a transfer: bf16 (2) globals, int8-channel+zstd (0x83) updates
    assert summary["transfers"] == 2 + 2 * 2 and summary["codecs"] == ["2", "131"]
    # receipts: 2 joins + per round 2 globals and 2 updates acknowledged, each hash checked
    assert summary["receipts_checked"] >= 2 + 2 * 2 * 2
