"""The compact, exact set of selected devices carried by ``round_start.members`` (sans-I/O).

The server gives every device a **member index** when it first joins: 0, 1, 2, … in the order of
first admission, kept for good (a device joining again, or a server resumed from its checkpoint,
keeps the index; a device joining mid-run takes the next one). The accepted ``join`` receipt tells
the device its index (``receipt.member_index``). A broadcast ``round_start`` then names the
selected devices by index in ``members``, one ``bin`` value of one of two forms, whichever is
shorter (the bitmap on a tie):

======  ==========  ============================================================================
byte 0  form        bytes 1…
======  ==========  ============================================================================
0       bitmap      bit ``i mod 8`` (least significant first) of byte ``1 + i div 8`` is set when
                    index ``i`` is selected; the encoder writes no trailing zero byte, so the
                    bitmap is ``max index div 8 + 1`` bytes
1       deltas      the selected indices in strictly increasing order, delta-coded (the first
                    delta is the first index itself, each next one ``index[j] - index[j-1]``,
                    hence ≥ 1), each delta an unsigned LEB128 varint (7 bits per byte, least
                    significant group first, high bit set on every byte but the last, minimal,
                    at most 4 bytes), nothing after the last one: the ``topk`` index coding
======  ==========  ============================================================================

An index is at most :data:`MAX_MEMBER_INDEX`. The set is never empty (the field is then absent).
Sizes for ``m`` selected of indices ``0 … n-1``: bitmap ``1 + ceil(n / 8)`` bytes whatever ``m``
(126 at n = 1,000); deltas ``1 + Σ varint(delta)`` bytes, ``1 + m`` while every gap is below 128
(a device index below 128 and every next one within 127 of the previous).
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import FieldError

BITMAP = 0
"""Form byte of a bitmap ``members`` value."""

DELTAS = 1
"""Form byte of a delta-varint ``members`` value."""

MAX_MEMBER_INDEX = (1 << 24) - 1
"""Largest member index (16,777,215): a bitmap is at most 2 MiB + 1 byte, a varint at most 4 bytes."""

MAX_MEMBERS = 100_000
"""Most indices a deltas form may list (the limit of ``round_start.selected``)."""

JOIN_INFO_KEY = "members"
"""``join.info`` key (bool ``true``) by which an agent says it reads ``round_start.members``; the
server gives ``receipt.member_index`` and names the device in ``members`` only then (an agent that
does not say so is named in ``selected``, as before)."""

_FIELD = "body.members"


def _varint(v: int, out: bytearray) -> None:
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def _checked(indices: Iterable[int]) -> list[int]:
    out = sorted(set(indices))
    if not out:
        raise ValueError("members: the set is empty (send no members field instead)")
    for i in (out[0], out[-1]):
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= MAX_MEMBER_INDEX:
            raise ValueError(f"members: index {i!r} is not an integer in 0..{MAX_MEMBER_INDEX}")
    if len(out) > MAX_MEMBERS:
        raise ValueError(f"members: {len(out)} indices, at most {MAX_MEMBERS}")
    return out


def bitmap_form(indices: Iterable[int]) -> bytes:
    """The bitmap form (form byte 0 + ``max // 8 + 1`` bytes) of a non-empty index set.

    Raises:
        ValueError: an empty set, or an index outside 0..:data:`MAX_MEMBER_INDEX`.
    """
    idx = _checked(indices)
    bits = bytearray(idx[-1] // 8 + 1)
    for i in idx:
        bits[i >> 3] |= 1 << (i & 7)
    return bytes([BITMAP]) + bytes(bits)


def deltas_form(indices: Iterable[int]) -> bytes:
    """The deltas form (form byte 1 + LEB128 varints of the gaps) of a non-empty index set.

    Raises:
        ValueError: an empty set, more than :data:`MAX_MEMBERS` indices, or an index outside
            0..:data:`MAX_MEMBER_INDEX`.
    """
    idx = _checked(indices)
    out = bytearray([DELTAS])
    prev = 0
    for j, i in enumerate(idx):
        _varint(i - prev if j else i, out)
        prev = i
    return bytes(out)


def encode_members(indices: Iterable[int]) -> bytes:
    """``round_start.members`` for the selected member indices: the shorter of the two forms
    (the bitmap on a tie). Duplicates are ignored; order does not matter.

    Raises:
        ValueError: an empty set, or an index outside 0..:data:`MAX_MEMBER_INDEX`.
    """
    idx = _checked(indices)
    bitmap_len = 1 + idx[-1] // 8 + 1
    if len(idx) > MAX_MEMBERS:
        return bitmap_form(idx)
    deltas = deltas_form(idx)
    return bitmap_form(idx) if bitmap_len <= len(deltas) else deltas


def _deltas(data: bytes) -> list[int]:
    """The indices of a deltas form (``data`` without its form byte), checked."""
    out: list[int] = []
    pos, prev, n = 0, 0, len(data)
    while pos < n:
        v = shift = 0
        start = pos
        while True:
            if pos >= n:
                raise FieldError(f"{_FIELD}: truncated varint at byte {start + 1}", field=_FIELD)
            b = data[pos]
            pos += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
            if pos - start >= 4:
                raise FieldError(f"{_FIELD}: varint at byte {start + 1} is longer than 4 bytes", field=_FIELD)
        if pos - start > 1 and b == 0:
            raise FieldError(f"{_FIELD}: non-minimal varint at byte {start + 1}", field=_FIELD)
        if out and v == 0:
            raise FieldError(f"{_FIELD}: a delta of 0 at byte {start + 1} (indices must increase)", field=_FIELD)
        prev = prev + v if out else v
        if prev > MAX_MEMBER_INDEX:
            raise FieldError(f"{_FIELD}: index {prev} exceeds {MAX_MEMBER_INDEX}", field=_FIELD)
        out.append(prev)
        if len(out) > MAX_MEMBERS:
            raise FieldError(f"{_FIELD}: more than {MAX_MEMBERS} indices", field=_FIELD)
    return out


def check_members(data: bytes) -> None:
    """Validate a received ``members`` value (what the decoder calls).

    Raises:
        FieldError: empty, an unknown form byte, a bitmap longer than the largest index allows
            or without any bit set, or a deltas form with a truncated, over-long or non-minimal
            varint, a zero delta after the first, an index above :data:`MAX_MEMBER_INDEX` or more
            than :data:`MAX_MEMBERS` indices.
    """
    if len(data) < 2:
        raise FieldError(f"{_FIELD}: {len(data)} bytes, at least 2 (a form byte and a non-empty set)", field=_FIELD)
    form = data[0]
    if form == BITMAP:
        if len(data) - 1 > MAX_MEMBER_INDEX // 8 + 1:
            raise FieldError(f"{_FIELD}: a bitmap of {len(data) - 1} bytes, at most {MAX_MEMBER_INDEX // 8 + 1}",
                             field=_FIELD)
        if not any(data[1:]):
            raise FieldError(f"{_FIELD}: the bitmap selects no device", field=_FIELD)
    elif form == DELTAS:
        _deltas(data[1:])
    else:
        raise FieldError(f"{_FIELD}: unknown form {form} (0 = bitmap, 1 = deltas)", field=_FIELD)


def decode_members(data: bytes) -> list[int]:
    """The member indices of a ``members`` value, increasing.

    Raises:
        FieldError: as :func:`check_members`.
    """
    check_members(data)
    if data[0] == BITMAP:
        return [8 * j + b for j, byte in enumerate(data[1:]) if byte for b in range(8) if byte >> b & 1]
    return _deltas(data[1:])


def members_contain(data: bytes, index: int) -> bool:
    """Whether member ``index`` is in the ``members`` value ``data`` (validated by the decoder):
    O(1) for a bitmap, one pass over the varints for the deltas form; ``False`` for empty ``data``."""
    if not data or index < 0:
        return False
    if data[0] == BITMAP:
        j = 1 + (index >> 3)
        return j < len(data) and bool(data[j] >> (index & 7) & 1)
    return index in _deltas(data[1:])
