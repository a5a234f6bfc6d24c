"""Child-process entry point that runs an amqtt broker on 127.0.0.1 (private; used by EmbeddedBroker).

Run as::

    python -m broker_server._amqtt_child --port-file FILE [--port PORT] [--log-level LEVEL]

- Binds ``127.0.0.1:PORT`` (``PORT`` 0, the default, lets the kernel choose a free port, so there
  is no free-port race). Anonymous clients are allowed; MQTT 3.1.1 only (amqtt refuses MQTT 5).
- Once the listener is open, writes the real port number as ASCII decimal followed by a newline to
  ``FILE`` (:func:`protocol.files.write_atomically`: a reader never sees a partial number).
- Runs until SIGTERM or SIGINT, then shuts the broker down (at most ``SHUTDOWN_TIMEOUT_S``
  seconds) and exits 0.
- Logs to stderr; the parent redirects stderr to the broker's log file.

amqtt 0.12.1 has no maximum packet size setting (its reader accepts any remaining length up to
the MQTT maximum of 268,435,455 bytes), so this child has none either.

Exit codes (never reused):
    0  clean shutdown after SIGTERM / SIGINT
    1  unexpected error (traceback in the log)
    2  bad command line (argparse)
    3  the port is already in use
    4  the broker failed to start for another reason (message in the log)
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import sys

from protocol.files import write_atomically

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_USAGE = 2
EXIT_ADDRESS_IN_USE = 3
EXIT_START_FAILED = 4

#: Longest time (seconds) given to ``Broker.shutdown()`` after SIGTERM before the child exits anyway.
SHUTDOWN_TIMEOUT_S = 3.0

#: Only loopback: the embedded broker is for single-machine runs and tests.
BIND_HOST = "127.0.0.1"

_log = logging.getLogger("fedfleet.amqtt_child")


def _broker_config(port: int) -> dict:
    """amqtt ``BrokerConfig`` dict: one TCP listener on 127.0.0.1:port, anonymous clients allowed.

    Only the anonymous-auth plugin is loaded: the default packet/event loggers and the ``$SYS``
    publisher are left out (noise and CPU for nothing in an embedded broker).
    """
    return {
        "listeners": {
            "default": {"type": "tcp", "bind": f"{BIND_HOST}:{port}", "max_connections": 0},
        },
        "plugins": {
            "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
        },
    }


def _is_address_in_use(exc: BaseException) -> bool:
    """True when ``exc`` or one of its causes is EADDRINUSE."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno == errno.EADDRINUSE:
            return True
        if "address already in use" in str(cur).lower():
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _write_port_file(path: str, port: int) -> None:
    """Write ``port`` to ``path`` atomically (write a temp file, then rename)."""
    write_atomically(path, f"{port}\n".encode("ascii"), fsync=True)


async def _serve(port: int, port_file: str) -> int:
    """Start the broker, publish its port, wait for SIGTERM/SIGINT, shut down; return an exit code."""
    from amqtt.broker import Broker  # imported here so `--help` works without amqtt

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    broker = Broker(_broker_config(port))
    try:
        await broker.start()
    except Exception as exc:  # amqtt wraps bind errors in BrokerError
        if _is_address_in_use(exc):
            _log.error("Address already in use: %s:%d (%s)", BIND_HOST, port, exc)
            return EXIT_ADDRESS_IN_USE
        _log.error("amqtt broker failed to start: %s", exc)
        return EXIT_START_FAILED

    # amqtt 0.12.1 keeps the asyncio.Server of each listener in Broker._servers[name].instance.
    server = broker._servers["default"].instance
    real_port = int(server.sockets[0].getsockname()[1])
    _write_port_file(port_file, real_port)
    _log.info("amqtt broker listening on %s:%d (pid %d)", BIND_HOST, real_port, os.getpid())

    await stop.wait()
    _log.info("signal received, shutting down")
    try:
        await asyncio.wait_for(broker.shutdown(), timeout=SHUTDOWN_TIMEOUT_S)
    except (asyncio.TimeoutError, Exception) as exc:  # exit anyway: the parent is waiting
        _log.warning("broker shutdown did not complete cleanly: %r", exc)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the broker until signalled, return the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m broker_server._amqtt_child", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port-file", required=True, help="file that receives the real port number")
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0: any free port)")
    parser.add_argument("--log-level", default="INFO", help="logging level name (default INFO)")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")

    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # `transitions` (amqtt's state machines) logs every state change at INFO: pure noise here.
    logging.getLogger("transitions").setLevel(logging.WARNING)
    try:
        return asyncio.run(_serve(args.port, args.port_file))
    except Exception:
        _log.exception("unexpected error in the amqtt child")
        return EXIT_UNEXPECTED


if __name__ == "__main__":
    sys.exit(main())
