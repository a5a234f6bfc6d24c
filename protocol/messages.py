"""Message kinds, the envelope, and their msgpack encoding (sans-I/O: bytes in, records out).

Wire layout (protocol version 1). A payload is one msgpack array, the **envelope**::

    [version, kind, round, sender, seq, timestamp_ms, body]

===============  ==========  ===============================================================
field            msgpack     meaning
===============  ==========  ===============================================================
version          uint        protocol major version, :data:`PROTOCOL_VERSION` (checked first)
kind             uint        message kind, a :class:`Kind` number (checked second)
round            uint        federated round the message belongs to (0 before round 1)
sender           str         client id of the sender (``"server"`` for the server), ≤ 64 chars
seq              uint        per-sender sequence number, strictly increasing from 1
timestamp_ms     uint        sender's wall clock, ms since the Unix epoch (informational only)
body             bin         the kind's body, itself a msgpack array (below)
===============  ==========  ===============================================================

The body is nested as ``bin`` so that its size is known exactly (the ledger's ``body_bytes``) and
so that a signature over the envelope can be checked before the body is parsed. Decoders ignore
extra trailing envelope and body fields (forward compatibility); new fields are only ever
appended, with defaults. With signing on, the envelope carries an 8th element, ``sec`` (epoch,
flags, signature …; §5c, :mod:`protocol.security`); unsigned envelopes keep their 7 elements and
their bytes.

Bodies (positional arrays; ``T`` = a tensor, see :mod:`protocol.tensors`; ``M`` = a map from
``str`` to a scalar ``int | float | str | bool``):

======  =============  =====================================================================
kind    name           body
======  =============  =====================================================================
1       join           ``[profile, manifest_hash, num_samples, class_histogram[uint], info M]``
2       round_start    ``[selected[str], deadline_s float, config M, (instructions M), (members bin)]``
3       global         ``[tensors[T], meta M, (extras X)]``
4       update         ``[tensors[T], num_samples, train_loss float, metrics M, delta bool, (extras X)]``
5       finish         ``[reason str, rounds_completed uint]``
6       status         ``[state str, detail str]``
7       receipt        ``[ref_kind uint, ref_seq uint, accepted bool, reason str, sha256 bin32, (member_index)]``
8       chunk          ``[transfer_id bin16, index, count, offset, total_bytes, sha256 bin32, data bin]``
9       resend         ``[transfer_id bin16, indices[uint]]``
======  =============  =====================================================================

``X`` = a map from a name (1–64 characters of ``[A-Za-z0-9_.-]``, at most 64 entries) to a
tensor: the non-model state an algorithm exchanges (``prototypes`` [C, d] with
``proto_classes`` [C], ``soft_predictions`` [P, C] on the proxy set, SCAFFOLD control variates
…). It is present only when not empty, so a model-only message is byte-identical with or
without it; each entry may use its own codec. ``tensors`` may be empty (no parameters shared,
as in FedProto and FedMCP++). The tensors and the extras share one decoded-byte budget.

A ``chunk`` carries a slice of another message's whole payload (an envelope of its own), on
that message's topic; the receiver reassembles by offset and decodes the result. ``resend`` asks
the sender of a transfer for the listed chunk indices again (see :mod:`protocol.chunking`).
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from ._join import join_segments
from ._mpread import Reader, ReadError, read_array_fields
from .errors import FieldError, MalformedMessage, ProtocolError, TensorError, UnknownKind, UnsupportedVersion
from .membership import MAX_MEMBER_INDEX, check_members
from .tensors import (
    DEFAULT_LIMITS,
    DTYPES,
    Codec,
    TensorLimits,
    declared_nbytes,
    decode_tensor,
    encode_tensor,
    raw_nbytes,
)

PROTOCOL_VERSION = 1
"""Protocol major version written in every envelope."""

MAX_PAYLOAD_BYTES = 256 * 1024 * 1024
"""Largest payload a decoder accepts (256 MiB, the MQTT maximum packet size is 256 MiB − 1)."""

MAX_TENSORS = 4096
"""Largest number of tensors in one message."""

MAX_STR = 1024
"""Longest string field (characters) other than ids."""

MAX_MAP_ENTRIES = 256
"""Largest number of entries in a scalar map (``info``, ``config``, ``meta``, ``metrics``)."""

MAX_LIST = 100_000
"""Longest list of ids or counts (``selected``, ``class_histogram``)."""

MAX_INT = (1 << 63) - 1

SERVER_ID = "server"
"""Sender id used by the aggregation server."""

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

Scalar = int | float | str | bool


class Kind(enum.IntEnum):
    """Message kind numbers. Numbers are never reused; retired ones stay here as comments."""

    JOIN = 1
    ROUND_START = 2
    GLOBAL = 3
    UPDATE = 4
    FINISH = 5
    STATUS = 6
    RECEIPT = 7
    CHUNK = 8
    RESEND = 9

    @property
    def label(self) -> str:
        """Lower-case name used in topics and the ledger (``"round_start"``)."""
        return self.name.lower()


def valid_id(value: str) -> bool:
    """True when ``value`` can be a client id: 1–64 chars of ``[A-Za-z0-9_.-]``, not starting
    with ``.``/``-``/``_`` (so it is safe as one MQTT topic level)."""
    return isinstance(value, str) and bool(_ID_RE.match(value))


# --------------------------------------------------------------------------------------------
# Message records (one frozen dataclass per kind)


@dataclass(frozen=True, slots=True)
class Join:
    """An agent announces itself (kind 1).

    Attributes:
        profile: firmware profile name (``"rpi4"``).
        manifest_hash: hash of the model manifest the agent will send tensors against.
        num_samples: training samples on the device.
        class_histogram: samples per class, ``len == num_classes``.
        info: free scalars (device, torch version, fallbacks).
    """

    profile: str
    manifest_hash: str
    num_samples: int
    class_histogram: tuple[int, ...] = ()
    info: Mapping[str, Scalar] = field(default_factory=dict)

    KIND = Kind.JOIN


@dataclass(frozen=True, slots=True)
class RoundStart:
    """The server opens a round (kind 2).

    Attributes:
        selected: client ids asked to train this round.
        deadline_s: seconds after this message within which updates are accepted.
        config: per-round training instructions (``local_epochs``, ``lr``, ``batch_size`` …),
            the same for every selected device.
        instructions: named scalars for ONE device (a per-device ``round_start`` on
            ``down/{client}/round_start``: its data ratio, its epochs …), merged by the agent over
            ``config``. A fourth body field sent only when not empty, so a ``round_start``
            without instructions is byte-identical to protocol v1 before this field.
        members: the selected devices by member index (:mod:`protocol.membership`: a bitmap or
            delta varints, whichever is shorter), beside those named in ``selected``; a fifth body
            field sent only when not empty (after an empty ``instructions`` map), never with
            ``instructions``; a received empty ``bin`` there is the same as none. A device is
            selected when its id is in ``selected`` or its member index (from its join receipt)
            is in ``members``.
    """

    selected: tuple[str, ...]
    deadline_s: float
    config: Mapping[str, Scalar] = field(default_factory=dict)
    instructions: Mapping[str, Scalar] = field(default_factory=dict)
    members: bytes = b""

    KIND = Kind.ROUND_START


@dataclass(frozen=True, slots=True)
class Global:
    """The global state for a round (kind 3): tensors positional against the model manifest.

    Attributes:
        tensors: arrays in manifest order (float32 for model weights); empty when the
            algorithm shares no parameters (FedProto, FedMCP++), or only the shared subset of
            the manifest (FedPer/FedRep send the backbone).
        meta: scalars describing the state (``"manifest_hash"``, ``"accuracy"`` …).
        extras: named non-model state (``"prototypes"`` float32 [C, d], ``"proto_classes"``
            int64 [C], ``"soft_predictions"`` float32 [P, C], SCAFFOLD's ``"control.<i>"`` …).
            Sent as a third body field only when not empty, so a model-only ``global`` is
            byte-identical to protocol v1 without extras.
    """

    tensors: tuple[np.ndarray, ...]
    meta: Mapping[str, Scalar] = field(default_factory=dict)
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)

    KIND = Kind.GLOBAL


@dataclass(frozen=True, slots=True)
class Update:
    """A client's result for a round (kind 4).

    Attributes:
        tensors: arrays in manifest order (for FedAvg: the full local model, float32).
        num_samples: training samples behind the update (FedAvg weight), > 0.
        train_loss: mean training loss of the last local epoch (finite).
        metrics: extra scalars (``"train_seconds"``, ``"train_accuracy"`` …).
        delta: ``tensors`` are differences to the round's global model (w_local − w_global)
            rather than the weights themselves.
        extras: named non-model results (class prototypes, their class ids and counts, soft
            predictions on the proxy set, control-variate deltas …), each a tensor; a sixth body
            field sent only when not empty. Names: 1–64 characters of ``[A-Za-z0-9_.-]``.
    """

    tensors: tuple[np.ndarray, ...]
    num_samples: int
    train_loss: float
    metrics: Mapping[str, Scalar] = field(default_factory=dict)
    delta: bool = False
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)

    KIND = Kind.UPDATE


@dataclass(frozen=True, slots=True)
class Finish:
    """The server ends the run (kind 5)."""

    reason: str
    rounds_completed: int

    KIND = Kind.FINISH


@dataclass(frozen=True, slots=True)
class Status:
    """Presence of a device (kind 6), published retained; also the MQTT last will. The server
    says its own presence with it too (``online`` / ``offline``, retained, its last will
    ``offline``) on ``down/status`` (:func:`protocol.topics.server_status`); in its ``online``
    the three round fields say where its rounds are: ``global_round`` the last round it
    completed, ``start_round`` the round it collects updates for (0: none), ``update_round`` 0.

    Attributes:
        state: one of :data:`STATUS_STATES`.
        detail: free text (reason for ``offline``, current round …).
        global_round, start_round, update_round: what an ``online`` device holds of the rounds,
            so that a server sends it again only what it lacks (third to fifth body fields, sent
            all three or none, only with ``online``; ``None``: not said, as by a device of an
            older version): the newest round whose ``global`` it holds or trained, the newest
            round whose ``round_start`` selecting it it holds or trained, and the round of its
            last ``update`` whose receipt it has not read (0: none of each). The encoder refuses
            them with another state or one without the others; the decoder ignores them with
            another state (``None``).
    """

    state: str
    detail: str = ""
    global_round: int | None = None
    start_round: int | None = None
    update_round: int | None = None

    KIND = Kind.STATUS

    @property
    def holds(self) -> tuple[int, int, int] | None:
        """``(global_round, start_round, update_round)`` when the status says all three, else ``None``."""
        if self.global_round is None or self.start_round is None or self.update_round is None:
            return None
        return self.global_round, self.start_round, self.update_round


STATUS_STATES = ("online", "offline", "training", "idle")


@dataclass(frozen=True, slots=True)
class Receipt:
    """Application-level acknowledgement of a received message (kind 7).

    Attributes:
        ref_kind: kind number of the acknowledged message.
        ref_seq: the acknowledged message's envelope ``seq``.
        accepted: whether it was taken (``False``: rejected, see ``reason``).
        reason: why it was rejected (empty when accepted).
        sha256: SHA-256 digest (32 bytes) of the acknowledged payload as received.
        member_index: on an accepted ``join`` receipt to a device that reads
            ``round_start.members``: its member index (:mod:`protocol.membership`); a sixth body
            field sent only when not ``None`` (the encoder refuses it on other receipts; the
            decoder ignores it there: ``None``).
    """

    ref_kind: int
    ref_seq: int
    accepted: bool
    reason: str = ""
    sha256: bytes = b""
    member_index: int | None = None

    KIND = Kind.RECEIPT


TRANSFER_ID_BYTES = 16
"""Length of a chunked transfer's id (random bytes)."""

MAX_CHUNKS = 1 << 20
"""Largest chunk count of one transfer."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One slice of a large payload (kind 8).

    Attributes:
        transfer_id: 16 random bytes naming the transfer.
        index: position of this chunk, 0 ≤ index < count.
        count: number of chunks in the transfer.
        offset: byte offset of ``data`` in the whole payload.
        total_bytes: length of the whole payload (bytes).
        sha256: SHA-256 digest of the whole payload (32 bytes).
        data: the slice: ``bytes`` when decoded; a read-only ``memoryview`` on the whole
            payload when cut by :func:`protocol.chunking.split` (no copy).
    """

    transfer_id: bytes
    index: int
    count: int
    offset: int
    total_bytes: int
    sha256: bytes
    data: bytes | memoryview

    KIND = Kind.CHUNK


@dataclass(frozen=True, slots=True)
class Resend:
    """Ask the sender of a transfer for some of its chunks again (kind 9).

    Attributes:
        transfer_id: the transfer.
        indices: chunk indices missing at the receiver.
    """

    transfer_id: bytes
    indices: tuple[int, ...]

    KIND = Kind.RESEND


Body = Join | RoundStart | Global | Update | Finish | Status | Receipt | Chunk | Resend


@dataclass(frozen=True, slots=True)
class Envelope:
    """One message: header fields plus a body record.

    Attributes:
        round: federated round (0 = before the first round).
        sender: client id of the sender, or :data:`SERVER_ID`.
        seq: per-sender sequence number (≥ 1 when sent by fedfleet; 0 is allowed for last wills).
        body: the kind's record; the kind number is ``type(body).KIND``.
        timestamp_ms: sender's wall clock in ms since the epoch; informational, never trusted.
        version: protocol major version.
    """

    round: int
    sender: str
    seq: int
    body: Body
    timestamp_ms: int = 0
    version: int = PROTOCOL_VERSION

    @property
    def kind(self) -> Kind:
        """The message kind of ``body``."""
        return type(self.body).KIND


@dataclass(frozen=True, slots=True)
class Encoded:
    """An encoded payload with its exact byte split.

    Attributes:
        payload: the bytes handed to MQTT as the PUBLISH payload.
        body_bytes: length of the nested body (the ``bin`` content).
        envelope_bytes: ``len(payload) - body_bytes``: header fields plus msgpack framing.
        field_bytes: ``(name, bytes)`` of each body field (they add up to ``body_bytes`` minus
            the body's 1–5 byte array header).
        raw_tensor_bytes: bytes of the tensors' values before the codec (``size × itemsize``).
        seq: the envelope's sequence number (to match receipts).
    """

    payload: bytes
    body_bytes: int
    field_bytes: tuple[tuple[str, int], ...] = ()
    raw_tensor_bytes: int = 0
    seq: int = 0

    @property
    def envelope_bytes(self) -> int:
        return len(self.payload) - self.body_bytes


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded payload: the envelope and the same byte split as :class:`Encoded`
    (``field_bytes``: bytes of each body field, measured while parsing)."""

    envelope: Envelope
    payload_bytes: int
    body_bytes: int
    field_bytes: tuple[tuple[str, int], ...] = ()
    codec: str = ""

    @property
    def envelope_bytes(self) -> int:
        return self.payload_bytes - self.body_bytes


# --------------------------------------------------------------------------------------------
# Encoding


def _scalar_map(m: Mapping[str, Scalar], name: str) -> dict[str, Scalar]:
    out: dict[str, Scalar] = {}
    for k, v in m.items():
        if not isinstance(k, str):
            raise FieldError(f"{name}: key {k!r} is not a string", field=name)
        if isinstance(v, (bool, int, float, str)):
            out[k] = v
        elif isinstance(v, np.generic):
            out[k] = v.item()
        else:
            raise FieldError(f"{name}[{k!r}]: value of type {type(v).__name__} is not a scalar", field=name)
    return out


def _tensor(t: np.ndarray, codec: Any) -> list[Any]:
    return encode_tensor(t) if codec is None else encode_tensor(t, codec)


# --------------------------------------------------------------------------------------------
# Segments: a payload is a list of byte strings and buffer views joined ONCE (``b"".join``, or in
# place on huge pages from 4 MiB: :mod:`protocol._join`), so a tensor's values are copied exactly
# once, from the array into the payload.

Segment = bytes | memoryview
"""One piece of an encoded payload: packed msgpack bytes, or a view on a buffer (a tensor's
values) that is copied only when the payload is joined."""

_VIEW_FROM = 4096
"""bin values at least this long (bytes) go into the segment list as views, not copies."""


def _bin_header(n: int) -> bytes:
    """msgpack ``bin`` header for ``n`` bytes (the smallest form, as ``msgpack.packb`` writes it)."""
    if n < 256:
        return b"\xc4" + bytes([n])
    if n < 65536:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _bin_segments(value: bytes | bytearray | memoryview, out: list[Segment]) -> int:
    """Append ``value`` as a msgpack ``bin`` (header + a view when long) to ``out``; its length."""
    view = memoryview(value)
    if not view.c_contiguous:  # msgpack would copy it too; keep its bytes
        view = memoryview(view.tobytes())
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    n = view.nbytes
    if n < _VIEW_FROM:
        seg = _bin_header(n) + view.tobytes()
        out.append(seg)
        return len(seg)
    head = _bin_header(n)
    out.append(head)
    out.append(view)
    return len(head) + n


def _value_segments(value: Any, out: list[Segment]) -> int:
    """Append msgpack's encoding of ``value`` to ``out`` (long bins as views); its length in bytes.

    Lists and tuples are walked only when they hold a bin or another list (a tensor, a list of
    tensors); anything else is packed by ``msgpack.packb`` as it is, so the bytes equal
    ``msgpack.packb(value, use_bin_type=True)`` exactly."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _bin_segments(value, out)
    if isinstance(value, (list, tuple)) and any(isinstance(v, (bytes, bytearray, memoryview, list, tuple))
                                                for v in value):
        head = _array_header(len(value))
        out.append(head)
        return len(head) + sum(_value_segments(v, out) for v in value)
    packed = msgpack.packb(value, use_bin_type=True)
    out.append(packed)
    return len(packed)


def _extras_parts(extras: Mapping[str, np.ndarray], codec: Any, extra_codecs: Mapping[str, Any] | None
                  ) -> list[tuple[str, list[Segment]]]:
    """Packed ``extras`` map as ``[("extras", [map header]), ("extras.<name>", [key, tensor …]), …]``:
    the concatenation is exactly msgpack's map encoding, and each entry's bytes are known."""
    if len(extras) > MAX_EXTRAS:
        raise FieldError(f"extras: {len(extras)} entries, at most {MAX_EXTRAS}", field="body.extras")
    n = len(extras)
    header = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    parts: list[tuple[str, list[Segment]]] = [("extras", [header])]
    for name, t in extras.items():
        if not isinstance(name, str) or not _EXTRA_NAME.fullmatch(name):
            raise FieldError(f"extras: name {name!r} must be 1-64 characters of [A-Za-z0-9_.-]", field="body.extras")
        c = (extra_codecs or {}).get(name, codec)
        segs: list[Segment] = [msgpack.packb(name, use_bin_type=True)]
        _value_segments(_tensor(t, c), segs)
        parts.append((f"extras.{name}", segs))
    return parts


def _encode_body(body: Body, codec: Any = None) -> list[Any]:
    match body:
        case Join():
            return [body.profile, body.manifest_hash, int(body.num_samples),
                    [int(c) for c in body.class_histogram], _scalar_map(body.info, "info")]
        case RoundStart():
            fields = [list(body.selected), float(body.deadline_s), _scalar_map(body.config, "config")]
            if body.instructions and len(body.selected) != 1:
                raise FieldError(f"instructions are for one device, but selected names {len(body.selected)}",
                                 field="instructions")
            if body.instructions and body.members:
                raise FieldError("members: a round_start with per-device instructions names its one device in "
                                 "selected, never in members", field="members")
            if body.instructions or body.members:
                fields.append(_scalar_map(body.instructions, "instructions"))
            if body.members:
                check_members(bytes(body.members))
                fields.append(bytes(body.members))
            return fields
        case Global():
            return [[_tensor(t, codec) for t in body.tensors], _scalar_map(body.meta, "meta")]
        case Update():
            return [[_tensor(t, codec) for t in body.tensors], int(body.num_samples),
                    float(body.train_loss), _scalar_map(body.metrics, "metrics"), bool(body.delta)]
        case Finish():
            return [body.reason, int(body.rounds_completed)]
        case Status():
            held = (body.global_round, body.start_round, body.update_round)
            if all(h is None for h in held):
                return [body.state, body.detail]
            if body.state != "online" or any(h is None for h in held):
                raise FieldError("global_round, start_round, update_round: sent all three, with state 'online' only",
                                 field="global_round")
            for name, h in zip(("global_round", "start_round", "update_round"), held):
                if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_INT:
                    raise FieldError(f"{name} {h!r} is not a round number", field=name)
            return [body.state, body.detail, *held]
        case Receipt():
            out = [int(body.ref_kind), int(body.ref_seq), bool(body.accepted), body.reason, bytes(body.sha256)]
            if body.member_index is not None:
                if not (body.ref_kind == Kind.JOIN and body.accepted):
                    raise FieldError("member_index: only an accepted join receipt carries one", field="member_index")
                if isinstance(body.member_index, bool) or not 0 <= int(body.member_index) <= MAX_MEMBER_INDEX:
                    raise FieldError(f"member_index {body.member_index!r} is not in 0..{MAX_MEMBER_INDEX}",
                                     field="member_index")
                out.append(int(body.member_index))
            return out
        case Chunk():
            return [bytes(body.transfer_id), int(body.index), int(body.count), int(body.offset),
                    int(body.total_bytes), bytes(body.sha256), body.data]
        case Resend():
            return [bytes(body.transfer_id), [int(i) for i in body.indices]]
    raise TypeError(f"not a message body: {type(body).__name__}")


#: names of each kind's body fields, in wire order (ledger ``fields`` column)
BODY_FIELDS: dict[Kind, tuple[str, ...]] = {
    Kind.JOIN: ("profile", "manifest_hash", "num_samples", "class_histogram", "info"),
    Kind.ROUND_START: ("selected", "deadline_s", "config", "instructions", "members"),
    Kind.GLOBAL: ("tensors", "meta", "extras"),
    Kind.UPDATE: ("tensors", "num_samples", "train_loss", "metrics", "delta", "extras"),
    Kind.FINISH: ("reason", "rounds_completed"),
    Kind.STATUS: ("state", "detail", "global_round", "start_round", "update_round"),
    Kind.RECEIPT: ("ref_kind", "ref_seq", "accepted", "reason", "sha256", "member_index"),
    Kind.CHUNK: ("transfer_id", "index", "count", "offset", "total_bytes", "sha256", "data"),
    Kind.RESEND: ("transfer_id", "indices"),
}


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 65536:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def encode(envelope: Envelope, codec: Any = None, extra_codecs: Mapping[str, Any] | None = None) -> Encoded:
    """Encode one message to its MQTT payload.

    The body array is packed field by field (header + concatenated elements, which is exactly
    msgpack's array encoding), so the bytes of each field are known without a second pass. The
    headers are packed around the tensors' buffers, which are referenced (memoryviews), not
    copied, until the payload is joined once: a raw tensor's values are copied exactly once, and
    the transient memory of an encode is the payload itself plus a few small headers (a lossy
    codec's encoded tensor besides). A payload of at least 4 MiB
    (:data:`protocol._join.HUGE_FROM`) is built in place in a ``bytes`` object whose memory is
    asked for as transparent huge pages, as numpy does for its arrays, instead of by
    ``b"".join``, whose fresh memory the kernel maps 4 KiB at a time on first touch (44.8 MB:
    ~11,000 page faults, ~8× the time of the copy itself); same bytes, same type, same memory
    (:mod:`protocol._join`).

    Args:
        envelope: the message. ``sender`` must satisfy :func:`valid_id`.
        codec: tensor codec (:class:`protocol.tensors.Codec`) for ``global``/``update`` tensors;
            ``None`` = ``fp32`` (raw).
        extra_codecs: codec per ``extras`` name (e.g. ``{"soft_predictions": Codec.parse("int8")}``);
            a name not listed uses ``codec``. Integer tensors are always sent raw.

    Returns:
        :class:`Encoded` with the payload (``bytes``), its exact body/envelope byte split and the
        bytes of each body field.

    Raises:
        FieldError: invalid sender id, negative round/seq, non-scalar map value.
        TensorError: a tensor with an unsupported dtype, or a value the codec cannot represent.
    """
    if not valid_id(envelope.sender):
        raise FieldError(f"sender {envelope.sender!r} is not a valid client id", field="envelope.sender")
    for name in ("round", "seq", "timestamp_ms"):
        v = getattr(envelope, name)
        if not 0 <= v <= MAX_INT:
            raise FieldError(f"envelope.{name} = {v} out of range", field=f"envelope.{name}")
    fields = _encode_body(envelope.body, codec)
    segments: list[Segment] = []
    names = list(BODY_FIELDS[envelope.kind][:len(fields)])
    sizes = [_value_segments(f, segments) for f in fields]
    extras = getattr(envelope.body, "extras", None)
    n_fields = len(fields)
    if extras:
        for name, segs in _extras_parts(extras, codec, extra_codecs):
            names.append(name)
            sizes.append(sum(len(memoryview(x)) for x in segs))
            segments += segs
        n_fields += 1
    body_head = _array_header(n_fields)
    body_bytes = len(body_head) + sum(sizes)
    # the envelope around the body: msgpack's [version, kind, round, sender, seq, timestamp_ms, body]
    head = msgpack.packb([envelope.version, int(envelope.kind), envelope.round, envelope.sender, envelope.seq,
                          envelope.timestamp_ms], use_bin_type=True)
    bin_head = _bin_header(body_bytes)
    payload = join_segments([b"\x97", head[1:], bin_head, body_head, *segments],
                            len(head) + len(bin_head) + body_bytes)  # the one copy
    raw = sum(raw_nbytes(t) for t in getattr(envelope.body, "tensors", ()))
    raw += sum(raw_nbytes(t) for t in (extras or {}).values())
    return Encoded(payload=payload, body_bytes=body_bytes, field_bytes=tuple(zip(names, sizes)),
                   raw_tensor_bytes=raw, seq=envelope.seq)


def now_ms() -> int:
    """Wall clock in ms since the Unix epoch (for ``timestamp_ms``; never used for decisions)."""
    return int(time.time() * 1000)


# --------------------------------------------------------------------------------------------
# Decoding (untrusted input)


MAX_CONTAINERS = 20_000

MAX_EXTRAS = 64
"""Most named entries in a ``global``/``update`` ``extras`` map."""

_EXTRA_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
"""Most arrays + maps one payload (or body) may hold: a byte of msgpack (an empty array) becomes a
Python list of ~56 bytes, so a payload of nested empty containers is refused once it has built
this many, instead of costing ~64× its size in memory. A legitimate message holds 2–3 per tensor
(≤ 4,096 tensors) plus a handful."""


def _want(value: Any, types: type | tuple[type, ...], name: str) -> Any:
    # bool is an int subclass: never accept one where the other is declared
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise MalformedMessage(f"{name}: expected {types}, got bool", field=name)
    if not isinstance(value, types):
        tn = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
        raise MalformedMessage(f"{name}: expected {tn}, got {type(value).__name__}", field=name)
    return value


def _bin(value: Any, name: str) -> bytes:
    """A ``bin`` field as ``bytes`` (the reader hands out memoryviews)."""
    if isinstance(value, memoryview):
        return value.tobytes()
    return _want(value, bytes, name)


def _uint(value: Any, name: str, maximum: int = MAX_INT) -> int:
    _want(value, int, name)
    if not 0 <= value <= maximum:
        raise FieldError(f"{name}: {value} is out of range 0..{maximum}", field=name)
    return value


def _str(value: Any, name: str, max_len: int = MAX_STR) -> str:
    _want(value, str, name)
    if len(value) > max_len:
        raise FieldError(f"{name}: string of {len(value)} chars, at most {max_len}", field=name)
    return value


def _finite(value: Any, name: str) -> float:
    _want(value, (float, int), name)
    f = float(value)
    if not math.isfinite(f):
        raise FieldError(f"{name}: {f} is not finite", field=name)
    return f


def _decode_map(value: Any, name: str) -> dict[str, Scalar]:
    _want(value, dict, name)
    for k, v in value.items():
        if not isinstance(k, str):
            raise MalformedMessage(f"{name}: key {k!r} is not a string", field=name)
        if not isinstance(v, (bool, int, float, str)):
            raise MalformedMessage(f"{name}[{k!r}]: {type(v).__name__} is not a scalar", field=f"{name}.{k}")
        if isinstance(v, str) and len(v) > MAX_STR:
            raise FieldError(f"{name}[{k!r}]: string too long", field=f"{name}.{k}")
    return value


def _fields(body: Any, n: int, name: str) -> list[Any]:
    _want(body, list, name)
    if len(body) < n:
        raise MalformedMessage(f"{name}: expected at least {n} fields, got {len(body)}", field=name)
    return body


def _tensors(value: Any, name: str, limits: TensorLimits) -> tuple[np.ndarray, ...]:
    _want(value, list, name)
    if len(value) > MAX_TENSORS:
        raise FieldError(f"{name}: {len(value)} tensors, at most {MAX_TENSORS}", field=name)
    total = 0
    for i, t in enumerate(value):
        nbytes = declared_nbytes(t)
        if nbytes and nbytes // DTYPES[t[1]].itemsize > limits.max_elements:
            decode_tensor(t, field=f"{name}[{i}]", limits=limits)  # raises, naming the tensor's shape
        total += nbytes
    if total > limits.max_total_bytes:
        raise TensorError(f"{name}: the tensors claim {total:,} decoded bytes, at most {limits.max_total_bytes:,}",
                          field=name)
    return tuple(decode_tensor(t, field=f"{name}[{i}]", limits=limits) for i, t in enumerate(value))


_ABSENT = object()
"""Marks a body without its optional ``extras`` field (a present field must be a map: nil is refused)."""


def _tensors_and_extras(tensors: Any, extras: Any, limits: TensorLimits
                        ) -> tuple[tuple[np.ndarray, ...], dict[str, np.ndarray]]:
    """Decode the positional tensors and the optional ``extras`` map under ONE byte budget
    (``limits.max_total_bytes`` covers both), checking names and entry count first. ``extras``
    is :data:`_ABSENT` when the body has no such field."""
    if extras is _ABSENT:
        return _tensors(tensors, "body.tensors", limits), {}
    _want(extras, dict, "body.extras")
    if len(extras) > MAX_EXTRAS:
        raise FieldError(f"body.extras: {len(extras)} entries, at most {MAX_EXTRAS}", field="body.extras")
    names = list(extras)
    for name in names:
        if not isinstance(name, str) or not _EXTRA_NAME.fullmatch(name):
            raise FieldError(f"body.extras: name {name!r} is not 1-64 characters of [A-Za-z0-9_.-]",
                             field="body.extras")
    values = [extras[k] for k in names]
    _want(tensors, list, "body.tensors")
    both = _tensors(list(tensors) + values, "body.tensors+extras", limits)
    k = len(tensors)
    return both[:k], dict(zip(names, both[k:]))


def _decode_body(kind: Kind, raw: Any, limits: TensorLimits) -> Body:
    b = "body"
    if kind is Kind.JOIN:
        f = _fields(raw, 5, b)
        hist = _want(f[3], list, "body.class_histogram")
        if len(hist) > MAX_LIST:
            raise FieldError("body.class_histogram: too long", field="body.class_histogram")
        return Join(profile=_str(f[0], "body.profile", 64), manifest_hash=_str(f[1], "body.manifest_hash", 128),
                    num_samples=_uint(f[2], "body.num_samples"),
                    class_histogram=tuple(_uint(c, "body.class_histogram") for c in hist),
                    info=_decode_map(f[4], "body.info"))
    if kind is Kind.ROUND_START:
        f = _fields(raw, 3, b)
        sel = _want(f[0], list, "body.selected")
        if len(sel) > MAX_LIST:
            raise FieldError("body.selected: too long", field="body.selected")
        for s in sel:
            if not valid_id(s):
                raise FieldError(f"body.selected: {s!r} is not a valid client id", field="body.selected")
        deadline = _finite(f[1], "body.deadline_s")
        if deadline <= 0:
            raise FieldError("body.deadline_s must be > 0", field="body.deadline_s")
        instructions = _decode_map(f[3], "body.instructions") if len(f) > 3 else {}
        if instructions and len(sel) != 1:  # one device's settings: never applied by several
            raise FieldError(f"body.instructions: for one device, but body.selected names {len(sel)}",
                             field="body.instructions")
        members = _bin(f[4], "body.members") if len(f) > 4 else b""
        if members:  # an empty bin stands for none (a placeholder when a later field follows)
            if instructions:
                raise FieldError("body.members: not allowed beside per-device instructions", field="body.members")
            check_members(members)
        return RoundStart(selected=tuple(sel), deadline_s=deadline, config=_decode_map(f[2], "body.config"),
                          instructions=instructions, members=members)
    if kind is Kind.GLOBAL:
        f = _fields(raw, 2, b)
        tensors, extras = _tensors_and_extras(f[0], f[2] if len(f) > 2 else _ABSENT, limits)
        return Global(tensors=tensors, meta=_decode_map(f[1], "body.meta"), extras=extras)
    if kind is Kind.UPDATE:
        f = _fields(raw, 4, b)
        n = _uint(f[1], "body.num_samples")
        if n == 0:
            raise FieldError("body.num_samples: an update must stand for at least one sample", field="body.num_samples")
        delta = _want(f[4], bool, "body.delta") if len(f) > 4 else False
        tensors, extras = _tensors_and_extras(f[0], f[5] if len(f) > 5 else _ABSENT, limits)
        return Update(tensors=tensors, num_samples=n,
                      train_loss=_finite(f[2], "body.train_loss"), metrics=_decode_map(f[3], "body.metrics"),
                      delta=delta, extras=extras)
    if kind is Kind.FINISH:
        f = _fields(raw, 2, b)
        return Finish(reason=_str(f[0], "body.reason"), rounds_completed=_uint(f[1], "body.rounds_completed"))
    if kind is Kind.STATUS:
        f = _fields(raw, 2, b)
        state = _str(f[0], "body.state", 32)
        if state not in STATUS_STATES:
            raise FieldError(f"body.state: {state!r} is not one of {STATUS_STATES}", field="body.state")
        held: list[int | None] = [_uint(v, f"body.{name}")
                                  for v, name in zip(f[2:5], ("global_round", "start_round", "update_round"))]
        if state != "online":
            held = []  # meaningless there: ignored
        held += [None] * (3 - len(held))
        return Status(state=state, detail=_str(f[1], "body.detail"), global_round=held[0], start_round=held[1],
                      update_round=held[2])
    if kind is Kind.RECEIPT:
        f = _fields(raw, 5, b)
        digest = _bin(f[4], "body.sha256")
        if len(digest) not in (0, 32):
            raise FieldError("body.sha256: must be 32 bytes (or empty)", field="body.sha256")
        ref_kind, accepted = _uint(f[0], "body.ref_kind", 255), _want(f[2], bool, "body.accepted")
        member_index = None
        if len(f) > 5:
            member_index = _uint(f[5], "body.member_index", MAX_MEMBER_INDEX)
            if not (ref_kind == Kind.JOIN and accepted):
                member_index = None  # meaningless there (a placeholder when a later field follows): ignored
        return Receipt(ref_kind=ref_kind, ref_seq=_uint(f[1], "body.ref_seq"), accepted=accepted,
                       reason=_str(f[3], "body.reason"), sha256=digest, member_index=member_index)
    if kind is Kind.CHUNK:
        f = _fields(raw, 7, b)
        tid = _bin(f[0], "body.transfer_id")
        if len(tid) != TRANSFER_ID_BYTES:
            raise FieldError(f"body.transfer_id: must be {TRANSFER_ID_BYTES} bytes", field="body.transfer_id")
        count = _uint(f[2], "body.count", MAX_CHUNKS)
        if count == 0:
            raise FieldError("body.count: a transfer has at least one chunk", field="body.count")
        index = _uint(f[1], "body.index", count - 1)
        total = _uint(f[4], "body.total_bytes", MAX_PAYLOAD_BYTES)
        offset = _uint(f[3], "body.offset", total)
        digest = _bin(f[5], "body.sha256")
        if len(digest) != 32:
            raise FieldError("body.sha256: must be 32 bytes", field="body.sha256")
        data = _bin(f[6], "body.data")
        if offset + len(data) > total:
            raise FieldError(f"body.data: {len(data)} bytes at offset {offset} overrun total_bytes {total}",
                             field="body.data")
        return Chunk(transfer_id=tid, index=index, count=count, offset=offset, total_bytes=total, sha256=digest,
                     data=data)
    if kind is Kind.RESEND:
        f = _fields(raw, 2, b)
        tid = _bin(f[0], "body.transfer_id")
        if len(tid) != TRANSFER_ID_BYTES:
            raise FieldError(f"body.transfer_id: must be {TRANSFER_ID_BYTES} bytes", field="body.transfer_id")
        idx = _want(f[1], list, "body.indices")
        if len(idx) > MAX_LIST:
            raise FieldError("body.indices: too long", field="body.indices")
        return Resend(transfer_id=tid, indices=tuple(_uint(i, "body.indices", MAX_CHUNKS - 1) for i in idx))
    raise UnknownKind(f"no decoder for kind {kind}", field="envelope.kind")  # pragma: no cover


def decode(payload: bytes, *, limits: TensorLimits = DEFAULT_LIMITS,
           max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> Decoded:
    """Decode an MQTT payload received from an untrusted peer.

    Checks, in order: size bound, msgpack validity (exactly one value, nothing trailing), envelope
    shape, protocol version, kind number, header field types, then the body.

    Args:
        payload: the PUBLISH payload bytes.
        limits: tensor bounds (dims, elements, NaN/Inf).
        max_payload_bytes: larger payloads are refused before parsing.

    Returns:
        :class:`Decoded`. Raw (fp32) tensors in it are read-only ``np.frombuffer`` views on
        ``payload`` itself: no copy (the bounded reader of :mod:`protocol._mpread` hands out
        ``bin`` values as memoryviews); lossy codecs allocate their decoded tensor.

    Raises:
        ProtocolError: any violation (a subclass naming the field); nothing else escapes.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise MalformedMessage(f"payload must be bytes, got {type(payload).__name__}")
    if not isinstance(payload, bytes):
        payload = bytes(payload)  # immutable: decoded tensors are read-only views on it
    if len(payload) > max_payload_bytes:
        raise FieldError(f"payload of {len(payload)} bytes exceeds {max_payload_bytes}", field="payload")
    env = _read(payload, "envelope")
    _want(env, list, "envelope")
    if len(env) < 7:
        raise MalformedMessage(f"envelope: expected 7 fields, got {len(env)}", field="envelope")
    version = _want(env[0], int, "envelope.version")
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})",
                                 field="envelope.version")
    kind_no = _want(env[1], int, "envelope.kind")
    try:
        kind = Kind(kind_no)
    except ValueError:
        raise UnknownKind(f"unknown message kind {kind_no}", field="envelope.kind") from None
    rnd = _uint(env[2], "envelope.round")
    sender = _want(env[3], str, "envelope.sender")
    if not valid_id(sender):
        raise FieldError(f"envelope.sender {sender[:80]!r} is not a valid client id", field="envelope.sender")
    seq = _uint(env[4], "envelope.seq")
    ts = _uint(env[5], "envelope.timestamp_ms")
    body_view = _want(env[6], memoryview, "envelope.body")
    try:
        fields, sizes = read_array_fields(body_view, **_BOUNDS)
    except ReadError as exc:
        raise MalformedMessage(f"body: not a valid msgpack array ({exc})", field="body") from None
    except MemoryError:
        raise FieldError("body: too large to decode in the memory available", field="body") from None
    try:
        body = _decode_body(kind, fields, limits)
    except ProtocolError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:  # defensive: never leak another type
        raise MalformedMessage(f"body: {exc}", field="body") from exc
    except MemoryError:
        raise FieldError("body: too large to decode in the memory available", field="body") from None
    names = BODY_FIELDS[kind] + tuple(f"field{i}" for i in range(len(BODY_FIELDS[kind]), len(sizes)))
    codec = ""
    if kind in (Kind.GLOBAL, Kind.UPDATE):
        extras_at = 2 if kind is Kind.GLOBAL else 5
        extra_values = list(fields[extras_at].values()) if len(fields) > extras_at else []
        codec = _codec_text(list(fields[0]) + extra_values)
    return Decoded(envelope=Envelope(round=rnd, sender=sender, seq=seq, body=body, timestamp_ms=ts, version=version),
                   payload_bytes=len(payload), body_bytes=len(body_view),
                   field_bytes=tuple(zip(names, sizes)), codec=codec)


def read_header(payload: bytes) -> tuple[Kind, int, str, int] | None:
    """The header of an envelope whose body may not decode: ``(kind, round, sender, seq)``.

    Reads the payload's outer msgpack array and checks the first five fields exactly as
    :func:`decode` does (version 1, a known kind, uint round, a valid id, uint seq); the body and
    any security trailer are not looked at. A receiver uses it to say *which* message it refused
    when the body is undecodable (the refusal's receipt names the ``seq``); whether the header can
    be trusted is the caller's question (it is only as authentic as the payload's signature).

    Returns:
        The four header values, or ``None`` when the payload has no readable header (never raises).
    """
    try:
        env = _read(bytes(payload), "envelope")
        if not isinstance(env, list) or len(env) < 7:
            return None
        if _want(env[0], int, "envelope.version") != PROTOCOL_VERSION:
            return None
        kind = Kind(_want(env[1], int, "envelope.kind"))
        rnd = _uint(env[2], "envelope.round")
        sender = _want(env[3], str, "envelope.sender")
        seq = _uint(env[4], "envelope.seq")
    except (ProtocolError, ValueError, TypeError):
        return None
    return (kind, rnd, sender, seq) if valid_id(sender) else None


def _codec_text(tensors: list) -> str:
    """The codec of a (valid) tensor list as configuration text, from its first float tensor:
    ``fp32``, ``fp16``, ``bf16``, ``int8``, ``int8-channel``, ``topk`` (+ ``+zstd``)."""
    for t in tensors:
        if t[1] in (1, 2, 3):  # float dtypes
            base, zstd = t[0] & 0x7F, t[0] & 0x80
            name = {0: "fp32", 1: "fp16", 2: "bf16", 3: "int8", 4: "topk"}.get(base, "?")
            if base == 3 and len(t) > 4 and t[4] != -1:
                name = "int8-channel"
            return name + ("+zstd" if zstd else "")
    return "fp32" if tensors else ""


_BOUNDS = dict(max_array=MAX_LIST + MAX_TENSORS, max_map=MAX_MAP_ENTRIES, max_str=MAX_PAYLOAD_BYTES,
               max_containers=MAX_CONTAINERS)
"""Bounds of the msgpack reader for every payload and body."""


def _read(data: bytes, what: str) -> Any:
    try:
        return Reader(data, **_BOUNDS).read_one()
    except ReadError as exc:
        cls = FieldError if "too many" in str(exc) or "at most" in str(exc) else MalformedMessage
        raise cls(f"{what}: not a valid msgpack value ({exc})", field=what) from None
    except MemoryError:
        raise FieldError(f"{what}: too large to decode in the memory available", field=what) from None


def payload_sha256(payload: bytes) -> bytes:
    """SHA-256 digest (32 bytes) of a payload, as carried by :class:`Receipt`."""
    return hashlib.sha256(payload).digest()


def parse_extras_codec(text: str) -> tuple[Codec | None, dict[str, Codec]]:
    """The ``[protocol] extras_codec`` setting: ``""`` (every entry uses the update codec), one
    codec for every entry (``"int8+zstd"``), or ``name=codec`` pairs separated by commas
    (``"soft_predictions=int8+zstd,prototypes=fp16"``; names not listed use the update codec).

    Returns:
        (the codec for every entry or ``None``, {name: codec}); one of them is empty.

    Raises:
        ValueError: an unparsable codec, a pair without ``=`` beside other pairs, an empty part,
            a name that is not an extras name (1–64 characters of ``[A-Za-z0-9_.-]``) or a name
            given twice.
    """
    text = text.strip()
    if not text:
        return None, {}
    if "=" not in text:
        return Codec.parse(text), {}
    out: dict[str, Codec] = {}
    for part in text.split(","):
        name, eq, codec = part.partition("=")
        name = name.strip()
        if not eq:
            raise ValueError(f"{part.strip()!r}: use name=codec for every entry (or one codec for all)")
        if not _EXTRA_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not an extras name (1-64 characters of [A-Za-z0-9_.-])")
        if name in out:
            raise ValueError(f"{name!r} is given twice")
        out[name] = Codec.parse(codec.strip())
    return None, out
