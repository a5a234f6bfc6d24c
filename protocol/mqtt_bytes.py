"""Exact MQTT framing sizes (MQTT 3.1.1 §2.2 and §3.3; MQTT 5 §2.1, §3.3), computed, not measured.

A PUBLISH packet is ``fixed header + variable header + payload``:

* fixed header: 1 byte (type and flags) + the Remaining Length as a variable byte integer
  (1 byte below 128, 2 below 16,384, 3 below 2,097,152, 4 up to 268,435,455);
* variable header: 2-byte topic length + topic (UTF-8) + 2-byte packet identifier when QoS > 0,
  and for MQTT 5 a property length (variable byte integer) + the properties.

These formulas matched the bytes counted on the socket in all 32 cases of
``notes/mqtt-transport-study.md`` §4.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_REMAINING_LENGTH = 268_435_455
MQTT_V311 = 4
MQTT_V5 = 5


def varint_size(value: int) -> int:
    """Bytes of ``value`` as an MQTT variable byte integer.

    Raises:
        ValueError: ``value`` is negative or above 268,435,455.
    """
    if value < 0 or value > MAX_REMAINING_LENGTH:
        raise ValueError(f"{value} cannot be an MQTT variable byte integer")
    return 1 if value < 128 else 2 if value < 16_384 else 3 if value < 2_097_152 else 4


@dataclass(frozen=True, slots=True)
class PublishSize:
    """Byte split of one PUBLISH packet.

    Attributes:
        topic_bytes: UTF-8 length of the topic name.
        header_bytes: fixed header + topic length prefix (2) + packet id (2 at QoS > 0)
            + MQTT 5 property length and properties; everything except topic and payload.
        payload_bytes: the application payload.
    """

    topic_bytes: int
    header_bytes: int
    payload_bytes: int

    @property
    def packet_bytes(self) -> int:
        """Total size of the PUBLISH packet on the TCP stream (bytes)."""
        return self.topic_bytes + self.header_bytes + self.payload_bytes


def publish_size(topic: str, payload_bytes: int, qos: int, *, protocol: int = MQTT_V311,
                 properties_bytes: int = 0) -> PublishSize:
    """Size of a PUBLISH packet carrying ``payload_bytes`` on ``topic``.

    Args:
        topic: topic name (its UTF-8 length counts).
        payload_bytes: payload length in bytes.
        qos: 0, 1 or 2.
        protocol: :data:`MQTT_V311` (4) or :data:`MQTT_V5` (5).
        properties_bytes: encoded MQTT 5 properties (0 without properties); ignored for 3.1.1.

    Raises:
        ValueError: bad QoS/protocol, or a packet above the MQTT maximum remaining length.
    """
    if qos not in (0, 1, 2):
        raise ValueError(f"QoS must be 0, 1 or 2, not {qos}")
    if protocol not in (MQTT_V311, MQTT_V5):
        raise ValueError(f"protocol must be 4 (3.1.1) or 5, not {protocol}")
    topic_bytes = len(topic.encode("utf-8"))
    variable = 2 + (2 if qos else 0)
    if protocol == MQTT_V5:
        variable += varint_size(properties_bytes) + properties_bytes
    remaining = variable + topic_bytes + payload_bytes
    header = 1 + varint_size(remaining) + variable
    return PublishSize(topic_bytes=topic_bytes, header_bytes=header, payload_bytes=payload_bytes)


def max_payload_for(topic: str, max_packet_bytes: int, qos: int, *, protocol: int = MQTT_V311) -> int:
    """Largest payload whose PUBLISH on ``topic`` fits in ``max_packet_bytes`` (whole packet).

    Raises:
        ValueError: not even an empty payload fits.
    """
    empty = publish_size(topic, 0, qos, protocol=protocol)
    if empty.packet_bytes > max_packet_bytes:
        raise ValueError(f"max packet size {max_packet_bytes} is too small for topic {topic!r}")
    # the remaining length (everything after the fixed header) can never exceed the MQTT maximum
    empty_remaining = next(empty.packet_bytes - 1 - v for v in (1, 2, 3, 4)
                           if varint_size(empty.packet_bytes - 1 - v) == v)
    lo, hi = 0, min(max_packet_bytes, MAX_REMAINING_LENGTH - empty_remaining)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if publish_size(topic, mid, qos, protocol=protocol).packet_bytes <= max_packet_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def connect_client_id(packet: bytes) -> str | None:
    """The client identifier in an MQTT CONNECT packet (3.1.1 §3.1.3.1, or 5 §3.1.3.1, where the
    CONNECT properties come between the keep-alive and the identifier); for tools that watch the
    wire (relays, packet captures).

    Args:
        packet: the bytes a connection began with (at least the whole CONNECT; more is ignored).

    Returns:
        The identifier decoded as UTF-8 (invalid bytes replaced); ``None`` when ``packet`` is not a
        CONNECT or not all of it is there yet.
    """

    def varint(i: int) -> tuple[int, int] | None:  # (value, index after it), None past the end
        value, shift = 0, 0
        while i < len(packet):
            value |= (packet[i] & 0x7F) << shift
            shift += 7
            i += 1
            if not packet[i - 1] & 0x80:
                return value, i
        return None

    if len(packet) < 2 or packet[0] >> 4 != 1:
        return None
    head = varint(1)
    if head is None or len(packet) < head[1] + head[0]:
        return None
    i = head[1] + 10  # protocol name (2 + 4), level, flags, keep-alive (2)
    if packet[head[1] + 6] == MQTT_V5:
        props = varint(i)
        if props is None:
            return None
        i = props[1] + props[0]
    ln = int.from_bytes(packet[i:i + 2], "big")
    return bytes(packet[i + 2:i + 2 + ln]).decode("utf-8", "replace")
