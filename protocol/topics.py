"""MQTT topic scheme of protocol version 1 (sans-I/O string helpers).

::

    fedfleet/v1/{federation}/down/{kind}                server → all agents (round_start, global, finish,
                                                        status: the server's retained presence + last will)
    fedfleet/v1/{federation}/down/{client_id}/{kind}    server → one agent (receipt, resend, round_start, global)
    fedfleet/v1/{federation}/up/{client_id}/{kind}      agent → server (join, update)
    fedfleet/v1/{federation}/status/{client_id}         retained presence + last will (status)

``federation`` and ``client_id`` are single topic levels: 1–64 characters of ``[A-Za-z0-9_.-]``
(see :func:`protocol.messages.valid_id`), so they can never contain ``/``, ``+`` or ``#``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .errors import FieldError
from .messages import SERVER_ID, Kind, valid_id

PREFIX = "fedfleet/v1"
_KIND_LABELS = frozenset(k.label for k in Kind)


def _check(value: str, what: str) -> str:
    if not valid_id(value):
        raise FieldError(f"{what} {value!r} is not a valid topic level (1-64 chars of A-Za-z0-9_.-)", field=what)
    return value


def down(federation: str, kind: Kind) -> str:
    """Topic of a broadcast from the server (``round_start``, ``global``, ``finish``)."""
    return f"{PREFIX}/{_check(federation, 'federation')}/down/{kind.label}"


def down_to(federation: str, client_id: str, kind: Kind) -> str:
    """Topic of a message from the server to one agent (``receipt``)."""
    return f"{PREFIX}/{_check(federation, 'federation')}/down/{_check(client_id, 'client_id')}/{kind.label}"


def server_status(federation: str) -> str:
    """Retained presence topic of the server (``down/status``; also its MQTT last will): every
    agent's ``down/+`` subscription takes it, so an agent of a version that does not read it
    receives a ``status`` from ``server`` there, which it ignores."""
    return down(federation, Kind.STATUS)


def up(federation: str, client_id: str, kind: Kind) -> str:
    """Topic of a message from one agent to the server (``join``, ``update``)."""
    return f"{PREFIX}/{_check(federation, 'federation')}/up/{_check(client_id, 'client_id')}/{kind.label}"


def status(federation: str, client_id: str) -> str:
    """Retained presence topic of one agent (also its MQTT last will)."""
    return f"{PREFIX}/{_check(federation, 'federation')}/status/{_check(client_id, 'client_id')}"


#: the most characters of the federation id an MQTT client id keeps as they are (a longer one is
#: cut to 31 and followed by ``.`` and 8 hex digits of its SHA-256, 40 in all): with a 64-character node id
#: the client id stays within 105 characters (AWS IoT and Azure IoT Hub allow 128).
MQTT_FEDERATION_CHARS = 40


def mqtt_client_id(federation: str, node_id: str) -> str:
    """The MQTT client id of node ``node_id`` (a device's client id, or ``"server"``) in
    ``federation``: ``{federation}:{node_id}``, the federation cut to
    :data:`MQTT_FEDERATION_CHARS` characters with a hash of the whole name when longer. Neither
    id holds ``:``, so distinct (federation, node) pairs get distinct client ids (short of a
    SHA-256 collision between two long federation names): one device id in two federations on
    one broker makes two MQTT clients, which would otherwise evict each other forever.
    :func:`node_of` inverts it.

    Raises:
        FieldError: ``federation`` or ``node_id`` is not a valid topic level.
    """
    fed = _check(federation, "federation")
    if len(fed) > MQTT_FEDERATION_CHARS:
        fed = f"{fed[:MQTT_FEDERATION_CHARS - 9]}.{hashlib.sha256(fed.encode()).hexdigest()[:8]}"
    return f"{fed}:{_check(node_id, 'client_id')}"


def node_of(mqtt_id: str) -> str | None:
    """The node id in an MQTT client id made by :func:`mqtt_client_id` (``"server"`` or a
    device's client id); ``None`` for a client id of another form."""
    fed, sep, node = mqtt_id.partition(":")
    return node if sep and fed and valid_id(node) else None


def check_device_id(client_id: str) -> str:
    """``client_id`` when it can name a device: a valid topic level other than ``"server"``
    (the server's node id, whose MQTT client id it would take over).

    Raises:
        FieldError: naming what is wrong.
    """
    _check(client_id, "client_id")
    if client_id == SERVER_ID:
        raise FieldError(f"client id {client_id!r} is the server's: give the device another id", field="client_id")
    return client_id


def server_filters(federation: str) -> list[str]:
    """Subscription filters of the server: every upload and every status."""
    fed = _check(federation, "federation")
    return [f"{PREFIX}/{fed}/up/+/+", f"{PREFIX}/{fed}/status/+"]


def agent_filters(federation: str, client_id: str) -> list[str]:
    """Subscription filters of one agent: broadcasts and messages addressed to it."""
    fed = _check(federation, "federation")
    cid = _check(client_id, "client_id")
    return [f"{PREFIX}/{fed}/down/+", f"{PREFIX}/{fed}/down/{cid}/+"]


def everything(federation: str | None = None) -> str:
    """Filter matching all fedfleet traffic (of one federation when given)."""
    return f"{PREFIX}/#" if federation is None else f"{PREFIX}/{_check(federation, 'federation')}/#"


@dataclass(frozen=True, slots=True)
class TopicInfo:
    """A parsed fedfleet topic.

    Attributes:
        federation: the federation level.
        direction: ``"down"``, ``"up"`` or ``"status"``.
        client_id: the agent the topic belongs to (``None`` for broadcasts).
        kind_label: the message kind's label (``"update"``), ``"status"`` for status topics.
    """

    federation: str
    direction: str
    client_id: str | None
    kind_label: str


def parse(topic: str) -> TopicInfo:
    """Parse a fedfleet topic.

    Raises:
        FieldError: the topic is not one of the four forms of the scheme.
    """
    parts = topic.split("/")
    if len(parts) < 4 or parts[0] != "fedfleet" or parts[1] != "v1" or not valid_id(parts[2]):
        raise FieldError(f"topic {topic!r} is not a fedfleet v1 topic", field="topic")
    fed, direction, rest = parts[2], parts[3], parts[4:]
    if direction in ("down", "up") and (not rest or rest[-1] not in _KIND_LABELS):
        raise FieldError(f"topic {topic!r} does not end in a message kind", field="topic")
    if direction == "down" and len(rest) == 1:
        return TopicInfo(fed, "down", None, rest[0])
    if direction == "down" and len(rest) == 2 and valid_id(rest[0]):
        return TopicInfo(fed, "down", rest[0], rest[1])
    if direction == "up" and len(rest) == 2 and valid_id(rest[0]):
        return TopicInfo(fed, "up", rest[0], rest[1])
    if direction == "status" and len(rest) == 1 and valid_id(rest[0]):
        return TopicInfo(fed, "status", rest[0], "status")
    raise FieldError(f"topic {topic!r} is not a fedfleet v1 topic", field="topic")
