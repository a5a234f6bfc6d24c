"""PROTOCOL.md stands alone: sections in order, no names of the Python code, and the rules it
states in its own words (chunk data budget formula, canonical manifest JSON, expected vector
fields, dtype table) agree with what the code does."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from protocol import chunking, messages, tensors
from protocol.test_vectors import MESSAGE_VECTORS, message_vector_records

ROOT = Path(__file__).resolve().parents[2]
SPEC = (ROOT / "protocol" / "PROTOCOL.md").read_text(encoding="utf-8")


def _gen():
    spec = importlib.util.spec_from_file_location("gen_protocol_md", ROOT / "tools" / "gen_protocol_md.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sections_run_in_order() -> None:
    numbers = [int(m) for m in re.findall(r"^## (\d+)\. ", SPEC, flags=re.M)]
    assert numbers == list(range(1, 13))


@pytest.mark.parametrize("name", ["TensorLimits", "needs_chunking", "TransferCache", "ReplayStore", "ErrorFeedback",
                                  "protocol.", "edge_agent", ".py", "study", "DTYPES", "CODECS", "MAX_DIMS",
                                  "numpy", "ProtocolError", "test_vectors", "python"])
def test_spec_names_no_python_internals(name: str) -> None:
    # identifiers case-sensitively; the words "study", "numpy", "python" in any case
    assert (name.lower() not in SPEC.lower()) if name.islower() and name.isalpha() else (name not in SPEC)


def test_dtype_table_lists_every_dtype() -> None:
    for code, dt in tensors.DTYPES.items():
        assert f"| {code} | `{dt.name}` | {dt.itemsize} |" in SPEC


def test_topic_table_names_receipts_both_ways_and_per_device_round_start() -> None:
    assert "`up/{client_id}/receipt` (answers a `global`)" in SPEC
    assert "`down/{client_id}/receipt` (answers a `join` or an `update`)" in SPEC
    assert "`down/{client_id}/round_start`" in SPEC


def test_manifest_example_hash_is_the_agents() -> None:
    models = pytest.importorskip("edge_agent.models")
    gen = _gen()
    assert gen.manifest_example_hash() == models.manifest_hash(
        [(n, tuple(s), d) for n, s, d in gen.MANIFEST_EXAMPLE])
    assert f"hash      = {gen.manifest_example_hash()}" in SPEC
    # worked by hand: sha256 of the canonical text, first 16 hex characters
    assert gen.manifest_example_hash() == "9f61ad7a9454f4d6"


@pytest.mark.parametrize("max_packet", [160, 181, 255, 256, 300, 1024, 65_536, 65_600, 1 << 20, 300_000_000])
@pytest.mark.parametrize("sender,rnd", [("server", 0), ("client-007", 3), ("c" * 40, 70_000)])
def test_chunk_budget_formula_is_the_codes(max_packet: int, sender: str, rnd: int) -> None:
    gen = _gen()
    topic = "fedfleet/v1/fed-1/up/client-007/update"
    try:
        want = chunking.chunk_data_budget(topic, max_packet, qos=1, sender=sender, round=rnd)
    except ValueError:
        with pytest.raises(ValueError):
            gen.chunk_budget_reference(topic, max_packet, sender, rnd)
        return
    assert gen.chunk_budget_reference(topic, max_packet, sender, rnd) == want


def test_budget_table_by_hand() -> None:
    # topic of 38 bytes, sender "client-007" (11 bytes as fixstr), round 3 (1 byte): payload(D) = 3 + 1 + 11
    # + 9 + 9 + bin(73 + bin(D)). D = 867: bin(D) = 870, body 943, bin(943) = 946, payload 979;
    # R = 2 + 38 + 2 + 979 = 1021, packet = 1 + 2 + 1021 = 1024 (fits); D = 868 gives 1025.
    assert "| 1,024 | 867 |" in SPEC


def test_expected_fields_beside_each_vector_match_the_records() -> None:
    import json

    records = message_vector_records()
    for name, (_, hx) in MESSAGE_VECTORS.items():
        block = SPEC.split(f"#### `{name}` ", 1)[1]
        assert hx in block.split("####", 1)[0]
        fields = json.loads(block.split("```json\n", 1)[1].split("\n```", 1)[0])
        rec = records[name]
        assert (fields["version"], fields["kind"], fields["round"], fields["sender"], fields["seq"],
                fields["timestamp_ms"]) == (1, int(rec.kind), rec.round, rec.sender, rec.seq, rec.timestamp_ms)
        for f in type(rec.body).__dataclass_fields__:
            want = getattr(rec.body, f)
            if f in ("tensors", "extras", "instructions") or isinstance(want, bytes):
                continue
            if want is None:  # an optional field the record leaves out: absent on the wire and beside it
                assert f not in fields["body"], f
                continue
            got = fields["body"][f]
            assert (list(got) if isinstance(want, tuple) else got) == (list(want) if isinstance(want, tuple) else want)


def test_body_table_and_limits_come_from_the_code() -> None:
    for k in messages.Kind:
        assert f"| {int(k)} | `{k.label}` |" in SPEC
    assert f"| chunks per transfer | {messages.MAX_CHUNKS:,} |" in SPEC
