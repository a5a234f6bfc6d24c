"""An MQTT broker run as a child process on 127.0.0.1, for single-machine runs and tests.

``EmbeddedBroker`` starts Mosquitto when its binary is installed (3–6× faster, MQTT 5, shared
subscriptions) and amqtt otherwise (pure Python, a fedfleet dependency, MQTT 3.1.1 only). The
broker always runs in a child process, never in the caller's: amqtt never returns memory and
would share the server's GIL (``notes/mqtt-transport-study.md`` §2.1, §2.3, §8).

Mosquitto gets a generated config (``max_queued_messages 0`` with a ``max_queued_bytes`` cap,
because the default 1000-message queue silently dropped QoS 1 messages in the study;
``set_tcp_nodelay true``; ``persistence false``). amqtt has no maximum packet size and no
config file; ``max_packet_size`` is not enforced there (a warning is logged) and
``extra_config`` is refused.

Also here: ``mosquitto_available()``, and ``parse_broker_url`` (``mqtt://`` / ``mqtts://`` URLs to a
``BrokerAddress``), re-exported from :mod:`protocol.broker_url`.

Cleanup: ``stop()`` terminates and reaps the broker. If the ``EmbeddedBroker`` is garbage
collected or the interpreter exits normally, a ``weakref.finalize`` hook stops it. If the parent
process dies without running Python cleanup (SIGKILL, ``os._exit``), a tiny ``sh`` watchdog
(one per broker, reading a pipe whose write end only the parent holds) sees end-of-file and
sends SIGTERM to the broker. No ``prctl`` is used. The broker runs in its own session/process
group, so a Ctrl-C in the terminal reaches the parent, which then stops the broker in order.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

from protocol.broker_url import BrokerAddress, parse_broker_url  # the URL parser lives in protocol

from .errors import BrokerStartError

__all__ = [
    "BrokerAddress",
    "EmbeddedBroker",
    "mosquitto_available",
    "parse_broker_url",
]

_log = logging.getLogger(__name__)

#: The only address the embedded broker ever binds to.
LOOPBACK_HOST = "127.0.0.1"

#: Default time (seconds) ``start()`` waits for the broker to answer a CONNECT with a CONNACK.
DEFAULT_START_TIMEOUT_S = 10.0

#: Default time (seconds) ``stop()`` waits after SIGTERM before it sends SIGKILL.
DEFAULT_STOP_TIMEOUT_S = 5.0

#: Mosquitto ``max_queued_bytes``: per-client cap (bytes) on queued outgoing QoS 1/2 messages,
#: used together with ``max_queued_messages 0`` (no message-count limit). 1 GiB.
MOSQUITTO_MAX_QUEUED_BYTES = 1 << 30

#: Smallest ``max_packet_size`` Mosquitto accepts (bytes, whole MQTT packet).
MIN_MAX_PACKET_SIZE = 20

#: Largest possible MQTT packet (bytes): 1 fixed-header byte + 4 remaining-length bytes +
#: 268,435,455 bytes of remaining length (MQTT 3.1.1 §2.2.3).
MAX_MAX_PACKET_SIZE = 1 + 4 + 268_435_455

_KINDS = ("auto", "mosquitto", "amqtt")
_START_ATTEMPTS = 3
_POLL_INTERVAL_S = 0.02
_PROBE_TIMEOUT_S = 1.0
_LOG_TAIL_LINES = 40
_LOG_TAIL_CHARS = 4000
_AMQTT_EXIT_ADDRESS_IN_USE = 3  # broker_server._amqtt_child.EXIT_ADDRESS_IN_USE
_SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")


# --------------------------------------------------------------------------------------------
# Broker discovery


def _find_mosquitto() -> str | None:
    """Path of the ``mosquitto`` binary (on PATH, then in the sbin directories), or None."""
    found = shutil.which("mosquitto")
    if found:
        return found
    return shutil.which("mosquitto", path=os.pathsep.join(_SBIN_DIRS))


def mosquitto_available() -> bool:
    """True when a ``mosquitto`` binary is found on PATH or in /usr/sbin, /usr/local/sbin, /sbin."""
    return _find_mosquitto() is not None


def _pick_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it, release it).

    Another process may take it before the broker binds it; ``start()`` retries on that race.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK_HOST, 0))
        return int(sock.getsockname()[1])


def _probe_mqtt(host: str, port: int, timeout_s: float,
                alive: Callable[[], bool] = lambda: True) -> bool:
    """Connect with a paho client (MQTT 3.1.1, clean session) and wait for a CONNACK.

    Returns True on any CONNACK, including a refusal such as "not authorised" (the broker is up
    and speaks MQTT; ``extra_config`` may have turned anonymous access off). Returns False when
    the TCP connection is refused or lost before a CONNACK, no CONNACK arrives within
    ``timeout_s`` seconds, or ``alive()`` turns False meanwhile (our broker process exited, so
    whatever accepted the TCP connection is not it).
    """
    import paho.mqtt.client as mqtt

    from protocol.transport import PollingClient  # select() fails on a descriptor >= 1024 (a big fleet)

    client = PollingClient(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=f"fedfleet-probe-{uuid.uuid4().hex[:12]}",
        protocol=mqtt.MQTTv311,
        clean_session=True,
    )
    # Loopback connects are instant unless the listen backlog is full; don't hang there.
    client.connect_timeout = max(0.05, min(0.25, timeout_s))
    connacks: list[object] = []
    client.on_connect = lambda _c, _u, _flags, reason_code, _props: connacks.append(reason_code)
    try:
        client.connect(host, port, keepalive=10)
    except (OSError, ValueError):
        return False
    try:
        deadline = time.monotonic() + timeout_s
        lost = False
        while not connacks and not lost and time.monotonic() < deadline and alive():
            # A refusing broker sends its CONNACK and closes at once: paho may report the lost
            # connection from the same loop() call that delivered the CONNACK, so check both.
            lost = client.loop(timeout=0.05) != mqtt.MQTT_ERR_SUCCESS
        if not connacks:
            return False
        if not lost:
            client.disconnect()
            client.loop(timeout=0.01)
        return True
    finally:
        sock = client.socket()
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


def _listener_owner_check(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds the LISTEN socket on 127.0.0.1:``port``.

    Reads ``/proc/net/tcp`` and ``/proc/<pid>/fd`` (Linux). Returns None when that information
    cannot be read (other systems), so the caller falls back to "the process is still alive".
    Guards against the free-port race where another broker took the port first and answered our
    probe while ours was failing to bind.
    """
    try:
        with open("/proc/net/tcp", encoding="ascii") as fh:
            rows = fh.read().splitlines()[1:]
        want = f"0100007F:{port:04X}"
        inodes = {
            fields[9]
            for fields in (row.split() for row in rows)
            if len(fields) > 9 and fields[1] == want and fields[3] == "0A"  # 0A = LISTEN
        }
        if not inodes:
            return False
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return True
        return False
    except OSError:
        return None


# --------------------------------------------------------------------------------------------
# Child-process bookkeeping (kept outside EmbeddedBroker so the finalizer holds no reference to it)


class _Children:
    """The broker process, its watchdog, and the temp workdir this EmbeddedBroker created."""

    __slots__ = ("broker", "owned_workdir", "owner_pid", "watchdog")

    def __init__(self, owner_pid: int, owned_workdir: str | None) -> None:
        self.owner_pid = owner_pid
        self.owned_workdir = owned_workdir
        self.broker: subprocess.Popen[bytes] | None = None
        self.watchdog: subprocess.Popen[bytes] | None = None


def _spawn_watchdog(pid: int) -> subprocess.Popen[bytes] | None:
    """Start ``sh`` that SIGTERMs ``pid`` when the pipe from this process reaches end-of-file.

    The write end of the pipe is held only by this process (it is not inheritable), so EOF means
    this process died, however it died. Returns None (and logs) when ``sh`` cannot be started.
    """
    sh = shutil.which("sh") or "/bin/sh"
    try:
        return subprocess.Popen(
            [sh, "-c", 'read _fedfleet_line; kill -TERM "$1" 2>/dev/null', "fedfleet-broker-watchdog",
             str(pid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as exc:
        _log.warning("no watchdog for broker pid %d (%s): it may outlive a killed parent", pid, exc)
        return None


def _stop_watchdog(children: _Children) -> None:
    """SIGKILL and reap the watchdog first, so it never signals a pid that was reaped and reused."""
    watchdog, children.watchdog = children.watchdog, None
    if watchdog is None:
        return
    try:
        watchdog.kill()
        watchdog.wait(timeout=5.0)
    except (OSError, subprocess.TimeoutExpired):
        pass
    if watchdog.stdin is not None:
        try:
            watchdog.stdin.close()
        except OSError:
            pass


def _stop_children(children: _Children, timeout_s: float, *, hard: bool) -> None:
    """Stop the broker: SIGKILL when ``hard``, else SIGTERM, wait ``timeout_s`` s, then SIGKILL. Reap it."""
    _stop_watchdog(children)
    proc = children.broker
    if proc is None:
        return
    if proc.poll() is None:
        try:
            if hard:
                proc.kill()
            else:
                proc.terminate()
                try:
                    proc.wait(timeout=max(0.0, timeout_s))
                except subprocess.TimeoutExpired:
                    _log.warning("broker pid %d ignored SIGTERM for %.1f s; sending SIGKILL",
                                 proc.pid, timeout_s)
                    proc.kill()
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:  # pragma: no cover - a SIGKILLed process not exiting
        _log.error("broker pid %d did not exit after SIGKILL", proc.pid)


def _finalize(children: _Children) -> None:
    """Garbage-collection / interpreter-exit hook: stop the broker, delete the owned temp workdir."""
    if os.getpid() != children.owner_pid:  # a fork()ed child must not stop its parent's broker
        return
    _stop_children(children, timeout_s=2.0, hard=False)
    if children.owned_workdir is not None:
        shutil.rmtree(children.owned_workdir, ignore_errors=True)


class _AddressInUse(Exception):
    """Internal: the broker exited because its port was taken (carries the log tail)."""

    def __init__(self, log_tail: str) -> None:
        super().__init__("address already in use")
        self.log_tail = log_tail


# --------------------------------------------------------------------------------------------
# EmbeddedBroker


class EmbeddedBroker:
    """An MQTT broker in a child process, bound to 127.0.0.1 only. Use as a context manager.

    Example::

        with EmbeddedBroker() as broker:
            client.connect(broker.host, broker.port)

    Args:
        kind: ``"mosquitto"``, ``"amqtt"`` or ``"auto"`` (Mosquitto when its binary is found on
            PATH or in /usr/sbin, else amqtt).
        port: TCP port on 127.0.0.1, 1..65535; None picks a free one at the first ``start()``.
            Once a port is known it is kept: ``restart()`` and every later ``start()`` reuse it.
        workdir: folder for the generated config, the log and the port file; created when
            missing and kept afterwards. None: a temporary folder, deleted when this object is
            garbage collected or the interpreter exits.
        extra_config: Mosquitto only: lines appended verbatim to the generated ``mosquitto.conf``
            after the ``listener PORT 127.0.0.1`` line, e.g. ``allow_anonymous false`` with a
            ``password_file``, or a second ``listener`` with TLS settings. Lines placed right after
            the first listener apply to it (keep the first listener plain: ``start()`` probes it
            without TLS). Refused for amqtt.
        max_packet_size: Mosquitto ``max_packet_size`` in bytes (the whole MQTT packet), 20 ..
            268,435,460; a client sending a bigger packet is disconnected. None: no limit.
            amqtt has no such limit: the value is not enforced there and a warning is logged.
            paho ignores this limit too: senders must keep their packets under it themselves.

    Raises:
        ValueError: unknown ``kind``, ``port`` or ``max_packet_size`` out of range, an
            ``extra_config`` line containing a newline, or ``extra_config`` given for amqtt.
        TypeError: ``port`` or ``max_packet_size`` not an int, or an ``extra_config`` item not a str.
        BrokerStartError: ``kind="mosquitto"`` and no binary found, or amqtt not importable.
    """

    def __init__(
        self,
        *,
        kind: str = "auto",
        port: int | None = None,
        workdir: str | os.PathLike[str] | None = None,
        extra_config: Sequence[str] = (),
        max_packet_size: int | None = None,
    ) -> None:
        if kind not in _KINDS:
            raise ValueError(f"kind must be one of {', '.join(map(repr, _KINDS))}; got {kind!r}")
        binary = _find_mosquitto()
        if kind == "auto":
            kind = "mosquitto" if binary is not None else "amqtt"
        if kind == "mosquitto" and binary is None:
            raise BrokerStartError(
                "kind='mosquitto' but no mosquitto binary was found on PATH or in "
                f"{', '.join(_SBIN_DIRS)}; install it (e.g. apt-get install mosquitto) or use "
                "kind='amqtt'",
                kind="mosquitto",
            )
        if kind == "amqtt" and importlib.util.find_spec("amqtt") is None:
            raise BrokerStartError(
                f"kind='amqtt' but the amqtt package is not importable by {sys.executable}; "
                "install it (pip install 'fedfleet[broker]'), or Mosquitto (apt-get install mosquitto), "
                "or pass --broker mqtt://HOST:PORT",
                kind="amqtt",
            )
        if port is not None:
            if isinstance(port, bool) or not isinstance(port, int):
                raise TypeError(f"port must be an int or None, got {type(port).__name__}")
            if not 1 <= port <= 65535:
                raise ValueError(f"port must be in 1..65535 (or None for a free port), got {port}")
        if max_packet_size is not None:
            if isinstance(max_packet_size, bool) or not isinstance(max_packet_size, int):
                raise TypeError(
                    f"max_packet_size must be an int or None, got {type(max_packet_size).__name__}")
            if not MIN_MAX_PACKET_SIZE <= max_packet_size <= MAX_MAX_PACKET_SIZE:
                raise ValueError(
                    f"max_packet_size must be in {MIN_MAX_PACKET_SIZE}..{MAX_MAX_PACKET_SIZE} "
                    f"bytes, got {max_packet_size}")
        if isinstance(extra_config, str):
            raise TypeError("extra_config must be a sequence of lines, not a single str")
        lines = tuple(extra_config)
        for line in lines:
            if not isinstance(line, str):
                raise TypeError(f"extra_config lines must be str, got {type(line).__name__}")
            if "\n" in line or "\r" in line:
                raise ValueError(f"extra_config line contains a line break: {line!r}")
        if lines and kind != "mosquitto":
            raise ValueError(
                "extra_config holds mosquitto.conf lines; the amqtt broker cannot use them "
                "(use kind='mosquitto')")
        if max_packet_size is not None and kind == "amqtt":
            _log.warning("amqtt has no maximum packet size: max_packet_size=%d is NOT enforced",
                         max_packet_size)

        self._kind = kind
        self._binary = binary
        self._port = port
        self._extra_config = lines
        self._max_packet_size = max_packet_size
        owned: str | None = None
        if workdir is None:
            owned = tempfile.mkdtemp(prefix=f"fedfleet-{kind}-")
            self._workdir = Path(owned)
        else:
            self._workdir = Path(workdir).resolve()
            self._workdir.mkdir(parents=True, exist_ok=True)
        self._log_path = self._workdir / f"{kind}.log"
        self._lock = threading.RLock()
        self._children = _Children(owner_pid=os.getpid(), owned_workdir=owned)
        self._finalizer = weakref.finalize(self, _finalize, self._children)

    # ---------------------------------------------------------------- properties

    @property
    def kind(self) -> str:
        """``"mosquitto"`` or ``"amqtt"`` (``"auto"`` is resolved in the constructor)."""
        return self._kind

    @property
    def host(self) -> str:
        """Always ``"127.0.0.1"``."""
        return LOOPBACK_HOST

    @property
    def port(self) -> int | None:
        """TCP port on 127.0.0.1; None until the first successful ``start()`` when none was given."""
        return self._port

    @property
    def url(self) -> str:
        """``"mqtt://127.0.0.1:PORT"`` (parseable by ``parse_broker_url``).

        Raises:
            RuntimeError: no port is known yet (call ``start()`` first).
        """
        if self._port is None:
            raise RuntimeError("the broker has no port yet: call start() first")
        return f"mqtt://{LOOPBACK_HOST}:{self._port}"

    @property
    def pid(self) -> int | None:
        """Process id of the current (or last) broker process; None before the first start."""
        proc = self._children.broker
        return proc.pid if proc is not None else None

    @property
    def log_path(self) -> Path:
        """The broker's log file (Mosquitto's ``log_dest file`` plus its stderr, or amqtt's stderr).

        Appended to across restarts; each start writes a ``--- fedfleet: starting ...`` line first.
        """
        return self._log_path

    @property
    def workdir(self) -> Path:
        """Folder holding the generated config, the log and (amqtt) the port file."""
        return self._workdir

    @property
    def max_packet_size(self) -> int | None:
        """Configured maximum MQTT packet size in bytes (enforced by Mosquitto only), or None."""
        return self._max_packet_size

    # ---------------------------------------------------------------- lifecycle

    def is_running(self) -> bool:
        """True while the broker process exists and has not exited."""
        with self._lock:
            proc = self._children.broker
            if proc is None:
                return False
            if proc.poll() is None:
                return True
            _stop_watchdog(self._children)  # the broker died on its own: its pid may be reused
            return False

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> EmbeddedBroker:
        """Start the broker and wait until it answers an MQTT CONNECT with a CONNACK.

        Does nothing when it is already running. Without a known port, picks a free one; when
        the broker then exits with "Address already in use" (another process took the port in
        between) it tries again with a new port, up to 3 attempts. With a known port it retries
        the same port (after 0.2 s, then 0.4 s) in case the old socket is still being released.

        Args:
            timeout_s: seconds to wait, in total over all attempts, for the CONNACK.

        Returns:
            self, so that ``broker = EmbeddedBroker().start()`` works.

        Raises:
            BrokerStartError: the process could not be spawned, exited while starting, did not
                answer within ``timeout_s``, or its port stayed in use. The message ends with
                the tail of the broker's log; the exception has ``kind``, ``port``, ``log_tail``.
        """
        with self._lock:
            if self.is_running():
                return self
            _stop_children(self._children, timeout_s=0.0, hard=True)  # reap a dead predecessor
            deadline = time.monotonic() + timeout_s
            sticky_port = self._port
            last_tail = ""
            for attempt in range(1, _START_ATTEMPTS + 1):
                port = sticky_port if sticky_port is not None else (
                    _pick_free_port() if self._kind == "mosquitto" else 0)
                try:
                    real_port = self._start_once(port, attempt, deadline)
                except _AddressInUse as exc:
                    last_tail = exc.log_tail
                    _log.info("%s: port %d in use (attempt %d/%d)", self._kind, port, attempt,
                              _START_ATTEMPTS)
                    if sticky_port is not None and attempt < _START_ATTEMPTS:
                        time.sleep(min(0.2 * attempt, max(0.0, deadline - time.monotonic())))
                    if time.monotonic() >= deadline:
                        break
                    continue
                self._port = real_port
                broker = self._children.broker
                assert broker is not None, "_start_once returned without a broker process"
                self._children.watchdog = _spawn_watchdog(broker.pid)
                _log.info("%s broker running on %s:%d (pid %d)", self._kind, LOOPBACK_HOST,
                          real_port, broker.pid)
                return self
            raise BrokerStartError(
                f"{self._kind} could not bind 127.0.0.1:{port}: address already in use "
                f"({attempt} attempt(s)){'' if sticky_port is None else '; choose another port'}",
                kind=self._kind, port=port, log_tail=last_tail)

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """Stop the broker: SIGTERM, wait up to ``timeout_s`` seconds, then SIGKILL; reap it.

        Idempotent: does nothing when the broker is not running. The port, workdir and log are kept.
        """
        with self._lock:
            _stop_children(self._children, timeout_s=timeout_s, hard=False)

    def kill(self) -> None:
        """SIGKILL the broker at once and reap it (a crash, for chaos tests). Idempotent."""
        with self._lock:
            _stop_children(self._children, timeout_s=0.0, hard=True)

    def restart(
        self,
        *,
        timeout_s: float = DEFAULT_START_TIMEOUT_S,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
    ) -> EmbeddedBroker:
        """Stop the broker (if running) and start it again on the same port.

        The new broker starts empty: retained messages, subscriptions and sessions are gone
        (``persistence false``). Clients must reconnect, and resubscribe unless the broker kept
        their session (it does not).

        Raises:
            BrokerStartError: as ``start()``; e.g. another process took the port meanwhile.
        """
        with self._lock:
            self.stop(stop_timeout_s)
            return self.start(timeout_s)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"<EmbeddedBroker kind={self._kind} port={self._port} pid={self.pid} {state}>"

    # ---------------------------------------------------------------- internals

    def _start_once(self, port: int, attempt: int, deadline: float) -> int:
        """Spawn one broker process on ``port`` (0: amqtt chooses) and wait until it is ready.

        Returns the port it listens on. Raises _AddressInUse, or BrokerStartError.
        """
        port_file = self._workdir / "amqtt.port"
        if self._kind == "mosquitto":
            conf_path = self._write_mosquitto_conf(port)
            cmd = [str(self._binary), "-c", str(conf_path)]
            env = None
        else:
            port_file.unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "broker_server._amqtt_child", "--port-file", str(port_file),
                   "--port", str(port)]
            env = dict(os.environ)
            package_root = str(Path(__file__).resolve().parent.parent)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (package_root, env.get("PYTHONPATH", "")) if p)
            env["PYTHONUNBUFFERED"] = "1"

        with open(self._log_path, "ab") as log_fh:
            log_fh.write(
                f"--- fedfleet: starting {self._kind} on {LOOPBACK_HOST}:{port or 'any'} "
                f"(attempt {attempt}) at {time.strftime('%Y-%m-%dT%H:%M:%S')} ---\n".encode())
            log_fh.flush()
            log_offset = log_fh.tell()
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log_fh,
                    stderr=subprocess.STDOUT,
                    cwd=self._workdir,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as exc:
                raise BrokerStartError(f"could not run {cmd[0]}: {exc}", kind=self._kind,
                                       port=port or None) from exc
        self._children.broker = proc

        known_port: int | None = port or None
        while True:
            rc = proc.poll()
            if rc is not None:
                tail = self._log_tail(log_offset)
                if (self._kind == "amqtt" and rc == _AMQTT_EXIT_ADDRESS_IN_USE) or (
                        "address already in use" in tail.lower()):
                    raise _AddressInUse(tail)
                raise BrokerStartError(
                    f"{self._kind} (pid {proc.pid}) exited with code {rc} while starting on "
                    f"{LOOPBACK_HOST}:{port or 'any'}; log: {self._log_path}",
                    kind=self._kind, port=port or None, log_tail=tail)
            if self._kind == "amqtt":
                # The child writes the port file only after its own bind succeeded.
                known_port = self._read_port_file(port_file)
            remaining = deadline - time.monotonic()
            if known_port is not None and remaining > 0:
                alive = lambda: proc.poll() is None  # noqa: E731
                if (_probe_mqtt(LOOPBACK_HOST, known_port, min(_PROBE_TIMEOUT_S, remaining), alive)
                        and proc.poll() is None
                        and _listener_owner_check(proc.pid, known_port) is not False):
                    return known_port
            if time.monotonic() >= deadline:
                _stop_children(self._children, timeout_s=1.0, hard=False)
                raise BrokerStartError(
                    f"{self._kind} (pid {proc.pid}) did not answer an MQTT CONNECT on "
                    f"{LOOPBACK_HOST}:{known_port or port or 'any'} in time; log: {self._log_path}",
                    kind=self._kind, port=known_port or port or None,
                    log_tail=self._log_tail(log_offset))
            time.sleep(_POLL_INTERVAL_S)

    def _write_mosquitto_conf(self, port: int) -> Path:
        """Write ``<workdir>/mosquitto.conf`` for a listener on 127.0.0.1:``port``; return its path."""
        lines = [
            "# generated by fedfleet EmbeddedBroker; rewritten at every start",
            f"listener {port} {LOOPBACK_HOST}",
            "allow_anonymous true",
            "persistence false",
            # No message-count limit: the default of 1000 silently dropped QoS 1 messages
            # (mqtt-transport-study §2.1, §7); cap the queue by bytes instead.
            "max_queued_messages 0",
            f"max_queued_bytes {MOSQUITTO_MAX_QUEUED_BYTES}",
            "set_tcp_nodelay true",
            f"log_dest file {self._log_path}",
            "log_timestamp_format %Y-%m-%dT%H:%M:%S",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            # As root, mosquitto switches to user "mosquitto", which cannot write our log file.
            lines.append("user root")
        if self._max_packet_size is not None:
            lines.append(f"max_packet_size {self._max_packet_size}")
        if self._extra_config:
            lines.append("# extra_config")
            lines.extend(self._extra_config)
        conf_path = self._workdir / "mosquitto.conf"
        conf_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return conf_path

    @staticmethod
    def _read_port_file(path: Path) -> int | None:
        """The port written by the amqtt child, or None while the file is absent or incomplete."""
        try:
            text = path.read_text(encoding="ascii").strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def _log_tail(self, offset: int) -> str:
        """The last lines (at most 40 lines / 4000 characters) written to the log after ``offset``."""
        try:
            with open(self._log_path, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
        except OSError:
            return ""
        lines = data.decode("utf-8", errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        return "\n".join(lines)[-_LOG_TAIL_CHARS:]
