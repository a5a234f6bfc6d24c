"""Reproducers (tester): a small hostile payload costs the server far more than its size.

``protocol.messages.decode`` hands the whole payload to ``msgpack.unpackb`` before checking that
it is an envelope. ``max_array_len`` bounds each array, not their number: a payload made of
nested empty arrays (``0x90``, one byte each) becomes one Python list per byte, about 64× the
payload in memory and ~0.4 s of CPU per MB on the server's only message thread. A 10 MB payload
costs ~700 MB and ~4 s; with a round deadline of 8 s it made the server skip round 1 and reject
all three on-time updates as "late" (observed; see the tester's report). MQTT allows 256 MB.
"""

from __future__ import annotations

import tracemalloc

import pytest

from protocol.errors import ProtocolError
from protocol.messages import decode


def _nested_empty_arrays(total_bytes: int) -> bytes:
    inner = b"\xdc\xff\xff" + b"\x90" * 65535  # array16 of 65,535 empty arrays
    k = max(1, total_bytes // len(inner))
    return b"\xdd" + k.to_bytes(4, "big") + inner * k  # array32 of k such arrays


def test_rejecting_a_non_envelope_costs_memory_proportional_to_its_size() -> None:
    payload = _nested_empty_arrays(1024 * 1024)
    size = len(payload)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            decode(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # what should happen: a payload whose first byte already says "not a 7-field envelope" (or
    # whose structure exceeds any sane element count) is refused in O(payload) memory
    del payload
    assert peak < 8 * size, f"peak {peak / 2**20:.0f} MiB for a {size / 2**20:.1f} MiB payload"
