"""Tensor encoding on the wire (codec ``fp32`` and the raw dtypes; sans-I/O, numpy only).

A tensor is a msgpack array ``[codec, dtype, shape, data]``:

* ``codec`` (uint): how ``data`` was produced. ``0`` = ``raw``: the values' little-endian bytes in
  C order, nothing else. Numbers are never reused (retired ones stay listed in :data:`CODECS`).
* ``dtype`` (uint): element type of the decoded tensor, a key of :data:`DTYPES`.
* ``shape`` (array of uint): at most :data:`MAX_DIMS` dimensions.
* ``data`` (bin): ``prod(shape) * itemsize`` bytes for ``raw``.

Decoding is zero-copy: :func:`decode_tensor` returns a read-only ``numpy`` view on the received
``bytes`` object (``np.frombuffer``), so a 45 MB update costs no extra copy.

The ``fp32`` codec of the configuration is ``raw`` with dtype ``float32``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import MalformedMessage, TensorError

#: codec number -> name. Never reuse a number.
CODECS: dict[int, str] = {0: "raw"}
CODEC_RAW = 0

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


@dataclass(frozen=True, slots=True)
class TensorLimits:
    """Bounds a decoder enforces on tensors from a peer.

    Attributes:
        max_elements: largest element count of one tensor.
        max_dims: largest number of dimensions.
        allow_nonfinite: whether NaN/Inf values are accepted (updates: no).
    """

    max_elements: int = MAX_ELEMENTS
    max_dims: int = MAX_DIMS
    allow_nonfinite: bool = False


DEFAULT_LIMITS = TensorLimits()


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


def encode_tensor(array: np.ndarray) -> list[Any]:
    """Encode one array with the ``raw`` codec.

    Args:
        array: any shape (≤ :data:`MAX_DIMS` dims), a dtype listed in :data:`DTYPES`. Non-contiguous
            or big-endian arrays are converted; a contiguous little-endian array is not copied
            (its buffer is handed to msgpack through a ``memoryview``).

    Returns:
        ``[codec, dtype, shape, data]`` ready to be placed in a msgpack body.

    Raises:
        TensorError: unsupported dtype or too many dimensions.
    """
    arr = np.asarray(array)
    code = dtype_code(arr.dtype)
    if arr.ndim > MAX_DIMS:
        raise TensorError(f"tensor has {arr.ndim} dimensions; at most {MAX_DIMS} are allowed")
    arr = np.ascontiguousarray(arr, dtype=DTYPES[code])
    return [CODEC_RAW, code, list(arr.shape), memoryview(arr).cast("B") if arr.size else b""]


def raw_nbytes(array: np.ndarray) -> int:
    """Bytes of ``array``'s values as sent by the ``raw`` codec (``size * itemsize``)."""
    return int(np.asarray(array).nbytes)


def decode_tensor(obj: Any, *, field: str = "tensor", limits: TensorLimits = DEFAULT_LIMITS) -> np.ndarray:
    """Decode ``[codec, dtype, shape, data]`` from an untrusted peer.

    Args:
        obj: the msgpack-decoded value.
        field: name used in error messages (``"body.tensors[2]"``).
        limits: bounds on dimensions, element count and non-finite values.

    Returns:
        A read-only array viewing ``data`` (no copy), dtype from the message, shape from the message.

    Raises:
        MalformedMessage: ``obj`` is not a 4-element array of the right types.
        TensorError: unknown codec or dtype, too many dims or elements, byte length not equal to
            ``prod(shape) * itemsize``, or NaN/Inf in a float tensor when ``limits`` forbid it.
    """
    if not isinstance(obj, (list, tuple)) or len(obj) < 4:
        raise MalformedMessage(f"{field}: a tensor is an array [codec, dtype, shape, data]", field=field)
    codec, code, shape, data = obj[0], obj[1], obj[2], obj[3]
    if type(codec) is not int or codec not in CODECS:
        raise TensorError(f"{field}.codec: unknown codec {codec!r}; known: {sorted(CODECS)}", field=f"{field}.codec")
    if type(code) is not int or code not in DTYPES:
        raise TensorError(f"{field}.dtype: unknown dtype number {code!r}; known: {sorted(DTYPES)}", field=f"{field}.dtype")
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
    if not isinstance(data, bytes):
        raise MalformedMessage(f"{field}.data: expected bin, got {type(data).__name__}", field=f"{field}.data")
    dt = DTYPES[code]
    if len(data) != count * dt.itemsize:
        raise TensorError(
            f"{field}.data: {len(data)} bytes, shape {list(shape)} of {dt.name} needs {count * dt.itemsize}",
            field=f"{field}.data",
        )
    arr = np.frombuffer(data, dtype=dt, count=count).reshape(shape)
    if not limits.allow_nonfinite and code in _FLOAT_CODES and count and not np.isfinite(arr).all():
        raise TensorError(f"{field}: contains NaN or Inf", field=field)
    return arr
