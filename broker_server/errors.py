"""Exceptions raised by the fedfleet server package (``broker_server``).

Grouped by what the caller can do about them::

    FedfleetServerError            base: catch this to catch every server-side failure
    ├── BrokerStartError           the embedded MQTT broker did not come up (binary missing,
    │                              port taken, crashed at start, no CONNACK in time); the
    │                              message carries the tail of the broker's log: read it,
    │                              then retry, choose another port or another broker kind
    ├── ConfigError                a configuration file or value is wrong; fix the config
    ├── RunError                   the federation could not run (no agents joined in time …)
    └── RunFolderBusy              another process (its pid, host and start time named) holds
                                   the run folder (:mod:`broker_server.run_lock`): wait for it
                                   to end or stop it, then try again; nothing was written

Foreign exceptions (``OSError`` from ``subprocess``, paho errors, ...) are converted once, at the
boundary where they happen, with ``raise ... from exc``. Programming errors (a bad argument type
or value passed to a constructor) raise the usual ``ValueError`` / ``TypeError`` instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .run_lock import Holder

__all__ = ["BrokerStartError", "ConfigError", "FedfleetServerError", "RunError", "RunFolderBusy"]


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


class RunFolderBusy(FedfleetServerError):
    """Another process holds the run folder's lock (:mod:`broker_server.run_lock`): a server, a
    simulation or a grid writes it now. Raised at once, before this process wrote anything there.

    Attributes:
        run_dir: the folder.
        holder: the process that holds it, as it wrote itself into the lock file
            (:class:`~broker_server.run_lock.Holder`), or None when it has not written itself yet
            (it is starting).
    """

    def __init__(self, run_dir: Path, holder: Holder | None) -> None:
        self.run_dir = Path(run_dir)
        self.holder = holder
        who = (f"another process ({holder.describe()})" if holder is not None
               else "another process (starting: it has not written its pid, host and start time yet)")
        super().__init__(f"run folder {self.run_dir} is in use by {who}; one process at a time writes a run folder: "
                         "wait for that one to end or stop it (a killed one frees the folder at once), then try again")
