"""Tests of the lossy and compressed tensor codecs of :mod:`protocol.tensors`.

Every expected value is computed here independently of the code under test: fp16 by numpy's own
cast, bf16 by a pure-Python exact-distance reference (``fractions.Fraction``) and a float64
nearest-candidate reference, int8 by the formula of the module table, top-k by a stable argsort,
LEB128 by hand-worked bytes, error feedback by a plain numpy loop. Byte-exact hex vectors are
checked in both directions (decode only for zstd frames, whose bytes vary across zstd versions).
The decoder is tested like a codec (STYLE.md 9): a table of hostile tensors, each with an id,
expects a named error class and field; random mutations raise nothing but ``ProtocolError``.
"""

from __future__ import annotations

import math
import re
import struct
import tracemalloc
from fractions import Fraction

import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from protocol import tensors
from protocol.errors import MalformedMessage, ProtocolError, TensorError
from protocol.messages import Update, decode
from protocol.tensors import (
    CODECS,
    Codec,
    ErrorFeedback,
    TensorLimits,
    codec_name,
    decode_tensor,
    encode_tensor,
    encoded_nbytes,
    varint_decode,
    varint_encode,
)
from protocol.test_vectors import DECODE_ONLY, TEST_VECTORS

SHAPES = [(), (0,), (1,), (3, 0), (10, 64), (1000, 10), (16, 1, 3, 3)]
ALLOW_NONFINITE = TensorLimits(allow_nonfinite=True)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def over_wire(obj) -> list:
    """What a peer's decoder receives: the tensor packed and unpacked by msgpack."""
    return msgpack.unpackb(pack(obj), raw=False)


def roundtrip(x: np.ndarray, text: str | None, **kw) -> tuple[list, np.ndarray]:
    wire = encode_tensor(x, None if text is None else Codec.parse(text))
    return wire, decode_tensor(over_wire(wire), **kw)


def rand(shape, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def bits_f32(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u))[0]


# ------------------------------------------------------------------------------------------
# Numbers and names


def test_codec_numbers_are_fixed_and_documented() -> None:
    assert CODECS == {0: "raw", 1: "fp16", 2: "bf16", 3: "int8", 4: "topk"}
    assert tensors.ZSTD_FLAG == 0x80
    for number, name in CODECS.items():
        assert re.search(rf"^{number}\s+{re.escape(name)}\s+\S", tensors.__doc__, re.M), name
    assert codec_name(0x81) == "fp16+zstd"
    assert codec_name(4) == "topk"
    for bad in (5, 0x85, -1, 256, True):
        with pytest.raises(ValueError):
            codec_name(bad)


# ------------------------------------------------------------------------------------------
# Codec.parse grammar

PARSE_OK = [
    ("fp32", Codec("fp32"), "fp32"),
    ("fp16", Codec("fp16"), "fp16"),
    ("bf16", Codec("bf16"), "bf16"),
    ("int8", Codec("int8"), "int8"),
    ("int8-channel", Codec("int8-channel"), "int8-channel"),
    ("fp32+zstd", Codec("fp32", zstd=True), "fp32+zstd"),
    ("fp16+zstd", Codec("fp16", zstd=True), "fp16+zstd"),
    ("int8+zstd:1", Codec("int8", zstd=True), "int8+zstd"),
    ("int8-channel+zstd:19", Codec("int8-channel", zstd=True, zstd_level=19), "int8-channel+zstd:19"),
    ("topk:0.1", Codec("topk", topk_fraction=0.1), "topk:0.1"),
    ("topk:500", Codec("topk", topk_k=500), "topk:500"),
    ("topk:1", Codec("topk", topk_k=1), "topk:1"),
    ("topk:1.0", Codec("topk", topk_fraction=1.0), "topk:1.0"),
    ("topk:.5", Codec("topk", topk_fraction=0.5), "topk:0.5"),
    ("topk:1e-3", Codec("topk", topk_fraction=0.001), "topk:0.001"),
    ("topk:1e-05", Codec("topk", topk_fraction=1e-05), "topk:1e-05"),
    ("topk:0.1:fp32", Codec("topk", topk_fraction=0.1), "topk:0.1"),
    ("topk:0.1:fp16", Codec("topk", topk_fraction=0.1, topk_values="fp16"), "topk:0.1:fp16"),
    ("topk:0.1:fp16+zstd", Codec("topk", zstd=True, topk_fraction=0.1, topk_values="fp16"), "topk:0.1:fp16+zstd"),
    ("topk:64+zstd:3", Codec("topk", zstd=True, zstd_level=3, topk_k=64), "topk:64+zstd:3"),
]


@pytest.mark.parametrize(("text", "want", "canonical"), PARSE_OK, ids=[c[0] for c in PARSE_OK])
def test_codec_parse(text: str, want: Codec, canonical: str) -> None:
    got = Codec.parse(text)
    assert got == want
    assert str(got) == canonical
    assert Codec.parse(str(got)) == got


PARSE_BAD = ["", "FP16", "fp16 ", " fp16", "fp64", "int4", "raw", "topk", "topk:", "topk:0", "topk:-1",
             "topk:0.0", "topk:1.5", "topk:1e3", "topk:nan", "topk:inf", "topk:abc", "topk:0.1:bf16",
             "topk:0.1:fp16:x", "topk:10:", "fp16+", "fp16+lz4", "fp16+zstd:0", "fp16+zstd:23", "fp16+zstd:",
             "fp16+zstd:x", "fp16+zstd+zstd", "int8:0.1", "fp16:fp16", "zstd", "+zstd"]


@pytest.mark.parametrize("text", PARSE_BAD, ids=[repr(t) for t in PARSE_BAD])
def test_codec_parse_refuses(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape("allowed: fp32 | fp16 | bf16 | int8 | int8-channel | topk:K")):
        Codec.parse(text)


@pytest.mark.parametrize("kwargs", [
    {"name": "fp8"}, {"name": "topk"}, {"name": "topk", "topk_k": 1, "topk_fraction": 0.5},
    {"name": "topk", "topk_k": 0}, {"name": "topk", "topk_fraction": 0.0}, {"name": "topk", "topk_fraction": 2.0},
    {"name": "topk", "topk_fraction": float("nan")}, {"name": "topk", "topk_k": 1, "topk_values": "int8"},
    {"name": "fp16", "topk_k": 3}, {"name": "int8", "topk_values": "fp16"}, {"name": "fp16", "zstd_level": 0},
    {"name": "fp16", "zstd": 1},
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_codec_constructor_refuses_inconsistent_fields(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Codec(**kwargs)


def test_codec_parse_refuses_non_strings() -> None:
    with pytest.raises(ValueError, match="allowed"):
        Codec.parse(None)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------
# Round trips and error bounds, per codec


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("zstd", [False, True], ids=["plain", "zstd"])
def test_fp32_is_exact(shape: tuple, zstd: bool) -> None:
    x = rand(shape)
    wire, got = roundtrip(x, "fp32+zstd" if zstd else "fp32")
    assert wire[0] == (0x80 if zstd else 0)
    assert got.shape == x.shape and got.dtype == np.float32
    assert got.tobytes() == x.tobytes()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp16_equals_numpy_half_cast(shape: tuple) -> None:
    x = rand(shape, scale=100.0)
    wire, got = roundtrip(x, "fp16")
    assert wire[:3] == [1, 1, list(shape)]
    assert got.dtype == np.float32 and got.shape == x.shape
    assert got.tobytes() == x.astype(np.float16).astype(np.float32).tobytes()
    assert encoded_nbytes(wire) == 2 * x.size


def test_fp16_overflow_is_refused_not_clipped() -> None:
    ok = np.array([65504.0, -65519.0, 65519.99], np.float32)  # all round to ±65504
    np.testing.assert_array_equal(roundtrip(ok, "fp16")[1], [65504.0, -65504.0, 65504.0])
    for v in (65520.0, -1e6, 3e38):
        with pytest.raises(TensorError, match="overflows fp16") as exc:
            encode_tensor(np.array([1.0, v], np.float32), Codec.parse("fp16"), field="body.tensors[7]")
        assert exc.value.field == "body.tensors[7]"
        assert "body.tensors[7]" in str(exc.value)
    with pytest.raises(TensorError, match="1e\\+06 overflows fp16"):
        encode_tensor(np.array([1e6], np.float32), Codec.parse("topk:1:fp16"))


def test_fp16_passes_nan_and_inf_through_to_the_decoder_policy() -> None:
    x = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    wire = encode_tensor(x, Codec.parse("fp16"))
    got = decode_tensor(over_wire(wire), limits=ALLOW_NONFINITE)
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf and got[3] == 1.0
    with pytest.raises(TensorError, match="NaN or Inf") as exc:
        decode_tensor(over_wire(wire), field="body.tensors[0]")
    assert exc.value.field == "body.tensors[0]"


# bf16 references ---------------------------------------------------------------------------


def bf16_python(v: float) -> int:
    """bf16 bit pattern of float32 ``v`` by exact distances (Fraction), ties to even."""
    u = f32_bits(v)
    if math.isnan(v):
        return None  # type: ignore[return-value]  # NaN: checked by value, not by pattern
    if math.isinf(v):
        return u >> 16
    lo = u >> 16
    hi = lo + 1
    x = Fraction(bits_f32(u))

    def value(h: int) -> Fraction:
        if h & 0x7FFF == 0x7F80:  # one past the largest finite: rounds as if to ±2**128
            return Fraction(-(2**128) if h & 0x8000 else 2**128)
        return Fraction(bits_f32(h << 16))

    d_lo, d_hi = abs(x - value(lo)), abs(x - value(hi))
    if d_lo != d_hi:
        return lo if d_lo < d_hi else hi
    return lo if lo % 2 == 0 else hi


def bf16_numpy_reference(x: np.ndarray) -> np.ndarray:
    """Nearest of the two bf16 candidates in float64 (exact for float32 inputs), ties to even."""
    u = x.view(np.uint32).astype(np.uint64)
    lo = (u >> 16) << 16
    hi = lo + 0x10000
    f_lo = lo.astype(np.uint32).view(np.float32).astype(np.float64)
    f_hi = hi.astype(np.uint32).view(np.float32).astype(np.float64)
    x64 = x.astype(np.float64)
    d_lo, d_hi = np.abs(x64 - f_lo), np.abs(x64 - f_hi)
    even_lo = ((lo >> 16) & 1) == 0
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(even_lo, lo, hi)))
    return pick.astype(np.uint32).view(np.float32)


BF16_CASES = [
    (1 + 2**-8, 1.0),                      # tie, 0x3F80 is even: down
    (1 + 3 * 2**-8, 1 + 2**-6),            # tie, 0x3F81 is odd: up to 0x3F82
    (-(1 + 2**-8), -1.0),
    (-(1 + 3 * 2**-8), -(1 + 2**-6)),
    (1 + 2**-8 + 2**-20, 1 + 2**-7),       # just above the tie: up
    (0.1, 0.10009765625),
    (-0.0, -0.0),
    (3.3895313892515355e38, 3.3895313892515355e38),  # the largest finite bf16, exact
    (1e-40, 9.183549615799121e-41),        # float32 subnormal
    (float("inf"), float("inf")),
    (float("-inf"), float("-inf")),
]


@pytest.mark.parametrize(("v", "want"), BF16_CASES, ids=[repr(c[0]) for c in BF16_CASES])
def test_bf16_hand_cases(v: float, want: float) -> None:
    v32 = float(np.float32(v))
    assert bf16_python(v32) << 16 == f32_bits(want)  # the reference agrees with the hand value
    got = roundtrip(np.array([v32], np.float32), "bf16", limits=ALLOW_NONFINITE)[1]
    assert f32_bits(float(got[0])) == f32_bits(want)
    assert f32_bits(float(got[0])) == bf16_python(v32) << 16


@pytest.mark.parametrize("nan_bits", [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFF800001, 0x7F80FFFF])
def test_bf16_keeps_nan_a_nan_with_its_sign(nan_bits: int) -> None:
    x = np.array([nan_bits], np.uint32).view(np.float32)
    wire = encode_tensor(x, Codec.parse("bf16"))
    h = struct.unpack("<H", bytes(wire[3]))[0]
    assert h & 0x7F80 == 0x7F80 and h & 0x007F  # exponent all ones, mantissa non-zero: NaN, not Inf
    assert h >> 15 == nan_bits >> 31
    got = decode_tensor(over_wire(wire), limits=ALLOW_NONFINITE)
    assert np.isnan(got[0]) and bool(np.signbit(got[0])) == bool(nan_bits >> 31)


def test_bf16_overflow_is_refused() -> None:
    for v in (np.finfo(np.float32).max, -3.4e38):  # past the midpoint of 0x7F7F and 2**128
        with pytest.raises(TensorError, match="overflows bf16"):
            encode_tensor(np.array([v], np.float32), Codec.parse("bf16"))
    with pytest.raises(TensorError, match="overflows bf16"):  # float64 beyond the float32 range
        encode_tensor(np.array([1e300], np.float64), Codec.parse("bf16"))
    with pytest.raises(TensorError, match="finite"):
        encode_tensor(np.array([1e300], np.float64), Codec.parse("int8"))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bf16_matches_the_reference(shape: tuple) -> None:
    x = rand(shape, scale=10.0)
    # put exact ties in: a bf16 value plus half a bf16 ulp
    if x.size:
        flat = x.reshape(-1)
        ties = (flat[::3].view(np.uint32) & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
        flat[::3] = ties.view(np.float32)
    wire, got = roundtrip(x, "bf16")
    assert got.tobytes() == bf16_numpy_reference(x).tobytes()
    assert encoded_nbytes(wire) == 2 * x.size
    for v, g in zip(x.reshape(-1)[:50].tolist(), got.reshape(-1)[:50].tolist()):
        assert f32_bits(g) == bf16_python(v) << 16


def test_bf16_of_float64_rounds_through_float32() -> None:
    x = np.array([0.1, -2.5, 1e-3], np.float64)
    wire, got = roundtrip(x, "bf16")
    assert wire[1] == 3 and got.dtype == np.float64
    np.testing.assert_array_equal(got, bf16_numpy_reference(x.astype(np.float32)).astype(np.float64))


# int8 ---------------------------------------------------------------------------------------


def int8_bound_ok(x: np.ndarray, got: np.ndarray, scale: np.ndarray) -> bool:
    """``|x - x̂| <= scale / 2`` up to float32 rounding of x / scale and q * scale."""
    err = np.abs(x.astype(np.float64) - got.astype(np.float64))
    s = scale.astype(np.float64)
    return bool((err <= s / 2 + s * 256 * np.finfo(np.float32).eps + 1e-45).all())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_per_tensor(shape: tuple) -> None:
    x = rand(shape, seed=3, scale=0.05)
    wire, got = roundtrip(x, "int8")
    assert wire[0] == 3 and wire[4] == -1
    scale = np.frombuffer(wire[5], "<f4")
    want_scale = np.float32(np.abs(x).max()) / np.float32(127) if x.size else np.float32(0)
    assert scale.tolist() == [want_scale]
    assert encoded_nbytes(wire) == x.size + 4
    assert got.dtype == np.float32 and got.shape == x.shape
    q = np.frombuffer(wire[3], np.int8)
    if x.size:
        assert q.min() >= -127 and q.max() <= 127 and np.abs(q).max() == 127
        assert int8_bound_ok(x, got, np.broadcast_to(scale[0], x.shape))
        np.testing.assert_array_equal(got.reshape(-1), q.astype(np.float32) * scale[0])


@pytest.mark.parametrize("shape", [(10, 64), (1000, 10), (16, 1, 3, 3), (4, 0), (0, 3)], ids=str)
def test_int8_per_channel(shape: tuple) -> None:
    magnitude = np.resize(np.array([0.01, 1.0, 100.0], np.float32), shape[0])  # channels of unequal range
    x = rand(shape, seed=4) * magnitude.reshape((-1,) + (1,) * (len(shape) - 1))
    if x.size:
        x[1] = 0.0  # an all-zero channel
    wire, got = roundtrip(x, "int8-channel")
    assert wire[4] == 0
    scales = np.frombuffer(wire[5], "<f4")
    assert scales.size == shape[0]
    assert encoded_nbytes(wire) == x.size + 4 * shape[0]
    for c in range(shape[0]):
        row = x[c]
        want = np.float32(np.abs(row).max()) / np.float32(127) if row.size else np.float32(0)
        assert scales[c] == want
        assert int8_bound_ok(row, got[c], np.broadcast_to(scales[c], row.shape))
    if x.size:
        assert scales[1] == 0 and not got[1].any()


@pytest.mark.parametrize("shape", [(), (5,)], ids=str)
def test_int8_channel_falls_back_to_per_tensor_below_two_dims(shape: tuple) -> None:
    wire, _ = roundtrip(rand(shape), "int8-channel")
    assert wire[4] == -1 and len(wire[5]) == 4


def test_int8_zero_tensor_has_scale_zero_and_decodes_to_zeros() -> None:
    wire, got = roundtrip(np.zeros((3, 4), np.float32), "int8")
    assert np.frombuffer(wire[5], "<f4").tolist() == [0.0] and wire[3] == bytes(12)
    assert not got.any()


@pytest.mark.parametrize("codec", ["int8", "int8-channel", "topk:2"])
def test_int8_and_topk_refuse_nonfinite_input(codec: str) -> None:
    for bad in (np.nan, np.inf):
        with pytest.raises(TensorError, match="finite") as exc:
            encode_tensor(np.array([[1.0, bad], [0.0, 2.0]], np.float32), Codec.parse(codec), field="t[1]")
        assert exc.value.field == "t[1]"


# topk ---------------------------------------------------------------------------------------


def topk_reference(x: np.ndarray, k: int) -> np.ndarray:
    """Flat indices of the k largest |x|, ties to the lower index (stable sort), ascending."""
    order = np.argsort(-np.abs(x.reshape(-1)), kind="stable")
    return np.sort(order[:k])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("text", ["topk:0.1", "topk:0.1:fp16", "topk:1.0", "topk:7"])
def test_topk_keeps_exactly_the_k_largest(shape: tuple, text: str) -> None:
    x = rand(shape, seed=5)
    if x.size > 4:
        x.reshape(-1)[[0, 2, 3]] = x.reshape(-1)[1]  # ties
    codec = Codec.parse(text)
    n = x.size
    k = min(codec.topk_k, n) if codec.topk_k else (max(1, math.ceil(codec.topk_fraction * n)) if n else 0)
    wire, got = roundtrip(x, text)
    assert wire[0] == 4 and wire[4] == k and wire[5] == (1 if ":fp16" in text else 0)
    idx = topk_reference(x, k)
    values = x.reshape(-1)[idx]
    if ":fp16" in text:
        values = values.astype(np.float16).astype(np.float32)
    want = np.zeros(n, np.float32)
    want[idx] = values
    assert got.shape == x.shape and got.tobytes() == want.reshape(x.shape).tobytes()
    deltas = np.diff(idx, prepend=0)
    assert wire[6] == b"".join(leb128(int(d)) for d in deltas)
    assert encoded_nbytes(wire) == k * (2 if ":fp16" in text else 4) + len(wire[6])


def test_topk_fraction_and_count() -> None:
    x = rand((640,))
    assert encode_tensor(x, Codec.parse("topk:0.1"))[4] == 64
    assert encode_tensor(x, Codec.parse("topk:0.0001"))[4] == 1           # max(1, ceil(0.064))
    assert encode_tensor(x, Codec.parse("topk:0.00157"))[4] == 2          # ceil(1.0048)
    assert encode_tensor(x, Codec.parse("topk:5000"))[4] == 640           # k clipped to n
    assert encode_tensor(np.zeros(0, np.float32), Codec.parse("topk:0.5"))[4] == 0
    assert encode_tensor(np.zeros(0, np.float32), Codec.parse("topk:3"))[4] == 0


def test_topk_ties_go_to_the_lower_index() -> None:
    x = np.array([0.5, -2.0, 2.0, 1.0, -2.0, 2.0], np.float32)
    got = roundtrip(x, "topk:3")[1]
    np.testing.assert_array_equal(got, [0.0, -2.0, 2.0, 0.0, -2.0, 0.0])
    got = roundtrip(np.zeros(5, np.float32), "topk:2")[1]
    assert not got.any()


# LEB128 ---------------------------------------------------------------------------------------


def leb128(v: int) -> bytes:
    """Unsigned LEB128, written out the textbook way."""
    out = bytearray()
    while True:
        byte = v & 0x7F
        v >>= 7
        if v:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def test_varint_hand_worked_example() -> None:
    # indices [3, 130, 131]: deltas 3, 127, 1 → 0x03, 0x7f, 0x01
    assert varint_encode(np.diff(np.array([3, 130, 131]), prepend=0)) == bytes.fromhex("037f01")
    # 300 = 0b10_0101100 → low group 0101100 | 0x80 = 0xac, then 0b10 = 0x02
    assert varint_encode(np.array([300])) == bytes.fromhex("ac02")
    assert varint_encode(np.array([0, 127, 128, 16383, 16384])) == bytes.fromhex("007f8001ff7f808001")
    assert varint_encode(np.array([2**64 - 1], np.uint64)) == bytes.fromhex("ff" * 9 + "01")
    assert varint_decode(bytes.fromhex("037f01"), 3).tolist() == [3, 127, 1]
    assert varint_decode(bytes.fromhex("ff" * 9 + "01"), 1).tolist() == [2**64 - 1]
    x = np.zeros(140, np.float32)
    x[[3, 130, 131]] = [1.0, 2.0, 3.0]
    assert encode_tensor(x, Codec.parse("topk:3"))[6] == bytes.fromhex("037f01")


@given(st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=50))
def test_varint_matches_textbook_leb128(values: list[int]) -> None:
    want = b"".join(leb128(v) for v in values)
    assert varint_encode(np.array(values, np.uint64)) == want
    assert varint_decode(want, len(values)).tolist() == values


@pytest.mark.parametrize(("data", "count", "why"), [
    (b"\x80", 1, "truncated"),
    (b"\x03\x7f\x81", 3, "truncated"),
    (b"\x80" * 10 + b"\x01", 1, "longer than 10"),
    (b"\xff" * 9 + b"\x02", 1, "above 2\\*\\*64"),
    (b"\x80\x00", 1, "non-minimal"),
    (b"\x03\x01", 1, "2 varints, 1 expected"),
    (b"\x03", 2, "1 varints, 2 expected"),
    (b"", 1, "empty"),
], ids=["one-truncated", "last-truncated", "11-bytes", "over-2**64", "non-minimal", "trailing", "too-few", "empty"])
def test_varint_decode_refuses(data: bytes, count: int, why: str) -> None:
    with pytest.raises(TensorError, match=why):
        varint_decode(data, count, field="x.indices")


# ------------------------------------------------------------------------------------------
# zstd


@pytest.mark.parametrize("text", ["fp32", "fp16", "bf16", "int8", "int8-channel", "topk:0.1", "topk:0.1:fp16"])
def test_zstd_variant_decodes_identically_and_wraps_only_data(text: str) -> None:
    x = rand((64, 33), seed=9)
    plain = encode_tensor(x, Codec.parse(text))
    packed = encode_tensor(x, Codec.parse(text + "+zstd"))
    assert packed[0] == plain[0] | 0x80
    assert packed[1:3] == plain[1:3] and packed[4:] == plain[4:]  # params are not compressed
    frame = packed[3]
    assert frame[:4] == b"\x28\xb5\x2f\xfd"  # zstd magic
    assert zstandard.get_frame_parameters(frame).content_size == len(plain[3])
    assert zstandard.ZstdDecompressor().decompress(frame) == bytes(plain[3])
    a = decode_tensor(over_wire(plain))
    b = decode_tensor(over_wire(packed))
    assert a.tobytes() == b.tobytes() and a.shape == b.shape


@pytest.mark.parametrize("text", ["fp32", "fp16", "int8"])
def test_zstd_is_smaller_on_compressible_data(text: str) -> None:
    x = np.repeat(rand((100,), seed=1), 50).reshape(100, 50)  # runs of equal values
    x[:, 25:] = 0.0
    plain = encode_tensor(x, Codec.parse(text))
    packed = encode_tensor(x, Codec.parse(text + "+zstd"))
    assert encoded_nbytes(packed) < 0.6 * encoded_nbytes(plain)
    high = encode_tensor(x, Codec.parse(text + "+zstd:19"))
    assert decode_tensor(over_wire(high)).tobytes() == decode_tensor(over_wire(plain)).tobytes()


def test_soft_prediction_wire_size_under_int8_zstd() -> None:
    """[1000, 10] float32 softmax outputs (logits N(0, 3²), seed 0): 40,000 bytes raw.

    int8 cuts the data to 10,000 bytes + one 4-byte scale; zstd level 1 then packs the many
    near-zero probabilities (q = 0) to about 5.6 kB: measured 5,566 bytes of data+scale and
    5,581 bytes of msgpack tensor (zstandard 0.25 / libzstd 1.5.7). Bounds below leave room for
    other zstd versions.
    """
    logits = np.random.default_rng(0).normal(0.0, 3.0, (1000, 10))
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p = (p / p.sum(axis=1, keepdims=True)).astype(np.float32)
    raw = encode_tensor(p, Codec.parse("fp32"))
    plain = encode_tensor(p, Codec.parse("int8"))
    packed = encode_tensor(p, Codec.parse("int8+zstd"))
    assert encoded_nbytes(raw) == 40_000 and len(pack(raw)) == 40_000 + 11
    assert encoded_nbytes(plain) == 10_004
    assert len(pack(plain)) == 10_004 + 14  # fixarray, codec, dtype, shape 5, bin16 hdr 3, -1, bin8 hdr 2
    assert 4_000 < encoded_nbytes(packed) < 7_000
    assert len(pack(packed)) == encoded_nbytes(packed) + (15 if encoded_nbytes(packed) - 4 < 65536 else 17)
    got = decode_tensor(over_wire(packed))
    assert np.abs(got - p).max() <= np.float32(p.max()) / 127 / 2 + 1e-7


def _streamed_zeros_frame(nbytes: int, *, write_content_size: bool) -> bytes:
    """A zstd frame of ``nbytes`` zeros, compressed in 1 MiB pieces (the input is never whole)."""
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=write_content_size)
    cobj = cctx.compressobj(size=nbytes if write_content_size else -1)
    chunk = bytes(1 << 20)
    parts = [cobj.compress(chunk) for _ in range(nbytes >> 20)]
    parts.append(cobj.flush())
    return b"".join(parts)


@pytest.mark.parametrize("declared", [True, False], ids=["size-in-header", "no-size-in-header"])
def test_zstd_bomb_is_refused_without_allocating(declared: bool) -> None:
    frame = _streamed_zeros_frame(100 << 20, write_content_size=declared)
    assert len(frame) < 100_000
    obj = over_wire([0x81, 1, [2, 3], frame])
    tracemalloc.start()
    try:
        with pytest.raises(TensorError, match="zstd") as exc:
            decode_tensor(obj, field="body.tensors[0]")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert exc.value.field == "body.tensors[0].data"
    assert peak < 1 << 20, f"decoder allocated {peak} bytes for a 12-byte tensor"


def test_zstd_frame_without_content_size_is_accepted_when_exact() -> None:
    x = rand((2, 3))
    data = zstandard.ZstdCompressor(write_content_size=False).compress(x.astype(np.float16).tobytes())
    assert zstandard.get_frame_parameters(data).content_size == zstandard.CONTENTSIZE_UNKNOWN
    got = decode_tensor([0x81, 1, [2, 3], data])
    np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float32))
    empty = zstandard.ZstdCompressor(write_content_size=False).compress(b"")
    assert decode_tensor([0x81, 1, [0, 3], empty]).shape == (0, 3)


def test_zstd_missing_gives_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    wire = over_wire(encode_tensor(rand((4,)), Codec.parse("fp16+zstd")))
    monkeypatch.setattr(tensors, "_zstd", None)
    with pytest.raises(ImportError, match="pip install zstandard"):
        encode_tensor(rand((4,)), Codec.parse("fp16+zstd"))
    with pytest.raises(TensorError, match="pip install zstandard") as exc:
        decode_tensor(wire, field="t")
    assert exc.value.field == "t.data"
    # without zstd the other codecs still work
    assert roundtrip(rand((4,)), "int8")[1].shape == (4,)


# ------------------------------------------------------------------------------------------
# Sizes, dtypes, zero-copy, 0-d


@pytest.mark.parametrize("n", [0, 1, 31, 32, 127, 128, 255, 256, 65535, 65536])
@pytest.mark.parametrize("text", ["fp32", "fp16", "bf16", "int8", "int8-channel", "topk:0.5"])
def test_sizes_at_msgpack_bin_boundaries(n: int, text: str) -> None:
    x = rand((n,), seed=n)
    wire = encode_tensor(x, Codec.parse(text))
    b = pack(wire)
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(b)
    obj = unpacker.unpack()
    assert unpacker.tell() == len(b)  # consumed exactly
    k = max(1, math.ceil(0.5 * n)) if n else 0
    want = {"fp32": 4 * n, "fp16": 2 * n, "bf16": 2 * n, "int8": n + 4, "int8-channel": n + 4,
            "topk:0.5": 4 * k + len(wire[-1])}[text]
    assert encoded_nbytes(wire) == encoded_nbytes(obj) == want
    decode_tensor(obj)


@pytest.mark.parametrize("dtype", ["<i8", "<i4", "<i2", "i1", "u1", "?"])
@pytest.mark.parametrize("text", ["fp16", "bf16", "int8", "int8-channel", "topk:1", "fp16+zstd"])
def test_non_float_tensors_are_always_raw(dtype: str, text: str) -> None:
    x = (np.arange(12) % 3).astype(dtype).reshape(3, 4)
    wire, got = roundtrip(x, text)
    assert wire[0] == 0 and len(wire) == 4
    assert got.dtype == np.dtype(dtype) and got.tobytes() == x.tobytes()


def test_dtype_is_the_decoded_dtype_for_float16_and_float64() -> None:
    for dtype in (np.float16, np.float64):
        x = rand((5, 4)).astype(dtype)
        for text in ("fp16", "bf16", "int8", "topk:3", "int8+zstd"):
            wire, got = roundtrip(x, text)
            assert wire[1] == {np.float16: 2, np.float64: 3}[dtype] and got.dtype == dtype and got.shape == x.shape


def test_raw_decode_is_still_zero_copy_and_read_only() -> None:
    x = rand((10, 64))
    data = x.tobytes()
    got = decode_tensor([0, 1, [10, 64], data])
    assert np.shares_memory(got, np.frombuffer(data, np.uint8))
    assert not got.flags.writeable
    view = decode_tensor(encode_tensor(x))  # memoryview data, no msgpack in between
    assert not view.flags.writeable and view.tobytes() == data


@pytest.mark.parametrize("text", [None, "fp32", "fp16", "bf16", "int8", "int8-channel", "topk:1", "fp16+zstd"])
def test_zero_dim_tensor_keeps_its_shape(text: str | None) -> None:
    x = np.array(-3.5, np.float32)
    wire, got = roundtrip(x, text)
    assert wire[2] == [] and got.shape == ()
    assert abs(float(got) + 3.5) <= 4e-7  # exact except int8, where it is -127 * float32(3.5 / 127)


def test_lossy_decoders_return_writable_new_arrays() -> None:
    for text in ("fp16", "bf16", "int8", "topk:3"):
        wire = over_wire(encode_tensor(rand((3, 3)), Codec.parse(text)))
        got = decode_tensor(wire)
        assert got.flags.writeable and not np.shares_memory(got, np.frombuffer(wire[3], np.uint8))


def test_compressed_tensor_inside_an_update_message() -> None:
    """messages.decode hands every tensor to decode_tensor, so any codec works inside a body."""
    x = rand((16, 8))
    tensor = encode_tensor(x, Codec.parse("int8+zstd"))
    body = pack([[tensor], 10, 0.5, {}])
    payload = pack([1, 4, 3, "client-007", 5, 1_700_000_000_000, body])
    got = decode(payload).envelope.body
    assert isinstance(got, Update)
    np.testing.assert_array_equal(got.tensors[0], decode_tensor(over_wire(tensor)))


# ------------------------------------------------------------------------------------------
# Hex test vectors (also in protocol/test_vectors.py, for PROTOCOL.md and a C implementation)

EXPECTED_HEX = {
    "fp32": "940001920203c4180000003f0000a0bf000040400000000000000040000000be",
    "fp32-scalar": "94000190c40400006040",
    "fp16": "940101920203c40c003800bd00420000004000b0",
    "fp16-rounding": "9401019106c40c662e003c023cff7b01000080",
    "bf16": "940201920203c40c003fa0bf40400000004000be",
    "bf16-rounding": "9402019106c40c803f823f82bfcd3d627f0100",
    "int8": "960301920203c40615cb7f0055fbffc4040683c13c",
    "int8-channel": "960301920203c40615cb7f007ff800c4080683c13c0402813c",
    "int8-channel-zero-row": "960301920202c40400007fc000c408000000000402013c",
    "topk": "970401920203c40c0000a0bf00004040000000400300c403010102",
    "topk-ties": "9704019104c4080000803f000080bf0200c4020001",
    "topk-varint-fp16": "97040191cc8cc406003e00c000440301c403037f01",
    "fp16+zstd": "94cc8101920203c41528b52ffd200c610000003800bd00420000004000b0",
}


def test_vector_module_matches_the_constants_here() -> None:
    assert {name: v[2] for name, v in TEST_VECTORS.items()} == EXPECTED_HEX
    assert DECODE_ONLY == {"fp16+zstd"}
    required = {"fp32", "fp16", "bf16", "int8", "int8-channel", "topk", "fp16+zstd"}
    assert required <= {v[1].split(":")[0] if v[1].startswith("topk") else v[1] for v in TEST_VECTORS.values()}


@pytest.mark.parametrize("name", sorted(TEST_VECTORS))
def test_vector(name: str) -> None:
    inp, text, hex_, decoded = TEST_VECTORS[name]
    x = np.array(inp, np.float32)
    if name not in DECODE_ONLY:
        assert pack(encode_tensor(x, Codec.parse(text))).hex() == hex_
    got = decode_tensor(msgpack.unpackb(bytes.fromhex(hex_), raw=False))
    want = np.array(decoded, np.float32)
    assert got.dtype == np.float32 and got.shape == x.shape
    assert got.tobytes() == want.tobytes()  # bit for bit (keeps -0.0)
    # and the decoded values are what this file's independent references say
    if text.startswith("fp16"):
        assert want.tobytes() == x.astype(np.float16).astype(np.float32).tobytes()
    if text == "bf16":
        assert want.tobytes() == bf16_numpy_reference(x).tobytes()


def test_vector_hand_reading() -> None:
    # fp16 tensor, field by field
    b = bytes.fromhex(EXPECTED_HEX["fp16"])
    assert b[:7] == bytes([0x94, 0x01, 0x01, 0x92, 0x02, 0x03, 0xC4]) and b[7] == 12
    assert np.frombuffer(b[8:], "<f2").tolist() == [0.5, -1.25, 3.0, 0.0, 2.0, -0.125]
    # int8 per tensor: scale 3/127, q = rint(x / scale)
    b = bytes.fromhex(EXPECTED_HEX["int8"])
    assert list(np.frombuffer(b[8:14], np.int8)) == [21, -53, 127, 0, 85, -5]
    assert b[14] == 0xFF  # axis -1 as a negative fixint
    assert b[15:17] == b"\xc4\x04" and np.frombuffer(b[17:21], "<f4")[0] == np.float32(3) / np.float32(127)
    # topk: k 3, value codec 0, indices 01 01 02
    assert bytes.fromhex(EXPECTED_HEX["topk"]).endswith(bytes.fromhex("0300c403010102"))


# ------------------------------------------------------------------------------------------
# Hostile tensors: each expects an error class and the field it names


def z(data: bytes, **kw) -> bytes:
    return zstandard.ZstdCompressor(**kw).compress(data)


F4 = struct.Struct("<f")
I8 = [3, 1, [2, 2], bytes([1, 2, 3, 4]), -1, F4.pack(0.1)]
I8C = [3, 1, [2, 2], bytes([1, 2, 3, 4]), 0, struct.pack("<2f", 0.1, 0.2)]
TK = [4, 1, [10], struct.pack("<2f", 1.0, 2.0), 2, 0, bytes([3, 4])]  # indices 3, 7


def tk(**over) -> list:
    t = list(TK)
    for key, i in (("data", 3), ("k", 4), ("value_codec", 5), ("indices", 6)):
        if key in over:
            t[i] = over[key]
    return t


HOSTILE = [
    pytest.param([5, 1, [2], bytes(8)], TensorError, "t.codec", id="codec-5"),
    pytest.param([0x85, 1, [2], bytes(8)], TensorError, "t.codec", id="codec-0x85"),
    pytest.param([0x100, 1, [2], bytes(8)], TensorError, "t.codec", id="codec-0x100"),
    pytest.param([-1, 1, [2], bytes(8)], TensorError, "t.codec", id="codec-negative"),
    pytest.param([True, 1, [2], bytes(8)], TensorError, "t.codec", id="codec-bool"),
    pytest.param([1, 4, [2], bytes(4)], TensorError, "t.codec", id="fp16-on-int64"),
    pytest.param([3, 9, [2], bytes(2), -1, F4.pack(1.0)], TensorError, "t.codec", id="int8-on-bool"),
    pytest.param([1, 1, [3], bytes(4)], TensorError, "t.data", id="fp16-data-short"),
    pytest.param([1, 1, [3], bytes(12)], TensorError, "t.data", id="fp16-data-fp32-length"),
    pytest.param([2, 1, [3], bytes(7)], TensorError, "t.data", id="bf16-data-long"),
    pytest.param([1, 1, [3], "abcdef"], MalformedMessage, "t.data", id="fp16-data-str"),
    pytest.param([1, 1, [1, 1], b"\x00\x7c"], TensorError, "t", id="fp16-inf-decoded"),
    pytest.param([2, 1, [1], b"\xc0\x7f"], TensorError, "t", id="bf16-nan-decoded"),
    pytest.param(I8[:4], MalformedMessage, "t.axis", id="int8-no-params"),
    pytest.param(I8[:5], MalformedMessage, "t.scales", id="int8-no-scales"),
    pytest.param([*I8[:4], "-1", I8[5]], MalformedMessage, "t.axis", id="int8-axis-str"),
    pytest.param([*I8[:4], 1.0, I8[5]], MalformedMessage, "t.axis", id="int8-axis-float"),
    pytest.param([*I8[:4], False, I8[5]], MalformedMessage, "t.axis", id="int8-axis-bool"),
    pytest.param([*I8[:4], 2, I8[5]], TensorError, "t.axis", id="int8-axis-past-ndim"),
    pytest.param([*I8[:4], -2, I8[5]], TensorError, "t.axis", id="int8-axis-minus-2"),
    pytest.param([3, 1, [], bytes(1), 0, F4.pack(0.1)], TensorError, "t.axis", id="int8-axis-on-0d"),
    pytest.param([*I8[:5], [0.1]], MalformedMessage, "t.scales", id="int8-scales-array"),
    pytest.param([*I8[:5], 0.1], MalformedMessage, "t.scales", id="int8-scales-float"),
    pytest.param([*I8[:5], F4.pack(0.1) * 2], TensorError, "t.scales", id="int8-two-scales-per-tensor"),
    pytest.param([*I8C[:5], F4.pack(0.1)], TensorError, "t.scales", id="int8-channel-one-scale"),
    pytest.param([*I8[:5], b"\x00\x00\x80"], TensorError, "t.scales", id="int8-scales-3-bytes"),
    pytest.param([*I8[:5], F4.pack(float("nan"))], TensorError, "t.scales", id="int8-scale-nan"),
    pytest.param([*I8[:5], F4.pack(float("inf"))], TensorError, "t.scales", id="int8-scale-inf"),
    pytest.param([*I8[:5], F4.pack(-0.1)], TensorError, "t.scales", id="int8-scale-negative"),
    pytest.param([3, 1, [2, 2], bytes([1, 0x80, 3, 4]), -1, F4.pack(0.1)], TensorError, "t.data",
                 id="int8-q-minus-128"),
    pytest.param([3, 1, [2, 2], bytes(3), -1, F4.pack(0.1)], TensorError, "t.data", id="int8-data-short"),
    pytest.param([3, 1, [2, 2], bytes([127, 0, 0, 0]), -1, F4.pack(3e38)], TensorError, "t", id="int8-decodes-to-inf"),
    pytest.param(TK[:4], MalformedMessage, "t.k", id="topk-no-params"),
    pytest.param(TK[:6], MalformedMessage, "t.indices", id="topk-no-indices"),
    pytest.param(tk(k="2"), MalformedMessage, "t.k", id="topk-k-str"),
    pytest.param(tk(k=2.0), MalformedMessage, "t.k", id="topk-k-float"),
    pytest.param(tk(k=-1), TensorError, "t.k", id="topk-k-negative"),
    pytest.param(tk(k=11, data=bytes(44), indices=bytes([0] + [1] * 10)), TensorError, "t.k", id="topk-k-above-size"),
    pytest.param(tk(k=2**64 - 1), TensorError, "t.k", id="topk-k-2**64-1"),
    pytest.param(tk(value_codec=2, data=bytes(4)), TensorError, "t.value_codec", id="topk-value-codec-bf16"),
    pytest.param(tk(value_codec=None), MalformedMessage, "t.value_codec", id="topk-value-codec-nil"),
    pytest.param(tk(indices=[3, 4]), MalformedMessage, "t.indices", id="topk-indices-array"),
    pytest.param(tk(indices=bytes([3, 0])), TensorError, "t.indices", id="topk-indices-repeated"),
    pytest.param(tk(indices=bytes([9, 1])), TensorError, "t.indices", id="topk-index-equals-size"),
    pytest.param(tk(indices=bytes([10, 1])), TensorError, "t.indices", id="topk-first-index-past-end"),
    pytest.param(tk(indices=bytes([3]) + b"\xff" * 9 + b"\x01"), TensorError, "t.indices", id="topk-delta-wraps"),
    pytest.param(tk(indices=bytes([3]) + b"\x80" * 10 + b"\x01"), TensorError, "t.indices", id="topk-overlong-varint"),
    pytest.param(tk(indices=bytes([3, 0x84, 0x00])), TensorError, "t.indices", id="topk-non-minimal-varint"),
    pytest.param(tk(indices=bytes([3, 4, 1])), TensorError, "t.indices", id="topk-trailing-varint"),
    pytest.param(tk(indices=bytes([3, 0x84])), TensorError, "t.indices", id="topk-truncated-varint"),
    pytest.param(tk(indices=bytes([3])), TensorError, "t.indices", id="topk-too-few-varints"),
    pytest.param(tk(indices=b"\x80" * 40), TensorError, "t.indices", id="topk-indices-longer-than-10k"),
    pytest.param(tk(data=bytes(4)), TensorError, "t.data", id="topk-data-short"),
    pytest.param(tk(value_codec=1), TensorError, "t.data", id="topk-fp16-with-fp32-length"),
    pytest.param(tk(data=struct.pack("<2f", 1.0, float("nan"))), TensorError, "t", id="topk-value-nan"),
    pytest.param([0x81, 1, [2, 3], b"garbage-not-a-frame"], TensorError, "t.data", id="zstd-garbage"),
    pytest.param([0x81, 1, [2, 3], bytes(12)], TensorError, "t.data", id="zstd-plain-data"),
    pytest.param([0x81, 1, [2, 3], z(bytes(13))], TensorError, "t.data", id="zstd-declares-13-of-12"),
    pytest.param([0x81, 1, [2, 3], z(bytes(11))], TensorError, "t.data", id="zstd-declares-11-of-12"),
    pytest.param([0x81, 1, [2, 3], z(bytes(13), write_content_size=False)], TensorError, "t.data",
                 id="zstd-undeclared-13-of-12"),
    pytest.param([0x81, 1, [2, 3], z(bytes(11), write_content_size=False)], TensorError, "t.data",
                 id="zstd-undeclared-11-of-12"),
    pytest.param([0x81, 1, [2, 3], z(bytes(12)) + b"\x00"], TensorError, "t.data", id="zstd-trailing-byte"),
    pytest.param([0x81, 1, [2, 3], z(bytes(12)) + z(bytes(12))], TensorError, "t.data", id="zstd-two-frames"),
    pytest.param([0x81, 1, [2, 3], z(bytes(12))[:-2]], TensorError, "t.data", id="zstd-truncated"),
    pytest.param([0x84, 1, [10], z(bytes(8)), 2, 0, bytes([3, 40])], TensorError, "t.indices",
                 id="zstd-topk-bad-indices-checked-first"),
    pytest.param([0x83, 1, [2, 2], z(bytes(4)), -1, F4.pack(-1.0)], TensorError, "t.scales",
                 id="zstd-int8-bad-scale-checked-first"),
]


@pytest.mark.parametrize(("obj", "error", "field"), HOSTILE)
def test_hostile_tensors_are_refused(obj: list, error: type, field: str) -> None:
    with pytest.raises(error) as exc:
        decode_tensor(over_wire(obj), field="t")
    assert type(exc.value) is error
    assert exc.value.field == field, str(exc.value)
    assert field.split(".")[-1] in str(exc.value) or field == "t"


def test_hostile_table_bases_are_valid() -> None:
    """The unmutated bases decode, so each row above fails for its own reason."""
    np.testing.assert_allclose(decode_tensor(over_wire(I8)), np.array([[1, 2], [3, 4]]) * np.float32(0.1))
    np.testing.assert_allclose(decode_tensor(over_wire(I8C)), [[0.1, 0.2], [0.6, 0.8]], rtol=1e-6)
    got = decode_tensor(over_wire(TK))
    assert got.tolist() == [0, 0, 0, 1.0, 0, 0, 0, 2.0, 0, 0]
    assert decode_tensor([0x81, 1, [2, 3], z(bytes(12))]).tolist() == [[0.0] * 3] * 2
    assert not decode_tensor([4, 1, [3], b"", 0, 0, b""]).any()  # k = 0 is valid
    assert decode_tensor([3, 1, [0, 2], b"", 0, b""]).shape == (0, 2)  # zero channels, zero scales


def test_trailing_params_are_ignored() -> None:
    for text in ("fp16", "int8", "topk:2", "bf16+zstd"):
        wire = encode_tensor(rand((3, 2)), Codec.parse(text))
        a = decode_tensor(over_wire(wire))
        b = decode_tensor(over_wire([*wire, "future", 1.5]))
        assert a.tobytes() == b.tobytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(TEST_VECTORS)), data=st.data())
def test_mutated_vectors_raise_only_protocol_errors(name: str, data: st.DataObject) -> None:
    b = bytearray(bytes.fromhex(TEST_VECTORS[name][2]))
    for _ in range(data.draw(st.integers(1, 4))):
        b[data.draw(st.integers(0, len(b) - 1))] = data.draw(st.integers(0, 255))
    try:
        obj = msgpack.unpackb(bytes(b), raw=False, strict_map_key=False)
    except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.UnpackException, TypeError):
        return
    try:
        decode_tensor(obj, limits=TensorLimits(max_elements=1 << 20))
    except ProtocolError:
        pass


# ------------------------------------------------------------------------------------------
# Error feedback


def int8_reference(p: np.ndarray) -> np.ndarray:
    s = np.float32(np.abs(p).max()) / np.float32(127)
    if s == 0:
        return np.zeros_like(p)
    return np.clip(np.rint(p / s), -127, 127).astype(np.float32) * s


def topk_dense_reference(p: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros_like(p).reshape(-1)
    idx = topk_reference(p, k)
    out[idx] = p.reshape(-1)[idx]
    return out.reshape(p.shape)


@pytest.mark.parametrize(("text", "reference"), [
    ("int8", int8_reference),
    ("topk:0.05", lambda p: topk_dense_reference(p, math.ceil(0.05 * p.size))),
    ("int8+zstd", int8_reference),
])
def test_error_feedback_matches_a_plain_numpy_loop(text: str, reference) -> None:
    rng = np.random.default_rng(11)
    steps = [(rng.standard_normal((20, 16)) * 1e-3 + 2e-4).astype(np.float32) for _ in range(40)]
    ef = ErrorFeedback()
    e = np.zeros((20, 16), np.float32)
    sent = np.zeros((20, 16), np.float64)
    for x in steps:
        x_before = x.copy()
        wire, decoded = ef.compress(3, x, Codec.parse(text))
        np.testing.assert_array_equal(x, x_before)  # the argument is not mutated
        p = x + e
        c = reference(p)
        e = p - c
        np.testing.assert_array_equal(decoded, c)
        np.testing.assert_array_equal(decode_tensor(over_wire(wire)), decoded)
        sent += decoded
    np.testing.assert_array_equal(ef.residual(3), e)
    # what was sent over T steps = sum of inputs - final residual (telescoping sum)
    total = np.sum(steps, axis=0, dtype=np.float64)
    np.testing.assert_allclose(sent + ef.residual(3), total, atol=1e-6)
    if text.startswith("int8"):
        assert int8_bound_ok(np.zeros_like(e), e, np.float32(np.abs(p).max()) / 127 * np.ones_like(e))


def test_error_feedback_removes_the_topk_bias() -> None:
    """Constant input [1, 0.1 × 9] under top-1: without feedback the 0.1s are never sent; with it
    their running sum tracks T × 0.1 within one residual."""
    x = np.array([1.0] + [0.1] * 9, np.float32)
    codec = Codec.parse("topk:1")
    ef = ErrorFeedback()
    plain_sum = np.zeros(10)
    ef_sum = np.zeros(10)
    steps = 200
    for _ in range(steps):
        plain_sum += decode_tensor(over_wire(encode_tensor(x, codec)))
        ef_sum += ef.compress(0, x, codec)[1]
    assert (plain_sum[1:] == 0).all()
    assert np.abs(ef_sum - steps * x.astype(np.float64)).max() <= np.abs(ef.residual(0)).max() + 1e-4
    assert np.abs(ef.residual(0)).max() < 2.0  # bounded, not growing with T


def test_error_feedback_state_reset_and_lossless() -> None:
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((8, 8)).astype(np.float32) for _ in range(6)]
    a, b = ErrorFeedback(), ErrorFeedback()
    codec = Codec.parse("bf16")
    for x in xs[:3]:
        a.compress(0, x, codec)
        a.compress(1, x[:2], codec)
    state = a.state_dict()
    assert sorted(state) == [0, 1] and state[0].dtype == np.float32
    state[0][:] = 99.0  # a copy: does not touch a
    assert a.residual(0).max() < 1.0
    b.load_state_dict(a.state_dict())
    for x in xs[3:]:
        assert a.compress(0, x, codec)[1].tobytes() == b.compress(0, x, codec)[1].tobytes()
    with pytest.raises(ValueError, match="differs"):
        a.compress(0, xs[0][:4], codec)
    with pytest.raises(ValueError):
        b.load_state_dict({"0": np.zeros(3, np.float32)})
    # a lossless codec sends x + e exactly and clears the residual
    e = a.residual(0)
    wire, decoded = a.compress(0, xs[0], Codec.parse("fp32"))
    np.testing.assert_array_equal(decoded, xs[0] + e)
    assert a.residual(0) is None
    a.reset()
    assert a.state_dict() == {}
    # non-float tensors pass through raw
    wire, decoded = a.compress(5, np.arange(4), Codec.parse("int8"))
    assert wire[0] == 0 and decoded.tolist() == [0, 1, 2, 3] and a.residual(5) is None


# ------------------------------------------------------------------------------------------
# Module hygiene


def test_protocol_tensors_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; import protocol.tensors, protocol.test_vectors; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@settings(max_examples=400, deadline=None)
@given(values=st.lists(st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32), min_size=1, max_size=40),
       text=st.sampled_from(["fp16", "bf16", "int8", "topk:0.3", "topk:0.3:fp16"]))
@example(values=[0.0, -8.781456830550365e-39], text="topk:0.3:fp16")  # the kept entry flushes to −0.0
def test_reencoding_a_decoded_tensor_is_idempotent(values: list[float], text: str) -> None:
    """A sender may re-encode what ErrorFeedback.compress decoded: the receiver gets the same values.

    (Not always the same bytes: under topk with fp16 values a kept entry that flushes to 0 in fp16
    can be swapped for an equal zero at a lower index, e.g. [0, 1e-9, 5] under topk:2:fp16, and
    that zero may carry the other sign: [0, −8.8e-39] under topk:0.3:fp16 decodes to [0, −0.0],
    which re-encodes to [0, 0]; −0.0 == 0.0, so values are compared, not bytes.)
    """
    x = np.array(values, np.float32)
    codec = Codec.parse(text)
    first = decode_tensor(over_wire(encode_tensor(x, codec)))
    again = decode_tensor(over_wire(encode_tensor(first, codec)))
    assert again.dtype == first.dtype and again.shape == first.shape
    assert np.array_equal(again, first), (first, again)


def test_reencoding_topk_fp16_flush_to_zero_changes_bytes_not_values() -> None:
    x = np.array([0.0, 1e-9, 5.0], np.float32)
    codec = Codec.parse("topk:2:fp16")
    first = encode_tensor(x, codec)
    decoded = decode_tensor(over_wire(first))
    again = encode_tensor(decoded, codec)
    assert first[6] == bytes([1, 1]) and again[6] == bytes([0, 2])  # indices [1, 2] then [0, 2]
    assert decode_tensor(over_wire(again)).tobytes() == decoded.tobytes()
