"""Exceptions raised by the fedfleet server package (``broker_server``).

Grouped by what the caller can do about them::

    FedfleetServerError            base: catch this to catch every server-side failure
    ├── BrokerStartError           the embedded MQTT broker did not come up (binary missing,
    │                              port taken, crashed at start, no CONNACK in time); the
    │                              message carries the tail of the broker's log: read it,
    │                              then retry, choose another port or another broker kind
    ├── ConfigError                a configuration file or value is wrong; fix the config
    └── RunError                   the federation could not run (no agents joined in time …)

Foreign exceptions (``OSError`` from ``subprocess``, paho errors, ...) are converted once, at the
boundary where they happen, with ``raise ... from exc``. Programming errors (a bad argument type
or value passed to a constructor) raise the usual ``ValueError`` / ``TypeError`` instead.
"""

from __future__ import annotations

__all__ = ["BrokerStartError", "ConfigError", "FedfleetServerError", "RunError"]


class FedfleetServerError(Exception):
    """Base class of every exception raised on purpose by ``broker_server``."""


class BrokerStartError(FedfleetServerError):
    """The embedded MQTT broker could not be started, or did not accept an MQTT connection in time.

    Attributes:
        kind: broker implementation that failed (``"mosquitto"`` or ``"amqtt"``), or None.
        port: TCP port on 127.0.0.1 that was tried last, or None when none was chosen yet.
        log_tail: the last lines the broker wrote to its log during this start attempt
            ("" when it wrote nothing or no log exists yet).
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str | None = None,
        port: int | None = None,
        log_tail: str = "",
    ) -> None:
        self.kind = kind
        self.port = port
        self.log_tail = log_tail
        full = message
        if log_tail:
            full = f"{message}\n--- broker log (tail) ---\n{log_tail.rstrip()}"
        super().__init__(full)


class ConfigError(FedfleetServerError):
    """A configuration file or value is invalid (unknown key, wrong type, out of range)."""


class RunError(FedfleetServerError):
    """The federation could not run: too few agents joined before the join timeout, say."""
