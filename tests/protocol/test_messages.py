"""Tests of the wire protocol: codec (messages, tensors), topic scheme and MQTT framing sizes.

The codec is tested like a codec (STYLE.md 9): every kind round-trips and the payload is compared
byte for byte with an envelope and body packed *here*, by hand, with ``msgpack.packb``; every
valid frame cut at every shorter length is rejected; a table of malformed payloads expects a
named ``ProtocolError`` subclass and field; sizes sit on msgpack's size-class boundaries; random
bytes and random mutations never raise anything but ``ProtocolError``.

MQTT framing sizes are checked against the measured table of
``notes/mqtt-transport-study.md`` §4, against amqtt's own PUBLISH encoder (MQTT 3.1.1), and
against a PUBLISH packet assembled byte by byte in this file (MQTT 5).
"""

from __future__ import annotations

import hashlib
import math
import time
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import mqtt_bytes, topics
from protocol.errors import (
    FieldError,
    MalformedMessage,
    ProtocolError,
    TensorError,
    UnknownKind,
    UnsupportedVersion,
)
from protocol.messages import (
    PROTOCOL_VERSION,
    Decoded,
    Encoded,
    Envelope,
    Finish,
    Global,
    Join,
    Kind,
    Receipt,
    RoundStart,
    Status,
    Update,
    decode,
    encode,
    now_ms,
)
from protocol.tensors import DTYPES, decode_tensor, encode_tensor

# ------------------------------------------------------------------------------------------
# Independent encoders (written from the wire tables in the module docstrings, not from the code)

#: Wire dtype numbers, copied from the table in protocol/tensors.py's docstring contract.
WIRE_DTYPES = {
    np.dtype("<f4"): 1, np.dtype("<f2"): 2, np.dtype("<f8"): 3, np.dtype("<i8"): 4,
    np.dtype("<i4"): 5, np.dtype("<i2"): 6, np.dtype("i1"): 7, np.dtype("u1"): 8, np.dtype("?"): 9,
}

KIND_NUMBERS = {"JOIN": 1, "ROUND_START": 2, "GLOBAL": 3, "UPDATE": 4, "FINISH": 5, "STATUS": 6, "RECEIPT": 7}

FED = "fed-a"
CLIENT = "client-007"
UPDATE_TOPIC = "fedfleet/v1/fed-a/up/client-007/update"


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def hand_tensor(arr: np.ndarray) -> list:
    """``[codec 0, dtype number, shape, little-endian C-order bytes]``."""
    le = np.asarray(arr).astype(np.asarray(arr).dtype.newbyteorder("<"))
    return [0, WIRE_DTYPES[le.dtype], list(np.shape(arr)), le.tobytes(order="C")]


def hand_body(body) -> list:
    """The positional body array of each kind, from the table in protocol/messages.py."""
    match body:
        case Join():
            return [body.profile, body.manifest_hash, body.num_samples, list(body.class_histogram), dict(body.info)]
        case RoundStart():
            return [list(body.selected), float(body.deadline_s), dict(body.config)]
        case Global():
            return [[hand_tensor(t) for t in body.tensors], dict(body.meta)]
        case Update():
            return [[hand_tensor(t) for t in body.tensors], body.num_samples, float(body.train_loss),
                    dict(body.metrics), bool(body.delta)]
        case Finish():
            return [body.reason, body.rounds_completed]
        case Status():
            return [body.state, body.detail]
        case Receipt():
            return [body.ref_kind, body.ref_seq, body.accepted, body.reason, body.sha256]
    raise AssertionError(body)


def frame(body: object = None, *, kind: object = 4, version: object = 1, rnd: object = 3, sender: object = CLIENT,
          seq: object = 5, ts: object = 1_700_000_000_000, raw_body: object = None, extra: tuple = ()) -> bytes:
    """A payload packed by hand: ``[version, kind, round, sender, seq, timestamp_ms, body, *extra]``.

    ``body`` is packed into a ``bin``; ``raw_body`` (when given) is placed as the 7th element as is.
    """
    seventh = raw_body if raw_body is not None else pack(body)
    return pack([version, kind, rnd, sender, seq, ts, seventh, *extra])


def ok_tensor() -> list:
    return hand_tensor(np.arange(6, dtype=np.float32).reshape(2, 3))


def update_body(**over) -> list:
    """A valid update body ``[tensors, num_samples, train_loss, metrics]`` with overrides."""
    fields = {"tensors": [ok_tensor()], "n": 10, "loss": 0.5, "metrics": {}}
    fields.update(over)
    return [fields["tensors"], fields["n"], fields["loss"], fields["metrics"]]


def tensor_body(t: list) -> list:
    return update_body(tensors=[t])


# ------------------------------------------------------------------------------------------
# Sample messages, one per kind

RNG = np.random.default_rng(7)
SAMPLES = {
    "join": Join(profile="rpi4", manifest_hash="sha256:0f3a", num_samples=600, class_histogram=tuple(range(60, 70)),
                 info={"device": "cpu", "threads": 4, "fp16": False, "ram_gb": 3.5}),
    "round_start": RoundStart(selected=("client-001", "client-007"), deadline_s=300.0,
                              config={"local_epochs": 1, "lr": 0.05, "batch_size": 32, "shuffle": True}),
    "global": Global(tensors=(
        RNG.standard_normal((4, 3)).astype(np.float32),
        RNG.standard_normal(5).astype(np.float16),
        RNG.standard_normal((2, 2)),                       # float64
        np.array([-(2**40), 0, 2**40], dtype=np.int64),
        np.array([-7, 7], dtype=np.int32),
        np.array([[-3], [3]], dtype=np.int16),
        np.array([-128, 127], dtype=np.int8),
        np.array([0, 255], dtype=np.uint8),
        np.array([True, False, True]),
        np.zeros((0, 3), dtype=np.float32),
    ), meta={"manifest_hash": "sha256:0f3a", "accuracy": 0.91}),
    "update": Update(tensors=(RNG.standard_normal((8, 4)).astype(np.float32),
                              RNG.standard_normal(8).astype(np.float32)),
                     num_samples=600, train_loss=0.42, metrics={"train_seconds": 1.5, "train_accuracy": 0.8}),
    "finish": Finish(reason="rounds done", rounds_completed=10),
    "status": Status(state="training", detail="round 3"),
    "receipt": Receipt(ref_kind=4, ref_seq=5, accepted=True, reason="", sha256=hashlib.sha256(b"x").digest()),
}
SAMPLE_KIND = {"join": Kind.JOIN, "round_start": Kind.ROUND_START, "global": Kind.GLOBAL, "update": Kind.UPDATE,
               "finish": Kind.FINISH, "status": Kind.STATUS, "receipt": Kind.RECEIPT}


def envelope_of(body, *, rnd: int = 3, seq: int = 5, ts: int = 1_700_000_000_000, sender: str = CLIENT) -> Envelope:
    return Envelope(round=rnd, sender=sender, seq=seq, body=body, timestamp_ms=ts)


def assert_body_equal(got, want) -> None:
    assert type(got) is type(want)
    for name in want.__dataclass_fields__:
        g, w = getattr(got, name), getattr(want, name)
        if name == "tensors":
            assert len(g) == len(w)
            for gt, wt in zip(g, w, strict=True):
                assert gt.dtype == wt.dtype
                assert gt.shape == wt.shape
                np.testing.assert_array_equal(gt, wt)
        elif isinstance(w, dict):
            assert dict(g) == w
            for k in w:  # bool stays bool, int stays int, float stays float
                assert type(g[k]) is type(w[k]), k
        else:
            assert g == w, name
            assert type(g) is type(w), name


def small_payloads() -> list[bytes]:
    return [encode(envelope_of(b)).payload for k, b in SAMPLES.items() if k != "global"] + [
        encode(envelope_of(Global(tensors=(np.arange(3, dtype=np.float32),), meta={"a": 1}))).payload]


# ------------------------------------------------------------------------------------------
# Round trip


@pytest.mark.parametrize("name", list(SAMPLES))
def test_round_trip_every_kind(name: str) -> None:
    body = SAMPLES[name]
    env = envelope_of(body)
    enc = encode(env)
    assert isinstance(enc, Encoded) and isinstance(enc.payload, bytes)

    dec = decode(enc.payload)
    assert isinstance(dec, Decoded)
    got = dec.envelope
    assert got.kind is SAMPLE_KIND[name]
    assert (got.version, got.round, got.sender, got.seq, got.timestamp_ms) == (PROTOCOL_VERSION, 3, CLIENT, 5,
                                                                               1_700_000_000_000)
    assert_body_equal(got.body, body)

    # The byte split, from both sides, adds up to exactly the payload.
    assert enc.envelope_bytes + enc.body_bytes == len(enc.payload)
    assert dec.envelope_bytes + dec.body_bytes == dec.payload_bytes == len(enc.payload)
    assert dec.body_bytes == enc.body_bytes


@pytest.mark.parametrize("name", list(SAMPLES))
def test_payload_matches_hand_packed_bytes(name: str) -> None:
    body = SAMPLES[name]
    enc = encode(envelope_of(body))
    hand_body_bytes = pack(hand_body(body))
    assert enc.body_bytes == len(hand_body_bytes)
    hand_payload = pack([1, KIND_NUMBERS[SAMPLE_KIND[name].name], 3, CLIENT, 5, 1_700_000_000_000, hand_body_bytes])
    assert enc.payload == hand_payload


def test_big_endian_and_non_contiguous_tensors_round_trip_as_little_endian_c_order() -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    tensors = (base.astype(">f4"), base.T, base[:, ::2], np.asfortranarray(base.astype(np.int64)))
    dec = decode(encode(envelope_of(Global(tensors=tensors))).payload)
    for got, want in zip(dec.envelope.body.tensors, tensors, strict=True):
        assert got.dtype == want.dtype.newbyteorder("<")
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_zero_dim_tensor_keeps_its_shape() -> None:
    scalar = np.array(3.5, dtype=np.float32)
    assert encode_tensor(scalar)[2] == []
    dec = decode(encode(envelope_of(Global(tensors=(scalar,)))).payload)
    assert dec.envelope.body.tensors[0].shape == ()


def test_numpy_scalars_in_maps_are_sent_as_plain_scalars() -> None:
    body = Update(tensors=(np.ones(2, np.float32),), num_samples=np.int64(3), train_loss=np.float32(0.25),
                  metrics={"a": np.float32(0.5), "b": np.int64(7), "c": np.bool_(True)})
    got = decode(encode(envelope_of(body)).payload).envelope.body
    assert got.num_samples == 3 and got.train_loss == 0.25
    assert got.metrics == {"a": 0.5, "b": 7, "c": True}
    assert type(got.metrics["c"]) is bool and type(got.metrics["b"]) is int


def test_envelope_overhead_of_a_typical_update_is_at_most_32_bytes() -> None:
    before = int(time.time() * 1000)
    ts = now_ms()
    assert before <= ts <= int(time.time() * 1000) + 1  # milliseconds since the epoch, now
    for n in (1_000, 100_000):  # body in a bin16 and in a bin32
        body = Update(tensors=(np.zeros(n, np.float32),), num_samples=600, train_loss=0.4)
        enc = encode(Envelope(round=3, sender="client-007", seq=5, body=body, timestamp_ms=ts))
        bin_header = 3 if enc.body_bytes < 2**16 else 5
        # fixarray(7) + version + kind + round + str(10) + seq + uint64 timestamp + bin header
        expected = 1 + 1 + 1 + 1 + (1 + 10) + 1 + 9 + bin_header
        assert enc.envelope_bytes == expected
        assert enc.envelope_bytes <= 32


def test_decoded_tensors_are_read_only_zero_copy_views() -> None:
    payload = encode(envelope_of(SAMPLES["update"])).payload
    dec = decode(payload)
    whole = np.frombuffer(payload, np.uint8)
    for arr in dec.envelope.body.tensors:
        assert arr.flags.writeable is False
        with pytest.raises(ValueError):
            arr[...] = 0
        if arr.size:
            assert np.shares_memory(arr, whole), "the array views the received payload itself: no copy"

    # decode_tensor itself views exactly the bytes object it is given
    data = np.arange(12, dtype="<f4").tobytes()
    arr = decode_tensor([0, 1, [3, 4], data])
    assert np.shares_memory(arr, np.frombuffer(data, np.uint8))
    assert arr.flags.writeable is False


# ------------------------------------------------------------------------------------------
# Truncation and malformed input


@pytest.mark.parametrize("payload", small_payloads(), ids=[*(k for k in SAMPLES if k != "global"), "global"])
def test_every_truncation_is_rejected(payload: bytes) -> None:
    assert len(payload) < 600, "keep the loop small"
    decode(payload)  # the full frame is valid
    for cut in range(len(payload)):
        with pytest.raises(ProtocolError):
            decode(payload[:cut])


_BAD_HIST = [1, 2, "x"]
MALFORMED = [
    pytest.param(b"\xc1", MalformedMessage, "envelope", id="not-msgpack"),
    pytest.param(b"", MalformedMessage, "envelope", id="empty"),
    pytest.param(frame(update_body()) + b"\x00", MalformedMessage, "envelope", id="trailing-bytes"),
    pytest.param(pack({"version": 1}), MalformedMessage, "envelope", id="envelope-is-map"),
    pytest.param(pack(1), MalformedMessage, "envelope", id="envelope-is-int"),
    pytest.param(pack([1, 4, 3, CLIENT, 5, 0]), MalformedMessage, "envelope", id="envelope-too-few-fields"),
    pytest.param(frame(update_body(), version=2), UnsupportedVersion, "envelope.version", id="version-2"),
    pytest.param(frame(update_body(), version=True), MalformedMessage, "envelope.version", id="version-bool"),
    pytest.param(frame(update_body(), kind=99), UnknownKind, "envelope.kind", id="kind-99"),
    pytest.param(frame(update_body(), kind=0), UnknownKind, "envelope.kind", id="kind-0"),
    pytest.param(frame(update_body(), kind="update"), MalformedMessage, "envelope.kind", id="kind-str"),
    pytest.param(frame(update_body(), rnd=True), MalformedMessage, "envelope.round", id="round-bool"),
    pytest.param(frame(update_body(), rnd=-1), FieldError, "envelope.round", id="round-negative"),
    pytest.param(frame(update_body(), seq=1.0), MalformedMessage, "envelope.seq", id="seq-float"),
    pytest.param(frame(update_body(), ts=-5), FieldError, "envelope.timestamp_ms", id="timestamp-negative"),
    pytest.param(frame(update_body(), sender="a/b"), FieldError, "envelope.sender", id="sender-slash"),
    pytest.param(frame(update_body(), sender=""), FieldError, "envelope.sender", id="sender-empty"),
    pytest.param(frame(update_body(), sender="x" * 65), FieldError, "envelope.sender", id="sender-65-chars"),
    pytest.param(frame(update_body(), sender="+"), FieldError, "envelope.sender", id="sender-wildcard"),
    pytest.param(frame(update_body(), sender=7), MalformedMessage, "envelope.sender", id="sender-int"),
    pytest.param(frame(raw_body="abc"), MalformedMessage, "envelope.body", id="body-str-not-bin"),
    pytest.param(frame(raw_body=update_body()), MalformedMessage, "envelope.body", id="body-array-not-bin"),
    pytest.param(frame({"tensors": []}), MalformedMessage, "body", id="body-is-map"),
    pytest.param(frame(raw_body=b"\xc1"), MalformedMessage, "body", id="body-not-msgpack"),
    pytest.param(frame(raw_body=pack(update_body()) + b"\x00"), MalformedMessage, "body", id="body-trailing-bytes"),
    pytest.param(frame(update_body()[:3]), MalformedMessage, "body", id="body-too-few-fields"),
    pytest.param(frame(update_body(tensors={})), MalformedMessage, "body.tensors", id="tensors-not-array"),
    pytest.param(frame(tensor_body([0, 42, [2, 3], bytes(24)])), TensorError, "body.tensors[0].dtype",
                 id="tensor-unknown-dtype"),
    pytest.param(frame(tensor_body([0, True, [2], bytes(8)])), TensorError, "body.tensors[0].dtype",
                 id="tensor-dtype-bool"),
    pytest.param(frame(tensor_body([7, 1, [2, 3], bytes(24)])), TensorError, "body.tensors[0].codec",
                 id="tensor-unknown-codec"),
    pytest.param(frame(tensor_body([0, 1, [2, 3], bytes(23)])), TensorError, "body.tensors[0].data",
                 id="tensor-data-too-short"),
    pytest.param(frame(tensor_body([0, 1, [2, 3], bytes(28)])), TensorError, "body.tensors[0].data",
                 id="tensor-data-too-long"),
    pytest.param(frame(tensor_body([0, 1, [2**40], b""])), TensorError, "body.tensors[0].shape",
                 id="tensor-2**40-elements"),
    pytest.param(frame(tensor_body([0, 1, [2**32 - 1], b""])), TensorError, "body.tensors[0].shape",
                 id="tensor-2**32-1-elements"),
    pytest.param(frame(tensor_body([0, 1, [2**20, 2**20], b""])), TensorError, "body.tensors[0].shape",
                 id="tensor-2**40-elements-in-two-dims"),
    pytest.param(frame(tensor_body([0, 1, [1] * 9, bytes(4)])), TensorError, "body.tensors[0].shape",
                 id="tensor-9-dims"),
    pytest.param(frame(tensor_body([0, 1, [-1], b""])), TensorError, "body.tensors[0].shape",
                 id="tensor-negative-dim"),
    pytest.param(frame(tensor_body([0, 1, [True], bytes(4)])), TensorError, "body.tensors[0].shape",
                 id="tensor-bool-dim"),
    pytest.param(frame(tensor_body([0, 1, {}, b""])), MalformedMessage, "body.tensors[0].shape",
                 id="tensor-shape-map"),
    pytest.param(frame(tensor_body([0, 1, [2, 3]])), MalformedMessage, "body.tensors[0]", id="tensor-3-fields"),
    pytest.param(frame(tensor_body([0, 1, [1], "abcd"])), MalformedMessage, "body.tensors[0].data",
                 id="tensor-data-str"),
    pytest.param(frame(tensor_body(hand_tensor(np.array([1.0, np.nan], np.float32)))), TensorError,
                 "body.tensors[0]", id="update-tensor-nan"),
    pytest.param(frame(tensor_body(hand_tensor(np.array([np.inf], np.float16)))), TensorError,
                 "body.tensors[0]", id="update-tensor-inf-f16"),
    pytest.param(frame([[hand_tensor(np.array([-np.inf]))], {}], kind=3), TensorError, "body.tensors[0]",
                 id="global-tensor-inf"),
    pytest.param(frame(update_body(loss=math.inf)), FieldError, "body.train_loss", id="train-loss-inf"),
    pytest.param(frame(update_body(loss=math.nan)), FieldError, "body.train_loss", id="train-loss-nan"),
    pytest.param(frame(update_body(loss="0.5")), MalformedMessage, "body.train_loss", id="train-loss-str"),
    pytest.param(frame(update_body(n=0)), FieldError, "body.num_samples", id="num-samples-0"),
    pytest.param(frame(update_body(n=-3)), FieldError, "body.num_samples", id="num-samples-negative"),
    pytest.param(frame(update_body(n=True)), MalformedMessage, "body.num_samples", id="num-samples-bool"),
    pytest.param(frame([[CLIENT], 0.0, {}], kind=2), FieldError, "body.deadline_s", id="deadline-0"),
    pytest.param(frame([[CLIENT], -1.0, {}], kind=2), FieldError, "body.deadline_s", id="deadline-negative"),
    pytest.param(frame([[CLIENT], math.inf, {}], kind=2), FieldError, "body.deadline_s", id="deadline-inf"),
    pytest.param(frame([["a/b"], 10.0, {}], kind=2), FieldError, "body.selected", id="selected-invalid-id"),
    pytest.param(frame([[7], 10.0, {}], kind=2), FieldError, "body.selected", id="selected-int"),
    pytest.param(frame(["sleeping", ""], kind=6), FieldError, "body.state", id="status-unknown-state"),
    pytest.param(frame(["online", "x" * 1025], kind=6), FieldError, "body.detail", id="status-detail-1025"),
    pytest.param(frame([4, 5, True, "", bytes(31)], kind=7), FieldError, "body.sha256", id="receipt-digest-31"),
    pytest.param(frame([4, 5, True, "", "0" * 32], kind=7), MalformedMessage, "body.sha256", id="receipt-digest-str"),
    pytest.param(frame([4, 5, 1, "", bytes(32)], kind=7), MalformedMessage, "body.accepted", id="receipt-accepted-int"),
    pytest.param(frame([256, 5, True, "", bytes(32)], kind=7), FieldError, "body.ref_kind", id="receipt-ref-kind-256"),
    pytest.param(frame(["rpi4", "h", 1, _BAD_HIST, {}], kind=1), MalformedMessage, "body.class_histogram",
                 id="join-histogram-str"),
    pytest.param(frame(["p" * 65, "h", 1, [], {}], kind=1), FieldError, "body.profile", id="join-profile-65"),
    pytest.param(frame(update_body(metrics={1: 2})), MalformedMessage, "body", id="map-int-key"),
    pytest.param(frame(update_body(metrics={b"k": 2})), MalformedMessage, "body", id="map-bin-key"),
    pytest.param(frame(update_body(metrics={"k": [1, 2]})), MalformedMessage, "body.metrics.k", id="map-list-value"),
    pytest.param(frame(update_body(metrics={"k": {"a": 1}})), MalformedMessage, "body.metrics.k",
                 id="map-map-value"),
    pytest.param(frame(update_body(metrics={"k": None})), MalformedMessage, "body.metrics.k", id="map-nil-value"),
    pytest.param(frame(update_body(metrics={"k": b"x"})), MalformedMessage, "body.metrics.k", id="map-bin-value"),
    pytest.param(frame(update_body(metrics={"k": "v" * 1025})), FieldError, "body.metrics.k",
                 id="map-long-string"),
    pytest.param(frame(update_body(metrics=[])), MalformedMessage, "body.metrics", id="map-is-array"),
    pytest.param(frame(update_body(), raw_body=msgpack.ExtType(1, b"abc")), MalformedMessage, None, id="body-ext"),
]


@pytest.mark.parametrize(("payload", "exc", "field"), MALFORMED)
def test_malformed_payload_is_rejected(payload: bytes, exc: type[ProtocolError], field: str | None) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(payload)
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    if field is not None:
        assert info.value.field == field


def test_huge_shape_fails_fast_without_allocating() -> None:
    payload = frame(tensor_body([0, 1, [2**40], bytes(16)]))
    tracemalloc.start()
    try:
        with pytest.raises(TensorError):
            decode(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak allocation {peak} bytes"


def test_zero_sized_dimension_with_huge_others_is_still_a_protocol_error() -> None:
    for shape in ([0, 2**62, 2**62], [0, 2**64 - 1]):
        with pytest.raises(ProtocolError):
            decode(frame(tensor_body([0, 1, shape, b""])))


def test_payload_above_the_size_limit_is_refused_before_parsing() -> None:
    payload = encode(envelope_of(SAMPLES["status"])).payload
    with pytest.raises(FieldError) as info:
        decode(payload, max_payload_bytes=len(payload) - 1)
    assert info.value.field == "payload"
    decode(payload, max_payload_bytes=len(payload))


def test_non_bytes_payload_is_malformed() -> None:
    with pytest.raises(MalformedMessage):
        decode("not bytes")  # type: ignore[arg-type]
    payload = encode(envelope_of(SAMPLES["status"])).payload
    assert decode(bytearray(payload)).envelope.body == SAMPLES["status"]
    assert decode(memoryview(payload)).envelope.body == SAMPLES["status"]


# ------------------------------------------------------------------------------------------
# msgpack size-class boundaries


@pytest.mark.parametrize("n", [0, 1, 31, 32, 255, 256, 65535, 65536])
def test_tensor_element_count_at_size_class_boundaries(n: int) -> None:
    arr = (np.arange(n, dtype=np.float32) * 0.5 - 3.0).astype(np.float32)
    body = Update(tensors=(arr,), num_samples=n + 1, train_loss=0.0)
    enc = encode(envelope_of(body))
    assert enc.body_bytes == len(pack(hand_body(body)))
    got = decode(enc.payload).envelope.body.tensors[0]
    assert got.dtype == np.float32 and got.shape == (n,)
    np.testing.assert_array_equal(got, arr)


@pytest.mark.parametrize("n", [0, 31, 32, 255, 256, 1024])
def test_status_detail_length_at_size_class_boundaries(n: int) -> None:
    detail = "".join(chr(ord("a") + i % 26) for i in range(n))
    body = Status(state="offline", detail=detail)
    enc = encode(envelope_of(body))
    str_header = 1 if n < 32 else 2 if n < 256 else 3
    assert enc.body_bytes == len(pack(["offline", detail])) == 1 + 8 + str_header + n
    assert decode(enc.payload).envelope.body == body


@pytest.mark.parametrize("n", [0, 15, 16, 255])
def test_map_entry_count_at_size_class_boundaries(n: int) -> None:
    meta = {f"k{i}": i for i in range(n)}
    body = Global(tensors=(), meta=meta)
    assert decode(encode(envelope_of(body)).payload).envelope.body.meta == meta


def test_online_status_with_holdings_is_three_uints_after_the_detail() -> None:
    """An ``online`` that says what the device holds: ``[state, detail, global_round, start_round,
    update_round]``, each the smallest msgpack uint; one without them is the two-field form of
    before, byte for byte, and decodes to ``holds`` ``None``."""
    body = Status("online", "reconnected", global_round=2, start_round=2, update_round=200)
    enc = encode(envelope_of(body))
    assert enc.body_bytes == len(pack(["online", "reconnected", 2, 2, 200]))
    assert enc.body_bytes == 1 + 7 + 12 + 1 + 1 + 2  # fixarray, "online", "reconnected", 2, 2, uint8 200
    got = decode(enc.payload).envelope.body
    assert got == body and got.holds == (2, 2, 200)
    plain = encode(envelope_of(Status("online", "reconnected")))
    assert plain.body_bytes == len(pack(["online", "reconnected"]))
    assert decode(plain.payload).envelope.body.holds is None


def test_holdings_beside_another_state_are_ignored_and_refused_by_the_encoder() -> None:
    raw = frame(["offline", "gone", 3, 3, 0], kind=KIND_NUMBERS["STATUS"])
    assert decode(raw).envelope.body == Status("offline", "gone")
    with pytest.raises(FieldError, match="'online' only"):
        encode(envelope_of(Status("offline", "", global_round=1, start_round=1, update_round=0)))
    with pytest.raises(FieldError, match="all three"):
        encode(envelope_of(Status("online", "", global_round=1)))
    for bad in (-1, True):
        with pytest.raises(FieldError):
            encode(envelope_of(Status("online", "", global_round=1, start_round=bad, update_round=0)))
    with pytest.raises(MalformedMessage):
        decode(frame(["online", "", 1, "two", 0], kind=KIND_NUMBERS["STATUS"]))


# ------------------------------------------------------------------------------------------
# Forward compatibility


@pytest.mark.parametrize("name", list(SAMPLES))
def test_unknown_trailing_envelope_and_body_fields_are_ignored(name: str) -> None:
    body = SAMPLES[name]
    # global/update/round_start: the optional map (extras, instructions) comes first (empty = none), then
    # fields of the future
    extras = [{}] if SAMPLE_KIND[name].name in ("GLOBAL", "UPDATE", "ROUND_START") else []
    # round_start's members (an empty bin: none), a non-join receipt's member_index (ignored) and a
    # status's holdings beside another state than online (ignored)
    extras += {Kind.ROUND_START: [b""], Kind.RECEIPT: [0], Kind.STATUS: [0, 0, 0]}.get(SAMPLE_KIND[name], [])
    raw_body = pack([*hand_body(body), *extras, "future-field", {"x": 1}])
    payload = pack([1, KIND_NUMBERS[SAMPLE_KIND[name].name], 3, CLIENT, 5, 0, raw_body, b"signature", 42])
    dec = decode(payload)
    assert_body_equal(dec.envelope.body, body)
    assert dec.body_bytes == len(raw_body)
    assert dec.payload_bytes == len(payload)


def test_unknown_trailing_tensor_fields_are_ignored() -> None:
    t = [*ok_tensor(), "scale", 1.0]
    got = decode(frame(tensor_body(t))).envelope.body.tensors[0]
    np.testing.assert_array_equal(got, np.arange(6, dtype=np.float32).reshape(2, 3))


# ------------------------------------------------------------------------------------------
# Encoder refusals


@pytest.mark.parametrize("sender", ["a/b", "", "x" * 65, "-lead", ".lead", "_lead", "a+b", "a#", "é"])
def test_encode_refuses_invalid_sender(sender: str) -> None:
    with pytest.raises(FieldError) as info:
        encode(envelope_of(SAMPLES["status"], sender=sender))
    assert info.value.field == "envelope.sender"


def test_encode_accepts_sender_of_64_chars() -> None:
    sender = "a" * 64
    assert decode(encode(envelope_of(SAMPLES["status"], sender=sender)).payload).envelope.sender == sender


@pytest.mark.parametrize("value", [[1, 2], {"a": 1}, None, np.zeros(2), b"bytes", (1,)],
                         ids=["list", "dict", "none", "ndarray", "bytes", "tuple"])
def test_encode_refuses_non_scalar_map_value(value: object) -> None:
    with pytest.raises(FieldError):
        encode(envelope_of(Update(tensors=(), num_samples=1, train_loss=0.0, metrics={"k": value})))


def test_encode_refuses_non_string_map_key() -> None:
    with pytest.raises(FieldError):
        encode(envelope_of(RoundStart(selected=(), deadline_s=1.0, config={1: 2})))  # type: ignore[dict-item]


@pytest.mark.parametrize("field", ["round", "seq", "timestamp_ms"])
def test_encode_refuses_negative_header_numbers(field: str) -> None:
    kw = {"round": 1, "seq": 1, "timestamp_ms": 0, field: -1}
    with pytest.raises(FieldError) as info:
        encode(Envelope(sender=CLIENT, body=SAMPLES["status"], **kw))
    assert info.value.field == f"envelope.{field}"


@pytest.mark.parametrize("arr", [np.zeros(2, np.complex64), np.zeros(2, np.uint16), np.zeros((1,) * 9, np.float32),
                                 np.array(["a"])], ids=["complex64", "uint16", "9-dims", "unicode"])
def test_encode_refuses_unsendable_tensor(arr: np.ndarray) -> None:
    with pytest.raises(TensorError):
        encode(envelope_of(Global(tensors=(arr,))))


# ------------------------------------------------------------------------------------------
# Numbers that are never reused


def test_kind_numbers_are_fixed() -> None:
    # A kind's number never changes; new kinds take new numbers (never a reused or aliased one).
    for name, number in KIND_NUMBERS.items():
        assert Kind[name].value == number, name
    assert len(Kind.__members__) == len(list(Kind)), "no alias: every name has its own number"


def test_every_kind_has_a_distinct_label() -> None:
    assert [Kind(n).label for n in range(1, 8)] == ["join", "round_start", "global", "update", "finish",
                                                     "status", "receipt"]
    labels = [k.label for k in Kind]
    assert all(label == k.name.lower() and label for label, k in zip(labels, Kind, strict=True))
    assert len(set(labels)) == len(labels)
    for cls, kind in [(Join, Kind.JOIN), (RoundStart, Kind.ROUND_START), (Global, Kind.GLOBAL),
                      (Update, Kind.UPDATE), (Finish, Kind.FINISH), (Status, Kind.STATUS), (Receipt, Kind.RECEIPT)]:
        assert cls.KIND is kind


def test_dtype_numbers_are_fixed() -> None:
    assert {code: dt for code, dt in DTYPES.items()} == {v: k for k, v in WIRE_DTYPES.items()}


# ------------------------------------------------------------------------------------------
# Topics

TOPIC_CASES = [
    (topics.up(FED, CLIENT, Kind.UPDATE), "fedfleet/v1/fed-a/up/client-007/update",
     topics.TopicInfo(FED, "up", CLIENT, "update")),
    (topics.up(FED, CLIENT, Kind.JOIN), "fedfleet/v1/fed-a/up/client-007/join",
     topics.TopicInfo(FED, "up", CLIENT, "join")),
    (topics.down(FED, Kind.ROUND_START), "fedfleet/v1/fed-a/down/round_start",
     topics.TopicInfo(FED, "down", None, "round_start")),
    (topics.down(FED, Kind.GLOBAL), "fedfleet/v1/fed-a/down/global", topics.TopicInfo(FED, "down", None, "global")),
    (topics.down_to(FED, CLIENT, Kind.RECEIPT), "fedfleet/v1/fed-a/down/client-007/receipt",
     topics.TopicInfo(FED, "down", CLIENT, "receipt")),
    (topics.status(FED, CLIENT), "fedfleet/v1/fed-a/status/client-007",
     topics.TopicInfo(FED, "status", CLIENT, "status")),
]


@pytest.mark.parametrize(("built", "expected", "info"), TOPIC_CASES, ids=[c[1] for c in TOPIC_CASES])
def test_topic_strings_and_parse_round_trip(built: str, expected: str, info: topics.TopicInfo) -> None:
    assert built == expected
    assert topics.parse(built) == info


def test_topic_length_of_the_study() -> None:
    assert len(topics.up(FED, CLIENT, Kind.UPDATE).encode()) == 38


def test_subscription_filters() -> None:
    assert topics.server_filters(FED) == ["fedfleet/v1/fed-a/up/+/+", "fedfleet/v1/fed-a/status/+"]
    assert topics.agent_filters(FED, CLIENT) == ["fedfleet/v1/fed-a/down/+", "fedfleet/v1/fed-a/down/client-007/+"]
    assert topics.everything() == "fedfleet/v1/#"
    assert topics.everything(FED) == "fedfleet/v1/fed-a/#"


@pytest.mark.parametrize("bad", ["a/b", "", "x" * 65, "+", "#", "-x", "a b"])
def test_topic_builders_refuse_invalid_levels(bad: str) -> None:
    for build in (lambda: topics.up(bad, CLIENT, Kind.UPDATE), lambda: topics.up(FED, bad, Kind.UPDATE),
                  lambda: topics.down(bad, Kind.GLOBAL), lambda: topics.down_to(FED, bad, Kind.RECEIPT),
                  lambda: topics.status(FED, bad), lambda: topics.server_filters(bad),
                  lambda: topics.agent_filters(FED, bad), lambda: topics.everything(bad)):
        with pytest.raises(FieldError):
            build()


@pytest.mark.parametrize("topic", [
    "other/v1/fed-a/down/global",
    "fedfleet/v2/fed-a/down/global",
    "fedfleet/v1",
    "fedfleet/v1/fed-a",
    "fedfleet/v1/fed-a/down",
    "fedfleet/v1/fed-a/sideways/global",
    "fedfleet/v1/fed-a/up/client-007",
    "fedfleet/v1/fed-a/up/client-007/update/extra",
    "fedfleet/v1/fed-a/down/client-007/receipt/extra",
    "fedfleet/v1/fed-a/status/client-007/extra",
    "fedfleet/v1/fed-a/status",
    "fedfleet/v1/a+b/down/global",
    "fedfleet/v1/fed-a/up/a+b/update",
    "fedfleet/v1/fed-a/status/-x",
    "/fedfleet/v1/fed-a/down/global",
])
def test_parse_refuses_foreign_topics(topic: str) -> None:
    with pytest.raises(FieldError):
        topics.parse(topic)


@pytest.mark.parametrize("topic", [
    "fedfleet/v1/fed-a/down/",
    "fedfleet/v1/fed-a/down/+",
    "fedfleet/v1/fed-a/up/client-007/bogus",
    "fedfleet/v1/fed-a/down/client-007/",
])
def test_parse_refuses_unknown_kind_level(topic: str) -> None:
    with pytest.raises(FieldError):
        topics.parse(topic)


# ------------------------------------------------------------------------------------------
# MQTT framing sizes

SIZES = [0, 100, 40 * 1024, 1 << 20, 16 << 20]


def hand_publish_packet(topic: str, payload: bytes, qos: int, protocol: int) -> bytes:
    """A PUBLISH packet assembled byte by byte (MQTT 3.1.1 §3.3 / MQTT 5 §3.3), no properties."""
    t = topic.encode()
    variable = len(t).to_bytes(2, "big") + t + (b"\x00\x01" if qos else b"") + (b"\x00" if protocol == 5 else b"")
    rl = len(variable) + len(payload)
    varint = bytearray()
    while True:
        digit, rl = rl % 128, rl // 128
        varint.append(digit | (0x80 if rl else 0))
        if not rl:
            break
    return bytes([0x30 | (qos << 1)]) + bytes(varint) + variable + payload


@pytest.mark.parametrize(("protocol", "qos", "overheads"), [
    (mqtt_bytes.MQTT_V311, 0, [42, 43, 44, 44, 45]),
    (mqtt_bytes.MQTT_V311, 1, [44, 45, 46, 46, 47]),
    (mqtt_bytes.MQTT_V5, 0, [43, 44, 45, 45, 46]),
    (mqtt_bytes.MQTT_V5, 1, [45, 46, 47, 47, 48]),
], ids=["3.1.1-qos0", "3.1.1-qos1", "5-qos0", "5-qos1"])
def test_publish_overhead_matches_the_measured_table(protocol: int, qos: int, overheads: list[int]) -> None:
    for n, want in zip(SIZES, overheads, strict=True):
        size = mqtt_bytes.publish_size(UPDATE_TOPIC, n, qos, protocol=protocol)
        assert size.topic_bytes == 38
        assert size.payload_bytes == n
        assert size.header_bytes + size.topic_bytes == want, n
        assert size.packet_bytes == want + n


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_publish_size_equals_amqtt_encoded_packet(qos: int) -> None:
    from amqtt.mqtt.publish import PublishPacket

    for n in SIZES + [127, 128, 16383, 16384]:
        pkt = PublishPacket.build(UPDATE_TOPIC, b"\x00" * n, 1 if qos else None, False, qos, False).to_bytes()
        assert mqtt_bytes.publish_size(UPDATE_TOPIC, n, qos).packet_bytes == len(pkt), n


@pytest.mark.parametrize("protocol", [mqtt_bytes.MQTT_V311, mqtt_bytes.MQTT_V5])
@pytest.mark.parametrize("qos", [0, 1])
def test_publish_size_equals_hand_built_packet(protocol: int, qos: int) -> None:
    for n in [0, 1, 80, 85, 86, 87, 88, 16300, 16340, 16341, 16342, 16343, 16344, 1 << 20]:
        pkt = hand_publish_packet(UPDATE_TOPIC, bytes(n), qos, protocol)
        assert mqtt_bytes.publish_size(UPDATE_TOPIC, n, qos, protocol=protocol).packet_bytes == len(pkt), n


def test_mqtt5_properties_count() -> None:
    plain = mqtt_bytes.publish_size(UPDATE_TOPIC, 100, 1, protocol=mqtt_bytes.MQTT_V5)
    alias = mqtt_bytes.publish_size(UPDATE_TOPIC, 100, 1, protocol=mqtt_bytes.MQTT_V5, properties_bytes=3)
    assert alias.header_bytes + alias.topic_bytes == 49  # study §4: Topic Alias, first message, N = 100
    assert alias.header_bytes == plain.header_bytes + 3
    v311 = mqtt_bytes.publish_size(UPDATE_TOPIC, 100, 1, properties_bytes=3)
    assert v311.header_bytes + v311.topic_bytes == 45  # ignored for 3.1.1


@pytest.mark.parametrize(("value", "size"), [
    (0, 1), (127, 1), (128, 2), (16383, 2), (16384, 3), (2097151, 3), (2097152, 4), (268435455, 4),
])
def test_varint_size_boundaries(value: int, size: int) -> None:
    assert mqtt_bytes.varint_size(value) == size


@pytest.mark.parametrize("value", [-1, 268435456])
def test_varint_size_out_of_range(value: int) -> None:
    with pytest.raises(ValueError):
        mqtt_bytes.varint_size(value)


@pytest.mark.parametrize(("remaining", "fixed_header"), [
    (127, 2), (128, 3), (16383, 3), (16384, 4), (2097151, 4), (2097152, 5), (268435455, 5),
])
def test_remaining_length_boundaries_through_publish_size(remaining: int, fixed_header: int) -> None:
    # QoS 0, MQTT 3.1.1: remaining length = 2 + 38 + N
    n = remaining - 40
    size = mqtt_bytes.publish_size(UPDATE_TOPIC, n, 0)
    assert size.header_bytes == fixed_header + 2


def test_publish_size_refuses_oversized_packet_and_bad_arguments() -> None:
    with pytest.raises(ValueError):
        mqtt_bytes.publish_size(UPDATE_TOPIC, 268435455 - 40 + 1, 0)
    with pytest.raises(ValueError):
        mqtt_bytes.publish_size(UPDATE_TOPIC, 0, 3)
    with pytest.raises(ValueError):
        mqtt_bytes.publish_size(UPDATE_TOPIC, 0, 1, protocol=3)


def test_publish_size_counts_utf8_bytes_of_the_topic() -> None:
    assert mqtt_bytes.publish_size("é", 0, 0).topic_bytes == 2


@pytest.mark.parametrize("protocol", [mqtt_bytes.MQTT_V311, mqtt_bytes.MQTT_V5])
@pytest.mark.parametrize("qos", [0, 1])
@pytest.mark.parametrize("limit", [47, 100, 170, 171, 172, 16384 + 50, 1 << 20, 100_000_000, 268_000_000])
def test_max_payload_for_is_the_largest_payload_that_fits(limit: int, qos: int, protocol: int) -> None:
    n = mqtt_bytes.max_payload_for(UPDATE_TOPIC, limit, qos, protocol=protocol)
    assert mqtt_bytes.publish_size(UPDATE_TOPIC, n, qos, protocol=protocol).packet_bytes <= limit
    assert mqtt_bytes.publish_size(UPDATE_TOPIC, n + 1, qos, protocol=protocol).packet_bytes > limit


def test_max_payload_for_refuses_a_limit_below_an_empty_publish() -> None:
    smallest = mqtt_bytes.publish_size(UPDATE_TOPIC, 0, 1).packet_bytes
    assert mqtt_bytes.max_payload_for(UPDATE_TOPIC, smallest, 1) == 0
    with pytest.raises(ValueError):
        mqtt_bytes.max_payload_for(UPDATE_TOPIC, smallest - 1, 1)


@pytest.mark.parametrize("limit", [268_435_455, 268_435_460, 2**32 - 1])
def test_max_payload_for_at_and_above_the_mqtt_maximum_packet(limit: int) -> None:
    # QoS 1, 3.1.1: remaining length = 2 + 38 + 2 + N <= 268,435,455
    largest_allowed = 268_435_455 - 42
    n = mqtt_bytes.max_payload_for(UPDATE_TOPIC, limit, 1)
    if limit >= largest_allowed + 42 + 5:
        assert n == largest_allowed
    assert mqtt_bytes.publish_size(UPDATE_TOPIC, n, 1).packet_bytes <= limit


# ------------------------------------------------------------------------------------------
# Random input never raises anything but ProtocolError


def _decode_only_protocol_errors(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    _decode_only_protocol_errors(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_behind_a_valid_header_raise_only_protocol_error(tail: bytes) -> None:
    _decode_only_protocol_errors(pack([1, 4, 3, CLIENT, 5, 0, tail]))
    _decode_only_protocol_errors(bytes([0x97, 1, 4, 3]) + tail)  # fixarray(7) header, then noise


_VALID = small_payloads()
_MUTATION = st.tuples(st.sampled_from(["flip", "insert", "delete", "set"]), st.integers(0, 10_000),
                      st.integers(0, 255))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(_VALID))), st.lists(_MUTATION, min_size=1, max_size=8))
def test_mutated_valid_payloads_raise_only_protocol_error(which: int, mutations: list) -> None:
    data = bytearray(_VALID[which])
    for op, pos, byte in mutations:
        i = pos % (len(data) + 1)
        if op == "insert":
            data.insert(i, byte)
        elif not data:
            continue
        elif op == "delete":
            del data[i % len(data)]
        elif op == "flip":
            data[i % len(data)] ^= 1 << (byte % 8)
        else:
            data[i % len(data)] = byte
    _decode_only_protocol_errors(bytes(data))


def test_instructions_are_refused_on_a_round_start_naming_several_devices() -> None:
    """Instructions are one device's settings: a ``round_start`` carrying them must select
    exactly that device — else every selected agent would apply another's instructions."""
    with pytest.raises(FieldError, match="one device"):
        encode(Envelope(round=1, sender="server", seq=1,
                        body=RoundStart(selected=("a", "b"), deadline_s=30.0, instructions={"local_epochs": 9})))
    one = encode(Envelope(round=1, sender="server", seq=1,
                          body=RoundStart(selected=("a",), deadline_s=30.0, instructions={"local_epochs": 9}))).payload
    assert decode(one).envelope.body.instructions == {"local_epochs": 9}
    env = msgpack.unpackb(one, raw=False)
    body = msgpack.unpackb(env[6], raw=False)
    body[0] = ["a", "b"]  # the same message, hand-made for two devices
    env[6] = msgpack.packb(body, use_bin_type=True)
    with pytest.raises(FieldError, match="one device"):
        decode(msgpack.packb(env, use_bin_type=True))
    # without instructions several devices are the broadcast of protocol v1, as before
    body[0], env[6] = ["a", "b"], msgpack.packb(body[:3], use_bin_type=True)
    assert decode(msgpack.packb(env, use_bin_type=True)).envelope.body.selected == ("a", "b")
