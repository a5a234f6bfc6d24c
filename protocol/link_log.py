"""What a node says in its log about its link to the broker: lost (``WARNING``) and back
(``INFO``), the same for an edge agent and the aggregation server.

:class:`LinkLog` listens to a transport's link events
(:class:`~protocol.transport_base.LinkEvents`). Those listeners run on the MQTT client's network
thread (paho's), as the transport's own records do: a process whose log handler may block (a
full pipe, a network handler) puts a :class:`logging.handlers.QueueHandler` in front of it, as
for any record of that thread.

The records (``{who}`` is the ``prefix`` given, ``"pi-07: "`` for an agent, ``""`` for the
server)::

    WARNING {who}link to the broker lost (connection 1: Unspecified error); 2 message(s) (1,234 bytes)
            not yet acknowledged, sent again once it is back; its update of round 3 awaits its receipt;
            reconnecting
    INFO    {who}link to the broker back (connection 2), 12.5 s after it was lost

paho's reason ``Unspecified error`` is what it says of a socket closed or reset under it; a
broker's MQTT 5 DISCONNECT is named (``DISCONNECT from the broker: Server shutting down``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .transport_base import LinkLost

__all__ = ["LinkLog"]


class LinkLog:
    """Logs one transport's link events (see the module docstring for the records).

    Args:
        logger: where the records go (the node's own logger: ``edge_agent.agent``,
            ``broker_server.server``).
        prefix: put before each message (``"pi-07: "``, or ``""``).
        pending: called at a loss, on the network thread, for more words on what was in flight
            (an agent: ``"its update of round 3 awaits its receipt"``), ``""`` for none; it must
            not block (read a few attributes); an exception it raises leaves the words out.
        clock: monotonic seconds (a test passes its own).

    Attributes:
        losses: connections lost so far.
        down_s: seconds the link was down, summed over the losses it came back from.
        lost_at: ``clock()`` when the link was lost, while it is down; ``None`` while it is up.
    """

    def __init__(self, logger: logging.Logger, *, prefix: str = "", pending: Callable[[], str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.prefix = prefix
        self.pending = pending
        self.clock = clock
        self.losses = 0
        self.down_s = 0.0
        self.lost_at: float | None = None

    def attach(self, transport: object) -> bool:
        """Listen to ``transport``'s link events (``add_disconnect_listener``,
        ``add_connect_listener``: whichever it has). Returns whether it has the disconnect
        listener (without it, nothing is said of a loss, and a reconnect is said without the
        time down)."""
        add_lost = getattr(transport, "add_disconnect_listener", None)
        add_connect = getattr(transport, "add_connect_listener", None)
        if add_lost is not None:
            add_lost(self.on_lost)
        if add_connect is not None:
            add_connect(self.on_connect)
        return add_lost is not None

    def on_lost(self, lost: LinkLost) -> None:
        """A disconnect listener: the ``WARNING`` record of ``lost`` (network thread)."""
        self.lost_at = self.clock()
        self.losses += 1
        what = f"connection {lost.connection}"
        if lost.reason:
            what += f": {'DISCONNECT from the broker: ' if lost.by_broker else ''}{lost.reason}"
        held = (f"{lost.unacked_messages} message(s) ({lost.unacked_bytes:,} bytes) not yet acknowledged, sent "
                f"again once it is back" if lost.unacked_messages else "no message awaiting acknowledgement")
        extra = ""
        if self.pending is not None:
            try:
                extra = self.pending()
            except Exception:  # noqa: BLE001 - a few words less, never a broken network thread
                extra = ""
        self._say(logging.WARNING, "%slink to the broker lost (%s); %s%s; reconnecting", self.prefix, what, held,
                  f"; {extra}" if extra else "")

    def on_connect(self, n: int) -> None:
        """A connect listener: the ``INFO`` record of the n-th connection when it follows a loss
        (n > 1; network thread)."""
        if n <= 1:
            return
        lost_at, self.lost_at = self.lost_at, None
        if lost_at is None:  # the loss was not told (a transport without the disconnect listener)
            self._say(logging.INFO, "%slink to the broker back (connection %d)", self.prefix, n)
            return
        down = max(0.0, self.clock() - lost_at)
        self.down_s += down
        self._say(logging.INFO, "%slink to the broker back (connection %d), %.1f s after it was lost", self.prefix,
                  n, down)

    def _say(self, level: int, msg: str, *args: object) -> None:
        """Log the record (on the network thread, like the transport's own)."""
        self.logger.log(level, msg, *args)
