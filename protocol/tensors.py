"""Tensor encoding on the wire: raw, fp16, bf16, int8, top-k, each optionally zstd-compressed
(sans-I/O; numpy, and ``zstandard`` for the ``+zstd`` variants only).

Layout
------
A tensor is a msgpack array ``[codec, dtype, shape, data, *params]``:

* ``codec`` (uint): how ``data`` (and ``params``) were produced, a number of :data:`CODECS`,
  optionally OR-ed with :data:`ZSTD_FLAG` (``0x80``). Numbers are never reused (retired ones stay
  listed in :data:`CODECS` as comments).
* ``dtype`` (uint): element type of the **decoded** tensor, a key of :data:`DTYPES` (``1`` =
  float32 for model weights, whatever the codec carries inside ``data``).
* ``shape`` (array of uint): at most :data:`MAX_DIMS` dimensions; ``[]`` is a 0-d tensor (one
  element). ``n = prod(shape)`` (``1`` for ``[]``).
* ``data`` (bin): the values, in C order, as the codec below says.
* ``params``: the codec's parameters, appended in the order listed. A decoder ignores elements
  after the ones its codec defines (forward compatibility); a raw tensor has none.

All multi-byte values are little-endian. ``fp16``, ``bf16``, ``int8`` and ``topk`` apply to float
dtypes (float16/32/64) only: an encoder sends every other dtype with ``raw`` (codec ``0``, no
zstd), whatever codec it was asked for, and a decoder rejects a lossy codec on a non-float dtype.

======  =======  ===================================================================================
codec   name     ``data`` and ``params``
======  =======  ===================================================================================
0       raw      ``data`` = ``n * itemsize(dtype)`` bytes, the values in ``dtype``. No params.
1       fp16     ``data`` = ``2n`` bytes, IEEE 754 binary16 (round to nearest even). No params.
                 Encoder: a finite value whose magnitude rounds to ±Inf in binary16
                 (``|x| >= 65520``) is an error, not clipped. NaN/±Inf pass through unchanged.
2       bf16     ``data`` = ``2n`` bytes, each the upper 16 bits of the value as float32, rounded to
                 nearest even: ``u = bits(float32(x))``; NaN → ``(u >> 16) | 0x0040`` (stays a
                 quiet NaN, sign kept); else ``(u + 0x7FFF + ((u >> 16) & 1)) >> 16``. Decode:
                 ``bits(x̂) = h << 16``. A finite value that rounds to ±Inf is an error. A float64
                 tensor is first rounded to float32. No params.
3       int8     symmetric quantisation. params = ``[axis int, scales bin]``. ``axis = -1``: one
                 scale for the whole tensor; ``0 <= axis < len(shape)``: one scale per index along
                 ``axis`` (encoders use ``axis = 0``, "int8-channel"). ``scales`` = float32 values
                 (``1`` or ``shape[axis]`` of them), each finite and ``>= 0``. In float32
                 arithmetic: ``scale = max|x| / 127`` over the tensor or channel (``0`` for an
                 all-zero or empty channel), ``q = clip(rint(x / scale), -127, 127)`` (``0``
                 where ``scale = 0``; ``rint`` rounds half to even), ``data`` = ``n`` bytes of
                 ``q`` as int8 (``-128`` is invalid). Decode: ``x̂ = float32(q) * scale`` in
                 float32, then converted to ``dtype``. ``|x - x̂| <= scale / 2`` (up to float32
                 rounding). Input with NaN/Inf is an encoder error.
4       topk     sparse. params = ``[k uint, value_codec uint, indices bin]``. The ``k``
                 (``0 <= k <= n``) entries of largest ``|x|`` in C order; ties are broken by
                 the lower flat index. ``indices``: their flat indices in strictly increasing
                 order, delta-encoded — the first delta is the first index itself, each next one
                 is ``index[i] - index[i-1]`` (hence ``>= 1``) — each delta an unsigned LEB128
                 varint (7 bits per byte, least significant group first, high bit set on every
                 byte but the last; at most 10 bytes; minimal: a multi-byte varint does not end in
                 ``0x00``), nothing after the ``k``-th varint. Example: indices ``[3, 130, 131]``
                 → deltas ``[3, 127, 1]`` → ``03 7f 01``; index ``300`` alone → ``ac 02``.
                 ``data`` = the ``k`` values in index order, coded with ``value_codec`` ``0``
                 (raw in ``dtype``, ``k * itemsize`` bytes) or ``1`` (fp16, ``2k`` bytes). Decode:
                 a dense tensor of zeros with those ``k`` values. Input with NaN/Inf is an encoder
                 error. Encoders pick ``k`` as a count (``min(k, n)``) or a fraction ``f`` of
                 ``n`` (``k = max(1, ceil(f * n))`` for ``n > 0``, ``0`` for ``n = 0``).
======  =======  ===================================================================================

**zstd** (flag ``0x80``, e.g. ``0x81`` = fp16 + zstd, ``0x80`` = raw + zstd): ``data`` is one
zstd frame (RFC 8878) whose content is the ``data`` the codec without the flag defines; ``params``
are never compressed. Encoders write the frame's content size (python-zstandard does by default);
the frame must not be followed by other bytes. Level 1 by default. A decoder knows the exact
decompressed size from ``shape``, ``dtype`` and ``params`` before it decompresses, rejects a frame
whose header declares another size, and decompresses into a buffer of exactly that size (a frame
with no declared size that would produce more is cut off and rejected), so a small frame cannot
make it allocate more than the tensor it claims to be. Zstd frames are not byte-identical across
zstd versions and levels; only their content is specified.

Decoding
--------
:func:`decode_tensor` checks every field of an untrusted tensor (types, ``k <= n``, strictly
increasing in-range indices, varint bounds, scale count and finiteness, exact byte lengths, the
limits of :class:`TensorLimits`, NaN/Inf in the *decoded* tensor) and raises
:class:`~protocol.errors.MalformedMessage` (wrong container or type) or
:class:`~protocol.errors.TensorError` (a value out of bounds), with ``field`` naming the part
(``"body.tensors[2].indices"``). A ``raw`` tensor decodes zero-copy: a read-only ``numpy`` view on
the received ``bytes`` (``np.frombuffer``), so a 45 MB update costs no extra copy; the other codecs
return a new array.

The configuration's codec names (:class:`Codec`) map onto wire codecs: ``fp32`` → ``raw``,
``int8`` → ``int8`` with ``axis = -1``, ``int8-channel`` → ``int8`` with ``axis = 0`` (``-1`` for a
0-d or 1-d tensor). :class:`ErrorFeedback` keeps the quantisation error of lossy codecs and adds it
to the next round's tensor. Test vectors: :mod:`protocol.test_vectors`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from .errors import MalformedMessage, TensorError

_zstd: ModuleType | None
try:  # optional: only the "+zstd" codecs need it
    import zstandard as _zstd
except ImportError:  # pragma: no cover - exercised by monkeypatching _zstd in the tests
    _zstd = None

#: codec number -> name. Never reuse a number. Any of them may be OR-ed with :data:`ZSTD_FLAG`.
CODECS: dict[int, str] = {0: "raw", 1: "fp16", 2: "bf16", 3: "int8", 4: "topk"}
CODEC_RAW = 0
CODEC_FP16 = 1
CODEC_BF16 = 2
CODEC_INT8 = 3
CODEC_TOPK = 4
ZSTD_FLAG = 0x80
"""Bit OR-ed onto a codec number when ``data`` is a zstd frame."""

#: ``value_codec`` numbers a ``topk`` tensor may use for its values (a subset of :data:`CODECS`).
TOPK_VALUE_CODECS: dict[int, str] = {0: "raw", 1: "fp16"}

#: dtype number -> numpy dtype (always little-endian on the wire). Never reuse a number.
DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<f4"),
    2: np.dtype("<f2"),
    3: np.dtype("<f8"),
    4: np.dtype("<i8"),
    5: np.dtype("<i4"),
    6: np.dtype("<i2"),
    7: np.dtype("i1"),
    8: np.dtype("u1"),
    9: np.dtype("?"),
}
_DTYPE_CODE: dict[str, int] = {dt.str.lstrip("<|="): code for code, dt in DTYPES.items()}
_FLOAT_CODES = frozenset({1, 2, 3})

MAX_DIMS = 8
"""Largest number of dimensions a received tensor may have."""

MAX_ELEMENTS = 1 << 28
"""Largest element count of one received tensor (268,435,456; 1 GiB of float32)."""

MAX_VARINT_BYTES = 10
"""Longest LEB128 varint accepted in ``topk`` indices (enough for any 64-bit value)."""

FP16_MAX = 65504.0
"""Largest finite IEEE binary16 value; finite inputs with ``|x| >= 65520`` round to Inf and are refused."""

ZSTD_LEVELS = range(1, 23)
"""zstd compression levels a :class:`Codec` may ask for (1 = fastest, 22 = smallest)."""

_F32 = np.dtype("<f4")
_F16 = np.dtype("<f2")


@dataclass(frozen=True, slots=True)
class TensorLimits:
    """Bounds a decoder enforces on tensors from a peer.

    Attributes:
        max_elements: largest element count of one tensor.
        max_dims: largest number of dimensions.
        allow_nonfinite: whether NaN/Inf values are accepted (updates: no). Checked on the
            decoded tensor, whatever the codec.
        max_total_bytes: largest sum of decoded tensor sizes (``n × itemsize``) in one message,
            checked from the declared shapes **before** anything is decoded, so a small message
            claiming huge sparse or compressed tensors is refused without allocating (bytes).
    """

    max_elements: int = MAX_ELEMENTS
    max_dims: int = MAX_DIMS
    allow_nonfinite: bool = False
    max_total_bytes: int = 512 * 1024 * 1024


def declared_nbytes(obj: Any) -> int:
    """Decoded size (bytes) a tensor array ``[codec, dtype, shape, ...]`` claims, from its header
    alone; 0 when the header is malformed (the decoder then rejects it with the reason)."""
    if not isinstance(obj, (list, tuple)) or len(obj) < 3:
        return 0
    code, shape = obj[1], obj[2]
    if type(code) is not int or code not in DTYPES or not isinstance(shape, (list, tuple)) or len(shape) > 64:
        return 0
    n = 1
    for d in shape:
        if type(d) is not int or d < 0:
            return 0
        n *= d
    return n * DTYPES[code].itemsize


DEFAULT_LIMITS = TensorLimits()
_TRUSTED = TensorLimits(max_elements=1 << 62, allow_nonfinite=True)


# --------------------------------------------------------------------------------------------
# Codec (the configuration's choice of encoding)

_NAMES = ("fp32", "fp16", "bf16", "int8", "int8-channel", "topk")
_TOPK_VALUES = ("fp32", "fp16")
_GRAMMAR = (
    "fp32 | fp16 | bf16 | int8 | int8-channel | topk:K[:V] | topk:F[:V], optionally followed by "
    "+zstd or +zstd:LEVEL; K = an integer >= 1 (entries kept), F = a decimal fraction in (0, 1] "
    "(written with '.' or an exponent, e.g. 0.1, 1.0, 1e-3), V = fp32 | fp16 (encoding of the kept "
    "values), LEVEL = 1..22"
)
_FRACTION_RE = re.compile(r"^(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][+-]?[0-9]+)?$")


@dataclass(frozen=True, slots=True)
class Codec:
    """How to encode float tensors, as chosen in the configuration (``[protocol] codec``).

    Attributes:
        name: ``"fp32"`` (raw), ``"fp16"``, ``"bf16"``, ``"int8"`` (one scale per tensor),
            ``"int8-channel"`` (one scale per index of axis 0), ``"topk"``.
        zstd: compress ``data`` with zstd (wire flag ``0x80``).
        zstd_level: zstd level, 1..22 (used only when ``zstd``).
        topk_fraction: for ``topk``: keep ``max(1, ceil(f * n))`` entries; exclusive with ``topk_k``.
        topk_k: for ``topk``: keep ``min(k, n)`` entries (``k >= 1``); exclusive with ``topk_fraction``.
        topk_values: for ``topk``: ``"fp32"`` (values raw in the tensor's dtype) or ``"fp16"``.

    Raises:
        ValueError: an unknown name or an inconsistent combination of fields.
    """

    name: str
    zstd: bool = False
    zstd_level: int = 1
    topk_fraction: float | None = None
    topk_k: int | None = None
    topk_values: str = "fp32"

    def __post_init__(self) -> None:
        if self.name not in _NAMES:
            raise ValueError(f"codec name {self.name!r} unknown; allowed: {', '.join(_NAMES)}")
        if type(self.zstd) is not bool:
            raise ValueError(f"codec zstd must be a bool, not {self.zstd!r}")
        if type(self.zstd_level) is not int or self.zstd_level not in ZSTD_LEVELS:
            raise ValueError(f"zstd level {self.zstd_level!r} out of range 1..22")
        if self.name == "topk":
            if (self.topk_fraction is None) == (self.topk_k is None):
                raise ValueError("topk needs exactly one of topk_fraction and topk_k")
            if self.topk_fraction is not None:
                f = self.topk_fraction
                if type(f) is not float or not (math.isfinite(f) and 0.0 < f <= 1.0):
                    raise ValueError(f"topk fraction {f!r} must be a float in (0, 1]")
            if self.topk_k is not None and (type(self.topk_k) is not int or self.topk_k < 1):
                raise ValueError(f"topk k {self.topk_k!r} must be an integer >= 1")
            if self.topk_values not in _TOPK_VALUES:
                raise ValueError(f"topk values {self.topk_values!r} unknown; allowed: {', '.join(_TOPK_VALUES)}")
        elif self.topk_fraction is not None or self.topk_k is not None or self.topk_values != "fp32":
            raise ValueError(f"topk_fraction, topk_k and topk_values apply to codec 'topk' only, not {self.name!r}")

    @property
    def lossy(self) -> bool:
        """True unless the codec is ``fp32`` (raw, with or without zstd)."""
        return self.name != "fp32"

    @classmethod
    def parse(cls, text: str) -> Codec:
        """Parse a configuration string.

        Grammar: ``BASE ["+zstd" [":" LEVEL]]`` with ``BASE`` one of ``fp32``, ``fp16``, ``bf16``,
        ``int8``, ``int8-channel``, ``topk:K[:V]``, ``topk:F[:V]``. ``K`` is a decimal integer
        ``>= 1`` (digits only), ``F`` a decimal fraction in ``(0, 1]`` written with a ``.`` or an
        exponent (``0.1``, ``1.0``, ``1e-3``: ``topk:1`` keeps one entry, ``topk:1.0`` all of
        them), ``V`` is ``fp32`` (default) or ``fp16``, ``LEVEL`` an integer 1..22 (default 1).
        Case-sensitive, no spaces. Examples: ``"fp16+zstd"``, ``"topk:0.1:fp16+zstd:3"``.

        Raises:
            ValueError: text outside the grammar; the message lists the allowed forms.
        """
        if not isinstance(text, str):
            raise ValueError(f"codec must be a string, not {type(text).__name__}; allowed: {_GRAMMAR}")

        def bad(why: str) -> ValueError:
            return ValueError(f"codec {text!r}: {why}; allowed: {_GRAMMAR}")

        base, plus, suffix = text.partition("+")
        zstd, level = False, 1
        if plus:
            head, colon, lvl = suffix.partition(":")
            if head != "zstd" or (colon and not re.fullmatch(r"[0-9]+", lvl)):
                raise bad(f"unknown suffix '+{suffix}'")
            zstd = True
            if colon:
                level = int(lvl)
                if level not in ZSTD_LEVELS:
                    raise bad(f"zstd level {level} out of range 1..22")
        if base in _NAMES and base != "topk":
            return cls(base, zstd=zstd, zstd_level=level)
        parts = base.split(":")
        if parts[0] != "topk":
            raise bad(f"unknown codec {base!r}")
        if len(parts) not in (2, 3):
            raise bad("topk needs an amount: topk:K or topk:F")
        amount = parts[1]
        values = parts[2] if len(parts) == 3 else "fp32"
        if values not in _TOPK_VALUES:
            raise bad(f"topk values {values!r} unknown")
        if re.fullmatch(r"[0-9]+", amount):
            k = int(amount)
            if k < 1:
                raise bad("topk K must be >= 1")
            return cls("topk", zstd=zstd, zstd_level=level, topk_k=k, topk_values=values)
        if not _FRACTION_RE.fullmatch(amount):
            raise bad(f"topk amount {amount!r} is neither an integer K nor a fraction F")
        f = float(amount)
        if not 0.0 < f <= 1.0:
            raise bad(f"topk fraction {amount} outside (0, 1]")
        return cls("topk", zstd=zstd, zstd_level=level, topk_fraction=f, topk_values=values)

    def __str__(self) -> str:
        """Canonical configuration text: ``Codec.parse(str(c)) == c``."""
        text = self.name
        if self.name == "topk":
            text += f":{self.topk_k}" if self.topk_k is not None else f":{self.topk_fraction!r}"
            if self.topk_values != "fp32":
                text += f":{self.topk_values}"
        if self.zstd:
            text += "+zstd" if self.zstd_level == 1 else f"+zstd:{self.zstd_level}"
        return text


def codec_name(number: int) -> str:
    """Readable name of a wire codec number (``0x81`` → ``"fp16+zstd"``), for logs and the ledger.

    Raises:
        ValueError: not a known codec number.
    """
    base = number & ~ZSTD_FLAG if type(number) is int and 0 <= number <= 0xFF else -1
    if base not in CODECS:
        raise ValueError(f"unknown codec number {number!r}")
    return CODECS[base] + ("+zstd" if number & ZSTD_FLAG else "")


# --------------------------------------------------------------------------------------------
# Element codecs (numpy only, vectorised)


def dtype_code(dtype: np.dtype | str) -> int:
    """Return the wire number of a numpy dtype.

    Raises:
        TensorError: the dtype has no wire number (e.g. complex, object, big-endian structs).
    """
    dt = np.dtype(dtype)
    key = dt.newbyteorder("<").str.lstrip("<|=") if dt.byteorder == ">" else dt.str.lstrip("<|=")
    try:
        return _DTYPE_CODE[key]
    except KeyError:
        raise TensorError(f"dtype {dt} cannot be sent; allowed: {sorted(_DTYPE_CODE)}") from None


def _bin(arr: np.ndarray) -> memoryview | bytes:
    """The bytes of a C-contiguous array without a copy (``b""`` when empty)."""
    return arr.data.cast("B") if arr.size else b""


def _fp16(x: np.ndarray, field: str) -> np.ndarray:
    """``x`` (float array) rounded to binary16; finite values that overflow raise TensorError."""
    with np.errstate(over="ignore", invalid="ignore"):
        h = np.asarray(x).astype(_F16, order="C")
    inf = np.isinf(h)
    if inf.any():
        bad = inf & np.isfinite(x)
        if bad.any():
            v = float(np.asarray(x)[bad].flat[0])
            raise TensorError(f"{field}: value {v:g} overflows fp16 (largest finite half is {FP16_MAX:g})",
                              field=field)
    return h


def _bf16_encode(x: np.ndarray, field: str) -> np.ndarray:
    """bfloat16 bit patterns (``uint16``) of ``x``, round to nearest even, NaN kept quiet."""
    with np.errstate(over="ignore", invalid="ignore"):
        x32 = np.asarray(x).astype(_F32, order="C", copy=False)
    u = x32.view("<u4")
    r = u >> np.uint32(16)  # in place from here: r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r &= np.uint32(1)
    r += np.uint32(0x7FFF)
    r += u
    r >>= np.uint32(16)
    nan = np.isnan(x32)
    if nan.any():
        r[nan] = (u[nan] >> np.uint32(16)) | np.uint32(0x0040)
    h = r.astype("<u2")
    rounded_inf = (h & np.uint16(0x7FFF)) == np.uint16(0x7F80)
    if rounded_inf.any():
        bad = rounded_inf & np.isfinite(x)  # x, not x32: a float64 beyond float32 range overflows too
        if bad.any():
            v = float(np.asarray(x)[bad].flat[0])
            raise TensorError(f"{field}: value {v:g} overflows bf16", field=field)
    return h


def _bf16_decode(h: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact)."""
    return (h.astype("<u4") << np.uint32(16)).view(_F32)


def _channel_shape(ndim: int, axis: int, channels: int) -> tuple[int, ...]:
    shape = [1] * ndim
    shape[axis] = channels
    return tuple(shape)


def _int8_encode(x: np.ndarray, axis: int, field: str) -> tuple[np.ndarray, np.ndarray]:
    """``(q int8, scales float32)`` of ``x`` for the int8 codec (see the module table)."""
    with np.errstate(over="ignore"):  # float64 beyond float32 range → Inf → refused below
        x32 = np.asarray(x, dtype=_F32)
    a = np.abs(x32)
    if axis < 0:
        m = np.array([a.max() if a.size else 0.0], dtype=_F32)
    elif a.size:
        m = a.max(axis=tuple(i for i in range(x32.ndim) if i != axis)).astype(_F32)
    else:
        m = np.zeros(x32.shape[axis], dtype=_F32)
    if not np.isfinite(m).all():
        raise TensorError(f"{field}: int8 needs finite values (NaN or Inf found)", field=field)
    scales = m / np.float32(127)
    scale_b = scales.reshape(()) if axis < 0 else scales.reshape(_channel_shape(x32.ndim, axis, scales.size))
    q = np.zeros(x32.shape, dtype=_F32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        np.divide(x32, scale_b, out=q, where=np.broadcast_to(scale_b > 0, x32.shape))
    np.rint(q, out=q)
    np.clip(q, -127, 127, out=q)
    return q.astype(np.int8), scales.astype(_F32)


def _topk_select(x: np.ndarray, k: int) -> np.ndarray:
    """Flat indices (ascending, int64) of the ``k`` largest ``|x|``; ties go to the lower index."""
    flat = np.asarray(x).reshape(-1)
    n = flat.size
    if k >= n:
        return np.arange(n, dtype=np.int64)
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    a = np.abs(flat)
    thr = np.partition(a, n - k)[n - k]  # the k-th largest |x|
    above = np.flatnonzero(a > thr)
    ties = np.flatnonzero(a == thr)[: k - above.size]
    return np.sort(np.concatenate([above, ties])).astype(np.int64)


def varint_encode(values: np.ndarray) -> bytes:
    """Unsigned LEB128 of each value, concatenated (minimal length; ≤ 10 bytes each).

    Args:
        values: non-negative integers (any integer dtype, ``< 2**64``).
    """
    v = np.asarray(values, dtype=np.uint64).reshape(-1)
    if v.size == 0:
        return b""
    nbytes = np.ones(v.size, dtype=np.int64)
    for j in range(1, MAX_VARINT_BYTES):
        nbytes += v >= np.uint64(1 << (7 * j))
    ends = np.cumsum(nbytes)
    starts = ends - nbytes
    out = np.zeros(int(ends[-1]), dtype=np.uint8)
    for j in range(MAX_VARINT_BYTES):
        has = nbytes > j
        if not has.any():
            break
        group = ((v[has] >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        more = (nbytes[has] > j + 1).astype(np.uint8) << np.uint8(7)
        out[starts[has] + j] = group | more
    return out.tobytes()


def varint_decode(data: bytes | memoryview, count: int, *, field: str = "indices") -> np.ndarray:
    """Decode exactly ``count`` unsigned LEB128 varints filling ``data`` (vectorised).

    Returns:
        ``uint64[count]``.

    Raises:
        TensorError: a varint longer than :data:`MAX_VARINT_BYTES` or above ``2**64 - 1``, a
            non-minimal varint, a truncated last varint, or a number of varints other than
            ``count`` (trailing bytes).
    """
    b = np.frombuffer(data, dtype=np.uint8)
    if b.size == 0:
        if count:
            raise TensorError(f"{field}: empty, {count} varints expected", field=field)
        return np.zeros(0, dtype=np.uint64)
    last = (b & 0x80) == 0
    if not last[-1]:
        raise TensorError(f"{field}: the last varint is truncated (continuation bit set)", field=field)
    ends = np.flatnonzero(last)
    if ends.size != count:
        raise TensorError(f"{field}: {ends.size} varints, {count} expected", field=field)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > MAX_VARINT_BYTES:
        raise TensorError(f"{field}: a varint is longer than {MAX_VARINT_BYTES} bytes", field=field)
    multi = lengths > 1
    if (b[ends[multi]] == 0).any():
        raise TensorError(f"{field}: non-minimal varint (ends in a 0x00 byte)", field=field)
    if (b[ends[lengths == MAX_VARINT_BYTES]] > 1).any():
        raise TensorError(f"{field}: varint above 2**64 - 1", field=field)
    pos = np.arange(b.size, dtype=np.int64) - np.repeat(starts, lengths)
    groups = (b & 0x7F).astype(np.uint64) << (np.uint64(7) * pos.astype(np.uint64))
    return np.add.reduceat(groups, starts)


# --------------------------------------------------------------------------------------------
# zstd


def _zstd_compress(data: bytes | memoryview, level: int) -> bytes:
    if _zstd is None:
        raise ImportError("the '+zstd' codecs need the zstandard package: pip install zstandard")
    return _zstd.ZstdCompressor(level=level).compress(data)


def _zstd_decompress(frame: bytes | memoryview, expected: int, field: str) -> bytes:
    """The content of one zstd frame that must be exactly ``expected`` bytes (bounded)."""
    if _zstd is None:
        raise TensorError(f"{field}: zstd-compressed tensor, but the zstandard package is not installed "
                          "(pip install zstandard)", field=field)
    try:
        declared = _zstd.get_frame_parameters(frame).content_size
        if declared != _zstd.CONTENTSIZE_UNKNOWN and declared != expected:
            raise TensorError(f"{field}: zstd frame declares {declared} bytes, the tensor needs {expected}",
                              field=field)
        # With a declared size (== expected) the output buffer has that size; without one,
        # python-zstandard allocates max_output_size and fails if the frame holds more.
        out = _zstd.ZstdDecompressor().decompress(frame, max_output_size=max(expected, 1),
                                                  allow_extra_data=False)
    except _zstd.ZstdError as exc:
        raise TensorError(f"{field}: bad zstd frame: {exc}", field=field) from exc
    if len(out) != expected:
        raise TensorError(f"{field}: zstd frame holds {len(out)} bytes, the tensor needs {expected}", field=field)
    return out


# --------------------------------------------------------------------------------------------
# Encoder


def encode_tensor(array: np.ndarray, codec: Codec | None = None, *, field: str = "tensor") -> list[Any]:
    """Encode one array as ``[codec, dtype, shape, data, *params]``.

    Args:
        array: any shape (≤ :data:`MAX_DIMS` dims, 0-d included), a dtype listed in
            :data:`DTYPES`. For ``raw``, a C-contiguous little-endian array is not copied (its
            buffer is handed on through a ``memoryview``).
        codec: ``None`` or ``Codec("fp32")`` → ``raw``. Lossy codecs apply to float dtypes only;
            any other dtype is sent ``raw`` (codec ``0``, no zstd) whatever ``codec`` says.
        field: name used in error messages (``"body.tensors[2]"``).

    Returns:
        The msgpack-ready array; ``data`` and bin params are ``bytes`` or ``memoryview``.

    Raises:
        TensorError: unsupported dtype, too many dimensions, a finite value that overflows
            fp16/bf16, or NaN/Inf given to ``int8``/``topk``.
        ImportError: a ``+zstd`` codec without the ``zstandard`` package installed.
    """
    arr = np.asarray(array)
    code = dtype_code(arr.dtype)
    if arr.ndim > MAX_DIMS:
        raise TensorError(f"{field}: tensor has {arr.ndim} dimensions; at most {MAX_DIMS} are allowed",
                          field=field)
    dt = DTYPES[code]
    arr = np.asarray(arr, dtype=dt, order="C")  # keeps 0-d tensors 0-d (np.ascontiguousarray does not)
    shape = list(arr.shape)
    if codec is None or code not in _FLOAT_CODES or (codec.name == "fp32" and not codec.zstd):
        return [CODEC_RAW, code, shape, _bin(arr)]
    params: list[Any] = []
    match codec.name:
        case "fp32":
            number, data = CODEC_RAW, _bin(arr)
        case "fp16":
            number, data = CODEC_FP16, _bin(_fp16(arr, field))
        case "bf16":
            number, data = CODEC_BF16, _bin(_bf16_encode(arr, field))
        case "int8" | "int8-channel":
            axis = 0 if codec.name == "int8-channel" and arr.ndim >= 2 else -1
            q, scales = _int8_encode(arr, axis, field)
            number, data = CODEC_INT8, _bin(q)
            params = [axis, scales.tobytes()]
        case "topk":
            flat = arr.reshape(-1)
            if flat.size and not np.isfinite(flat).all():
                raise TensorError(f"{field}: topk needs finite values (NaN or Inf found)", field=field)
            n = flat.size
            if codec.topk_k is not None:
                k = min(codec.topk_k, n)
            else:  # Codec.__post_init__: exactly one of topk_k and topk_fraction is set
                assert codec.topk_fraction is not None
                k = max(1, math.ceil(codec.topk_fraction * n)) if n else 0
            idx = _topk_select(flat, k)
            values = flat[idx]
            if codec.topk_values == "fp16":
                value_codec, data = 1, _bin(_fp16(values, field))
            else:
                value_codec, data = 0, _bin(np.ascontiguousarray(values, dtype=dt))
            deltas = np.diff(idx, prepend=0) if idx.size else idx
            number, params = CODEC_TOPK, [k, value_codec, varint_encode(deltas)]
        case _:  # pragma: no cover - Codec.__post_init__ rejects other names
            raise ValueError(f"unknown codec {codec.name!r}")
    if codec.zstd:
        number |= ZSTD_FLAG
        data = _zstd_compress(data, codec.zstd_level)
    return [number, code, shape, data, *params]


def raw_nbytes(array: np.ndarray) -> int:
    """Bytes of ``array``'s values as sent by the ``raw`` codec (``size * itemsize``)."""
    return int(np.asarray(array).nbytes)


def encoded_nbytes(obj: list[Any]) -> int:
    """Bytes of a tensor's binary payload: ``data`` plus every bin param (int8 ``scales``, topk
    ``indices``). Excludes msgpack headers, ``codec``, ``dtype``, ``shape`` and int params (a few
    bytes; the ledger counts whole payloads separately).

    Args:
        obj: a tensor as returned by :func:`encode_tensor` or decoded by msgpack.
    """
    return sum(memoryview(v).nbytes for v in obj[3:] if isinstance(v, (bytes, bytearray, memoryview)))


# --------------------------------------------------------------------------------------------
# Decoder


def _as_bin(value: Any, field: str) -> bytes | memoryview:
    """``value`` if it is bin (``bytes``; also a contiguous ``bytearray``/``memoryview``)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        try:
            return memoryview(value).cast("B")
        except TypeError:
            pass
    raise MalformedMessage(f"{field}: expected bin, got {type(value).__name__}", field=field)


def _param(obj: Any, i: int, field: str, name: str) -> Any:
    if len(obj) <= i:
        raise MalformedMessage(f"{field}.{name}: missing (parameter {i - 3} of the codec)", field=f"{field}.{name}")
    return obj[i]


def _int_param(obj: Any, i: int, field: str, name: str) -> int:
    v = _param(obj, i, field, name)
    if type(v) is not int:
        raise MalformedMessage(f"{field}.{name}: expected an integer, got {type(v).__name__}", field=f"{field}.{name}")
    return v


def decode_tensor(obj: Any, *, field: str = "tensor", limits: TensorLimits = DEFAULT_LIMITS) -> np.ndarray:
    """Decode ``[codec, dtype, shape, data, *params]`` from an untrusted peer.

    Args:
        obj: the msgpack-decoded value.
        field: name used in error messages (``"body.tensors[2]"``).
        limits: bounds on dimensions, element count and non-finite values.

    Returns:
        An array of the message's dtype and shape. ``raw``: a read-only view on ``data`` (no
        copy); other codecs: a new array.

    Raises:
        MalformedMessage: ``obj`` is not an array of at least 4 elements, or a field or param has
            the wrong type (``shape`` not an array, ``data``/``scales``/``indices`` not bin,
            ``axis``/``k``/``value_codec`` not an integer) or is missing.
        TensorError: unknown codec or dtype, a lossy codec on a non-float dtype, too many dims or
            elements, a byte length other than the codec's, a bad zstd frame, bad params (axis out
            of range, wrong scale count, negative or non-finite scale, int8 value ``-128``,
            ``k > n``, unknown value codec, bad varints, indices not strictly increasing or
            ``>= n``), or NaN/Inf in a float tensor when ``limits`` forbid it.
    """
    if not isinstance(obj, (list, tuple)) or len(obj) < 4:
        raise MalformedMessage(f"{field}: a tensor is an array [codec, dtype, shape, data, *params]", field=field)
    codec, code, shape, data = obj[0], obj[1], obj[2], obj[3]
    base = codec & ~ZSTD_FLAG if type(codec) is int and 0 <= codec <= 0xFF else -1
    if base not in CODECS:
        raise TensorError(f"{field}.codec: unknown codec {codec!r}; known: {sorted(CODECS)}, each optionally "
                          f"| {ZSTD_FLAG:#x} (zstd)", field=f"{field}.codec")
    if type(code) is not int or code not in DTYPES:
        raise TensorError(f"{field}.dtype: unknown dtype number {code!r}; known: {sorted(DTYPES)}",
                          field=f"{field}.dtype")
    if base != CODEC_RAW and code not in _FLOAT_CODES:
        raise TensorError(f"{field}.codec: codec {CODECS[base]} applies to float dtypes only, not "
                          f"{DTYPES[code].name}", field=f"{field}.codec")
    if not isinstance(shape, (list, tuple)):
        raise MalformedMessage(f"{field}.shape: expected an array of dimensions", field=f"{field}.shape")
    if len(shape) > limits.max_dims:
        raise TensorError(f"{field}.shape: {len(shape)} dimensions, at most {limits.max_dims}", field=f"{field}.shape")
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise TensorError(f"{field}.shape: dimension {d!r} is not a non-negative integer", field=f"{field}.shape")
        count *= d
        if count > limits.max_elements:
            raise TensorError(f"{field}.shape: more than {limits.max_elements} elements", field=f"{field}.shape")
    shape = tuple(shape)
    data = _as_bin(data, f"{field}.data")
    dt = DTYPES[code]

    # Params first: they fix the exact size of data (needed to bound zstd).
    if base == CODEC_RAW:
        expected = count * dt.itemsize
    elif base in (CODEC_FP16, CODEC_BF16):
        expected = 2 * count
    elif base == CODEC_INT8:
        axis = _int_param(obj, 4, field, "axis")
        if not (axis == -1 or 0 <= axis < len(shape)):
            raise TensorError(f"{field}.axis: {axis} is neither -1 nor a dimension of shape {list(shape)}",
                              field=f"{field}.axis")
        scales_bin = _as_bin(_param(obj, 5, field, "scales"), f"{field}.scales")
        channels = 1 if axis == -1 else shape[axis]
        if len(scales_bin) != 4 * channels:
            raise TensorError(f"{field}.scales: {len(scales_bin)} bytes, {channels} float32 scales need "
                              f"{4 * channels}", field=f"{field}.scales")
        scales = np.frombuffer(scales_bin, dtype=_F32)
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise TensorError(f"{field}.scales: every scale must be finite and >= 0", field=f"{field}.scales")
        expected = count
    else:  # CODEC_TOPK
        k = _int_param(obj, 4, field, "k")
        if not 0 <= k <= count:
            raise TensorError(f"{field}.k: {k} outside 0..{count} (the element count)", field=f"{field}.k")
        value_codec = _int_param(obj, 5, field, "value_codec")
        if value_codec not in TOPK_VALUE_CODECS:
            raise TensorError(f"{field}.value_codec: {value_codec} unknown; known: {sorted(TOPK_VALUE_CODECS)}",
                              field=f"{field}.value_codec")
        indices_bin = _as_bin(_param(obj, 6, field, "indices"), f"{field}.indices")
        if len(indices_bin) > MAX_VARINT_BYTES * k:
            raise TensorError(f"{field}.indices: {len(indices_bin)} bytes for {k} varints", field=f"{field}.indices")
        expected = k * (dt.itemsize if value_codec == 0 else 2)

    if codec & ZSTD_FLAG:
        data = _zstd_decompress(data, expected, f"{field}.data")
    elif len(data) != expected:
        raise TensorError(
            f"{field}.data: {len(data)} bytes, {codec_name(codec)} of shape {list(shape)} {dt.name} needs {expected}",
            field=f"{field}.data",
        )

    check: np.ndarray  # the values whose finiteness decides
    if base == CODEC_RAW:
        arr = np.frombuffer(data, dtype=dt, count=count).reshape(shape)
        if arr.flags.writeable:  # a view on a bytearray/memoryview: keep the read-only contract
            arr.flags.writeable = False
        check = arr
    elif base == CODEC_FP16:
        arr = np.frombuffer(data, dtype=_F16, count=count).astype(dt).reshape(shape)
        check = arr
    elif base == CODEC_BF16:
        with np.errstate(over="ignore"):  # bf16 → float16 may overflow: caught as Inf below
            arr = _bf16_decode(np.frombuffer(data, dtype="<u2", count=count)).astype(dt, copy=False).reshape(shape)
        check = arr
    elif base == CODEC_INT8:
        q = np.frombuffer(data, dtype=np.int8, count=count)
        if count and int(q.min()) == -128:
            raise TensorError(f"{field}.data: int8 value -128 (allowed: -127..127)", field=f"{field}.data")
        scale_b = scales.reshape(()) if axis == -1 else scales.reshape(_channel_shape(len(shape), axis, channels))
        with np.errstate(over="ignore"):
            arr = (q.reshape(shape).astype(_F32) * scale_b).astype(dt, copy=False)
        check = arr
    else:  # CODEC_TOPK
        deltas = varint_decode(indices_bin, k, field=f"{field}.indices")
        idx = np.cumsum(deltas, dtype=np.uint64)
        # Every delta after the first is >= 1, so the running sum only goes down if it wrapped
        # past 2**64: "strictly increasing and last < n" covers order, range and overflow.
        if k and ((deltas[1:] == 0).any() or (idx[1:] <= idx[:-1]).any() or idx[-1] >= np.uint64(count)):
            raise TensorError(f"{field}.indices: indices must be strictly increasing and < {count}",
                              field=f"{field}.indices")
        vals = np.frombuffer(data, dtype=dt if value_codec == 0 else _F16, count=k)
        out = np.zeros(count, dtype=dt)
        out[idx.astype(np.int64)] = vals
        arr = out.reshape(shape)
        check = vals
    if not limits.allow_nonfinite and code in _FLOAT_CODES and check.size and not np.isfinite(check).all():
        raise TensorError(f"{field}: contains NaN or Inf", field=field)
    return arr


# --------------------------------------------------------------------------------------------
# Error feedback


class ErrorFeedback:
    """Error-feedback memory for lossy codecs, one residual per tensor position.

    ``compress`` sends ``C(x_t + e_t)`` and keeps ``e_{t+1} = (x_t + e_t) - C(x_t + e_t)``, so
    the sum of what was sent over ``T`` steps equals ``sum x_t + e_0 - e_T``: the compression
    error does not accumulate. Source: Seide et al. 2014, "1-bit stochastic gradient descent and
    its application to data-parallel distributed training of speech DNNs" (error feedback);
    Karimireddy et al. 2019, "Error feedback fixes SignSGD and other gradient compression
    schemes", Algorithm 2 (EF-SGD: ``p_t = γ g_t + e_t``, ``Δ_t = C(p_t)``, ``e_{t+1} = p_t - Δ_t``).
    Pure numpy; not thread-safe.
    """

    def __init__(self) -> None:
        self._residuals: dict[int, np.ndarray] = {}

    def compress(self, name_index: int, x: np.ndarray, codec: Codec | None) -> tuple[list[Any], np.ndarray]:
        """Encode ``x`` plus the stored residual of tensor ``name_index``.

        Args:
            name_index: the tensor's position in the manifest (any int key).
            x: the tensor to send (float for error feedback to apply; others pass through raw).
                Not modified.
            codec: as for :func:`encode_tensor`; a lossless codec sends ``x + e`` exactly and
                clears the residual.

        Returns:
            ``(wire_obj, decoded)``: what :func:`encode_tensor` returns for ``x + e``, and the
            array the receiver will decode from it (dtype and shape of ``x``).

        Raises:
            ValueError: ``x``'s shape or dtype differs from the stored residual's.
            TensorError, ImportError: as :func:`encode_tensor`.
        """
        arr = np.asarray(x)
        field = f"tensors[{name_index}]"
        if arr.dtype.kind != "f":
            wire = encode_tensor(arr, codec, field=field)
            return wire, decode_tensor(wire, field=field, limits=_TRUSTED)
        e = self._residuals.get(name_index)
        if e is not None:
            if e.shape != arr.shape or e.dtype != arr.dtype:
                raise ValueError(f"{field}: shape {arr.shape} {arr.dtype} differs from the residual's "
                                 f"{e.shape} {e.dtype}; call reset() when the model changes")
            corrected = arr + e
        else:
            corrected = np.array(arr, copy=True)
        wire = encode_tensor(corrected, codec, field=field)
        decoded = decode_tensor(wire, field=field, limits=_TRUSTED)
        if codec is None or not codec.lossy:
            self._residuals.pop(name_index, None)
        else:
            self._residuals[name_index] = (corrected - decoded).astype(arr.dtype, copy=False)
        return wire, decoded

    def residual(self, name_index: int) -> np.ndarray | None:
        """The stored residual of tensor ``name_index`` (a copy), or ``None`` when there is none."""
        e = self._residuals.get(name_index)
        return None if e is None else e.copy()

    def layout(self) -> dict[int, tuple[tuple[int, ...], np.dtype]]:
        """Each stored residual's (shape, dtype), keyed by tensor position (no copy)."""
        return {i: (tuple(e.shape), e.dtype) for i, e in self._residuals.items()}

    def reset(self) -> None:
        """Forget every residual (new model, new federation)."""
        self._residuals.clear()

    def state_dict(self) -> dict[int, np.ndarray]:
        """Copies of the residuals, keyed by tensor position (for checkpoints)."""
        return {i: e.copy() for i, e in self._residuals.items()}

    def load_state_dict(self, state: dict[int, np.ndarray]) -> None:
        """Replace the residuals with copies of ``state`` (as returned by :meth:`state_dict`).

        Raises:
            ValueError: a key that is not an int or a value that is not a float array.
        """
        new: dict[int, np.ndarray] = {}
        for i, e in state.items():
            arr = np.asarray(e)
            if type(i) is not int or arr.dtype.kind != "f":
                raise ValueError(f"error-feedback state: key {i!r} must be an int and its value a float array")
            new[i] = np.array(arr, copy=True)
        self._residuals = new
