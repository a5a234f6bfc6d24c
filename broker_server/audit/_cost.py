"""What reaching an accuracy cost, and how long the bytes take on a link: ledger sums (from
:mod:`._queries`) against ``metrics.jsonl`` records and link speeds."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from ._queries import LedgerSource, client_bytes_per_round, cumulative_bytes


def _accuracy_records(metrics: Iterable[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """(round, accuracy) of the metrics records that have both, in file order."""
    out = []
    for m in metrics:
        acc, rnd = m.get("accuracy"), m.get("round")
        if acc is None or rnd is None:
            continue
        try:
            out.append((int(rnd), float(acc)))
        except (TypeError, ValueError):
            continue
    return out


def final_accuracy(metrics: Iterable[Mapping[str, Any]]) -> Any:
    """The ``accuracy`` of the last metrics record that has one (a fraction, as written), or None."""
    out = None
    for record in metrics:
        if record.get("accuracy") is not None:
            out = record["accuracy"]
    return out


def first_round_reaching(metrics: Iterable[Mapping[str, Any]], target: float) -> int | None:
    """The first round (in ``metrics`` order) whose ``accuracy`` (fraction) is ≥ ``target``, or None.
    Records without an accuracy (rounds the server did not evaluate, ``[server] eval_every``) are
    passed over: the round is the first evaluated one, within ``eval_every`` rounds of the true one."""
    for rnd, acc in _accuracy_records(metrics):
        if acc >= target:
            return rnd
    return None


def bytes_to_target(metrics: Iterable[Mapping[str, Any]], rows: LedgerSource, target: float) -> int | None:
    """Device-link wire bytes (bytes) the fleet paid to reach test accuracy ``target``.

    Args:
        metrics: the records of ``metrics.jsonl`` (``round``, ``accuracy`` as a fraction in [0, 1]).
        rows: the run's ledger rows, in ledger order (or an open ledger connection).
        target: accuracy to reach, a fraction (0.95 = 95 %).

    Returns:
        :func:`cumulative_bytes` up to and including the first round whose ``accuracy`` ≥
        ``target``; None when no round reached it.
    """
    rnd = first_round_reaching(metrics, target)
    if rnd is None:
        return None
    return cumulative_bytes(rows, [rnd])[rnd]


def accuracy_curve(metrics: Iterable[Mapping[str, Any]], rows: LedgerSource) -> list[dict[str, Any]]:
    """Test accuracy against the device-link bytes paid so far, one point per evaluated round.

    Returns:
        ``[{"round": R, "accuracy": fraction, "cumulative_bytes": bytes}, …]`` in metrics order
        (see :func:`cumulative_bytes`).
    """
    records = _accuracy_records(metrics)
    cum = cumulative_bytes(rows, [r for r, _ in records])
    return [{"round": r, "accuracy": a, "cumulative_bytes": cum[r]} for r, a in records]


def _check_kbps(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of kbit/s, got {value!r}")


def link_time_s(rows: LedgerSource, uplink_kbps: float | None, downlink_kbps: float | None) -> dict[str, Any]:
    """Estimated time (seconds) to move the device-link bytes over links of the given speeds.

    Every agent has its own link of ``uplink_kbps`` up and ``downlink_kbps`` down, in kbit/s
    (1 kbit/s = 1000 bit/s). A client's time in one direction of one round is its device-view
    wire bytes · 8 / (kbps · 1000) seconds. Per round and direction:

    * ``max``: the slowest client (clients transfer in parallel, each on its own link); the
      round waits for it. This is the estimate of the run's transfer time.
    * ``sum``: the sum over clients (as if the clients shared one link of that speed).

    The session traffic (rows without a round: control packets …) is one more phase, listed as
    ``round`` None and included in the totals. A direction whose speed is None is not estimated
    (its values are None) and is left out of the totals.

    Returns:
        ``{"uplink_kbps", "downlink_kbps", "directions": ["up", "down"] (those estimated),
        "per_round": [{"round", "up_max_s", "up_sum_s", "down_max_s", "down_sum_s"}, …],
        "up_max_s", "up_sum_s", "down_max_s", "down_sum_s", "max_s", "sum_s"}`` where ``max_s``
        and ``sum_s`` add the estimated directions (0.0 when none is).

    Raises:
        ValueError: a speed is not a positive finite number.
    """
    _check_kbps("uplink_kbps", uplink_kbps)
    _check_kbps("downlink_kbps", downlink_kbps)
    speeds = {"up": uplink_kbps, "down": downlink_kbps}
    per: dict[int | None, dict[str, list[int]]] = {}  # round → direction → bytes of each client
    for g in client_bytes_per_round(rows, "device"):
        per.setdefault(g["round"], {"up": [], "down": []})[g["direction"]].append(g["wire_bytes"])
    out: dict[str, Any] = {"uplink_kbps": uplink_kbps, "downlink_kbps": downlink_kbps,
                           "directions": [d for d in ("up", "down") if speeds[d] is not None],
                           "per_round": []}
    sums: dict[str, float | None] = {f"{d}_{k}_s": (None if speeds[d] is None else 0.0)
                                     for d in ("up", "down") for k in ("max", "sum")}
    for rnd, clients in per.items():
        entry: dict[str, Any] = {"round": rnd}
        for d in ("up", "down"):
            kbps = speeds[d]
            if kbps is None:
                entry[f"{d}_max_s"] = entry[f"{d}_sum_s"] = None
                continue
            times = [n * 8 / (kbps * 1000) for n in clients[d]]
            t_max, t_sum = max(times, default=0.0), sum(times)
            entry[f"{d}_max_s"], entry[f"{d}_sum_s"] = t_max, t_sum
            # a direction with a speed starts its sums at 0.0 (None only for directions without one)
            sums[f"{d}_max_s"] = (sums[f"{d}_max_s"] or 0.0) + t_max
            sums[f"{d}_sum_s"] = (sums[f"{d}_sum_s"] or 0.0) + t_sum
        out["per_round"].append(entry)
    out.update(sums)
    out["max_s"] = sum(sums[f"{d}_max_s"] or 0.0 for d in ("up", "down"))
    out["sum_s"] = sum(sums[f"{d}_sum_s"] or 0.0 for d in ("up", "down"))
    return out
