"""A small, bounded msgpack reader that returns ``bin`` values as zero-copy ``memoryview`` slices.

msgpack-python copies every ``bin`` into a new ``bytes`` object; for a 45 MB update that is two
full copies (the envelope's body, then each tensor's data) before numpy sees a byte. This reader
walks the same format over a ``memoryview`` of the payload and hands out views instead, so a
decoded tensor is ``np.frombuffer`` over the received payload itself.

It reads exactly one value and refuses: unknown or reserved type bytes, ext types, truncation,
trailing bytes, containers nested deeper than :data:`MAX_DEPTH`, more than ``max_containers``
arrays + maps in all, longer arrays/maps/strings than the given bounds, non-UTF-8 strings, and map
keys other than strings. Every refusal is a :class:`ReadError` with the offset.
"""

from __future__ import annotations

import struct
from typing import Any

MAX_DEPTH = 64

_U8, _U16, _U32, _U64 = struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">I"), struct.Struct(">Q")
_I8, _I16, _I32, _I64 = struct.Struct(">b"), struct.Struct(">h"), struct.Struct(">i"), struct.Struct(">q")
_F32, _F64 = struct.Struct(">f"), struct.Struct(">d")


class ReadError(ValueError):
    """The bytes are not one well-formed, bounded msgpack value."""


class Reader:
    """Reads msgpack from ``buf`` (any bytes-like object; not copied).

    Args:
        buf: the bytes.
        max_array: longest array; max_map: most map entries; max_str: longest string (bytes);
        max_containers: most arrays + maps in the whole value.
    """

    def __init__(self, buf: Any, *, max_array: int, max_map: int, max_str: int, max_containers: int) -> None:
        self.mv = memoryview(buf).cast("B") if not isinstance(buf, memoryview) or buf.format != "B" else buf
        self.n = len(self.mv)
        self.pos = 0
        self.max_array, self.max_map, self.max_str = max_array, max_map, max_str
        self.containers_left = max_containers

    def _take(self, k: int) -> int:
        p = self.pos
        if k < 0 or p + k > self.n:
            raise ReadError(f"truncated at byte {p}: {k} more bytes needed, {self.n - p} left")
        self.pos = p + k
        return p

    def _u(self, s: struct.Struct) -> int:
        p = self._take(s.size)
        return s.unpack_from(self.mv, p)[0]

    def read_one(self) -> Any:
        """The whole buffer as exactly one value (nothing may follow)."""
        v = self.read(0)
        if self.pos != self.n:
            raise ReadError(f"{self.n - self.pos} bytes after the value at byte {self.pos}")
        return v

    def _container(self, count: int, limit: int, what: str) -> None:
        if count > limit:
            raise ReadError(f"{what} of {count} elements at byte {self.pos}, at most {limit}")
        self.containers_left -= 1
        if self.containers_left < 0:
            raise ReadError("too many arrays and maps")

    def read(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ReadError(f"nested deeper than {MAX_DEPTH}")
        b = self.mv[self._take(1)]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return self._map(b & 0x0F, depth)
        if 0x90 <= b <= 0x9F:
            return self._array(b & 0x0F, depth)
        if 0xA0 <= b <= 0xBF:
            return self._str(b & 0x1F)
        if b == 0xC0:
            return None
        if b == 0xC2:
            return False
        if b == 0xC3:
            return True
        if b in (0xC4, 0xC5, 0xC6):
            k = self._u((_U8, _U16, _U32)[b - 0xC4])
            p = self._take(k)
            return self.mv[p:p + k]
        if b == 0xCA:
            return float(self._u(_F32))
        if b == 0xCB:
            return self._u(_F64)
        if 0xCC <= b <= 0xCF:
            return self._u((_U8, _U16, _U32, _U64)[b - 0xCC])
        if 0xD0 <= b <= 0xD3:
            return self._u((_I8, _I16, _I32, _I64)[b - 0xD0])
        if b in (0xD9, 0xDA, 0xDB):
            return self._str(self._u((_U8, _U16, _U32)[b - 0xD9]))
        if b in (0xDC, 0xDD):
            return self._array(self._u((_U16, _U32)[b - 0xDC]), depth)
        if b in (0xDE, 0xDF):
            return self._map(self._u((_U16, _U32)[b - 0xDE]), depth)
        raise ReadError(f"type byte 0x{b:02x} at byte {self.pos - 1} is not allowed (ext or reserved)")

    def _str(self, k: int) -> str:
        if k > self.max_str:
            raise ReadError(f"string of {k} bytes at byte {self.pos}, at most {self.max_str}")
        p = self._take(k)
        try:
            return str(self.mv[p:p + k], "utf-8")
        except UnicodeDecodeError as exc:
            raise ReadError(f"string at byte {p} is not UTF-8") from exc

    def _array(self, k: int, depth: int) -> list:
        self._container(k, self.max_array, "array")
        if k > self.n - self.pos:  # every element takes at least one byte
            raise ReadError(f"array of {k} elements cannot fit in the {self.n - self.pos} bytes left")
        return [self.read(depth + 1) for _ in range(k)]

    def _map(self, k: int, depth: int) -> dict:
        self._container(k, self.max_map, "map")
        if 2 * k > self.n - self.pos:
            raise ReadError(f"map of {k} entries cannot fit in the {self.n - self.pos} bytes left")
        out = {}
        for _ in range(k):
            key = self.read(depth + 1)
            if not isinstance(key, str):
                raise ReadError(f"map key of type {type(key).__name__} before byte {self.pos}: keys are strings")
            out[key] = self.read(depth + 1)
        return out


def read_array_fields(buf: Any, **bounds: int) -> tuple[list, list[int]]:
    """Read a top-level array and return (elements, byte size of each element)."""
    r = Reader(buf, **bounds)
    b = r.mv[r._take(1)] if r.n else None
    if b is None:
        raise ReadError("empty input")
    if 0x90 <= b <= 0x9F:
        k = b & 0x0F
    elif b == 0xDC:
        k = r._u(_U16)
    elif b == 0xDD:
        k = r._u(_U32)
    else:
        raise ReadError("not an array")
    r._container(k, r.max_array, "array")
    items, sizes = [], []
    for _ in range(k):
        start = r.pos
        items.append(r.read(1))
        sizes.append(r.pos - start)
    if r.pos != r.n:
        raise ReadError(f"{r.n - r.pos} bytes after the value at byte {r.pos}")
    return items, sizes
