"""fedfleet's wire protocol: message kinds, envelope, tensor codecs, topics, byte ledger, MQTT.

Depends on msgpack, numpy, paho-mqtt and cryptography only (never on torch), so it fits the
smallest device. The codec (:mod:`protocol.messages`, :mod:`protocol.tensors`) is sans-I/O; the MQTT
session lives in :mod:`protocol.transport`; :mod:`protocol.security` signs, encrypts and verifies;
:mod:`protocol.channel` joins them and keeps the ledger.
"""

from .channel import Channel, Received, Rejected
from .errors import (
    ChunkError,
    ConnectError,
    FedfleetProtocolError,
    FieldError,
    LedgerError,
    MalformedMessage,
    ProtocolError,
    PublishTimeout,
    TensorError,
    TransportError,
    UnknownKind,
    UnsupportedVersion,
)
from .ledger import Ledger, LedgerRow
from .messages import (
    PROTOCOL_VERSION,
    SERVER_ID,
    Chunk,
    Decoded,
    Encoded,
    Envelope,
    Finish,
    Global,
    Join,
    Kind,
    Receipt,
    Resend,
    RoundStart,
    Status,
    Update,
    decode,
    encode,
    valid_id,
)
from .tensors import Codec, ErrorFeedback
from .transport import Incoming, MqttTransport, Will

__all__ = sorted([
    "Channel", "Chunk", "ChunkError", "Codec", "ErrorFeedback", "Resend", "ConnectError", "Decoded", "Encoded", "Envelope", "FedfleetProtocolError", "FieldError",
    "Finish", "Global", "Incoming", "Join", "Kind", "Ledger", "LedgerError", "LedgerRow", "MalformedMessage",
    "MqttTransport", "PROTOCOL_VERSION", "ProtocolError", "PublishTimeout", "Receipt", "Received", "Rejected",
    "RoundStart", "SERVER_ID", "Status", "TensorError", "TransportError", "UnknownKind", "UnsupportedVersion",
    "Update", "Will", "decode", "encode", "valid_id",
])
