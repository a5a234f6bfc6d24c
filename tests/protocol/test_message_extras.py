"""The optional ``extras`` map of ``global`` and ``update`` bodies (prototypes, soft predictions,
control variates …): byte layout checked against msgpack packed by hand, per-name codecs,
exact per-entry byte accounting, one shared decode budget, and refusals."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from protocol.errors import FieldError, MalformedMessage, ProtocolError, TensorError
from protocol.messages import Envelope, Global, Update, decode, encode
from protocol.tensors import Codec, TensorLimits


def pack(v) -> bytes:
    return msgpack.packb(v, use_bin_type=True)


def raw_tensor(a: np.ndarray) -> list:
    code = {np.dtype("float32"): 1, np.dtype("int64"): 4}[a.dtype]
    return [0, code, list(a.shape), a.astype(a.dtype.newbyteorder("<")).tobytes()]


def test_update_with_extras_matches_hand_packed_bytes() -> None:
    soft = np.arange(30, dtype=np.float32).reshape(3, 10) / 30
    protos = np.ones((2, 4), np.float32)
    classes = np.array([1, 7], np.int64)
    up = Update(tensors=(), num_samples=12, train_loss=0.5, metrics={"a": 1}, delta=False,
                extras={"soft_predictions": soft, "prototypes": protos, "proto_classes": classes})
    enc = encode(Envelope(round=2, sender="dev-1", seq=9, body=up, timestamp_ms=5))
    # protocol table: update = [tensors, num_samples, train_loss, metrics, delta, extras]
    body = pack([[], 12, 0.5, {"a": 1}, False,
                 {"soft_predictions": raw_tensor(soft), "prototypes": raw_tensor(protos),
                  "proto_classes": raw_tensor(classes)}])
    assert enc.payload == pack([1, 4, 2, "dev-1", 9, 5, body])
    fb = dict(enc.field_bytes)
    assert fb["extras.soft_predictions"] == len(pack("soft_predictions")) + len(pack(raw_tensor(soft)))
    assert fb["extras"] == 1  # fixmap header of 3 entries
    assert sum(fb.values()) + 1 == enc.body_bytes  # + the body array header
    assert enc.raw_tensor_bytes == soft.nbytes + protos.nbytes + classes.nbytes
    got = decode(enc.payload).envelope.body
    assert set(got.extras) == {"soft_predictions", "prototypes", "proto_classes"}
    np.testing.assert_array_equal(got.extras["soft_predictions"], soft)
    np.testing.assert_array_equal(got.extras["proto_classes"], classes)


def test_fedmcp_upload_is_42560_tensor_bytes() -> None:
    """SPECS.md §5.2: soft predictions [1000, 10] + prototypes [10, 64], fp32 = 42,560 bytes."""
    up = Update(tensors=(), num_samples=100, train_loss=0.1,
                extras={"soft_predictions": np.zeros((1000, 10), np.float32),
                        "prototypes": np.zeros((10, 64), np.float32)})
    enc = encode(Envelope(round=1, sender="c", seq=1, body=up))
    assert enc.raw_tensor_bytes == 42_560
    # each entry: key + tensor header; the values themselves are exactly the raw bytes
    overhead = enc.body_bytes - 42_560
    assert 0 < overhead < 100


def test_model_only_messages_unchanged_by_empty_extras() -> None:
    w = (np.ones((2, 2), np.float32),)
    a = encode(Envelope(round=1, sender="server", seq=1, body=Global(tensors=w, meta={"m": 1}), timestamp_ms=3))
    b = encode(Envelope(round=1, sender="server", seq=1, body=Global(tensors=w, meta={"m": 1}, extras={}),
                        timestamp_ms=3))
    assert a.payload == b.payload == pack([1, 3, 1, "server", 1, 3, pack([[raw_tensor(w[0])], {"m": 1}])])


def test_per_name_codecs() -> None:
    rng = np.random.default_rng(0)
    soft = rng.dirichlet(np.ones(10), size=1000).astype(np.float32)
    protos = rng.normal(size=(10, 64)).astype(np.float32)
    g = Global(tensors=(np.ones(5, np.float32),), extras={"soft_predictions": soft, "prototypes": protos})
    codecs = {"soft_predictions": Codec.parse("int8"), "prototypes": Codec.parse("fp16")}
    enc = encode(Envelope(round=1, sender="server", seq=1, body=g), None, codecs)
    fb = dict(enc.field_bytes)
    assert fb["extras.soft_predictions"] < soft.nbytes / 3.9  # 1 byte per value + scale
    assert fb["extras.prototypes"] < protos.nbytes / 1.9
    got = decode(enc.payload).envelope.body
    np.testing.assert_array_equal(got.tensors[0], np.ones(5, np.float32))  # fp32 default for the rest
    scale = np.abs(soft).max() / 127
    assert np.abs(got.extras["soft_predictions"] - soft).max() <= scale / 2 + 1e-7
    np.testing.assert_allclose(got.extras["prototypes"], protos.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("name", ["", "a/b", "x" * 65, "sp ace", 3])
def test_bad_extra_names_refused_both_ways(name) -> None:
    with pytest.raises(FieldError):
        encode(Envelope(round=1, sender="c", seq=1,
                        body=Update(tensors=(), num_samples=1, train_loss=0.0, extras={name: np.zeros(1, np.float32)})))
    payload = pack([1, 4, 1, "c", 1, 0, pack([[], 1, 0.0, {}, False, {name: raw_tensor(np.zeros(1, np.float32))}])])
    with pytest.raises(ProtocolError):  # FieldError, or MalformedMessage for a non-string key
        decode(payload)


def test_extras_share_the_tensor_byte_budget() -> None:
    t = np.zeros(300, np.float32)  # 1200 bytes
    up = Update(tensors=(t,), num_samples=1, train_loss=0.0, extras={"p": t, "q": t})
    payload = encode(Envelope(round=1, sender="c", seq=1, body=up)).payload
    decode(payload, limits=TensorLimits(max_total_bytes=3600))
    with pytest.raises(TensorError):
        decode(payload, limits=TensorLimits(max_total_bytes=3599))


def test_extras_must_be_a_map() -> None:
    payload = pack([1, 4, 1, "c", 1, 0, pack([[], 1, 0.0, {}, False, [1, 2]])])
    with pytest.raises(MalformedMessage, match="body.extras"):
        decode(payload)


def test_nil_extras_in_an_update_is_a_protocol_error() -> None:
    """An update whose 6th body field (extras) is msgpack nil is refused with a ProtocolError
    ("nothing else escapes"), not an AttributeError."""
    payload = pack([1, 4, 1, "client-000", 1_000, 0, pack([[], 10, 0.5, {}, False, None])])
    with pytest.raises(ProtocolError):
        decode(payload)


def test_nil_extras_in_a_global_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode(pack([1, 3, 1, "server", 7, 0, pack([[], {}, None])]))
