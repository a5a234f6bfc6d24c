"""MqttTransport's bounded buffer of unacknowledged QoS 1 messages while the link is up: a
publish that finds it full waits for the broker's acknowledgements (back-pressure) instead of
failing, and fails with a message that says so when they do not come in ``full_wait_s``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from broker_server.embedded_broker import EmbeddedBroker
from protocol.errors import OfflineBufferFull
from protocol.transport import MqttTransport
from tests.helpers.brokers import require_mosquitto
from tests.helpers.waiting import subscribed


def test_a_full_buffer_with_the_link_up_waits_for_acknowledgements_and_loses_nothing(tmp_path: Path) -> None:
    """Room for one unacknowledged message, 60 publishes back to back: each one after the first
    finds the previous still waiting for its PUBACK and waits; all 60 arrive, in order."""
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        sub = MqttTransport("bp-sub", broker.host, broker.port)
        pub = MqttTransport("bp-pub", broker.host, broker.port, max_buffered_messages=1)
        try:
            sub.connect(timeout_s=10.0)
            subscribed(sub, "t/bp")
            pub.connect(timeout_s=10.0)
            sent = [f"message {i}".encode() for i in range(60)]
            for p in sent:
                pub.publish("t/bp", p, qos=1)
            got = []
            while len(got) < len(sent):
                item = sub.get(10.0)
                assert item is not None, f"only {len(got)} of {len(sent)} arrived"
                got.append(item.payload)
            assert got == sent
            assert pub.buffered[0] <= 1
        finally:
            pub.close()
            sub.close()


def test_a_stalled_broker_fails_the_publish_after_full_wait_s_and_keeps_the_buffered_one(tmp_path: Path) -> None:
    """The broker process stopped (SIGSTOP): the TCP link stays up but no PUBACK comes. With room
    for one message and ``full_wait_s`` 0.3 s, the second publish raises OfflineBufferFull saying
    the link is up and how long it waited; once the broker runs again, the first message is
    acknowledged and the next publish goes through."""
    require_mosquitto()  # a broker process that can be stopped alone (amqtt runs in this one)
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "broker") as broker:
        pid = broker.pid
        assert pid is not None
        pub = MqttTransport("bp-stall", broker.host, broker.port, max_buffered_messages=1, full_wait_s=0.3,
                            keepalive_s=60)
        try:
            pub.connect(timeout_s=10.0)
            os.kill(pid, signal.SIGSTOP)
            try:
                pub.publish("t/stall", b"first", qos=1)
                t0 = time.monotonic()
                with pytest.raises(OfflineBufferFull) as err:
                    pub.publish("t/stall", b"second", qos=1)
                waited = time.monotonic() - t0
                assert pub.connected and pub.buffered == (1, len(b"first"))
            finally:
                os.kill(pid, signal.SIGCONT)
            assert waited >= 0.3  # it waited its full_wait_s before giving up
            assert "1 messages (5 bytes) wait for acknowledgement (link up, 0.3 s waited for room)" in str(err.value)
            pub.publish("t/stall", b"third", qos=1, wait_s=10.0)
            assert pub.buffered[0] == 0 and pub.full_waits >= 1
        finally:
            pub.close()


def test_a_message_that_no_acknowledgement_can_make_room_for_fails_at_once(tmp_path: Path) -> None:
    """A 100-byte QoS 1 message with ``max_buffered_bytes`` 10 and nothing awaiting its PUBACK:
    no acknowledgement can ever make room, so the publish raises at once (``full_waits`` stays 0,
    the message says nothing of a wait), naming the message's size; nothing reaches the broker."""
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        pub = MqttTransport("bp-big", broker.host, broker.port, max_buffered_bytes=10, full_wait_s=5.0)
        try:
            pub.connect(timeout_s=10.0)
            with pytest.raises(OfflineBufferFull) as err:
                pub.publish("t/big", b"x" * 100, qos=1)
            assert pub.full_waits == 0 and pub.buffered == (0, 0)
            text = str(err.value)
            assert "no room for a 100-byte message" in text and "waited" not in text
            assert "0 messages (0 bytes) wait for acknowledgement (link up)" in text
        finally:
            pub.close()


def test_full_wait_s_below_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="full_wait_s must be >= 0 seconds, got -1"):
        MqttTransport("bp-bad", "127.0.0.1", 1, full_wait_s=-1)
