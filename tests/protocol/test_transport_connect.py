"""MqttTransport.connect against a real broker: descriptors above select()'s 1024, retries with a
jittered backoff (a broker started late, one that never answers), a refusal that is not retried,
and messages published while connect replaces its paho client (the MQTT 5 trial's fallback to
3.1.1, a retry) that must go out on the new client."""

from __future__ import annotations

import gc
import logging
import os
import random
import resource
import socket
import threading
import time
from pathlib import Path

import pytest
from helpers.waiting import subscribed, wait_for

from broker_server.embedded_broker import EmbeddedBroker
from protocol import transport
from protocol.errors import ConnectError, FieldError
from protocol.mqtt_bytes import MQTT_V311, publish_size
from protocol.transport import ConnectRetry, MqttTransport
from tests.helpers.brokers import password_file, require_mosquitto


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
    assert "did not accept the MQTT 3.1.1 connection of " in str(caught.value)  # a timeout waited out: named
    assert " within 0.3 s (no CONNACK); the broker may be overloaded or still starting" in str(caught.value)


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
    assert str(caught.value) == (  # no login given: the hint says the broker asks for one
        f"the MQTT broker at 127.0.0.1:{broker.port} refused the connection of 'no-login': Not authorized (MQTT 5 "
        "CONNACK reason code 0x87); the broker asks for a login and none was given: pass a user name and password "
        "(--username/--password-file, or USER:PASSWORD@ in the --broker URL)")


@pytest.mark.parametrize(("level", "code", "name", "said"), [
    ("5", 0x87, "Not authorized", "Not authorized (MQTT 5 CONNACK reason code 0x87)"),
    ("5", 0x86, "Bad user name or password", "Bad user name or password (MQTT 5 CONNACK reason code 0x86)"),
    ("3.1.1", 0x87, "Not authorized", "Not authorized (MQTT 3.1.1 CONNACK return code 5)"),
    ("3.1.1", 0x86, "Bad user name or password", "Bad user name or password (MQTT 3.1.1 CONNACK return code 4)"),
    ("3.1.1", 0x88, "Server unavailable", "Server unavailable (MQTT 3.1.1 CONNACK return code 3)"),
    ("3.1.1", 0x85, "Client identifier not valid", "Client identifier not valid (MQTT 3.1.1 CONNACK return code 2)"),
    ("3.1.1", 0x84, "Unsupported protocol version",
     "Unsupported protocol version (MQTT 3.1.1 CONNACK return code 1)"),
    ("3.1.1", 0x80, "Unspecified error", "Unspecified error (MQTT 3.1.1 CONNACK return code above 5, reserved)"),
])
def test_a_refusal_names_an_mqtt_311_return_code_not_a_reason_code(level: str, code: int, name: str,
                                                                    said: str) -> None:
    """paho 2.x reports an MQTT 3.1.1 CONNACK return code as an MQTT 5 reason code (5 Not
    authorized as 0x87): the message names the code the broker sent, as its protocol level has it."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.reasoncodes import ReasonCode

    assert ReasonCode(PacketTypes.CONNACK, name).value == code  # paho's name of that code
    where = "the MQTT broker at h:1"
    text = transport._refusal_text(where, "c", level, code, name)
    assert text.startswith(f"{where} refused the ") and f": {said}; " in text
    if code in (0x86, 0x87):
        assert text.endswith("check the user name and password it was given (neither is shown here) and the "
                             "broker's password file and ACL")
        assert transport._refusal_text(where, "c", level, code, name, login=False) == (
            f"{where} refused the connection of 'c': {said}; the broker asks for a login and none was given: pass a "
            "user name and password (--username/--password-file, or USER:PASSWORD@ in the --broker URL)")


@pytest.mark.parametrize("version", ["5", "3.1.1"])
def test_a_wrong_password_is_said_as_the_brokers_refusal_without_a_timeout_or_the_login(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, version: str) -> None:
    """Mosquitto with a password file refuses a wrong password in its CONNACK at once: the error
    says the broker refused the login, with the CONNACK's reason, and names no time limit it did
    not wait out; neither the user name nor the password is in it or in the log. (Mosquitto 2
    answers a wrong password with Not authorized under both protocol levels.)"""
    require_mosquitto()
    caplog.set_level(logging.DEBUG)
    pw = password_file(tmp_path / "passwd", "fleet-op", "s3cret-pw")
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "broker",
                        extra_config=[f"password_file {pw}", "allow_anonymous false"]) as broker:
        good = MqttTransport("good-login", broker.host, broker.port, mqtt_version=version, username="fleet-op",
                             password="s3cret-pw")
        good.connect(timeout_s=30.0)
        good.close()
        tr = MqttTransport("bad-login", broker.host, broker.port, mqtt_version=version, username="fleet-op",
                           password="wrong-pw")
        t0 = time.monotonic()
        with pytest.raises(ConnectError) as caught:
            tr.connect(timeout_s=30.0)
        waited = time.monotonic() - t0
        tr.close()
    code = "reason code 0x87" if version == "5" else "return code 5"  # MQTT 3.1.1's CONNACK has return codes 0-5
    assert str(caught.value) == (
        f"the MQTT broker at 127.0.0.1:{broker.port} refused the login of 'bad-login': Not authorized (MQTT {version} "
        f"CONNACK {code}); check the user name and password it was given (neither is shown here) "
        "and the broker's password file and ACL")
    assert waited < 15.0 and not caught.value.transient  # not the 30 s timeout: the CONNACK's answer
    said = [str(caught.value), *(r.getMessage() for r in caplog.records)]
    assert [t for t in said if "fleet-op" in t or "s3cret" in t or "wrong-pw" in t or "within" in t] == []


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


def _outcomes(tr: MqttTransport) -> list[tuple[object, str]]:
    seen: list[tuple[object, str]] = []
    tr.set_delivery_listener(lambda handle, outcome, reason: seen.append((handle, outcome)))
    return seen


def test_a_publish_after_the_refused_mqtt5_trial_goes_out_on_the_3_1_1_connection(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` against amqtt (MQTT 3.1.1 only): the MQTT 5 trial is refused, its socket closed,
    and the paho client is replaced by a 3.1.1 one. Another thread publishes in between (forced:
    the replacement waits for that publish to return). The message was queued on the MQTT 5 client,
    and was lost with it: no error, never sent, no outcome, and its bytes held in the offline buffer
    for good. It must be moved to the 3.1.1 client and sent after its CONNACK."""
    monkeypatch.setattr(transport, "_V311_ONLY", set())
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        sub = MqttTransport("fallback-sub", broker.host, broker.port, mqtt_version="3.1.1")
        tr = MqttTransport("fallback-pub", broker.host, broker.port)
        outcomes = _outcomes(tr)
        handles: list[object] = []
        replace = tr._replace_client

        def publish_then_replace(version: int) -> None:  # the trial's socket is closed already
            assert not tr.connected and tr._client.socket() is None
            other = threading.Thread(target=lambda: handles.append(tr.publish("t/fallback", b"between", qos=1)))
            other.start()
            other.join()
            replace(version)

        monkeypatch.setattr(tr, "_replace_client", publish_then_replace)
        try:
            sub.connect(timeout_s=10.0)
            subscribed(sub, "t/fallback")
            tr.connect(timeout_s=10.0)
            assert tr.mqtt_version == MQTT_V311 and len(handles) == 1
            _arrived_once(tr, sub, b"between", handles, outcomes)
            assert outcomes[0] == (handles[0], "resized")  # moved: its PUBLISH is 1 byte smaller under 3.1.1
        finally:
            tr.close()
            sub.close()


def _arrived_once(tr: MqttTransport, sub: MqttTransport, payload: bytes, handles: list[object],
                  outcomes: list) -> None:
    """The one message published (its handle in ``handles``) reached ``sub`` with ``payload``,
    was acknowledged, and left nothing in ``tr``'s offline buffer (a ``resized`` report, for a
    message moved from the MQTT 5 client, is no outcome)."""
    got = sub.get(10.0)
    assert got is not None and got.payload == payload
    assert wait_for(lambda: [o for o in outcomes if o[1] != "resized"] == [(handles[0], "acked")], 10.0), outcomes
    assert tr.buffered == (0, 0)

def test_a_publish_inside_paho_when_the_client_is_replaced_goes_out_on_the_new_client(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The narrower interleaving: a publish has taken the MQTT 5 client and is inside its paho
    ``publish`` (held there by an event) when the trial fails and the replacement begins. The
    replacement must not swap the client under it: the publish completes on the old client first
    and its message is moved to the 3.1.1 client, or it lands on the new one; either way it is sent."""
    monkeypatch.setattr(transport, "_V311_ONLY", set())
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        sub = MqttTransport("inside-sub", broker.host, broker.port, mqtt_version="3.1.1")
        tr = MqttTransport("inside-pub", broker.host, broker.port)
        outcomes = _outcomes(tr)
        old = tr._client
        real_publish = old.publish
        inside, go = threading.Event(), threading.Event()

        def held_publish(*args, **kwargs):  # the publisher holds the MQTT 5 client here
            inside.set()
            assert go.wait(30.0)
            return real_publish(*args, **kwargs)

        old.publish = held_publish  # type: ignore[method-assign]
        replace = tr._replace_client

        def release_then_replace(version: int) -> None:
            assert inside.wait(30.0)  # the publish is inside the old client's paho publish
            go.set()
            replace(version)

        monkeypatch.setattr(tr, "_replace_client", release_then_replace)
        handles: list[object] = []
        publisher = threading.Thread(target=lambda: handles.append(tr.publish("t/inside", b"inside", qos=1)))
        try:
            sub.connect(timeout_s=10.0)
            subscribed(sub, "t/inside")
            publisher.start()
            assert inside.wait(30.0)
            tr.connect(timeout_s=10.0)
            publisher.join(30.0)
            assert tr._client is not old and tr.mqtt_version == MQTT_V311 and len(handles) == 1
            _arrived_once(tr, sub, b"inside", handles, outcomes)
        finally:
            go.set()
            tr.close()
            sub.close()


def test_publishes_before_connect_and_between_its_retries_are_sent_after_it(tmp_path: Path) -> None:
    """ConnectRetry replaces the paho client before each retry. A message published before
    :meth:`connect` (the link is down: paho queues it) and one published in ``on_retry`` (after the
    failed attempt, before the replacement) sat on the replaced client and were lost silently;
    both must go out once the retry connects, in order, and be acknowledged."""
    port = _free_port()
    broker = EmbeddedBroker(port=port, workdir=tmp_path / "broker")
    tr = MqttTransport("retry-pub", "127.0.0.1", port, mqtt_version="3.1.1")
    outcomes = _outcomes(tr)
    handles = [tr.publish("t/retry", b"before connect", qos=1)]
    sub: MqttTransport | None = None

    def publish_and_start_broker(attempt: int, exc: ConnectError, delay: float) -> None:
        handles.append(tr.publish("t/retry", b"between attempts", qos=1))
        nonlocal sub
        broker.start()
        sub = MqttTransport("retry-sub", "127.0.0.1", port)
        sub.connect(timeout_s=10.0)
        subscribed(sub, "t/retry")

    try:
        tr.connect(timeout_s=10.0, retry=ConnectRetry(attempts=3, base_s=0.01, cap_s=0.01, seed=3),
                   on_retry=publish_and_start_broker)
        assert tr.connect_attempts == 2 and sub is not None
        got = [sub.get(10.0) for _ in range(2)]
        assert [g.payload if g is not None else None for g in got] == [b"before connect", b"between attempts"]
        assert wait_for(lambda: len(outcomes) == 2, 10.0), outcomes
        assert outcomes == [(h, "acked") for h in handles]
        assert tr.buffered == (0, 0)
    finally:
        tr.close()
        if sub is not None:
            sub.close()
        broker.stop()


def _nothing_left(tr: MqttTransport) -> None:
    """After close(): not connected, no socket, no paho thread of this transport alive."""
    assert not tr.connected and tr._client.socket() is None
    alive = [t.name for t in threading.enumerate() if t.name == f"paho-mqtt-client-{tr.client_id}"]
    assert alive == []


def test_close_as_the_mqtt5_trial_falls_back_ends_connect_and_sends_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` against amqtt: the MQTT 5 trial is refused, and another thread closes the
    transport before the 3.1.1 client replaces the trial's (forced: the replacement waits for that
    close to return). Before the fix connect() went on, connected with 3.1.1 and returned: a
    transport closed by its owner, connected, with a live paho thread and socket, and sending the
    message published before connect(). It must raise ("closed while connecting"), make no 3.1.1
    connection, leave no thread or socket, and report the never-sent message ``dropped``."""
    monkeypatch.setattr(transport, "_V311_ONLY", set())
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        tr = MqttTransport("close-trial", broker.host, broker.port)
        outcomes = _outcomes(tr)
        handle = tr.publish("t/close", b"before connect", qos=1)
        trial = tr._client
        replace = tr._replace_client

        def close_then_replace(version: int) -> None:
            closer = threading.Thread(target=tr.close)
            closer.start()
            closer.join(30.0)
            replace(version)

        monkeypatch.setattr(tr, "_replace_client", close_then_replace)
        with pytest.raises(ConnectError, match="closed while connecting") as caught:
            tr.connect(timeout_s=10.0)
        assert not caught.value.transient
        assert tr._client is trial and tr.connects == 0  # no 3.1.1 client, no connection
        _nothing_left(tr)
        assert outcomes == [(handle, "dropped")]


def test_close_during_the_mqtt5_trial_wait_ends_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    """A listener that accepts TCP and never answers: ``auto`` waits for the MQTT 5 CONNACK. A
    close() from another thread while it waits ends connect() with "closed while connecting"
    (before the fix connect() waited out the trial, then tried MQTT 3.1.1 until its timeout, with a
    client started after the close), with no thread or socket left."""
    monkeypatch.setattr(transport, "_V311_ONLY", set())
    box: dict[str, BaseException] = {}
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)  # the kernel completes the handshakes; nobody reads
        tr = MqttTransport("close-mute", "127.0.0.1", mute.getsockname()[1])

        def run() -> None:
            try:
                tr.connect(timeout_s=60.0)
            except BaseException as exc:  # noqa: BLE001 (the test looks at it)
                box["error"] = exc

        connector = threading.Thread(target=run)
        connector.start()
        assert wait_for(lambda: tr._client.socket() is not None, 10.0)  # the trial's CONNECT is out
        tr.close()
        connector.join(30.0)
        assert not connector.is_alive()
    error = box.get("error")
    assert isinstance(error, ConnectError) and "closed while connecting" in str(error), error
    assert tr.mqtt_version == transport.MQTT_V5  # no fallback was tried
    _nothing_left(tr)


def test_close_between_connect_retries_ends_connect_and_the_queued_message_is_never_sent(tmp_path: Path) -> None:
    """ConnectRetry with nothing listening; after the first failed attempt the transport is
    closed and the broker started (in ``on_retry``). Before the fix connect() slept, replaced the
    client, connected to the broker and sent the message published before the close. It must
    raise ("closed while connecting"), never connect (no socket byte), and report the message
    ``dropped``."""
    port = _free_port()
    broker = EmbeddedBroker(port=port, workdir=tmp_path / "broker")
    tr = MqttTransport("close-retry", "127.0.0.1", port, mqtt_version="3.1.1")
    outcomes = _outcomes(tr)
    handle = tr.publish("t/close", b"published before close", qos=1)

    def close_and_start_broker(attempt: int, exc: ConnectError, delay: float) -> None:
        tr.close()
        broker.start()

    try:
        with pytest.raises(ConnectError, match="closed while connecting"):
            tr.connect(timeout_s=10.0, retry=ConnectRetry(attempts=5, base_s=0.01, cap_s=0.01, seed=1),
                       on_retry=close_and_start_broker)
        assert tr.connect_attempts == 1 and tr.socket_bytes == (0, 0)
        _nothing_left(tr)
        assert outcomes == [(handle, "dropped")]
    finally:
        broker.stop()


def test_a_message_moved_from_the_mqtt5_trial_is_ledgered_at_its_mqtt_3_1_1_size(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A channel sends before connect(): its row is sized for MQTT 5, the level the transport
    starts with. amqtt refuses MQTT 5; the message moves to the 3.1.1 client and goes out one byte
    smaller (no property length). The transport reports it ``resized`` and the channel corrects
    the row: the ledger's sent bytes (the update, the CONNECTs, the DISCONNECT) are the socket's
    and the relay's. Before the fix the ledger had one byte more."""
    import numpy as np

    from protocol.channel import Channel
    from protocol.ledger import Ledger
    from protocol.messages import Update
    from tools.counting_relay import CountingRelay

    monkeypatch.setattr(transport, "_V311_ONLY", set())
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        tr = MqttTransport("fedfleet-moved-1", "127.0.0.1", relay.port)
        ledger = Ledger(tmp_path / "ledger.sqlite")
        ch = Channel(tr, node_id="moved-1", side="agent", federation="fed", ledger=ledger, qos=1)
        try:
            ch.send("fedfleet/v1/fed/up/moved-1/update", Update(tensors=(np.arange(8, dtype=np.float32),),
                    num_samples=1, train_loss=0.1, metrics={}), round=1)
            tr.connect(timeout_s=10.0)
            assert tr.mqtt_version == MQTT_V311
            assert wait_for(lambda: ch.acked == 1, 10.0)
        finally:
            ch.close()
            relay.close()
        ledger.flush()
        rows = ledger.rows()
        ledger.close()
    sent = sum(r.mqtt_header_bytes + r.topic_bytes + r.payload_bytes for r in rows if r.event == "sent")
    assert sent == tr.socket_bytes[0] == relay.total_bytes("up")
    (row,) = [r for r in rows if r.kind == "update"]
    assert row.mqtt_header_bytes == publish_size(row.topic, row.payload_bytes, 1, protocol=MQTT_V311).header_bytes


def test_subscribe_takes_one_filter_or_several_and_refuses_an_invalid_one() -> None:
    """A string is one filter (it used to be taken as a list of its characters: ``"status/#"``
    subscribed to ``s``, ``t`` … and ``#``, every topic); an invalid filter or QoS is refused
    before any is kept, as the memory transport refuses them."""
    tr = MqttTransport("subscriber", "127.0.0.1", 1, mqtt_version="3.1.1")
    tr.subscribe("status/#")
    tr.subscribe(["a/+/c", "d"], qos=0)
    assert tr._filters == {"status/#": 1, "a/+/c": 0, "d": 0}
    for bad in (["e", "a/#/b"], ["x+"], [""]):
        with pytest.raises(ValueError, match="topic filter"):
            tr.subscribe(bad)
    with pytest.raises(ValueError, match="QoS must be 0, 1 or 2"):
        tr.subscribe(["f"], qos=3)
    assert tr._filters == {"status/#": 1, "a/+/c": 0, "d": 0}


def test_subscribe_refuses_a_filter_mqtt_cannot_carry_and_the_next_connect_is_not_broken(tmp_path: Path) -> None:
    """A filter is a UTF-8 string of at most 65,535 bytes (MQTT 3.1.1 §1.5.3): one of 65,536
    bytes, and one with a lone surrogate (no UTF-8 form), are refused as the wildcard misuses are,
    before any is kept. Before, they passed the check and were kept: paho refused them only as it
    subscribed, on the CONNACK, and its network thread died there: connect() waited its 10 s and
    raised "no CONNACK" (with the link up, subscribe raised but kept the filter for the reconnects)."""
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        tr = MqttTransport("subscriber", "127.0.0.1", broker.port, mqtt_version="3.1.1")
        tr.subscribe("ok/#")
        for bad in ("a" * 65_536, ["b", "st\ud800/x"]):
            with pytest.raises(ValueError, match="topic filter"):
                tr.subscribe(bad)
        tr.subscribe("é" * 32_767 + "z")  # 65,535 bytes: the most a filter takes
        assert list(tr._filters) == ["ok/#", "é" * 32_767 + "z"]
        try:
            tr.connect(timeout_s=10.0)
            assert tr.connected
        finally:
            tr.close()
