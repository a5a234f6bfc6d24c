"""What a hostile payload may cost the decoder: ``protocol.messages.decode`` refuses, with a
``ProtocolError`` and in memory proportional to the payload, a message whose *declared* contents
are huge, and an allocation failure while decoding is a ``ProtocolError`` too ("nothing else
escapes").

The payloads are packed here by hand with msgpack: nested empty arrays (one Python list per
byte if unpacked eagerly, ~64× the payload), and ``topk`` tensors that declare 2**28 float64
elements each (2 GiB dense per tensor for a ~30-byte tensor)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import msgpack
import numpy as np
import pytest

from protocol.errors import ProtocolError
from protocol.messages import decode
from protocol.tensors import Codec, encode_tensor

ROOT = Path(__file__).resolve().parents[2]


def _nested_empty_arrays(total_bytes: int) -> bytes:
    """An array32 of k array16s of 65,535 empty arrays each (``0x90``, one byte apiece), about
    ``total_bytes`` long: not an envelope."""
    inner = b"\xdc\xff\xff" + b"\x90" * 65535
    k = max(1, total_bytes // len(inner))
    return b"\xdd" + k.to_bytes(4, "big") + inner * k


def _topk_update(n_tensors: int, elements: int = 1 << 28) -> bytes:
    """An update envelope with ``n_tensors`` copies of a ``topk:1`` tensor whose dense shape is
    declared as [elements] float64 (its one index, 1, stays valid)."""
    small = np.zeros(4, np.float64)
    small[1] = 1.0
    t = list(encode_tensor(small, Codec.parse("topk:1")))
    t[2] = [elements]
    body = msgpack.packb([[t] * n_tensors, 5, 0.1, {}, False], use_bin_type=True)
    return msgpack.packb([1, 4, 1, "client-000", 1, 0, body], use_bin_type=True)


def test_a_non_envelope_is_refused_in_memory_proportional_to_its_size() -> None:
    """1 MiB of nested empty arrays: refused with a peak below 8× the payload."""
    payload = _nested_empty_arrays(1024 * 1024)
    size = len(payload)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            decode(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del payload
    assert peak < 8 * size, f"peak {peak / 2**20:.0f} MiB for a {size / 2**20:.1f} MiB payload"


def test_a_message_declaring_terabytes_of_tensors_is_refused() -> None:
    """4096 topk tensors of 2**28 float64 each (8 TiB dense) in a < 100 kB message."""
    payload = _topk_update(4096)
    assert len(payload) < 100_000
    with pytest.raises(ProtocolError):
        decoded = decode(payload)
        del decoded


def test_an_allocation_failure_while_decoding_is_a_protocol_error(tmp_path: Path) -> None:
    """Under a 3 GiB address-space limit (a container, a 32-bit or small-RAM device), four topk
    tensors declaring 2 GiB each end in ``ProtocolError``, not ``MemoryError``."""
    payload_file = tmp_path / "payload.bin"
    payload_file.write_bytes(_topk_update(4))
    script = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {str(ROOT)!r})
        from protocol.errors import ProtocolError
        from protocol.messages import decode
        payload = open({str(payload_file)!r}, "rb").read()
        limit = 3 << 30
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        try:
            decode(payload)
            print("ACCEPTED")
        except ProtocolError as exc:
            print("PROTOCOL_ERROR", exc)
        except BaseException as exc:
            print("ESCAPED", type(exc).__name__, exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "PROTOCOL_ERROR" in out.stdout, out.stdout + out.stderr
