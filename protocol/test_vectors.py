"""Byte-exact test vectors of the tensor codecs (:mod:`protocol.tensors`), for PROTOCOL.md and for
other implementations (a C decoder on a device, say).

:data:`TEST_VECTORS` maps a vector name to ``(input, codec, hex, decoded)``:

* ``input``: the tensor as (nested) Python floats, converted with ``np.array(input, float32)``
  (shape from the nesting; a bare float is a 0-d tensor).
* ``codec``: the configuration text (:meth:`protocol.tensors.Codec.parse` grammar).
* ``hex``: the msgpack encoding (``msgpack.packb(encode_tensor(...), use_bin_type=True)``) of the
  tensor ``[codec, dtype, shape, data, *params]``, lower-case hex.
* ``decoded``: the values a decoder returns for ``hex`` (float32 values written exactly as Python
  floats; ``dtype`` float32, shape as ``input``).

Every vector holds in both directions (encode(input) == hex, decode(hex) == decoded) except those
in :data:`DECODE_ONLY`: a zstd frame's bytes depend on the zstd version and level, so for those
only decode(hex) == decoded is specified; an encoder need only produce a frame with the same
content. Decode vectors with NaN/Inf forbidden (the default :class:`~protocol.tensors.TensorLimits`).

Hand-checked reading of two of them:

* ``fp16``: ``94`` array of 4, ``01`` codec fp16, ``01`` dtype float32, ``92 02 03`` shape [2, 3],
  ``c4 0c`` bin of 12 bytes, then ``0038 00bd 0042 0000 0040 00b0`` = 0.5, -1.25, 3.0, 0.0, 2.0,
  -0.125 as little-endian binary16.
* ``topk-varint-fp16``: ``97`` array of 7, ``04`` topk, ``01`` float32, ``91 cc8c`` shape [140],
  ``c4 06 003e 00c0 0044`` values 1.5, -2.0, 4.0 as fp16, ``03`` k, ``01`` value codec fp16,
  ``c4 03 03 7f 01`` indices [3, 130, 131] as deltas 3, 127, 1 in LEB128.
"""

from __future__ import annotations

_X = [[0.5, -1.25, 3.0], [0.0, 2.0, -0.125]]
_LONG = [0.0] * 3 + [1.5] + [0.0] * 126 + [-2.0, 4.0] + [0.0] * 7 + [0.25]

#: name -> (input, codec text, msgpack hex of the encoded tensor, decoded values).
TEST_VECTORS: dict[str, tuple[object, str, str, object]] = {
    "fp32": (_X, "fp32", "940001920203c4180000003f0000a0bf000040400000000000000040000000be", _X),
    "fp32-scalar": (3.5, "fp32", "94000190c40400006040", 3.5),
    "fp16": (_X, "fp16", "940101920203c40c003800bd00420000004000b0", _X),
    # 0.1 rounds; 1 + 2**-11 is a tie and goes to even (1.0); 1 + 3 * 2**-11 goes up to 1 + 2**-9;
    # 65504 is the largest half; 6e-8 becomes the smallest subnormal 2**-24; -0.0 keeps its sign.
    "fp16-rounding": (
        [0.1, 1.00048828125, 1.00146484375, 65504.0, 6e-08, -0.0], "fp16",
        "9401019106c40c662e003c023cff7b01000080",
        [0.0999755859375, 1.0, 1.001953125, 65504.0, 5.960464477539063e-08, -0.0],
    ),
    "bf16": (_X, "bf16", "940201920203c40c003fa0bf40400000004000be", _X),
    # 1 + 2**-8 is a tie and goes to even (1.0); 1 + 3 * 2**-8 is a tie and goes up to 1 + 2**-6;
    # 0.1 rounds up; 3e38 stays finite; the float32 subnormal 1e-40 keeps 7 mantissa bits.
    "bf16-rounding": (
        [1.00390625, 1.01171875, -1.01171875, 0.1, 3.0e38, 1e-40], "bf16",
        "9402019106c40c803f823f82bfcd3d627f0100",
        [1.0, 1.015625, -1.015625, 0.10009765625, 3.00405527047391e+38, 9.183549615799121e-41],
    ),
    # scale = 3 / 127; q = [21, -53, 127, 0, 85, -5]
    "int8": (
        _X, "int8", "960301920203c40615cb7f0055fbffc4040683c13c",
        [[0.4960629940032959, -1.251968502998352, 3.0], [0.0, 2.007874011993408, -0.11811023950576782]],
    ),
    # scales = [3 / 127, 2 / 127]; q = [21, -53, 127, 0, 127, -8]
    "int8-channel": (
        _X, "int8-channel", "960301920203c40615cb7f007ff800c4080683c13c0402813c",
        [[0.4960629940032959, -1.251968502998352, 3.0], [0.0, 2.0, -0.12598425149917603]],
    ),
    # an all-zero channel has scale 0 and decodes to zeros
    "int8-channel-zero-row": (
        [[0.0, 0.0], [1.0, -0.5]], "int8-channel", "960301920202c40400007fc000c408000000000402013c",
        [[0.0, 0.0], [1.0, -0.5039370059967041]],
    ),
    # keeps 3.0 (index 2), 2.0 (4), -1.25 (1): indices [1, 2, 4] → deltas 01 01 02
    "topk": (
        _X, "topk:3", "970401920203c40c0000a0bf00004040000000400300c403010102",
        [[0.0, -1.25, 3.0], [0.0, 2.0, 0.0]],
    ),
    # k = ceil(0.5 * 4) = 2 of three equal |x| = 1: the lower indices 0 and 1 win the tie
    "topk-ties": ([1.0, -1.0, 1.0, 0.5], "topk:0.5", "9704019104c4080000803f000080bf0200c4020001",
                  [1.0, -1.0, 0.0, 0.0]),
    "topk-varint-fp16": (
        _LONG, "topk:3:fp16", "97040191cc8cc406003e00c000440301c403037f01",
        [0.0] * 3 + [1.5] + [0.0] * 126 + [-2.0, 4.0] + [0.0] * 8,
    ),
    # decode only (zstd frames vary across zstd versions): frame of the 12 bytes of "fp16"
    "fp16+zstd": (_X, "fp16+zstd", "94cc8101920203c41528b52ffd200c610000003800bd00420000004000b0", _X),
}

#: Vectors whose ``hex`` is only to be decoded (their zstd frame is one valid encoding of many).
DECODE_ONLY: frozenset[str] = frozenset(name for name, v in TEST_VECTORS.items() if "+zstd" in v[1])


#: Whole messages (envelope + body), one per kind: name -> (codec text or None, payload hex).
#: Built from the records in :func:`message_vector_records`; ``timestamp_ms`` = 1764420000000.
MESSAGE_VECTORS: dict[str, tuple[str | None, str]] = {
    "join": (None, "97010100aa636c69656e742d30303701cf0000019acfa09900c42995a472706934b033663261396330643165346235613637cd02589364ccc8cd012c81a5636f72657304"),
    "round_start": (None, "97010203a67365727665720acf0000019acfa09900c43c9392aa636c69656e742d303031aa636c69656e742d303037cb403e00000000000082a26c72cb3fa999999999999aac6c6f63616c5f65706f63687301"),
    "round_start-instructions": (None, "97010203a67365727665720ecf0000019acfa09900c4329491aa636c69656e742d303037cb403e00000000000081a26c72cb3fa999999999999a81ac6c6f63616c5f65706f63687303"),
    "round_start-members": (None, "97010203a67365727665720fcf0000019acfa09900c4299591aa636c69656e742d303033cb403e00000000000081a26c72cb3fa999999999999a80c403000702"),
    "global": (None, "97010303a67365727665720bcf0000019acfa09900c4429291940001920203c4180000003f0000a0bf000040400000000000000040000000be81ad6d616e69666573745f68617368b033663261396330643165346235613637"),
    "update": (None, "97010403aa636c69656e742d30303704cf0000019acfa09900c4479591940001920203c4180000003f0000a0bf000040400000000000000040000000becd0258cb3fd000000000000081ad747261696e5f7365636f6e6473cb3ff8000000000000c2"),
    "update-int8-delta": ('int8', "97010403aa636c69656e742d30303705cf0000019acfa09900c4259591960301920203c40615cb7f0055fbffc4040683c13ccd0258cb3fd000000000000080c3"),
    "finish": (None, "9701050aa673657276657228cf0000019acfa09900c40c92a9636f6d706c657465640a"),
    "status": (None, "97010600aa636c69656e742d30303702cf0000019acfa09900c40992a66f6e6c696e65a0"),
    "status-holdings": (None, "97010600aa636c69656e742d30303703cf0000019acfa09900c41795a66f6e6c696e65ab7265636f6e6e6563746564030303"),
    "receipt": (None, "97010703a67365727665720ccf0000019acfa09900c427950404c3a0c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"),
    "receipt-join-index": (None, "97010700a673657276657210cf0000019acfa09900c42a960101c3a0c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fcd012c"),
    "chunk": (None, "97010803aa636c69656e742d30303706cf0000019acfa09900c43d97c410000102030405060708090a0b0c0d0e0f01020406c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fc4026566"),
    "resend": (None, "97010900a67365727665720dcf0000019acfa09900c41692c410000102030405060708090a0b0c0d0e0f920002"),
}


#: Sealed messages (:mod:`protocol.security`): name -> (unsigned vector in
#: :data:`MESSAGE_VECTORS`, topic, epoch, encrypted, sealed payload hex). Signed with the fixed
#: keys of :func:`security_vector_keys` (Ed25519 is deterministic, RFC 8032; the GCM nonce comes
#: from ``seq``), so every byte is reproducible. ``update-encrypted``'s AES-256-GCM key is
#: :data:`SECURITY_VECTOR_UPLOAD_KEY` (client-007, epoch 2).
SECURITY_VECTORS: dict[str, tuple[str, str, int, bool, str]] = {
    "update-signed": ("update", "fedfleet/v1/fed-1/up/client-007/update", 2, False,
                      "98010403aa636c69656e742d30303704cf0000019acfa09900c4479591940001920203c4180000003f0000a0bf000040400000000000000040000000becd0258cb3fd000000000000081ad747261696e5f7365636f6e6473cb3ff8000000000000c295020047c408c8c20bf61bab35acc4400828edd5910c81787bc7e7f759de3958ed5e5481a4baddc44d216feb0dceebc6f8cc82441e5f4091615eda7e26bc831baf435c45bbbe38ce31ec96f8cc104603"),
    "update-encrypted": ("update", "fedfleet/v1/fed-1/up/client-007/update", 2, True,
                         "98010403aa636c69656e742d30303704cf0000019acfa09900c45720e54da0878383e093360746bc64a490b681bc05d5b251f72293035ec9dfefe5c57e77d6b270bf8d89ecc8719af257724172774ccdb1591038b8f2366eb9663a4ef87cb6b9b78434d073fb6cd59a0c3c53ca7ac776fb7f95020157c408c8c20bf6ed84cf86c440360ae3b1e20acf0c77a3487d3bc9cf23a9edbcde671292a7fc971b29fd7cc208a841c2b402d97c1670c8416139d7320f9c8a5ef110c37527412539c4bbeca10d"),
    "round_start-signed": ("round_start", "fedfleet/v1/fed-1/down/round_start", 1, False,
                           "98010203a67365727665720acf0000019acfa09900c43c9392aa636c69656e742d303031aa636c69656e742d303037cb403e00000000000082a26c72cb3fa999999999999aac6c6f63616c5f65706f636873019501003cc408085b2c04de679551c440182918381830664b55a8041f6dd2863b9d5e04bc03831f100909ca5b95660c6dc858f855bc7ee6ae9f363f0566248e13b43c8dae43eefa7724d7f3882f27e703"),
}

#: The AES-256-GCM key of ``update-encrypted`` (hex), from :func:`protocol.security.upload_key`.
SECURITY_VECTOR_UPLOAD_KEY = "627238f041c10b3f76c311cbc06b1bd537fa3363cfb2c28426ddd2a93a307590"


def security_vector_keys() -> dict[str, bytes]:
    """The raw private keys of :data:`SECURITY_VECTORS` (test keys only, never for real use):
    ``device_ed25519`` = bytes 0..31, ``device_x25519`` = 32..63, ``server_ed25519`` = 64..95,
    ``server_x25519`` = 96..127 (Ed25519 seeds, RFC 8032 §5.1.5; X25519 scalars, RFC 7748 §5)."""
    return {"device_ed25519": bytes(range(32)), "device_x25519": bytes(range(32, 64)),
            "server_ed25519": bytes(range(64, 96)), "server_x25519": bytes(range(96, 128))}


def message_vector_records() -> dict[str, object]:
    """The :class:`~protocol.messages.Envelope` records behind :data:`MESSAGE_VECTORS`."""
    import numpy as np

    from .messages import Chunk, Envelope, Finish, Global, Join, Receipt, Resend, RoundStart, Status, Update

    ts = 1764420000000
    t = np.array(_X, np.float32)
    return {
        "join": Envelope(round=0, sender="client-007", seq=1, timestamp_ms=ts,
                         body=Join("rpi4", "3f2a9c0d1e4b5a67", 600, (100, 200, 300), {"cores": 4})),
        "round_start": Envelope(round=3, sender="server", seq=10, timestamp_ms=ts,
                                body=RoundStart(("client-001", "client-007"), 30.0, {"lr": 0.05, "local_epochs": 1})),
        "round_start-instructions": Envelope(round=3, sender="server", seq=14, timestamp_ms=ts,
                                             body=RoundStart(("client-007",), 30.0, {"lr": 0.05},
                                                             {"local_epochs": 3})),
        # client-003 by id (it does not read member sets), indices 0, 1, 2 and 9 in a bitmap
        "round_start-members": Envelope(round=3, sender="server", seq=15, timestamp_ms=ts,
                                        body=RoundStart(("client-003",), 30.0, {"lr": 0.05}, {}, b"\x00\x07\x02")),
        "global": Envelope(round=3, sender="server", seq=11, timestamp_ms=ts,
                           body=Global((t,), {"manifest_hash": "3f2a9c0d1e4b5a67"})),
        "update": Envelope(round=3, sender="client-007", seq=4, timestamp_ms=ts,
                           body=Update((t,), 600, 0.25, {"train_seconds": 1.5})),
        "update-int8-delta": Envelope(round=3, sender="client-007", seq=5, timestamp_ms=ts,
                                      body=Update((t,), 600, 0.25, {}, True)),
        "finish": Envelope(round=10, sender="server", seq=40, timestamp_ms=ts, body=Finish("completed", 10)),
        "status": Envelope(round=0, sender="client-007", seq=2, timestamp_ms=ts, body=Status("online", "")),
        # back after a reconnect, holding round 3's global and round_start, its update still without a receipt
        "status-holdings": Envelope(round=0, sender="client-007", seq=3, timestamp_ms=ts,
                                    body=Status("online", "reconnected", 3, 3, 3)),
        "receipt": Envelope(round=3, sender="server", seq=12, timestamp_ms=ts,
                            body=Receipt(4, 4, True, "", bytes(range(32)))),
        "receipt-join-index": Envelope(round=0, sender="server", seq=16, timestamp_ms=ts,
                                       body=Receipt(1, 1, True, "", bytes(range(32)), 300)),
        "chunk": Envelope(round=3, sender="client-007", seq=6, timestamp_ms=ts,
                          body=Chunk(bytes(range(16)), 1, 2, 4, 6, bytes(range(32)), b"ef")),
        "resend": Envelope(round=0, sender="server", seq=13, timestamp_ms=ts, body=Resend(bytes(range(16)), (0, 2))),
    }
