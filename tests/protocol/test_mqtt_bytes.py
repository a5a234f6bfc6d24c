"""protocol.mqtt_bytes.connect_client_id on CONNECT packets written out by hand from the MQTT
3.1.1 and MQTT 5 specifications (§3.1), and on what is not a whole CONNECT."""

from __future__ import annotations

from protocol.mqtt_bytes import connect_client_id

# MQTT 3.1.1 §3.1: fixed header 0x10, remaining length 14; "MQTT", level 4, flags 0x02 (clean
# session), keep-alive 60; payload: the client id "ab" (2-byte length + bytes)
V311 = bytes([0x10, 14, 0, 4]) + b"MQTT" + bytes([4, 0x02, 0, 60, 0, 2]) + b"ab"
# MQTT 5 §3.1: level 5, then properties (length 5: Session Expiry Interval 0x11 = 10 s) before the id
V5 = bytes([0x10, 20, 0, 4]) + b"MQTT" + bytes([5, 0x02, 0, 60, 5, 0x11, 0, 0, 0, 10, 0, 2]) + b"ab"


def test_the_client_id_of_a_311_and_a_5_connect() -> None:
    assert connect_client_id(V311) == "ab"
    assert connect_client_id(V5) == "ab"
    assert connect_client_id(V311 + b"\x30\x00") == "ab"  # bytes after the CONNECT are ignored


def test_not_a_whole_connect_gives_none() -> None:
    assert connect_client_id(b"") is None
    assert connect_client_id(V311[:-1]) is None  # one byte short of its remaining length
    assert connect_client_id(V5[:9]) is None
    assert connect_client_id(bytes([0x30]) + V311[1:]) is None  # a PUBLISH, not a CONNECT
