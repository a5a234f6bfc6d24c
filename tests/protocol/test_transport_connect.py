"""MqttTransport.connect against a real broker: descriptors above select()'s 1024, retries with a
jittered backoff (a broker started late, one that never answers), and a refusal that is not retried."""

from __future__ import annotations

import gc
import logging
import os
import random
import resource
import socket
from pathlib import Path

import pytest

from broker_server.embedded_broker import EmbeddedBroker
from protocol.errors import ConnectError, FieldError
from protocol.transport import ConnectRetry, MqttTransport
from tests.helpers.brokers import require_mosquitto


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_HARD_FILES = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
_WANT_FILES = 1400


@pytest.mark.skipif(_HARD_FILES != resource.RLIM_INFINITY and _HARD_FILES < _WANT_FILES,
                    reason=f"needs a hard open-files limit of at least {_WANT_FILES} to put a socket above "
                           f"descriptor 1023; this machine's is {_HARD_FILES} (raise it with ulimit -Hn)")
def test_a_client_whose_socket_is_above_descriptor_1023_connects_and_exchanges(tmp_path: Path) -> None:
    """paho's select() cannot watch descriptor 1024 or above; the transport's poll() loop can: with
    1,100 descriptors held first, the client's socket lands above 1023 and a message goes round.
    A descriptor below that another thread of the worker closes meanwhile (an earlier test's
    object collected) would take the socket: the holes are filled again and the client connects
    anew (the check that the socket is above 1023 stays)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _WANT_FILES
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    held: list[int] = []
    tr = None
    try:
        with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
            for _ in range(5):
                gc.collect()  # what is to be closed is closed before the holes are filled
                while not held or held[-1] < 1100:  # the lowest free descriptor each time: holes first
                    held.append(os.open(os.devnull, os.O_RDONLY))
                tr = MqttTransport("high-fd", broker.host, broker.port)
                tr.connect(timeout_s=10.0)
                sock = tr._client.socket()
                if sock is not None and sock.fileno() > 1023:
                    break
                tr.close()
                held.append(os.open(os.devnull, os.O_RDONLY))  # a hole was taken: fill again from here
            assert sock is not None and sock.fileno() > 1023  # the case select() could not serve
            tr.subscribe(["t/high-fd"])
            tr.publish("t/high-fd", b"\x00payload\xff", wait_s=10.0)
            got = tr.get(10.0)
            assert got is not None and (got.topic, got.payload) == ("t/high-fd", b"\x00payload\xff")
    finally:
        if tr is not None:
            tr.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_connect_retries_with_the_jittered_delay_until_a_late_broker_is_up(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing listens at the first attempt; the broker is started while the transport waits its
    first backoff; the second attempt connects. The wait is the policy's full-jitter draw:
    uniform(0, min(cap, base · 2^0)) from a generator seeded as the policy says."""
    port = _free_port()
    broker = EmbeddedBroker(port=port, workdir=tmp_path / "broker")
    seen: list[tuple[int, ConnectError, float]] = []

    def start_broker(attempt: int, exc: ConnectError, delay: float) -> None:
        seen.append((attempt, exc, delay))
        if attempt == 1:
            broker.start()

    tr = MqttTransport("late-broker", "127.0.0.1", port)
    retry = ConnectRetry(attempts=4, base_s=0.3, cap_s=2.0, seed=11)
    try:
        with caplog.at_level(logging.WARNING, logger="protocol.transport"):
            tr.connect(timeout_s=10.0, retry=retry, on_retry=start_broker)
        assert tr.connected and tr.connect_attempts == 2
        expected = random.Random(11).uniform(0.0, 0.3)  # retry 1: bound min(2.0, 0.3 · 2^0)
        assert tr.connect_delays == [expected]
        assert [(a, e.transient, d) for a, e, d in seen] == [(1, True, expected)]
        assert "cannot reach the MQTT broker" in str(seen[0][1])
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("connect attempt 1 of 4 failed" in w and f"{expected:.2f} s" in w for w in warnings), warnings
    finally:
        tr.close()
        broker.stop()


def test_connect_gives_up_after_its_attempts_when_no_connack_comes() -> None:
    """A listener that accepts TCP and never answers the CONNECT: every attempt waits its
    timeout, the waits between them follow the policy (retry k bounded by base · 2^(k−1)), and the
    error after the last says how many were made."""
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)  # the kernel completes the handshakes; nobody reads
        port = mute.getsockname()[1]
        tr = MqttTransport("mute-broker", "127.0.0.1", port, mqtt_version="3.1.1")
        retry = ConnectRetry(attempts=3, base_s=0.05, cap_s=0.08, seed=5)
        with pytest.raises(ConnectError) as caught:
            tr.connect(timeout_s=0.3, retry=retry)
        tr.close()
    rng = random.Random(5)
    expected = [rng.uniform(0.0, 0.05), rng.uniform(0.0, 0.08)]  # min(cap, base · 2^(k-1)) for k = 1, 2
    assert tr.connect_delays == expected
    assert caught.value.attempts == 3 and caught.value.transient
    assert "no CONNACK" in str(caught.value) and "gave up after 3 attempts" in str(caught.value)


def test_a_refused_login_fails_at_once_whatever_the_retry_policy(tmp_path: Path) -> None:
    """Mosquitto with anonymous access off answers CONNACK "Not authorized": not a cause that
    passes by itself, so one attempt, no wait, the refusal named."""
    require_mosquitto()
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "broker",
                        extra_config=["allow_anonymous false"]) as broker:
        tr = MqttTransport("no-login", broker.host, broker.port)
        with pytest.raises(ConnectError) as caught:
            tr.connect(timeout_s=10.0, retry=ConnectRetry(attempts=5, base_s=0.5, cap_s=1.0, seed=1))
        tr.close()
    assert caught.value.attempts == 1 and not caught.value.transient
    assert tr.connect_delays == []
    assert "not authori" in str(caught.value).lower()


@pytest.mark.parametrize("kwargs", [{"attempts": 0}, {"base_s": 0.0}, {"base_s": 2.0, "cap_s": 1.0}])
def test_connect_retry_refuses_values_out_of_range(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="ConnectRetry"):
        ConnectRetry(**kwargs)


def test_one_device_id_in_two_federations_makes_two_mqtt_clients(tmp_path: Path) -> None:
    """A device id in two federations on one broker gets two MQTT client ids
    (:func:`protocol.topics.mqtt_client_id`), so neither evicts the other: after the second
    connects, the first still receives what the second publishes. (Under one client id the broker
    disconnects the first on the second's CONNECT: checked by hand, the first then receives
    nothing.)"""
    from helpers.waiting import subscribed

    from protocol.topics import mqtt_client_id

    with pytest.raises(FieldError, match="federation 'a/b' is not a valid topic level"):
        mqtt_client_id("a/b", "pi-07")
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        first = MqttTransport(mqtt_client_id("trial-a", "pi-07"), broker.host, broker.port)
        second = MqttTransport(mqtt_client_id("trial-b", "pi-07"), broker.host, broker.port)
        try:
            first.connect(timeout_s=10.0)
            subscribed(first, "t/two-federations")
            second.connect(timeout_s=10.0)
            second.publish("t/two-federations", b"from trial-b", wait_s=10.0)
            got = first.get(10.0)
            assert got is not None and got.payload == b"from trial-b"
            assert first.connected and second.connected
        finally:
            first.close()
            second.close()
