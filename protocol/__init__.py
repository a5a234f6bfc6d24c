"""fedfleet's wire protocol: message kinds, envelope, tensor codecs, topics, byte ledger, MQTT.

Depends on msgpack, numpy, zstandard and cryptography (never on torch), so it fits the smallest
device; paho-mqtt only for the MQTT client. The codec (:mod:`protocol.messages`,
:mod:`protocol.tensors`, :mod:`protocol.chunking`) is sans-I/O; :mod:`protocol.security` signs,
encrypts and verifies; :mod:`protocol.channel` joins them to a transport and keeps the ledger.
The channel needs only the seam :class:`protocol.transport_base.Transport`; the MQTT session,
:class:`protocol.transport.MqttTransport`, is loaded on first use (``protocol.MqttTransport`` or
``import protocol.transport``), so everything else imports and works without paho-mqtt, and
using the MQTT client without it raises an :class:`ImportError` naming paho-mqtt.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
from .transport_base import Incoming, Will

if TYPE_CHECKING:  # for type checkers only: at run time it is loaded on first use (see __getattr__)
    from . import transport as transport
    from .transport import MqttTransport as MqttTransport

#: Loaded on first use, so that ``import protocol`` needs no paho-mqtt: name → (module, attribute).
_LAZY = {"MqttTransport": (".transport", "MqttTransport"), "transport": (".transport", None)}

__all__ = [
    "Channel", "Chunk", "ChunkError", "Codec", "ConnectError", "Decoded", "Encoded", "Envelope", "ErrorFeedback",
    "FedfleetProtocolError", "FieldError", "Finish", "Global", "Incoming", "Join", "Kind", "Ledger", "LedgerError",
    "LedgerRow", "MalformedMessage", "MqttTransport", "PROTOCOL_VERSION", "ProtocolError", "PublishTimeout",
    "Receipt", "Received", "Rejected", "Resend", "RoundStart", "SERVER_ID", "Status", "TensorError",
    "TransportError", "UnknownKind", "UnsupportedVersion", "Update", "Will", "decode", "encode", "valid_id",
]


def __getattr__(name: str) -> Any:
    """Import the MQTT transport when it is first asked for (PEP 562).

    Raises:
        ImportError: paho-mqtt is not installed (the message names it and how to install it).
        AttributeError: ``name`` is not an attribute of :mod:`protocol`.
    """
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name, __name__)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the lazily loaded ones included (without loading them)."""
    return sorted(set(globals()) | set(_LAZY))
