"""The state of the open round: who was asked, what came back, who withdrew, its counters."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from protocol.messages import Global, RoundStart

from .strategies import Accumulator


@dataclass
class RoundStats:
    """Counters of one round (written to ``metrics.jsonl``).

    ``dropped``: selected devices that went offline (last will or ``offline`` status) and were
    not back within the grace period; ``resent_to``: selected devices that said ``online`` again
    while the round was open and were sent its ``global`` and ``round_start`` again (or the
    ``round_start`` alone); ``round_start_resends``: client → ``round_start`` copies sent to it on
    its own topic after the round opened (an answer to its ``online``, selected or not, and the
    copies after the server's own reconnect); ``round_start_asks``: client → ``online`` statuses
    of a device the server held online that said it holds the round's ``global`` but no
    ``round_start`` of it (an agent asking for a ``round_start`` the broker dropped);
    ``unreported``: selected devices the round waited for until its deadline in vain.
    ``global_receipts`` counts devices (not receipts) that confirmed a copy of the round's global."""

    round: int
    selected: int = 0
    clients_reported: int = 0
    duplicates: int = 0
    late: int = 0
    unsolicited: int = 0
    #: updates for a round not open yet, left unanswered (the device sends each again when it starts)
    early: int = 0
    invalid: int = 0
    global_receipts: int = 0
    global_resends: int = 0
    withdrawn: int = 0
    skipped: bool = False
    skip_reason: str = ""
    dropped: list[str] = field(default_factory=list)
    resent_to: list[str] = field(default_factory=list)
    round_start_resends: dict[str, int] = field(default_factory=dict)
    round_start_asks: dict[str, int] = field(default_factory=dict)
    unreported: list[str] = field(default_factory=list)


@dataclass
class RoundState:
    """One round while it is open (``collecting`` is its number; ``None`` between rounds).

    Attributes:
        collecting: the open round, or ``None``.
        selected: the client ids asked to train.
        results: client → (num_samples, train_loss, metrics) of each accepted update.
        withdrawn: selected clients that will not report (idle status, refused update).
        stats: the round's counters.
        accumulator: the strategy's accumulator for the round.
        deadline: ``time.monotonic()`` after which updates are late (``inf`` between rounds).
        messages: the round's ``global`` and its ``round_start`` messages as (client or ``None``
            for the broadcast, message), kept for a resync after a reconnect.
        global_sha256: the hash of the round's global payload (receipts confirm it).
        global_hashes: the hashes of every copy of the round's global sent (the broadcast, its
            re-broadcast after a reconnect, per-device copies to devices that came back, and the
            inner payload of a sealed one, which a chunked re-send carries).
        global_confirmed: devices whose receipt confirmed one of those copies.
        offline_since: selected devices still awaited whose ``offline`` status (last will)
            arrived: client → (``time.monotonic()`` of its arrival, its detail).
        dropped: selected devices not awaited any more: offline for longer than the grace period.
        resent: client → how many times the round was sent to it again after it came back
            (or asked for its ``round_start``).
        start_resends: client → ``round_start`` copies sent to it on its own topic since the round
            opened (each answer to its ``online``, selected or not, and each copy after the
            server's own reconnect).
        start_asks: client → ``online`` statuses from a device already online that said it holds
            the round's global but not its ``round_start``.
        told_unselected: unselected devices that asked for the round's ``round_start``: client →
            how many times they were sent one naming nobody (at most ``MAX_ROUND_RESENDS``).
        global_bytes, global_sent_at, global_seq: the global's payload size, when it was last
            sent (``time.monotonic()``) and its envelope seq, for sending it again smaller when no
            device confirms it.
        strategy_metrics: the ``metrics`` of the :class:`~broker_server.strategies.GlobalUpdate`
            the driver committed in this round (``{}``: none committed), for its metrics line.
        delivery: how the round's global goes out: ``"broadcast"`` (``down/global``) or
            ``"per_device"`` (one copy per selected device on ``down/{client}/global``).
        device_globals: with per-device delivery, each selected device's copy of the global
            (the round's, or the strategy's ``device_global`` for it).
        delta_base: the tensors a device's copy carried when they are not the round's shared
            tensors: its delta updates are resolved against them.
        global_bytes_to, global_seq_to: with per-device delivery, each copy's payload size and
            envelope seq when last sent.
        opened_on: the server transport's connection (its ``connects`` count; 0: unknown) the
            round's messages went out on: a reconnect to that one or an older one lost none of them.
        deferred: devices whose ``online`` said they lack the round's global while the copy sent
            after the server's reconnect may still reach them: client → ``time.monotonic()`` of
            that ``online`` (their own copy goes unless they confirm the round's global in time).
    """

    collecting: int | None = None
    selected: set[str] = field(default_factory=set)
    results: dict[str, tuple[int, float, dict]] = field(default_factory=dict)
    withdrawn: set[str] = field(default_factory=set)
    stats: RoundStats = field(default_factory=lambda: RoundStats(round=0))
    accumulator: Accumulator | None = None
    deadline: float = float("inf")
    messages: tuple[Global, list[tuple[str | None, RoundStart]]] | None = None
    global_sha256: bytes = b""
    global_hashes: set[bytes] = field(default_factory=set)
    global_confirmed: set[str] = field(default_factory=set)
    offline_since: dict[str, tuple[float, str]] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)
    resent: dict[str, int] = field(default_factory=dict)
    start_resends: dict[str, int] = field(default_factory=dict)
    start_asks: dict[str, int] = field(default_factory=dict)
    told_unselected: dict[str, int] = field(default_factory=dict)
    global_bytes: int = 0
    global_sent_at: float = 0.0
    global_seq: int = 0
    strategy_metrics: dict = field(default_factory=dict)
    delivery: str = "broadcast"
    device_globals: dict[str, Global] = field(default_factory=dict)
    delta_base: dict[str, tuple[np.ndarray, ...]] = field(default_factory=dict)
    global_bytes_to: dict[str, int] = field(default_factory=dict)
    global_seq_to: dict[str, int] = field(default_factory=dict)
    opened_on: int = 0
    deferred: dict[str, float] = field(default_factory=dict)

    def awaited(self) -> set[str]:
        """Selected clients that have neither reported, withdrawn, nor been dropped."""
        return self.selected - set(self.results) - self.withdrawn - self.dropped

    def awaiting(self) -> bool:
        """Whether some selected client has neither reported, withdrawn, nor been dropped."""
        return bool(self.awaited())

    def close(self) -> None:
        """Between rounds: nothing is collected, no deadline, no messages to resend."""
        self.collecting, self.messages, self.deadline = None, None, float("inf")


class CountedUpdates:
    """Client ids whose update was counted, per round, for the last few rounds (duplicates and
    resends after a lost receipt are acknowledged as counted, never counted again), each with the
    envelope ``seq`` and payload SHA-256 of the copy counted (what its receipt names)."""

    def __init__(self, keep_rounds: int = 8) -> None:
        self.keep_rounds = keep_rounds
        self._by_round: dict[int, dict[str, tuple[int, bytes]]] = {}

    def __contains__(self, key: tuple[int, str]) -> bool:
        round, client = key
        return client in self._by_round.get(round, {})

    def clear(self) -> None:
        """Forget every count (what a freshly started process knows)."""
        self._by_round.clear()

    def add(self, round: int, client: str, seq: int = 0, sha256: bytes = b"") -> None:
        """Count ``client``'s update of ``round``: the copy with envelope ``seq`` and payload ``sha256``."""
        self._by_round.setdefault(round, {})[client] = (seq, sha256)
        for old in [r for r in self._by_round if r < round - self.keep_rounds]:
            del self._by_round[old]

    def copy(self, round: int, client: str) -> tuple[int, bytes] | None:
        """(``seq``, ``sha256``) of the copy of ``client``'s update of ``round`` that was counted,
        or ``None`` (not counted, or a round no longer kept)."""
        return self._by_round.get(round, {}).get(client)
