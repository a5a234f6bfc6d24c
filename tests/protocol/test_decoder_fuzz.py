"""Property-based fuzzing of the decoders: 4 × 1,000 = 4,000 random and mutated messages
(derandomized: the same examples on every run).

Whatever the bytes, ``decode`` returns a message or raises a ``ProtocolError`` subclass: no
other exception, no hang (pytest-timeout stops the module), no unbounded memory (a payload
cannot make the decoder allocate much more than its own size, checked with tracemalloc).
"""

from __future__ import annotations

import tracemalloc

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.chunking import Reassembler
from protocol.errors import ProtocolError
from protocol.messages import (
    Chunk,
    Envelope,
    Finish,
    Global,
    Join,
    Receipt,
    Resend,
    RoundStart,
    Status,
    Update,
    decode,
    encode,
)
from protocol.tensors import Codec, encode_tensor

FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=True, database=None)

_rng = np.random.default_rng(0)
_T = _rng.standard_normal((6, 5)).astype(np.float32)
VALID = [
    encode(Envelope(round=0, sender="client-007", seq=1,
                    body=Join("rpi4", "abc123", 100, (10, 20, 70), {"torch": "2.1", "cores": 4}))).payload,
    encode(Envelope(round=3, sender="server", seq=9,
                    body=RoundStart(("client-001", "client-002"), 30.0, {"lr": 0.05, "local_epochs": 1}))).payload,
    encode(Envelope(round=3, sender="server", seq=10, body=Global((_T, _T[0]), {"manifest_hash": "x"})),
           Codec.parse("fp16")).payload,
    encode(Envelope(round=3, sender="client-007", seq=4, body=Update((_T,), 12, 0.25, {"acc": 0.9}, True)),
           Codec.parse("int8+zstd")).payload,
    encode(Envelope(round=3, sender="client-007", seq=5, body=Update((_T,), 12, 0.25)),
           Codec.parse("topk:0.2")).payload,
    encode(Envelope(round=10, sender="server", seq=99, body=Finish("completed", 10))).payload,
    encode(Envelope(round=0, sender="client-007", seq=2, body=Status("online", ""))).payload,
    encode(Envelope(round=3, sender="server", seq=11, body=Receipt(4, 4, True, "", bytes(32)))).payload,
    encode(Envelope(round=3, sender="client-007", seq=6,
                    body=Chunk(bytes(16), 0, 2, 0, 10, bytes(32), b"hello"))).payload,
    encode(Envelope(round=3, sender="server", seq=12, body=Resend(bytes(16), (1, 3)))).payload,
]


def _decode_bounded(data: bytes) -> None:
    tracemalloc.start()
    try:
        decode(data)
    except ProtocolError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    # a decoder may copy what it reads (a few times), never allocate from a claimed size
    assert peak <= 8 * len(data) + 2_000_000, f"{peak} bytes allocated for a {len(data)}-byte payload"


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes(data: bytes) -> None:
    _decode_bounded(data)


@FUZZ
@given(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255),
                                                   st.sampled_from(["flip", "insert", "delete", "set"])),
                                        min_size=1, max_size=8))
def test_mutated_valid_messages(payload: bytes, edits) -> None:
    b = bytearray(payload)
    for pos, val, op in edits:
        if not b:
            break
        i = pos % len(b)
        if op == "flip":
            b[i] ^= 1 << (val % 8)
        elif op == "insert":
            b.insert(i, val)
        elif op == "delete":
            del b[i]
        else:
            b[i] = val
    _decode_bounded(bytes(b))


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64 - 1), st.floats(), st.text(max_size=20),
                  st.binary(max_size=40))
_obj = st.recursive(_leaf, lambda c: st.one_of(st.lists(c, max_size=6), st.dictionaries(st.text(max_size=5), c,
                                                                                        max_size=4)),
                    max_leaves=30)


def _pack(obj) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return b"\xc1"


@FUZZ
@given(st.integers(0, 3), st.integers(0, 12), st.integers(-1, 2**40), _obj, _obj)
def test_well_formed_msgpack_with_wrong_content(version: int, kind: int, rnd: int, body, extra) -> None:
    """Envelopes that are valid msgpack with plausible headers and arbitrary bodies."""
    body_bin = _pack(body) if not isinstance(body, bytes) else body
    _decode_bounded(_pack([version, kind, rnd, "client-1", 1, 0, body_bin, extra]))
    _decode_bounded(_pack([1, kind, abs(rnd), "client-1", 1, 0, _pack([body, extra, [0, 1, [3], b"\x00" * 12]])]))


@FUZZ
@given(st.integers(0, 40), st.integers(0, 3), st.integers(0, 200), st.binary(max_size=64), st.booleans())
def test_reassembler_never_leaks_another_exception(index: int, count: int, total: int, data: bytes,
                                                   same_tid: bool) -> None:
    r = Reassembler(max_bytes=10_000, max_transfers=4, max_transfer_bytes=1_000)
    tid = bytes(16) if same_tid else bytes([index % 256]) * 16
    for i in range(3):
        c = Chunk(tid, index + i, max(count, 1), (index + i) * len(data), total, bytes(32), data)
        try:
            r.add("client-1", c)
        except ProtocolError:
            pass
    assert r.buffered_bytes <= 10_000


def test_a_huge_claimed_tensor_is_refused_without_allocating() -> None:
    tensor = [0, 1, [1 << 20, 1 << 20], b"\x00" * 16]
    payload = msgpack.packb([1, 4, 1, "client-1", 1, 0, msgpack.packb([[tensor], 1, 0.0, {}])])
    _decode_bounded(payload)
    assert encode_tensor(np.zeros(3, np.float32))[2] == [3]
