"""Reproducers (tester): the decoder bounds each tensor (2**28 elements) and the tensor count
(4096) but not what a message decodes to in total, and an allocation failure escapes as
``MemoryError`` although ``decode`` promises "ProtocolError: any violation; nothing else escapes".

* ``topk`` densifies: a 129-byte update with four ``topk`` tensors declaring 2**28 float64
  elements each asks for 8 GiB; the 98 KB version with 4096 of them asks for 8 TiB and is
  *accepted* (calloc'ed lazily, so only address space is used - until an allocation fails).
* ``fp32+zstd`` really writes it: a 32 KB zstd frame of zeros honestly declaring 2**27 float64
  decodes to 1 GiB of RSS (measured; 6 such tensors in a 197 KB message hit a 6 GiB limit).
* Observed live: ``fedfleet simulate --config examples/quickstart.toml`` run with
  ``RLIMIT_AS`` = 8 GiB (a normal run peaks at ~4.8 GB of address space) died with exit code 1
  and ``numpy._core._exceptions._ArrayMemoryError: Unable to allocate 2.00 GiB`` raised through
  ``Channel.accept`` → ``AggregationServer.pump`` after one 129-byte forged update. A 1–2 GB
  Raspberry Pi agent has that limit without any ulimit (same path for a forged ``global``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import numpy as np
import pytest

from protocol.errors import ProtocolError
from protocol.messages import decode
from protocol.tensors import Codec, encode_tensor

ROOT = Path(__file__).resolve().parents[1]


def _topk_update(n_tensors: int, elements: int = 1 << 28) -> bytes:
    small = np.zeros(4, np.float64)
    small[1] = 1.0
    t = list(encode_tensor(small, Codec.parse("topk:1")))
    t[2] = [elements]  # declare a huge dense shape; the single index (1) stays valid
    body = msgpack.packb([[t] * n_tensors, 5, 0.1, {}, False], use_bin_type=True)
    return msgpack.packb([1, 4, 1, "client-000", 1, 0, body], use_bin_type=True)


def test_message_decoding_to_terabytes_is_refused() -> None:
    payload = _topk_update(4096)
    assert len(payload) < 100_000
    with pytest.raises(ProtocolError):
        decoded = decode(payload)
        del decoded


def test_allocation_failure_while_decoding_is_a_protocol_error(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_break_tensor_budget import _topk_update
        from protocol.errors import ProtocolError
        from protocol.messages import decode
        payload = _topk_update(4)
        limit = 3 << 30  # an address-space limit (container, 32-bit or small-RAM device)
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
