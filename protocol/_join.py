"""The one copy of an encode: an encoded payload's segments joined into one ``bytes`` object.

:func:`protocol.messages.encode` packs headers around the tensors' buffers and copies the whole
into the payload once. ``b"".join`` does that copy into memory from ``malloc``; a payload of
tens of MB is above glibc's mmap threshold (at most 32 MiB, lower in a process that has not yet
freed a large block), so the kernel maps it fresh, one 4 KiB page per first touch, each fault
zeroing its page: 44.8 MB take ~11,000 faults and ~8× the time of ``np.copyto`` of the same bytes
into an existing array. numpy asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on its
allocations of 4 MiB or more, which the kernel honours in its ``madvise`` mode
(``/sys/kernel/mm/transparent_hugepage/enabled``), whence ``arr.copy()`` is 4–5× faster than
the join.

:func:`join_segments` does the same for a ``bytes`` object: from :data:`HUGE_FROM` bytes it
allocates the payload uninitialised (``PyBytes_FromStringAndSize(NULL, n)``, the C API's way of
building a bytes object in place: its contents may be written while no one else holds it),
marks the 2 MiB pages wholly inside it ``MADV_HUGEPAGE``, and copies each segment to its place.
The result is the same type with the same bytes as ``b"".join(segments)``, made with the same
one copy and the same memory (the payload itself); only the page faults differ (one per 2 MiB,
the kernel zeroing each huge page once). Smaller payloads, and a platform without any of the
pieces (not CPython, no ``ctypes``, no ``MADV_HUGEPAGE``: not Linux), use ``b"".join``; so does
every payload after ``madvise`` failed once (a kernel without transparent huge pages), which is
logged.
"""

from __future__ import annotations

import logging
import mmap
import sys
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

HUGE_FROM = 4 * 1024 * 1024
"""Payloads at least this long (bytes) are built in place on huge pages (numpy's threshold)."""

_HUGE_PAGE = 2 * 1024 * 1024
"""Size of an x86-64 / arm64 (4 KiB base pages) transparent huge page, bytes."""

def _load() -> tuple[Any, Any, Any, int] | None:
    """(PyBytes_FromStringAndSize, PyBytes_AsString, madvise, MADV_HUGEPAGE), or ``None`` when
    this platform lacks one of them."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if sys.implementation.name != "cpython" or advice is None:
        return None
    try:
        import ctypes

        new = ctypes.pythonapi.PyBytes_FromStringAndSize  # PyDLL: holds the GIL, raises a set error
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
        address = ctypes.pythonapi.PyBytes_AsString
        address.restype = ctypes.c_void_p
        address.argtypes = [ctypes.py_object]
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.restype = ctypes.c_int
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (ImportError, AttributeError, OSError):
        return None
    return new, address, madvise, int(advice)


_API = _load()


def join_in_place(segments: Sequence[bytes | memoryview], total: int) -> bytes:
    """``b"".join(segments)`` built in an uninitialised bytes object on huge pages.

    Args:
        segments: the pieces in order; each ``bytes`` or a 1-D ``"B"`` C-contiguous memoryview.
        total: their summed length in bytes (≥ 0).

    Returns:
        A new ``bytes`` equal to ``b"".join(segments)``.

    Raises:
        ValueError: ``total`` is not the segments' summed length (the object is discarded unread).
        OSError: ``madvise`` refused the range (its errno).
        RuntimeError: this platform cannot build bytes in place (:func:`join_segments` checks).
        MemoryError: no memory for the payload.
    """
    if _API is None:
        raise RuntimeError("building bytes in place needs CPython, ctypes and madvise(MADV_HUGEPAGE)")
    import ctypes

    new, address, madvise, advice = _API
    out = new(None, total)
    at = address(out)
    start = -(-at // _HUGE_PAGE) * _HUGE_PAGE
    end = (at + total) // _HUGE_PAGE * _HUGE_PAGE
    if end > start and madvise(start, end - start, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_HUGEPAGE) of {end - start:,} bytes failed")
    offset = 0
    with memoryview((ctypes.c_char * total).from_address(at)).cast("B") as dst:  # released before return
        for seg in segments:
            n = len(seg)
            if offset + n > total:
                raise ValueError(f"segments are longer than total = {total:,} bytes")
            dst[offset:offset + n] = seg
            offset += n
    if offset != total:
        raise ValueError(f"segments hold {offset:,} bytes, not total = {total:,}")
    return out


def fillable_bytes(total: int) -> tuple[bytes, memoryview] | None:
    """A new ``bytes`` object of ``total`` bytes, uninitialised, and a writable ``"B"`` memoryview
    onto its contents, to be filled in place before anyone else sees the object (the receiving
    side of a chunked transfer: :class:`protocol.chunking.Reassembler` writes each chunk at its
    offset and hands over the object itself, not a copy of a ``bytearray``). From
    :data:`HUGE_FROM` bytes the 2 MiB pages wholly inside it are asked for as huge pages (a refusal
    is ignored here: the object is still good, in 4 KiB pages).

    Args:
        total: the size in bytes (≥ 0).

    Returns:
        ``(obj, view)``: write through ``view`` only while no one else holds ``obj``, every byte
        before ``obj`` is read, then ``view.release()``; ``None`` when this platform cannot build
        bytes in place (not CPython, no ``ctypes``): the caller fills a ``bytearray`` instead.

    Raises:
        MemoryError: no memory for ``total`` bytes.
    """
    if _API is None or total <= 0:
        return None
    import ctypes

    new, address, madvise, advice = _API
    out = new(None, total)
    at = address(out)
    if total >= HUGE_FROM:
        start = -(-at // _HUGE_PAGE) * _HUGE_PAGE
        end = (at + total) // _HUGE_PAGE * _HUGE_PAGE
        if end > start:
            madvise(start, end - start, advice)  # a refusal only costs page faults
    return out, memoryview((ctypes.c_char * total).from_address(at)).cast("B")


def join_segments(segments: Sequence[bytes | memoryview], total: int) -> bytes:
    """The payload ``b"".join(segments)``: its values copied once, on huge pages from
    :data:`HUGE_FROM` bytes (:func:`join_in_place`, see the module docstring), else by the join.

    Args:
        segments: the pieces in order; each ``bytes`` or a 1-D ``"B"`` C-contiguous memoryview.
        total: their summed length in bytes.

    Returns:
        A new ``bytes`` object (for a single ``bytes`` segment, possibly that object itself).

    Raises:
        ValueError: ``total`` is not the segments' summed length (on the in-place path).
        MemoryError: no memory for the payload.
    """
    global _API
    if total < HUGE_FROM or _API is None:
        return b"".join(segments)
    try:
        return join_in_place(segments, total)
    except OSError as exc:
        _API = None
        log.warning("payloads of %s bytes and more are joined in 4 KiB pages from now on: %s "
                    "(encode of a large payload is then several times slower than a copy)", f"{HUGE_FROM:,}", exc)
        return b"".join(segments)
