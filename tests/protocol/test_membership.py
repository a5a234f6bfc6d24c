"""Member sets (``round_start.members``): round trips of random selections (every id's membership
exact, none extra), the sizes at 10, 100 and 1,000 selected devices worked out from the encoding's
definition, the spec's examples, what the decoder refuses, and the two new optional fields inside
whole messages (an old reader of the first fields sees the same values)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from protocol.errors import FieldError
from protocol.membership import (
    MAX_MEMBER_INDEX,
    bitmap_form,
    check_members,
    decode_members,
    deltas_form,
    encode_members,
    members_contain,
)
from protocol.messages import Envelope, Kind, Receipt, RoundStart, decode, encode


@pytest.mark.parametrize("seed", range(24))
def test_random_selections_round_trip_exactly(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 1200))
    rate = float(rng.choice([0.001, 0.01, 0.1, 0.5, 0.9, 1.0]))
    chosen = sorted({int(i) for i in rng.choice(n, size=max(1, int(rate * n)), replace=False)})
    for data in (encode_members(chosen), bitmap_form(chosen), deltas_form(chosen)):
        assert decode_members(data) == chosen
        # every index of the fleet (and some past it) tests right: the selected ones, and no other
        assert [i for i in range(n + 20) if members_contain(data, i)] == chosen
    assert len(encode_members(chosen)) == min(len(bitmap_form(chosen)), len(deltas_form(chosen)))


def _varint_len(v: int) -> int:
    return 1 if v < 128 else 2 if v < 16384 else 3 if v < 2097152 else 4


@pytest.mark.parametrize("m", [10, 100, 1000])
def test_sizes_by_hand_every_device_selected(m: int) -> None:
    # indices 0..m-1: the bitmap is 1 form byte + ceil(m / 8) bytes; the deltas 1 + m one-byte varints
    chosen = list(range(m))
    bitmap, deltas = 1 + (m + 7) // 8, 1 + m
    assert (len(bitmap_form(chosen)), len(deltas_form(chosen))) == (bitmap, deltas)
    assert {10: 3, 100: 14, 1000: 126}[m] == bitmap
    assert encode_members(chosen) == bitmap_form(chosen)  # the shorter
    # inside round_start: bin8 header (2 bytes) up to 255 bytes, then bin16 (3)
    assert len(msgpack.packb(encode_members(chosen), use_bin_type=True)) == bitmap + (2 if bitmap < 256 else 3)


@pytest.mark.parametrize("m", [10, 100, 1000])
def test_sizes_by_hand_one_in_ten_selected(m: int) -> None:
    # every 10th of 10·m devices: indices 0, 10, …, 10(m-1); bitmap 1 + (10(m-1)) // 8 + 1 bytes,
    # deltas 1 + m (the first delta 0, then gaps of 10, one byte each)
    chosen = list(range(0, 10 * m, 10))
    bitmap, deltas = 1 + 10 * (m - 1) // 8 + 1, 1 + m
    assert {10: 13, 100: 125, 1000: 1250}[m] == bitmap
    assert (len(bitmap_form(chosen)), len(deltas_form(chosen))) == (bitmap, deltas)
    assert encode_members(chosen) == deltas_form(chosen) == bytes([1, 0] + [10] * (m - 1))


def test_varint_sizes_and_the_spec_examples() -> None:
    assert encode_members([0, 1, 2, 9]).hex() == "000702"
    assert deltas_form([0, 1, 2, 9]).hex() == "0100010107"
    assert encode_members([300]).hex() == "01ac02" and len(bitmap_form([300])) == 1 + 38
    big = [5, 200, 20_000, MAX_MEMBER_INDEX]
    assert len(deltas_form(big)) == 1 + sum(_varint_len(d) for d in (5, 195, 19_800, MAX_MEMBER_INDEX - 20_000))
    assert decode_members(deltas_form(big)) == big
    assert encode_members([3, 3, 1]) == encode_members([1, 3])  # a set: order and repeats do not matter


@pytest.mark.parametrize("bad", [[], [-1], [MAX_MEMBER_INDEX + 1], [True]])
def test_encoder_refuses_an_empty_set_or_a_bad_index(bad) -> None:
    with pytest.raises(ValueError, match="members"):
        encode_members(bad)


@pytest.mark.parametrize("data, why", [
    (b"", "at least 2"), (b"\x00", "at least 2"), (b"\x02\x01", "unknown form"),
    (b"\x00\x00\x00", "selects no device"), (b"\x01\x80", "truncated"), (b"\x01\x85\x00", "non-minimal"),
    (b"\x01\x05\x00", "delta of 0"), (b"\x01\xff\xff\xff\xff\x01", "longer than 4"),
    (b"\x01\x80\x80\x80\x08", "exceeds"),  # 2**24
])
def test_decoder_refuses_malformed_member_sets(data: bytes, why: str) -> None:
    with pytest.raises(FieldError, match=why):
        check_members(data)


def _body(payload: bytes) -> list:
    return msgpack.unpackb(msgpack.unpackb(payload, raw=False)[6], raw=False)


def test_round_start_members_round_trip_and_old_readers_see_the_same_fields() -> None:
    members = encode_members([0, 4, 7, 999])
    env = Envelope(round=2, sender="server", seq=5, body=RoundStart(("old-1",), 30.0, {"lr": 0.1}, members=members))
    enc = encode(env)
    got = decode(enc.payload).envelope.body
    assert got == RoundStart(("old-1",), 30.0, {"lr": 0.1}, {}, members)
    body = _body(enc.payload)
    # a reader of protocol v1 before these fields reads the first three (or four) as before
    assert body[:4] == [["old-1"], 30.0, {"lr": 0.1}, {}] and body[4] == members
    assert dict(enc.field_bytes)["members"] == 2 + len(members) and dict(enc.field_bytes)["instructions"] == 1
    # without members the message has its former three fields, byte for byte
    plain = encode(Envelope(round=2, sender="server", seq=5, body=RoundStart(("old-1",), 30.0, {"lr": 0.1})))
    assert len(_body(plain.payload)) == 3 and len(enc.payload) == len(plain.payload) + 1 + 2 + len(members)


def test_members_never_beside_instructions_nor_malformed() -> None:
    with pytest.raises(FieldError, match="members"):
        encode(Envelope(round=1, sender="server", seq=1,
                        body=RoundStart(("a",), 30.0, {}, {"local_epochs": 2}, encode_members([1]))))
    with pytest.raises(FieldError, match="body.members"):
        encode(Envelope(round=1, sender="server", seq=1, body=RoundStart((), 30.0, {}, {}, b"\x07\x01")))
    body = msgpack.packb([["a"], 30.0, {}, {"local_epochs": 2}, b"\x00\x01"], use_bin_type=True)
    with pytest.raises(FieldError, match="body.members"):
        decode(msgpack.packb([1, int(Kind.ROUND_START), 1, "server", 1, 0, body], use_bin_type=True))


def test_join_receipt_member_index_round_trip_and_refused_elsewhere() -> None:
    rec = Receipt(int(Kind.JOIN), 3, True, "", bytes(32), member_index=0)
    enc = encode(Envelope(round=0, sender="server", seq=9, body=rec))
    assert decode(enc.payload).envelope.body == rec and _body(enc.payload)[5] == 0
    assert len(_body(encode(Envelope(round=0, sender="server", seq=9,
                                     body=Receipt(int(Kind.JOIN), 3, True, "", bytes(32)))).payload)) == 5
    for bad in (Receipt(int(Kind.UPDATE), 3, True, "", bytes(32), member_index=1),
                Receipt(int(Kind.JOIN), 3, False, "no", bytes(32), member_index=1)):
        with pytest.raises(FieldError, match="member_index"):
            encode(Envelope(round=0, sender="server", seq=9, body=bad))
    # received on another receipt (a placeholder before a later field) it means nothing: ignored
    body = msgpack.packb([4, 3, True, "", bytes(32), 1, "a later field"], use_bin_type=True)
    got = decode(msgpack.packb([1, int(Kind.RECEIPT), 0, "server", 1, 0, body], use_bin_type=True)).envelope.body
    assert got == Receipt(4, 3, True, "", bytes(32))
    body = msgpack.packb([4, 3, True, "", bytes(32), -1], use_bin_type=True)
    with pytest.raises(FieldError, match="body.member_index"):
        decode(msgpack.packb([1, int(Kind.RECEIPT), 0, "server", 1, 0, body], use_bin_type=True))


def test_an_empty_members_bin_is_no_set() -> None:
    body = msgpack.packb([["a"], 30.0, {}, {"local_epochs": 2}, b"", "a later field"], use_bin_type=True)
    got = decode(msgpack.packb([1, int(Kind.ROUND_START), 1, "server", 1, 0, body], use_bin_type=True)).envelope.body
    assert got == RoundStart(("a",), 30.0, {}, {"local_epochs": 2})
