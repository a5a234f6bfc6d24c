"""The server's device registry: what it knows of each device, join bookkeeping, ``registry.json``."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from protocol.files import write_atomically
from protocol.messages import Join

#: allowed ranges of the MQTT limits a device announces in ``join.info`` (bytes), as its firmware
#: profile's (:mod:`edge_agent.profiles`)
LIMIT_RANGES = {"max_packet_bytes": (1024, 268_435_460), "chunk_bytes": (64, 256 * 1024 * 1024)}


def announced_limit(info: dict, key: str) -> int | str | None:
    """A device's announced ``key`` (``max_packet_bytes`` or ``chunk_bytes``) from ``join.info``:
    the int (decimal text accepted), ``None`` when absent, or a sentence saying why it is refused
    (not an integer, outside :data:`LIMIT_RANGES`)."""
    if key not in info:
        return None
    v = info[key]
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v)
    lo, hi = LIMIT_RANGES[key]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        return f"join.info {key} = {info[key]!r} is not an integer in [{lo}, {hi}] bytes"
    return v


@dataclass
class ClientRecord:
    """What the server knows of one device (the registry; ``info`` is what it announced at join:
    profile, device, precision, fallbacks …). ``index`` is its member index
    (:mod:`protocol.membership`): 0, 1, 2 … in the order of first admission, kept for good."""

    client_id: str
    profile: str = ""
    num_samples: int = 0
    class_histogram: list[int] = field(default_factory=list)
    online: bool = True
    last_seen: float = 0.0
    joined_round: int = 0
    updates_accepted: int = 0
    info: dict = field(default_factory=dict)
    index: int = -1


class DeviceRegistry:
    """Client id → :class:`ClientRecord` (``records``), with the bookkeeping the driver needs.

    Times are ``time.monotonic()`` seconds."""

    def __init__(self) -> None:
        self.records: dict[str, ClientRecord] = {}

    def __contains__(self, client_id: object) -> bool:
        return client_id in self.records

    def get(self, client_id: str) -> ClientRecord | None:
        """The record of ``client_id``, or ``None`` for a device that never joined."""
        return self.records.get(client_id)

    def online(self) -> list[str]:
        """Ids of the joined devices currently online, sorted."""
        return sorted(c for c, r in self.records.items() if r.online)

    def seen(self, client_id: str, now: float) -> bool:
        """A message other than join/status came from ``client_id``: online, last seen ``now``.
        Returns True when the device was offline before (it is back)."""
        rec = self.records.get(client_id)
        if rec is None:
            return False
        back = not rec.online
        rec.online, rec.last_seen = True, now
        return back

    def limits(self, client_ids: list[str] | None = None) -> tuple[int, int]:
        """(max_packet_bytes, chunk_bytes) the devices ``client_ids`` (all joined ones when
        ``None``) announced in ``join.info``: the smallest of each, bytes; 0 where none announced.
        Values were checked at admission (:func:`announced_limit`)."""
        recs = self.records.values() if client_ids is None else [self.records[c] for c in client_ids
                                                                 if c in self.records]
        out = []
        for key in ("max_packet_bytes", "chunk_bytes"):
            vals = [v for r in recs if (v := announced_limit(r.info, key)) and isinstance(v, int)]
            out.append(min(vals) if vals else 0)
        return out[0], out[1]

    def admit(self, client_id: str, join: Join, *, round: int, now: float) -> ClientRecord:
        """Record an accepted ``join`` (a device joining again keeps its counters, joined round and
        member index; a new device takes the next member index)."""
        rec = self.records.get(client_id) or ClientRecord(client_id, joined_round=round, index=self._next_index())
        rec.profile, rec.num_samples = join.profile, join.num_samples
        rec.class_histogram, rec.online, rec.last_seen = list(join.class_histogram), True, now
        rec.info = dict(join.info)  # device, precision, fallbacks … as the agent announced them
        self.records[client_id] = rec
        return rec

    def _next_index(self) -> int:
        return 1 + max((r.index for r in self.records.values()), default=-1)

    def index_of(self, client_id: str) -> int:
        """The member index of ``client_id`` (-1 for a device that never joined)."""
        rec = self.records.get(client_id)
        return rec.index if rec is not None else -1

    def set_status(self, client_id: str, state: str, now: float) -> ClientRecord | None:
        """Apply a ``status`` message: online unless ``state`` is ``"offline"``."""
        rec = self.records.get(client_id)
        if rec is not None:
            rec.online = state != "offline"
            rec.last_seen = now
        return rec

    def count_update(self, client_id: str) -> None:
        """One more accepted update from ``client_id``."""
        rec = self.records.get(client_id)
        if rec is not None:
            rec.updates_accepted += 1
            rec.last_seen = time.monotonic()

    def rows(self) -> list[dict]:
        """Every record as a dict (the checkpoint's registry)."""
        return [asdict(r) for r in self.records.values()]

    def restore(self, rows: list[dict]) -> None:
        """Records from a checkpoint, every device offline until it joins again, each with its
        member index (a checkpoint written before member indices gives its devices the next free
        ones, in its order)."""
        for row in rows:
            r = ClientRecord(**{k: v for k, v in row.items() if k in ClientRecord.__dataclass_fields__})
            r.online, r.last_seen = False, 0.0
            self.records[r.client_id] = r
        for r in self.records.values():
            if r.index < 0:
                r.index = self._next_index()

    def write(self, run_dir: Path, round: int) -> None:
        """``registry.json`` in ``run_dir``: every device with online/offline, seconds since it
        was last seen, profile, samples, accepted updates (rewritten atomically)."""
        now = time.monotonic()
        rows = [{**asdict(r), "last_seen_s_ago": round_(now - r.last_seen) if r.last_seen else None}
                for r in sorted(self.records.values(), key=lambda r: r.client_id)]
        for row in rows:
            row.pop("last_seen", None)
        write_atomically(Path(run_dir) / "registry.json",
                         json.dumps({"round": round, "devices": rows}, indent=1).encode("utf-8"))


def round_(x: float) -> float:
    """``x`` to one decimal (seconds in ``registry.json``)."""
    return round(x, 1)
