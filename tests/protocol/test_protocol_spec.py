"""PROTOCOL.md is the normative spec: its test vectors hold byte for byte, in both directions, and
the file is what tools/gen_protocol_md.py generates from the code's documentation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from protocol.messages import decode, encode
from protocol.tensors import Codec
from protocol.test_vectors import MESSAGE_VECTORS, message_vector_records

ROOT = Path(__file__).resolve().parents[2]
SPEC = (ROOT / "protocol" / "PROTOCOL.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(MESSAGE_VECTORS))
def test_message_vector_round_trips_byte_for_byte(name: str) -> None:
    codec_text, hx = MESSAGE_VECTORS[name]
    record = message_vector_records()[name]
    assert encode(record, Codec.parse(codec_text) if codec_text else None).payload.hex() == hx
    dec = decode(bytes.fromhex(hx)).envelope
    assert (dec.round, dec.sender, dec.seq, dec.timestamp_ms, dec.kind) == \
        (record.round, record.sender, record.seq, record.timestamp_ms, record.kind)
    for f in type(record.body).__dataclass_fields__:
        got, want = getattr(dec.body, f), getattr(record.body, f)
        if f == "tensors":
            tol = 0.0 if codec_text is None else np.abs(want[0]).max() / 127 / 2 + 1e-7
            for g, w in zip(got, want):
                assert g.shape == w.shape and g.dtype == w.dtype
                np.testing.assert_allclose(g, w, atol=tol, rtol=0)
        else:
            assert got == want, f
    # re-encoding the decoded message gives the same bytes again (lossless vectors)
    if codec_text is None:
        assert encode(dec).payload.hex() == hx


def test_every_vector_is_in_the_spec() -> None:
    from protocol.test_vectors import TEST_VECTORS

    for _, hx in MESSAGE_VECTORS.values():
        assert hx in SPEC
    for _, _, hx, _ in TEST_VECTORS.values():
        assert hx in SPEC


def test_every_kind_has_a_vector() -> None:
    from protocol.messages import Kind

    kinds = {r.kind for r in message_vector_records().values()}
    assert kinds == set(Kind)


def test_spec_is_generated_from_the_code() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_protocol_md.py"), "--check"], cwd=ROOT)
    assert r.returncode == 0, "protocol/PROTOCOL.md is stale: run python tools/gen_protocol_md.py"
