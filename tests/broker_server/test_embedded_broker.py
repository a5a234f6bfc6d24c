"""Integration tests of broker_server.embedded_broker against real brokers (Mosquitto and amqtt).

Every broker test runs for each kind through the ``broker_kind`` fixture (conftest.py): Mosquitto
is skipped when its binary is missing, except with CI=true, where that is a failure. Clients are
paho-mqtt 2.x, ``CallbackAPIVersion.VERSION2``, MQTT 3.1.1; every test uses its own topics.
"""

from __future__ import annotations

import gc
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from helpers.brokers import require_mosquitto

from broker_server import embedded_broker as eb_module
from broker_server.embedded_broker import (
    BrokerAddress,
    EmbeddedBroker,
    mosquitto_available,
    parse_broker_url,
)
from broker_server.errors import BrokerStartError, FedfleetServerError
from protocol.broker_url import shown_broker_url

REPO_ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 30.0  # a bound on waits for what must come (never on what must not): generous for a loaded machine


# --------------------------------------------------------------------------------------------
# helpers


class Client:
    """A paho client on a network thread that records CONNACKs, SUBACKs, messages and disconnects."""

    def __init__(self, port: int, *, will_topic: str | None = None,
                 reconnect_delay_s: int = 1) -> None:
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.connacks: queue.Queue[mqtt.ReasonCode] = queue.Queue()
        self.subacks: queue.Queue[int] = queue.Queue()
        self.disconnects: queue.Queue[object] = queue.Queue()
        self.resubscribe: list[str] = []
        self.paho = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                client_id=f"fedfleet-test-{uuid.uuid4().hex[:12]}",
                                protocol=mqtt.MQTTv311, clean_session=True)
        self.paho.reconnect_delay_set(reconnect_delay_s, reconnect_delay_s)
        if will_topic is not None:
            self.paho.will_set(will_topic, b"offline", qos=1)
        self.paho.on_connect = self._on_connect
        self.paho.on_subscribe = lambda _c, _u, mid, _rcs, _p: self.subacks.put(mid)
        self.paho.on_message = lambda _c, _u, msg: self.messages.put(msg)
        self.paho.on_disconnect = lambda _c, _u, _f, rc, _p: self.disconnects.put(rc)
        self.port = port

    def _on_connect(self, client, _userdata, _flags, reason_code, _props) -> None:
        self.connacks.put(reason_code)
        for topic in self.resubscribe:  # the broker keeps no subscriptions across a restart
            client.subscribe(topic, qos=1)

    def connect(self) -> Client:
        self.paho.connect("127.0.0.1", self.port, keepalive=30)
        self.paho.loop_start()
        reason = self.connacks.get(timeout=WAIT_S)
        assert not reason.is_failure, reason
        return self

    def subscribe(self, topic: str) -> None:
        _rc, mid = self.paho.subscribe(topic, qos=1)
        assert self.subacks.get(timeout=WAIT_S) == mid

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        info = self.paho.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(timeout=WAIT_S)
        assert info.is_published(), "no PUBACK in time"  # wait_for_publish does not raise

    def close(self) -> None:
        self.paho.disconnect()
        self.paho.loop_stop()


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    """A list the test appends its clients to; all are disconnected afterwards."""
    made: list[Client] = []
    yield made
    for client in made:
        client.close()


@pytest.fixture
def topic() -> str:
    """A topic no other test uses."""
    return f"fedfleet/test/{uuid.uuid4().hex}"


def _process_gone(pid: int) -> bool:
    """True when no process ``pid`` exists, or it is a zombie waiting for someone else to reap it."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _broker_children_of(pid: int) -> list[int]:
    """Live child processes of ``pid`` that are brokers or broker watchdogs (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, ppid = fields[0], int(fields[1])
        if ppid == pid and state != "Z" and re.search(
                r"mosquitto|_amqtt_child|fedfleet-broker-watchdog", cmdline):
            found.append(int(entry))
    return found


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """One line from ``proc.stdout`` (text mode), or "" when none arrives in ``timeout_s`` s."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline().strip() if ready else ""


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def _occupied_port() -> socket.socket:
    """A listening socket on a free 127.0.0.1 port (close it when done)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


# --------------------------------------------------------------------------------------------
# MQTT behaviour through the embedded broker


def test_qos1_publish_delivers_exact_bytes(embedded_broker, clients, topic):
    assert embedded_broker.host == "127.0.0.1"
    assert embedded_broker.url == f"mqtt://127.0.0.1:{embedded_broker.port}"
    assert parse_broker_url(embedded_broker.url) == BrokerAddress("mqtt", "127.0.0.1",
                                                                  embedded_broker.port)
    sub = Client(embedded_broker.port).connect()
    pub = Client(embedded_broker.port).connect()
    clients += [sub, pub]
    sub.subscribe(topic)
    payload = bytes(range(256)) * 64 + b"\x00\xff\x00"  # 16,387 bytes, every byte value

    pub.publish(topic, payload)

    msg = sub.messages.get(timeout=WAIT_S)
    assert (msg.topic, msg.qos, msg.retain) == (topic, 1, False)
    assert msg.payload == payload


def test_retained_message_reaches_late_subscriber(embedded_broker, clients, topic):
    pub = Client(embedded_broker.port).connect()
    clients.append(pub)
    pub.publish(topic, b"round-manifest-7", retain=True)

    late = Client(embedded_broker.port).connect()
    clients.append(late)
    late.subscribe(topic)

    msg = late.messages.get(timeout=WAIT_S)
    assert msg.payload == b"round-manifest-7"
    assert msg.retain


_WILL_CHILD = textwrap.dedent("""
    import sys
    import paho.mqtt.client as mqtt
    port, topic = int(sys.argv[1]), sys.argv[2]
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=sys.argv[3], protocol=mqtt.MQTTv311)
    c.will_set(topic, b"offline", qos=1)
    c.on_connect = lambda *args: print("connected", flush=True)
    c.connect("127.0.0.1", port, keepalive=60)
    c.loop_forever()
""")


def test_last_will_delivered_when_client_process_is_killed(embedded_broker, clients, topic):
    watcher = Client(embedded_broker.port).connect()
    clients.append(watcher)
    watcher.subscribe(topic)
    child = subprocess.Popen(
        [sys.executable, "-c", _WILL_CHILD, str(embedded_broker.port), topic,
         f"fedfleet-test-will-{uuid.uuid4().hex[:8]}"],
        stdout=subprocess.PIPE, text=True, env=_child_env())
    try:
        assert _read_line(child, WAIT_S) == "connected"
        assert watcher.messages.empty()

        child.send_signal(signal.SIGKILL)  # TCP FIN without an MQTT DISCONNECT
        child.wait(timeout=WAIT_S)

        msg = watcher.messages.get(timeout=WAIT_S)
        assert (msg.topic, msg.payload) == (topic, b"offline")
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


# --------------------------------------------------------------------------------------------
# lifecycle


def test_restart_and_kill_keep_the_port_and_clients_reconnect(embedded_broker, clients, topic):
    port = embedded_broker.port
    client = Client(port, reconnect_delay_s=1).connect()
    clients.append(client)
    client.resubscribe.append(topic)
    client.subscribe(topic)

    for crash in (False, True):
        old_pid = embedded_broker.pid
        if crash:
            embedded_broker.kill()
            assert not embedded_broker.is_running()
            assert _process_gone(old_pid)
        embedded_broker.restart()

        assert embedded_broker.is_running()
        assert embedded_broker.port == port
        assert embedded_broker.pid != old_pid
        assert client.disconnects.get(timeout=WAIT_S) is not None
        assert not client.connacks.get(timeout=WAIT_S).is_failure  # paho reconnected by itself
        assert client.subacks.get(timeout=WAIT_S) is not None  # resubscribed in on_connect
        payload = f"after restart, crash={crash}".encode()
        client.publish(topic, payload)
        assert client.messages.get(timeout=WAIT_S).payload == payload


def test_stop_leaves_no_process_and_is_idempotent(broker_kind, tmp_path):
    broker = EmbeddedBroker(kind=broker_kind, workdir=tmp_path)
    assert not broker.is_running() and broker.pid is None and broker.port is None
    with pytest.raises(RuntimeError, match="start"):
        _ = broker.url
    broker.start()
    pid = broker.pid
    assert broker.is_running() and not _process_gone(pid)
    assert _broker_children_of(os.getpid())  # the broker and its watchdog

    broker.stop()

    assert not broker.is_running()
    assert _process_gone(pid)
    assert _broker_children_of(os.getpid()) == []  # neither the broker nor its watchdog
    broker.stop()
    broker.kill()  # both idempotent
    assert broker.log_path.is_file() and broker.log_path.parent == tmp_path


def test_garbage_collected_broker_is_stopped_and_its_temp_workdir_removed(broker_kind):
    broker = EmbeddedBroker(kind=broker_kind).start()
    pid, workdir = broker.pid, broker.workdir
    assert workdir.is_dir()

    del broker
    gc.collect()

    assert _process_gone(pid)
    assert not workdir.exists()


_ORPHAN_CHILD = textwrap.dedent("""
    import sys, time
    from broker_server.embedded_broker import EmbeddedBroker
    b = EmbeddedBroker(kind=sys.argv[1], workdir=sys.argv[2]).start()
    print(b.pid, flush=True)
    if sys.argv[3] == "sigkill":
        time.sleep(60)
    # else: exit normally without stop(); the finalizer must stop the broker
""")


@pytest.mark.parametrize("parent_end", ["sigkill", "exit"])
def test_broker_stops_when_its_parent_ends(broker_kind, tmp_path, parent_end):
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_CHILD, broker_kind, str(tmp_path), parent_end],
        stdout=subprocess.PIPE, text=True, env=_child_env())
    try:
        line = _read_line(parent, 15.0)
        assert line.isdigit(), f"child printed {line!r}"
        broker_pid = int(line)

        if parent_end == "sigkill":
            assert not _process_gone(broker_pid)
            parent.send_signal(signal.SIGKILL)  # no atexit, no finalizer: only the watchdog acts
        assert parent.wait(timeout=WAIT_S) == (-signal.SIGKILL if parent_end == "sigkill" else 0)

        assert _wait_until(lambda: _process_gone(broker_pid), WAIT_S), "orphan broker survived"
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_start_fails_when_the_given_port_is_taken(broker_kind, tmp_path):
    with _occupied_port() as sock:
        port = sock.getsockname()[1]
        broker = EmbeddedBroker(kind=broker_kind, port=port, workdir=tmp_path)
        with pytest.raises(BrokerStartError, match="(?i)already in use") as info:
            broker.start(timeout_s=60.0)  # its 3 tries end at the refused bind, well before
    assert isinstance(info.value, FedfleetServerError)
    assert (info.value.kind, info.value.port) == (broker_kind, port)
    assert not broker.is_running()
    assert _broker_children_of(os.getpid()) == []


@pytest.mark.mosquitto
def test_free_port_race_retries_on_a_new_port(tmp_path, monkeypatch):
    require_mosquitto()
    with _occupied_port() as sock:
        taken = sock.getsockname()[1]
        picks = iter([taken, taken])  # lose the race twice, then pick normally
        real_pick = eb_module._pick_free_port
        monkeypatch.setattr(eb_module, "_pick_free_port", lambda: next(picks, None) or real_pick())
        with EmbeddedBroker(kind="mosquitto", workdir=tmp_path) as broker:
            assert broker.port != taken
            assert broker.log_path.read_text().count("--- fedfleet: starting") == 3
            assert "Address already in use" in broker.log_path.read_text()


@pytest.mark.mosquitto
def test_mosquitto_config_and_max_packet_size(tmp_path, clients, topic):
    require_mosquitto()
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path, max_packet_size=1024) as broker:
        conf = (tmp_path / "mosquitto.conf").read_text().splitlines()
        for line in (f"listener {broker.port} 127.0.0.1", "allow_anonymous true",
                     "persistence false", "max_queued_messages 0",
                     "max_queued_bytes 1073741824", "set_tcp_nodelay true",
                     f"log_dest file {broker.log_path}", "max_packet_size 1024"):
            assert line in conf
        client = Client(broker.port).connect()
        clients.append(client)
        client.subscribe(topic)
        client.publish(topic, b"x" * 512)
        assert client.messages.get(timeout=WAIT_S).payload == b"x" * 512
        assert client.disconnects.empty()

        client.paho.publish(topic, b"y" * 2048, qos=0)  # packet > 1024 bytes

        assert client.disconnects.get(timeout=WAIT_S) is not None  # the broker dropped us


@pytest.mark.mosquitto
def test_mosquitto_extra_config_applies_and_start_accepts_a_refusing_broker(tmp_path):
    require_mosquitto()
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path,
                        extra_config=["allow_anonymous false"]) as broker:
        assert "allow_anonymous false" in (tmp_path / "mosquitto.conf").read_text()
        client = Client(broker.port)
        client.paho.connect("127.0.0.1", broker.port)
        client.paho.loop_start()
        try:
            assert client.connacks.get(timeout=WAIT_S).is_failure  # "Not authorized"
        finally:
            client.close()


@pytest.mark.mosquitto
def test_mosquitto_start_error_carries_the_log_tail(tmp_path):
    require_mosquitto()
    broker = EmbeddedBroker(kind="mosquitto", workdir=tmp_path,
                            extra_config=["no_such_option 1"])
    with pytest.raises(BrokerStartError, match="exited with code") as info:
        broker.start()
    assert "no_such_option" in info.value.log_tail
    assert "no_such_option" in str(info.value)
    assert not broker.is_running()


# --------------------------------------------------------------------------------------------
# constructor checks (no broker started)


def test_auto_kind_prefers_mosquitto():
    assert EmbeddedBroker().kind == ("mosquitto" if mosquitto_available() else "amqtt")


def test_amqtt_warns_that_max_packet_size_is_not_enforced(caplog):
    with caplog.at_level("WARNING", logger="broker_server.embedded_broker"):
        broker = EmbeddedBroker(kind="amqtt", max_packet_size=4096)
    assert broker.max_packet_size == 4096
    assert "NOT enforced" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        pytest.param({"kind": "rabbitmq"}, ValueError, "kind must be", id="unknown-kind"),
        pytest.param({"kind": "amqtt", "port": 0}, ValueError, "1..65535", id="port-0"),
        pytest.param({"kind": "amqtt", "port": 70000}, ValueError, "1..65535", id="port-too-big"),
        pytest.param({"kind": "amqtt", "port": "1883"}, TypeError, "port", id="port-str"),
        pytest.param({"kind": "amqtt", "max_packet_size": 19}, ValueError, "max_packet_size",
                     id="packet-too-small"),
        pytest.param({"kind": "amqtt", "max_packet_size": 268_435_461}, ValueError,
                     "max_packet_size", id="packet-too-big"),
        pytest.param({"kind": "amqtt", "extra_config": ["user x"]}, ValueError,
                     "mosquitto.conf", id="extra-config-for-amqtt"),
        pytest.param({"kind": "amqtt", "extra_config": "user x"}, TypeError,
                     "sequence of lines", id="extra-config-str"),
        pytest.param({"kind": "amqtt", "extra_config": ["a\nb"]}, ValueError,
                     "line break", id="extra-config-newline"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        EmbeddedBroker(**kwargs)


def test_kind_mosquitto_without_binary_is_a_start_error(monkeypatch):
    monkeypatch.setattr(eb_module, "_find_mosquitto", lambda: None)
    assert not eb_module.mosquitto_available()
    with pytest.raises(BrokerStartError, match="no mosquitto binary"):
        EmbeddedBroker(kind="mosquitto")
    assert EmbeddedBroker(kind="auto").kind == "amqtt"


# --------------------------------------------------------------------------------------------
# parse_broker_url


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        pytest.param("mqtt://broker.example.com", BrokerAddress("mqtt", "broker.example.com", 1883),
                     id="default-port"),
        pytest.param("mqtts://broker.example.com", BrokerAddress("mqtts", "broker.example.com", 8883),
                     id="tls-default-port"),
        pytest.param("MQTT://Broker.Example.COM:1884/", BrokerAddress("mqtt", "broker.example.com", 1884),
                     id="case-and-trailing-slash"),
        pytest.param("mqtts://alice:s%40cr%3At@10.0.0.5:9999",
                     BrokerAddress("mqtts", "10.0.0.5", 9999, "alice", "s@cr:t"), id="credentials"),
        pytest.param("mqtt://bob@127.0.0.1", BrokerAddress("mqtt", "127.0.0.1", 1883, "bob", None),
                     id="user-only"),
        pytest.param("mqtt://[::1]:1883", BrokerAddress("mqtt", "::1", 1883), id="ipv6"),
        pytest.param("  mqtt://h:1  ", BrokerAddress("mqtt", "h", 1), id="whitespace-port-1"),
        pytest.param("mqtt://h:65535", BrokerAddress("mqtt", "h", 65535), id="port-65535"),
    ],
)
def test_parse_broker_url_valid(url, expected):
    address = parse_broker_url(url)
    assert address == expected
    assert address.tls == (expected.scheme == "mqtts")


@pytest.mark.parametrize(
    ("url", "pattern"),
    [
        pytest.param("http://host:1883", "scheme must be 'mqtt' or 'mqtts'", id="http"),
        pytest.param("ws://host", "scheme must be", id="websocket"),
        pytest.param("host:1883", "forget the 'mqtt://' prefix", id="no-scheme"),
        pytest.param("", "scheme must be", id="empty"),
        pytest.param("mqtt://", "no host", id="no-host"),
        pytest.param("mqtt://:1883", "no host", id="port-only"),
        pytest.param("mqtt://host:abc", "bad port", id="port-not-int"),
        pytest.param("mqtt://host:0", "port 0", id="port-0"),
        pytest.param("mqtt://host:65536", "bad port", id="port-too-big"),
        pytest.param("mqtt://host:1883/fedfleet", "path, query or fragment", id="path"),
        pytest.param("mqtt://host?x=1", "path, query or fragment", id="query"),
        pytest.param("mqtt://:pw@host", "password but no user name", id="password-without-user"),
    ],
)
def test_parse_broker_url_invalid(url, pattern):
    with pytest.raises(ValueError, match=re.escape(pattern) if "'" in pattern else pattern):
        parse_broker_url(url)


def test_parse_broker_url_never_shows_the_password():
    with pytest.raises(ValueError) as info:
        parse_broker_url("http://alice:topsecret@host")
    assert "topsecret" not in str(info.value)
    with pytest.raises(ValueError) as info:
        parse_broker_url("mqtt://alice:topsecret@host:99999")
    assert "topsecret" not in str(info.value)
    assert "topsecret" not in repr(parse_broker_url("mqtt://alice:topsecret@host"))
    with pytest.raises(TypeError):
        parse_broker_url(b"mqtt://host")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        pytest.param("mqtt://127.0.0.1:18833?password=Zq9SECRETpw", "'mqtt://127.0.0.1:18833' has a path, query",
                     id="query"),
        pytest.param("mqtt://h:1/Zq9SECRETpw", "'mqtt://h:1' has a path, query", id="path"),
        pytest.param("mqtts://h#Zq9SECRETpw", "'mqtts://h' has a path, query", id="fragment"),
        pytest.param("mqtt://op:pw@[::1]:1/x?Zq9SECRETpw", "'mqtt://op:***@[::1]:1' has a path, query",
                     id="ipv6-login"),
        pytest.param("http://h/?Zq9SECRETpw", "'http://h': scheme must be", id="scheme-and-query"),
        pytest.param("mqtt://fleet-op:Zq9SECRETpw", "'mqtt://fleet-op:***' has a bad port (not a number)",
                     id="login-without-host"),  # urlsplit reads the password as the port
        pytest.param("fleet-op:Zq9SECRETpw@h", "'fleet-op:***@h': scheme must be 'mqtt' or 'mqtts', got none",
                     id="no-scheme-login"),
    ],
)
def test_parse_broker_url_never_echoes_a_path_query_fragment_or_password(url, shown):
    """The URL's path, query and fragment (``?password=...``) and a port that is not a number are
    never shown in an error: the message says the URL has one, not what it is."""
    with pytest.raises(ValueError) as info:
        parse_broker_url(url)
    text = str(info.value)
    assert shown in text
    assert "Zq9SECRETpw" not in text and "Zq9SECRETpw" not in shown_broker_url(url)


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("mqtt://fleet-op:abc/def@127.0.0.1:18831", id="slash"),  # urlsplit: host 'fleet-op', port 'abc'
        pytest.param("mqtt://fleet-op:S3cr@t:p%w/x@127.0.0.1:18831", id="at-colon-percent-slash"),
        pytest.param("mqtt://fleet-op:ab#cd@h:1", id="hash"),  # urlsplit: the rest is a fragment
        pytest.param("mqtt://fleet-op:ab?cd@h:1", id="question-mark"),  # urlsplit: the rest is a query
        pytest.param("mqtt://fleet-op:12/x@h", id="digits-slash"),  # urlsplit: port 12 and a path
        pytest.param("mqtt://fleet-op:p[x@h:1", id="bracket"),  # urlsplit: "Invalid IPv6 URL"
    ],
)
def test_parse_broker_url_password_not_percent_encoded(url):
    """A password typed with a character a URL must percent-encode is named as such, and never
    shown, not even the part after that character (urlsplit ends the host part there)."""
    password = url.split("fleet-op:", 1)[1].rsplit("@", 1)[0]
    with pytest.raises(ValueError, match="percent-encode") as info:
        parse_broker_url(url)
    text = str(info.value)
    assert "fleet-op:***@" in text
    for piece in {password, *password.replace("@", "/").split("/")} - {""}:
        if len(piece) > 2:
            assert piece not in text, (piece, text)
    assert password not in shown_broker_url(url) and "***" in shown_broker_url(url)


@pytest.mark.parametrize(
    ("url", "password"),
    [
        ("mqtt://fleet-op:S3cr%40t%3Ap%25w%2Fx@127.0.0.1:18831", "S3cr@t:p%w/x"),
        ("mqtt://fleet-op:a@b:c@127.0.0.1:18831", "a@b:c"),  # '@' and ':' typed as they are still parse
    ],
)
def test_parse_broker_url_password_with_special_characters(url, password):
    address = parse_broker_url(url)
    assert (address.username, address.password, address.host, address.port) == ("fleet-op", password,
                                                                                 "127.0.0.1", 18831)
    assert shown_broker_url(url) == "mqtt://127.0.0.1:18831"
