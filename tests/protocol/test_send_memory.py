"""The memory and the bytes of encoding and sending an update: headers packed around the tensors'
buffers, joined into the payload once, chunks cut as views on it.

Bytes: every payload equals msgpack's own packing of the same nested arrays (the encoder before
the one-copy change), at the sizes where the ``bin`` header changes and where the encoder starts
passing buffers by reference. Memory: ``tracemalloc`` (numpy reports its allocations to it)
measures the peak of what an encode or a whole chunked send allocates beyond the tensors that
already exist; the goal is at most 1.2× the payload, the payload itself being 1×.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import msgpack
import numpy as np
import pytest

from protocol import topics
from protocol.channel import Channel
from protocol.chunking import Reassembler
from protocol.messages import Envelope, Global, Kind, Update, decode, encode
from protocol.tensors import Codec, encode_tensor

CLIENT = "client-007"


def reference_payload(env: Envelope, codec: Codec | None = None) -> bytes:
    """The payload packed by msgpack as nested values: the body packed whole, then the envelope."""
    b = env.body
    assert isinstance(b, (Global, Update))
    tensors = [encode_tensor(t, codec) for t in b.tensors]
    if isinstance(b, Update):
        fields: list[Any] = [tensors, b.num_samples, float(b.train_loss), dict(b.metrics), bool(b.delta)]
    else:
        fields = [tensors, dict(b.meta)]
    if b.extras:
        fields.append({k: encode_tensor(v, codec) for k, v in b.extras.items()})
    body = msgpack.packb(fields, use_bin_type=True)
    return msgpack.packb([env.version, int(env.kind), env.round, env.sender, env.seq, env.timestamp_ms, body],
                         use_bin_type=True)


def update_env(*tensors: np.ndarray, extras: dict[str, np.ndarray] | None = None) -> Envelope:
    body = Update(tensors=tensors, num_samples=12, train_loss=0.25, metrics={"train_seconds": 1.5},
                  extras=extras or {})
    return Envelope(round=3, sender=CLIENT, seq=9, body=body, timestamp_ms=1_700_000_000_123)


# bin header boundaries (255/256, 65,535/65,536 bytes) and the encoder's by-reference threshold
# (4,096 bytes), as float32 element counts, each side of the boundary
@pytest.mark.parametrize("nbytes", [0, 252, 256, 4092, 4096, 4100, 65532, 65536, 262144])
def test_payload_bytes_equal_msgpack_packing(nbytes: int) -> None:
    arr = np.arange(nbytes // 4, dtype=np.float32) * np.float32(0.5)
    ints = np.arange(nbytes // 8, dtype=np.int64)
    env = update_env(arr, ints, extras={"proto": arr[: nbytes // 8].copy()})
    enc = encode(env)
    assert type(enc.payload) is bytes
    assert enc.payload == reference_payload(env)
    assert sum(n for _, n in enc.field_bytes) + 1 == enc.body_bytes  # body array header: 1 byte


@pytest.mark.parametrize("codec", ["fp16", "int8-channel", "topk:0.25", "fp16+zstd"])
def test_lossy_payload_bytes_equal_msgpack_packing(codec: str) -> None:
    arr = (np.arange(64 * 40, dtype=np.float32).reshape(64, 40) - 900.0) * np.float32(0.01)
    env = update_env(arr)
    c = Codec.parse(codec)
    if c.zstd:
        pytest.importorskip("zstandard")
    assert encode(env, c).payload == reference_payload(env, c)


def test_global_payload_bytes_equal_msgpack_packing() -> None:
    arr = np.linspace(-1, 1, 30_000, dtype=np.float32)
    env = Envelope(round=4, sender="server", seq=2, body=Global(tensors=(arr,), meta={"acc": 0.5}))
    assert encode(env).payload == reference_payload(env)


def traced_peak(fn: Any) -> tuple[int, Any]:
    """Peak bytes allocated while ``fn()`` runs (tracemalloc), and its result."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        out = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - before, out


def big_update() -> Envelope:
    """~20 MB of float32 in three tensors (a conv net's sizes)."""
    rng = np.random.default_rng(3)
    return update_env(rng.standard_normal(4_500_000, dtype=np.float32),
                      rng.standard_normal(500_000, dtype=np.float32), np.ones(10, np.float32))


def test_encoding_a_20mb_update_allocates_its_payload_once() -> None:
    env = big_update()
    peak, enc = traced_peak(lambda: encode(env))
    assert len(enc.payload) > 20_000_000
    assert peak <= 1.2 * len(enc.payload), f"peak {peak:,} B for a {len(enc.payload):,} B payload"


class CountingTransport:
    """Counts what is published and keeps none of it (the sender's memory only)."""

    client_id = CLIENT

    def __init__(self) -> None:
        self.sha = __import__("hashlib").sha256()
        self.packets = 0

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                wait_s: float | None = None) -> None:
        self.sha.update(payload)
        self.packets += 1

    def subscribe(self, filters: list[str], qos: int = 1) -> None:
        pass

    def get(self, timeout_s: float | None) -> None:
        return None

    def close(self) -> None:
        pass


class KeepingTransport(CountingTransport):
    def __init__(self) -> None:
        super().__init__()
        self.payloads: list[bytes] = []

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                wait_s: float | None = None) -> None:
        self.payloads.append(payload)


def test_sending_a_20mb_update_in_chunks_peaks_below_1_2x_its_payload() -> None:
    env = big_update()
    reference = reference_payload(env)
    ch = Channel(CountingTransport(), node_id=CLIENT, side="agent", federation="fed-a", ledger=None)
    topic = topics.up("fed-a", CLIENT, Kind.UPDATE)
    peak, enc = traced_peak(lambda: ch.send(topic, env.body, round=3))
    assert len(enc.payload) == len(reference)
    assert ch.transport.packets == -(-len(enc.payload) // ch.chunk_bytes)  # type: ignore[attr-defined]
    assert peak <= 1.2 * len(enc.payload), f"peak {peak:,} B for a {len(enc.payload):,} B payload"


def test_chunked_send_reassembles_to_the_msgpack_payload() -> None:
    env = big_update()
    tr = KeepingTransport()
    ch = Channel(tr, node_id=CLIENT, side="agent", federation="fed-a", ledger=None, chunk_bytes=3 << 20)
    enc = ch.send(topics.up("fed-a", CLIENT, Kind.UPDATE), env.body, round=3)
    r = Reassembler()
    outs = [r.add(CLIENT, decode(p).envelope.body) for p in tr.payloads]  # type: ignore[arg-type]
    whole = outs[-1]
    assert outs[:-1] == [None] * (len(outs) - 1) and whole == enc.payload
    # the same bytes msgpack packs, but for seq and timestamp_ms, which the channel chose
    e = decode(whole).envelope
    assert whole == reference_payload(Envelope(round=3, sender=CLIENT, seq=e.seq, body=env.body,
                                               timestamp_ms=e.timestamp_ms))
