"""The ledger's totals, in SQL: ``GROUP BY`` queries over the ``ledger`` relation of :mod:`._load`.

Every function takes the ledger as **rows** (mappings with the ``messages`` columns, as
:func:`protocol.ledger.read_rows` yields them, in ledger order; they are loaded into an in-memory
SQLite table first) or as an open **connection** from :func:`._load.open_ledger` /
:func:`._load.memory_ledger`, and returns plain JSON-serialisable lists and dicts. Byte counts
are in bytes. The two views, control packets and the byte columns are described in the package
docstring (:mod:`broker_server.audit`).
"""

from __future__ import annotations

import bisect
import sqlite3
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ._load import memory_ledger

#: The two ways to look at the ledger (see the package docstring).
VIEWS = ("device", "server")

#: Kinds of the ledger's MQTT control-packet rows (they also carry ``reason='control'``).
CONTROL_KINDS = frozenset({"CONNECT", "CONNACK", "SUBSCRIBE", "SUBACK", "UNSUBSCRIBE", "UNSUBACK", "PUBACK",
                           "PUBREC", "PUBREL", "PUBCOMP", "PINGREQ", "PINGRESP", "DISCONNECT", "AUTH",
                           "PUBLISH-DUP"})

#: Rows or an open ledger connection (see the module docstring).
LedgerSource = Iterable[Mapping[str, Any]] | sqlite3.Connection

_VIEW_SIDE = {"device": "agent", "server": "server"}

#: SQL: a row is an MQTT control packet (same test as :func:`is_control`).
IS_CONTROL = "(reason = 'control' OR kind IN ({}))".format(", ".join(f"'{k}'" for k in sorted(CONTROL_KINDS)))
#: SQL: the bytes the row's packet took on the link: header + topic + payload, less the bytes of it
#: the socket never took (``unsent_bytes``: the connection was lost with the packet partly written).
WIRE = "(mqtt_header_bytes + topic_bytes + payload_bytes - unsent_bytes)"
#: SQL: a row stands for one whole message, once (same test as :func:`whole_message`).
WHOLE_MESSAGE = "(event IN ('message', 'sent', 'received') AND chunk_index IS NULL)"

#: Sums of one group of view rows (see :func:`_tally`); ``ctl`` and ``wire`` come from :func:`_view`.
_TALLY = """COUNT(*) AS messages,
    COALESCE(SUM(CASE WHEN ctl THEN 0 ELSE body_bytes END), 0) AS body,
    COALESCE(SUM(CASE WHEN ctl THEN 0 ELSE envelope_bytes END), 0) AS envelope,
    COALESCE(SUM(CASE WHEN ctl THEN 0 ELSE mqtt_header_bytes + topic_bytes END), 0) AS mqtt,
    COALESCE(SUM(ctl), 0) AS control_messages,
    COALESCE(SUM(CASE WHEN ctl THEN wire ELSE 0 END), 0) AS control,
    COALESCE(SUM(wire), 0) AS wire,
    COALESCE(SUM(CASE WHEN ctl THEN 0 ELSE sig_bytes END), 0) AS sig,
    COALESCE(SUM(CASE WHEN ctl THEN 0 ELSE enc_bytes END), 0) AS enc,
    COALESCE(SUM(CASE WHEN ctl THEN 0 ELSE unsent_bytes END), 0) AS unsent,
    COALESCE(SUM(NOT ctl AND sig_bytes > 0), 0) AS signed,
    COALESCE(SUM(NOT ctl AND enc_bytes > 0), 0) AS encrypted"""

_EMPTY_TALLY = {"messages": 0, "body": 0, "envelope": 0, "mqtt": 0, "control_messages": 0, "control": 0,
                "wire": 0, "sig": 0, "enc": 0, "unsent": 0, "signed": 0, "encrypted": 0}


@contextmanager
def ledger_db(ledger: LedgerSource, *, ordered: bool = False, keep_ids: bool = False) -> Iterator[sqlite3.Connection]:
    """The connection to query: ``ledger`` itself when it is one, else an in-memory ledger of the
    rows (closed on exit). ``ordered``: rows that all have an ``id`` are put in ``id`` order first
    (what :func:`cumulative_bytes` needs); otherwise they keep the order given. ``keep_ids``: rows
    that all have an ``id`` keep it (what :func:`resume_bytes` needs: the ids ``meta`` notes).

    Raises:
        ValueError: ``ledger`` is a connection without the ``ledger`` relation (not one from
            :func:`._load.open_ledger` or :func:`._load.memory_ledger`).
    """
    if isinstance(ledger, sqlite3.Connection):
        try:
            ledger.execute("SELECT id FROM ledger LIMIT 0")
        except sqlite3.Error as exc:
            raise ValueError("the connection has no 'ledger' relation: open the ledger file with open_ledger(run_dir) "
                             f"or load rows with memory_ledger(rows) ({exc})") from exc
        yield ledger
        return
    rows = list(ledger)
    with_ids = bool(rows) and all(r.get("id") is not None for r in rows)
    if ordered and with_ids:
        rows.sort(key=lambda r: int(r["id"]))
    db = memory_ledger(rows, keep_ids=keep_ids and with_ids)
    try:
        yield db
    finally:
        db.close()


def query(db: sqlite3.Connection, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
    """Rows of an SQL query as dicts keyed by the result's column names."""
    cur = db.execute(sql, tuple(params))
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def _view(view: str) -> tuple[str, tuple[str]]:
    """A ``WITH v AS (…)`` clause selecting the rows of ``view``, with ``wire`` (bytes), ``ctl``
    (0/1: a control packet) and ``dir`` (``'up'``, else ``'down'``) added; and its parameters.

    Raises:
        ValueError: ``view`` is not one of :data:`VIEWS`.
    """
    if view not in _VIEW_SIDE:
        raise ValueError(f"view must be one of {', '.join(map(repr, VIEWS))}, got {view!r}")
    return (f"WITH v AS (SELECT *, {WIRE} AS wire, {IS_CONTROL} AS ctl, "
            "CASE WHEN direction = 'up' THEN 'up' ELSE 'down' END AS dir "
            "FROM ledger WHERE side = ? AND event IN ('sent', 'received', 'rejected')) "), (_VIEW_SIDE[view],)


def _overhead(wire_bytes: int, body_bytes: int) -> float | None:
    """(wire − body) / wire, or None when wire is 0."""
    return (wire_bytes - body_bytes) / wire_bytes if wire_bytes else None


def _tally(t: Mapping[str, Any]) -> dict[str, Any]:
    """The public dict of one :data:`_TALLY` result."""
    return {"messages": t["messages"], "body_bytes": t["body"], "envelope_bytes": t["envelope"],
            "mqtt_bytes": t["mqtt"], "control_messages": t["control_messages"], "control_bytes": t["control"],
            "wire_bytes": t["wire"], "overhead_share": _overhead(t["wire"], t["body"]), "sig_bytes": t["sig"],
            "enc_bytes": t["enc"], "unsent_bytes": t["unsent"], "signed_messages": t["signed"],
            "encrypted_messages": t["encrypted"]}


def round_key(value: int | None) -> tuple[bool, int]:
    """Sort rounds ascending, rows without a round (the session) last."""
    return (value is None, value if value is not None else 0)


def _up_down(groups: list[dict[str, Any]], key: str) -> dict[Any, dict[str, dict[str, Any]]]:
    """``{key value: {"up": tally, "down": tally}}`` of rows grouped by (``key``, ``dir``), in
    the order of ``groups``; a direction without rows gets zero sums."""
    out: dict[Any, dict[str, dict[str, Any]]] = {}
    for g in groups:
        out.setdefault(g[key], {"up": dict(_EMPTY_TALLY), "down": dict(_EMPTY_TALLY)})[g["dir"]] = g
    return out


# --------------------------------------------------------------------------------------------
# Row predicates (the same tests as the SQL constants above, for callers holding rows)


def _str(row: Mapping[str, Any], key: str) -> str:
    value = row.get(key)
    return "" if value is None else str(value)


def is_control(row: Mapping[str, Any]) -> bool:
    """Whether a ledger row is an MQTT control packet (``reason='control'``, or a control kind)."""
    return _str(row, "reason") == "control" or _str(row, "kind") in CONTROL_KINDS


def whole_message(row: Mapping[str, Any]) -> bool:
    """Whether a ledger row stands for one whole message, once: an unchunked ``sent`` or
    ``received`` row, or the ``event='message'`` row of a chunked transfer. The chunk rows of a
    transfer (``chunk_index`` set: ``sent``/``received``, and the ``message`` rows of a chunk
    refused or never handed to the MQTT client) and ``rejected`` rows are not."""
    return row.get("event") in ("message", "sent", "received") and row.get("chunk_index") is None


def round_label(value: int | None) -> str:
    """``'session'`` for traffic without a round (round NULL), else the round number."""
    return "session" if value is None else str(value)


# --------------------------------------------------------------------------------------------
# Totals per link, round, client, kind


def totals(rows: LedgerSource, view: str = "device") -> dict[str, Any]:
    """Totals of ``view`` by direction and overall, control packets included.

    Returns:
        ``{"view": view, "up": T, "down": T, "all": T}`` where each ``T`` holds ``messages``
        (control packets included), ``body_bytes``, ``envelope_bytes``, ``mqtt_bytes``,
        ``control_messages``, ``control_bytes``, ``wire_bytes`` (= body + envelope + sig + enc +
        mqtt + control − unsent), ``overhead_share``, ``sig_bytes``, ``enc_bytes``,
        ``unsent_bytes`` (of application PUBLISH packets the socket took only part of: counted
        whole in body … mqtt, never on the wire; a control packet's are already out of
        ``control_bytes``), ``signed_messages`` and ``encrypted_messages``.

    Raises:
        ValueError: unknown ``view``.
    """
    with_v, params = _view(view)
    with ledger_db(rows) as db:
        groups = query(db, f"{with_v} SELECT dir AS k, {_TALLY} FROM v GROUP BY dir "
                           f"UNION ALL SELECT 'all' AS k, {_TALLY} FROM v", params)
    by = {g["k"]: g for g in groups}
    return {"view": view, **{k: _tally(by.get(k, _EMPTY_TALLY)) for k in ("up", "down", "all")}}


def by_round(rows: LedgerSource, view: str = "device") -> list[dict[str, Any]]:
    """Traffic per round in ``view``, rounds ascending; rows without a round (control packets and
    any other traffic not tied to a round) form the last, *session* row with ``round`` None.

    Returns:
        One dict per round: ``round`` (int or None), ``up_messages``, ``up_bytes`` (wire bytes),
        ``up_body_bytes``, ``down_messages``, ``down_bytes`` (wire bytes), ``down_body_bytes``,
        ``overhead_share`` (both directions together; None when no bytes).

    Raises:
        ValueError: unknown ``view``.
    """
    with_v, params = _view(view)
    with ledger_db(rows) as db:
        groups = query(db, f"{with_v} SELECT round, dir, {_TALLY} FROM v GROUP BY round, dir "
                           "ORDER BY round IS NULL, round", params)
    out = []
    for rnd, t in _up_down(groups, "round").items():
        up, down = t["up"], t["down"]
        out.append({"round": rnd, "up_messages": up["messages"], "up_bytes": up["wire"], "up_body_bytes": up["body"],
                    "down_messages": down["messages"], "down_bytes": down["wire"], "down_body_bytes": down["body"],
                    "overhead_share": _overhead(up["wire"] + down["wire"], up["body"] + down["body"])})
    return out


def by_round_kind(rows: LedgerSource, view: str = "device") -> list[dict[str, Any]]:
    """Traffic per (round, kind, direction) in ``view``: rounds ascending with the session
    (``round`` None) last, then kind, then direction.

    Returns:
        One dict per triple: ``round``, ``kind``, ``direction``, ``control`` (bool: a control
        packet kind), ``messages``, ``wire_bytes`` (bytes).

    Raises:
        ValueError: unknown ``view``.
    """
    with_v, params = _view(view)
    with ledger_db(rows) as db:
        groups = query(db, f"{with_v} SELECT round, kind, direction, MAX(ctl) AS control, COUNT(*) AS messages, "
                           "SUM(wire) AS wire_bytes FROM v GROUP BY round, kind, direction "
                           "ORDER BY round IS NULL, round, kind, direction", params)
    return [{**g, "control": bool(g["control"])} for g in groups]


def by_client(rows: LedgerSource, view: str = "device") -> list[dict[str, Any]]:
    """Traffic per client in ``view``, sorted by client id.

    ``client`` is the agent a row concerns; in the server view a broadcast (and the server's own
    control packets) is recorded with client ``'*'``.

    Returns:
        One dict per client: ``client``, ``up_messages``, ``up_bytes``, ``down_messages``,
        ``down_bytes`` (wire bytes), ``body_bytes`` (both directions).

    Raises:
        ValueError: unknown ``view``.
    """
    with_v, params = _view(view)
    with ledger_db(rows) as db:
        groups = query(db, f"{with_v} SELECT client, dir, {_TALLY} FROM v GROUP BY client, dir ORDER BY client",
                       params)
    return [{"client": c, "up_messages": t["up"]["messages"], "up_bytes": t["up"]["wire"],
             "down_messages": t["down"]["messages"], "down_bytes": t["down"]["wire"],
             "body_bytes": t["up"]["body"] + t["down"]["body"]}
            for c, t in _up_down(groups, "client").items()]


def by_kind(rows: LedgerSource, view: str = "device") -> list[dict[str, Any]]:
    """Traffic per (message kind, direction) in ``view``, sorted by kind then direction.

    Control packets appear under their own kinds (``CONNECT``, ``PUBACK`` …), with all their
    bytes in ``control_bytes``.

    Returns:
        One dict per pair: ``kind``, ``direction`` (``'up'``/``'down'``), and the sums of
        :func:`totals` (``messages``, ``body_bytes``, ``envelope_bytes``, ``mqtt_bytes`` (header +
        topic), ``control_messages``, ``control_bytes``, ``wire_bytes``, ``overhead_share`` …).

    Raises:
        ValueError: unknown ``view``.
    """
    with_v, params = _view(view)
    with ledger_db(rows) as db:
        groups = query(db, f"{with_v} SELECT kind, direction, {_TALLY} FROM v GROUP BY kind, direction "
                           "ORDER BY kind, direction", params)
    return [{"kind": g["kind"], "direction": g["direction"], **_tally(g)} for g in groups]


# --------------------------------------------------------------------------------------------
# Rejected messages; the run's rounds and federation


def rejected(rows: LedgerSource) -> list[dict[str, Any]]:
    """Rejected messages (either side), in ledger order.

    Returns:
        One dict per rejected row: ``side``, ``node`` (who rejected it), ``topic``, ``reason``,
        ``payload_bytes`` (the MQTT payload length, bytes).
    """
    with ledger_db(rows) as db:
        return query(db, "SELECT side, node, topic, reason, payload_bytes FROM ledger WHERE event = 'rejected' "
                         "ORDER BY id")


def rejected_totals(rows: LedgerSource) -> dict[str, int]:
    """Rejected rows of either side: ``messages``, ``payload_bytes``, ``wire_bytes`` (bytes)."""
    with ledger_db(rows) as db:
        (out,) = query(db, f"SELECT COUNT(*) AS messages, COALESCE(SUM(payload_bytes), 0) AS payload_bytes, "
                           f"COALESCE(SUM({WIRE}), 0) AS wire_bytes FROM ledger WHERE event = 'rejected'")
    return out


#: The ledger's sides, as the delivery counts name them: the agents' PUBLISH packets travel on the
#: device links, the server's on the server link.
SIDES = ("agent", "server")


def _delivery_counts(db: sqlite3.Connection, where: str, params: tuple[Any, ...]) -> dict[str, int]:
    """``acked``, ``handed``, ``refused``, ``unknown``, ``dropped``, ``not_handed``,
    ``undeliverable``, ``not_sent``, ``sent`` of the ledger rows matching ``where`` (see
    :func:`deliveries`)."""
    counts = {d: n for d, n in db.execute(
        f"SELECT delivery, COUNT(*) FROM ledger WHERE event = 'sent' AND reason != 'control' AND {where} "
        "GROUP BY delivery", params)}
    refused_messages = db.execute(f"SELECT COUNT(*) FROM ledger WHERE event = 'message' AND delivery = 'refused' "
                                  f"AND {where}", params).fetchone()[0]
    given_up, not_sent = db.execute(
        f"SELECT COALESCE(SUM(NOT ({_NOT_SENT})), 0), COALESCE(SUM({_NOT_SENT}), 0) FROM ledger "
        f"WHERE kind = 'undeliverable' AND {where}", params).fetchone()
    never_written, not_handed = db.execute(
        f"SELECT COALESCE(SUM(NOT ({NOT_HANDED})), 0), COALESCE(SUM({NOT_HANDED}), 0) FROM ledger "
        f"WHERE event = 'message' AND delivery = 'dropped' AND kind != 'undeliverable' AND reason != 'control' "
        f"AND {where}", params).fetchone()
    return {"acked": counts.get("acked", 0), "handed": counts.get("handed", 0),
            "refused": counts.get("refused", 0) + refused_messages, "unknown": counts.get("", 0),
            "dropped": counts.get("dropped", 0) + never_written, "not_handed": not_handed,
            "undeliverable": given_up, "not_sent": not_sent, "sent": sum(counts.values())}


#: An ``undeliverable`` row of a message (or chunk) the channel could not send: QoS 0 while the
#: link was down (MQTT keeps no QoS 0 message for the reconnect), or still queued when the
#: connection or the transport closed: the channel writes it with delivery ``dropped``. The
#: broker never saw it: not one it refused.
_NOT_SENT = "delivery = 'dropped'"

#: SQL: a ``message`` row (delivery ``dropped``) of a PUBLISH the transport never took: an unchunked
#: message, or a chunk and the chunks after it, offered to a closed transport or one whose offline
#: buffer was full (:meth:`protocol.channel.Channel.send`). Not one the lost connection took out of
#: the MQTT client's queue: it was never in it.
NOT_HANDED = "(reason LIKE 'not handed to the MQTT client:%')"


def deliveries(rows: LedgerSource) -> dict[str, Any]:
    """What became of the PUBLISH packets each side sent (the ledger's ``delivery`` column; a
    ledger older than schema 5 has none: every count is then 0 but ``unknown``).

    Returns:
        ``acked`` (the broker's PUBACK accepted them), ``handed`` (handed to the MQTT client and
        never acknowledged: QoS 0, or no PUBACK came), ``refused`` (PUBACK reason code >= 0x80, a
        packet above the broker's limit, one it disconnected for), ``unknown`` (rows without a
        delivery: older ledgers), all counts of ``sent`` PUBLISH rows of both sides together;
        ``dropped``: PUBLISH packets handed to the MQTT client that the lost connection (or the
        transport's close) took out of its queue before the socket took all of them (QoS 0, or
        unsent at close): partly written ones stay ``sent`` rows, never written ones are out of
        the wire totals (``message`` rows);
        ``not_handed``: PUBLISH packets the MQTT client never took (:data:`NOT_HANDED`: the
        transport was closed, or its offline buffer full; an unchunked message, or chunks of a
        transfer): not sent, out of the wire totals (``message`` rows, delivery ``dropped``);
        ``undeliverable``: messages given up after the broker's refusals; ``not_sent``: QoS 0
        messages (or chunks) the channel could not send, the link being down (not the broker's
        doing: it never saw them); ``sent``: the ``sent`` PUBLISH rows;
        ``by_side``: the same counts per side that sent them, ``"agent"`` (the devices, on the
        device links) and ``"server"`` (on the server link); ``refusals``: up to 20
        ``{side, node, kind, reason, count, what}`` (reasons in the order first seen; ``what``:
        ``"refused"`` by the broker, ``"given up"`` after its refusals, ``"not sent"``: QoS 0
        while the link was down, ``"not handed"``: never handed to the MQTT client).
    """
    untaken = f"(event = 'message' AND delivery = 'dropped' AND kind != 'undeliverable' AND {NOT_HANDED})"
    with ledger_db(rows) as db:
        out: dict[str, Any] = _delivery_counts(db, "1", ())
        out["by_side"] = {side: _delivery_counts(db, "side = ?", (side,)) for side in SIDES}
        out["refusals"] = query(db, f"SELECT side, node, kind, reason, COUNT(*) AS count, CASE WHEN {untaken} THEN "
                                    f"'not handed' WHEN kind != 'undeliverable' THEN 'refused' WHEN {_NOT_SENT} THEN "
                                    "'not sent' ELSE 'given up' END AS what FROM ledger WHERE delivery = 'refused' "
                                    f"OR kind = 'undeliverable' OR {untaken} GROUP BY side, node, kind, reason "
                                    "ORDER BY MIN(id) LIMIT 20")
    return out


def training_rounds(rows: LedgerSource) -> int:
    """Distinct round numbers ≥ 1 in the ledger (any side, any event)."""
    with ledger_db(rows) as db:
        return db.execute("SELECT COUNT(DISTINCT round) FROM ledger WHERE round > 0").fetchone()[0]


def federations(rows: LedgerSource) -> list[str]:
    """The distinct non-empty federation names of the rows, sorted."""
    with ledger_db(rows) as db:
        return [r[0] for r in db.execute("SELECT DISTINCT federation FROM ledger WHERE federation != '' "
                                         "ORDER BY federation")]


# --------------------------------------------------------------------------------------------
# Bytes paid up to a round; bytes per client per round


def cumulative_bytes(rows: LedgerSource, rounds: Iterable[int]) -> dict[int, int]:
    """Device-link wire bytes (bytes) paid by the fleet up to and including each round in ``rounds``.

    For training round ``R`` (≥ 1): every device-view row of a round 1 … ``R``, plus every
    *session* row recorded in the ledger **before** the last row of those rounds. Session rows
    are the ones not tied to a training round: ``round`` NULL (MQTT control packets: CONNECT,
    SUBSCRIBE, PUBACK …) or ``round`` 0 (what the protocol sends outside a round: join, status,
    resend). So the connection set-up and the acknowledgements exchanged up to the end of round
    ``R`` count, the final ``offline`` status and DISCONNECT do not. Rows are taken in ledger
    order (by ``id`` where every row has one); rows of later rounds never count, even when they
    interleave.

    Returns:
        ``{R: bytes}`` for every ``R`` in ``rounds`` (0 where the ledger has nothing up to ``R``).
    """
    with_v, params = _view("device")
    with ledger_db(rows, ordered=True) as db:
        # pre: per known round k, the bytes of rounds 1..k and the id of the last row of those
        # rounds (running SUM and MAX over the rounds ascending). Then one running sum in id order
        # over the session rows (round NULL or < 1) with a mark at each of those last rows: at a
        # mark it holds the session bytes recorded before that row.
        prefix = db.execute(
            f"{with_v}, per AS (SELECT round, SUM(wire) AS b, MAX(id) AS last FROM v WHERE round >= 1 GROUP BY round),"
            " pre AS (SELECT round, SUM(b) OVER w AS cb, MAX(last) OVER w AS cl FROM per"
            " WINDOW w AS (ORDER BY round ROWS UNBOUNDED PRECEDING)),"
            " marks AS (SELECT cl AS id, round, cb, 1 AS mark, 0 AS wire FROM pre"
            " UNION ALL SELECT id, NULL, 0, 0, wire FROM v WHERE round IS NULL OR round < 1),"
            " run AS (SELECT round, cb, mark, SUM(wire) OVER (ORDER BY id, mark ROWS UNBOUNDED PRECEDING) AS before"
            " FROM marks)"
            " SELECT round, cb + before FROM run WHERE mark ORDER BY round",
            params).fetchall()
    known = [r for r, _ in prefix]
    out: dict[int, int] = {}
    for target_round in rounds:
        i = bisect.bisect_right(known, target_round)
        out[target_round] = prefix[i - 1][1] if i else 0
    return out


def cumulative_parts(rows: LedgerSource, rnd: int) -> dict[str, Any]:
    """What :func:`cumulative_bytes` of round ``rnd`` is made of, in the rows of :func:`by_round`
    (device links; bytes = wire bytes).

    ``cumulative_bytes(rows, [rnd])[rnd]`` = ``rounds_bytes`` + ``round0_bytes`` +
    ``session_bytes``: the whole rows of rounds 1 … ``rnd``, and the traffic outside the rounds
    recorded before the last row of those rounds: of round 0 (and below: join, status …) and of
    the *session* row (``round`` NULL: control packets …). The rest of those two rows came later
    and does not count (the final ``offline`` statuses, the DISCONNECTs).

    Returns:
        ``round`` (``rnd``), ``last_round`` (the last round 1 … ``rnd`` with rows; None when
        none has), ``rounds_bytes``, ``rounds_messages``; ``round0_bytes`` and ``round0_messages``
        (counted), ``round0_all_bytes`` (the whole round 0 row); ``session_bytes``,
        ``session_messages``, ``session_control_messages`` (counted), ``session_all_bytes`` (the
        whole session row); ``wire_bytes`` (the sum of the three counted parts).
    """
    with_v, params = _view("device")
    with ledger_db(rows, ordered=True) as db:
        (out,) = query(db, f"""{with_v}, mark AS (SELECT MAX(id) AS last, MAX(round) AS last_round FROM v
            WHERE round BETWEEN 1 AND ?)
            SELECT (SELECT last_round FROM mark) AS last_round,
              COALESCE(SUM(CASE WHEN round BETWEEN 1 AND ? THEN wire END), 0) AS rounds_bytes,
              COALESCE(SUM(round BETWEEN 1 AND ?), 0) AS rounds_messages,
              COALESCE(SUM(CASE WHEN round < 1 AND id < (SELECT last FROM mark) THEN wire END), 0) AS round0_bytes,
              COALESCE(SUM(round < 1 AND id < (SELECT last FROM mark)), 0) AS round0_messages,
              COALESCE(SUM(CASE WHEN round < 1 THEN wire END), 0) AS round0_all_bytes,
              COALESCE(SUM(CASE WHEN round IS NULL AND id < (SELECT last FROM mark) THEN wire END), 0)
                AS session_bytes,
              COALESCE(SUM(round IS NULL AND id < (SELECT last FROM mark)), 0) AS session_messages,
              COALESCE(SUM(round IS NULL AND ctl AND id < (SELECT last FROM mark)), 0) AS session_control_messages,
              COALESCE(SUM(CASE WHEN round IS NULL THEN wire END), 0) AS session_all_bytes
            FROM v""", (*params, rnd, rnd, rnd))
    out["round"] = rnd
    out["wire_bytes"] = out["rounds_bytes"] + out["round0_bytes"] + out["session_bytes"]
    return out


def client_bytes_per_round(rows: LedgerSource, view: str = "device") -> list[dict[str, Any]]:
    """Wire bytes per (round, direction, client) in ``view``: rounds ascending with the session
    (``round`` None) last, then direction (``'down'``, ``'up'``), then clients in the order of
    their first row in that round and direction.

    Returns:
        One dict per triple: ``round``, ``direction`` (``'up'``, else ``'down'``), ``client``,
        ``wire_bytes``.

    Raises:
        ValueError: unknown ``view``.
    """
    with_v, params = _view(view)
    with ledger_db(rows) as db:
        return query(db, f"{with_v} SELECT round, dir AS direction, client, SUM(wire) AS wire_bytes FROM v "
                         "GROUP BY round, dir, client ORDER BY round IS NULL, round, dir, MIN(id)", params)


# --------------------------------------------------------------------------------------------
# What a --resume added


#: The bytes of one part of a resume, by kind and direction (see :func:`resume_bytes`).
_RESUME_PART = """SELECT kind, dir AS direction, MAX(ctl) AS control, COUNT(*) AS messages, COALESCE(SUM(wire), 0)
    AS wire_bytes FROM v WHERE {where} GROUP BY kind, dir ORDER BY MIN(id)"""

#: The parts of what a resume added, in the order told (see :func:`resume_bytes`).
RESUME_PARTS = ("rerun", "ending", "rejoin", "refusal")

#: Far beyond any row id: the upper bound of the last session.
_NO_ID = 2 ** 62


def _sqlite_int(value: Any) -> int:
    """``int(value)`` within ±:data:`_NO_ID` (SQLite takes no integer beyond 64 bits): a note
    larger than that is beyond every row id and round of a ledger, as is the bound it is cut to,
    so the queries' answer is the same.

    Raises:
        ValueError, OverflowError, TypeError: ``value`` is not a number (NaN, ±Infinity …).
    """
    return max(-_NO_ID, min(int(value), _NO_ID))


def _part(db: sqlite3.Connection, with_v: str, params: tuple[Any, ...], where: str,
          where_params: tuple[Any, ...]) -> dict[str, Any]:
    """``messages``, ``up_bytes``, ``down_bytes``, ``wire_bytes``, ``control_messages``,
    ``kinds`` (``kind``, ``direction``, ``control``, ``messages``, ``wire_bytes``, in the order
    first recorded) and ``rounds`` (``round``, None for the session, ``messages``,
    ``wire_bytes``: where :func:`by_round` counts them) of the view rows matching ``where``."""
    kinds = query(db, with_v + _RESUME_PART.format(where=where), (*params, *where_params))
    rounds = query(db, f"{with_v} SELECT round, COUNT(*) AS messages, COALESCE(SUM(wire), 0) AS wire_bytes FROM v "
                       f"WHERE {where} GROUP BY round ORDER BY round IS NULL, round", (*params, *where_params))
    return {"messages": sum(k["messages"] for k in kinds),
            "up_bytes": sum(k["wire_bytes"] for k in kinds if k["direction"] == "up"),
            "down_bytes": sum(k["wire_bytes"] for k in kinds if k["direction"] == "down"),
            "wire_bytes": sum(k["wire_bytes"] for k in kinds),
            "control_messages": sum(k["messages"] for k in kinds if k["control"]),
            "kinds": [{**k, "control": bool(k["control"])} for k in kinds], "rounds": rounds}


def _sum_parts(parts: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    keys = ("messages", "up_bytes", "down_bytes", "wire_bytes", "control_messages")
    out = dict.fromkeys(keys, 0)
    for p in parts:
        for k in keys:
            out[k] += p[k]
    return out


def _from_start(db: sqlite3.Connection, registry: int | None, lo: int, hi: int) -> bool:
    """Whether a resume after round 0 whose session holds the rows ``lo`` < id ≤ ``hi`` started the
    run again from its joins (see :func:`resume_bytes`, ``rejoin``): its note's ``registry`` is 0
    (no checkpoint: every device had to join again), or, where the note does not say (None), a
    device joined that session (a ``join`` sent or received, whichever side wrote it)."""
    if registry is not None:
        return registry == 0
    return bool(db.execute("SELECT EXISTS (SELECT 1 FROM ledger WHERE id > ? AND id <= ? AND kind = 'join' "
                           "AND event IN ('sent', 'received'))", (lo, hi)).fetchone()[0])


def resume_bytes(rows: LedgerSource, resumes: Iterable[Mapping[str, Any]], view: str = "device") -> dict[str, Any]:
    """The bytes of ``view`` that the resumes of a run added to its ledger (bytes = wire bytes).

    ``resumes`` are the ledger's notes (:func:`broker_server.resumes.ledger_resumes`: per resume
    ``after_round`` R and ``after_id`` L, the newest row id before the resumed session). They cut
    the ledger into sessions: rows up to the first L, rows after it up to the next, …; resume k
    goes on from session k−1 (the last one not refused) to session k. Every row stays counted in
    the run's totals (each crossed the wire); these are the ones an uninterrupted run would not
    have sent, in four parts:

    ``rerun``
        re-sent: the rows of session k−1 of rounds after R, the rounds the resumed session ran
        again (their ``global``, ``round_start``, updates, receipts …); and the update copies of
        session k received (server view) or sent (device view) before session k's first download
        of their round: a device sending again an update of the interrupted session (its
        receipt timeout) to a resumed server that has not opened that round yet (the server's
        ``early``, not answered; the device sends it once more when the round starts).
    ``ending``
        the end of session k−1: its rows without a training round (``round`` NULL or 0: MQTT
        control packets, statuses) recorded after its first row of a round after R, or after its
        last row of rounds 1 … R where that comes first (the acknowledgements that went with the
        unfinished attempt; a stopped run's offline statuses and DISCONNECTs), and its ``finish``
        (a run resumed with more rounds after it had finished). A control packet names no message:
        one acknowledging a row of round R may count here, one acknowledging a re-sent row may
        fall before it (4 B each, a PUBACK).
    ``rejoin``
        reconnecting: the resumed session's rows without a training round (connections, joins,
        statuses: the last wills of the interrupted session's devices among them) recorded before
        its first download of a round after R (an uninterrupted run connects and joins once).
        A resume *from the start* (``from_start``: after round 0 with no registry to go on from)
        is the exception: the resumed session starts the run again from its joins, it sends what
        an uninterrupted run sends, and the interrupted session is the one whose connections and
        joins are extra: its rows without a training round up to where ``ending`` begins (with
        ``rerun`` and ``ending``: every row of that session). A resume after round 0 is from the
        start when its note says the checkpoint it took back held no registry (``registry`` 0:
        there was no checkpoint, every device had to join again); one whose checkpoint held the
        devices that had joined (round 0's, written once they had) goes on from their joins as
        after any later round: the devices come back (their ``online`` status) and only what
        the resumed session adds is extra, a join of a device that joins again included. A note
        that does not say (written before ``registry`` was noted) is from the start when the
        resumed session has a ``join`` row (a device joined again: without a registry every one
        must), and not when it has none (the devices came back: the registry was restored).
    ``refusal``
        a refused ``--resume`` attempt (a note with ``refused`` true: the checkpoint did not load,
        :func:`broker_server.resumes.refused_if_raises`): every row of its session, its
        connections. It goes on from nothing: the next resume goes on from the session before it
        (rows of a refused session are in no other part), and a run never continued after it
        keeps its ending (a finished run's finish and goodbyes are its own).

    Args:
        rows: ledger rows (with their ``id``: the noted ids refer to them) or an open ledger
            connection.
        resumes: the notes, each with ``after_round`` and ``after_id`` (and ``refused``, true
            for a refused attempt).
        view: ``"device"`` or ``"server"``.

    Returns:
        ``view``; ``resumes``: one dict per resume in ``after_id`` order, with ``after_round``,
        ``after_id``, ``refused`` (bool), ``registry`` (the note's, None where it has none),
        ``from_start`` (bool: see ``rejoin``), ``from_session`` (the session it goes on from: 0 the
        first, k−1 …; None when refused), ``finished`` (that session had a ``finish``: the run
        was continued after it had finished), ``rerun_rounds`` (the rounds after R that session
        had begun), ``early_updates`` (the early update rows counted in ``rerun``: chunk rows
        each), ``rerun``, ``ending``, ``rejoin`` and ``refusal`` (each: ``messages``,
        ``up_bytes``, ``down_bytes``, ``wire_bytes``, ``control_messages``; ``kinds``: per
        ``kind`` and ``direction``, ``control``, ``messages``, ``wire_bytes``; ``rounds``: per
        ``round`` (None: the session row of :func:`by_round`), ``messages``, ``wire_bytes``),
        ``messages`` and ``wire_bytes`` (the four parts); ``rerun``, ``ending``, ``rejoin``,
        ``refusal``, ``all``: the sums over the resumes (``messages``, ``up_bytes``,
        ``down_bytes``, ``wire_bytes``, ``control_messages``).

    Raises:
        ValueError: unknown ``view``.
    """
    with_v, params = _view(view)
    marks: list[dict[str, Any]] = sorted(
        ({"after_round": _sqlite_int(m["after_round"]), "after_id": _sqlite_int(m["after_id"]),
          "refused": bool(m.get("refused")),
          "registry": None if m.get("registry") is None else _sqlite_int(m["registry"])} for m in resumes),
        key=lambda m: m["after_id"])
    bounds = [0] + [m["after_id"] for m in marks] + [_NO_ID]
    out: list[dict[str, Any]] = []

    def one(db: sqlite3.Connection, sql: str, *args: Any) -> Any:
        return db.execute(f"{with_v} {sql}", (*params, *args)).fetchone()[0]

    with ledger_db(rows, keep_ids=True) as db:
        nothing = _part(db, with_v, params, "0", ())
        went_on = 0  # the session the next resume goes on from: the first, or the last one not refused
        for k, m in enumerate(marks, start=1):
            hi, nxt, r = bounds[k], bounds[k + 1], m["after_round"]
            if m["refused"]:
                refusal = _part(db, with_v, params, "id > ? AND id <= ?", (hi, nxt))
                out.append({**m, "from_start": False, "from_session": None, "finished": False, "rerun_rounds": [],
                            "early_updates": 0,
                            "rerun": nothing, "ending": nothing, "rejoin": nothing,
                            "refusal": refusal, "messages": refusal["messages"],
                            "wire_bytes": refusal["wire_bytes"]})
                continue
            # the session it goes on from: the rows of the last session not refused, up to the next note
            lo, end, session = bounds[went_on], bounds[went_on + 1], went_on
            went_on = k
            finished = db.execute("SELECT EXISTS (SELECT 1 FROM ledger WHERE id > ? AND id <= ? AND kind = 'finish')",
                                  (lo, end)).fetchone()[0]
            first_again = one(db, "SELECT MIN(id) FROM v WHERE id > ? AND id <= ? AND round > ?", lo, end, r)
            last_kept = one(db, "SELECT MAX(id) FROM v WHERE id > ? AND id <= ? AND round BETWEEN 1 AND ? "
                                "AND kind != 'finish'", lo, end, r)
            marks_end = [i for i in (first_again, last_kept) if i is not None]
            # a device's copy of an update it had sent the interrupted session, sent again to the resumed
            # one before that session opened its round (the server's "early", not answered)
            early_where = ("id > ? AND id <= ? AND kind = 'update' AND dir = 'up' AND round > ? AND id < COALESCE("
                           "(SELECT MIN(d.id) FROM v d WHERE d.id > ? AND d.id <= ? AND d.dir = 'down' "
                           "AND d.round = v.round), ?)")
            early_params = (hi, nxt, r, hi, nxt, _NO_ID)
            early = one(db, f"SELECT COUNT(*) FROM v WHERE {early_where} AND NOT ctl", *early_params)
            rerun = _part(db, with_v, params, f"(id > ? AND id <= ? AND round > ?) OR ({early_where})",
                          (lo, end, r, *early_params))
            ending = _part(db, with_v, params, "id > ? AND id <= ? AND (kind = 'finish' OR ((round IS NULL OR "
                                               "round < 1) AND id > ?))", (lo, end, min(marks_end, default=end)))
            from_start = r == 0 and _from_start(db, m["registry"], hi, nxt)
            if from_start:  # no registry: the resumed session is a whole run, the interrupted one's joins are extra
                rejoin = _part(db, with_v, params, "id > ? AND id <= ? AND (round IS NULL OR round < 1) AND kind != "
                                                   "'finish'", (lo, min(marks_end, default=end)))
            else:
                again = one(db, "SELECT MIN(id) FROM v WHERE id > ? AND id <= ? AND round > ? AND dir = 'down'",
                            hi, nxt, r)
                rejoin = _part(db, with_v, params, "id > ? AND id <= ? AND id < ? AND (round IS NULL OR round < 1)",
                               (hi, nxt, nxt + 1 if again is None else again))
            rounds = [x for (x,) in db.execute(f"{with_v} SELECT DISTINCT round FROM v WHERE id > ? AND id <= ? "
                                               "AND round > ? ORDER BY round", (*params, lo, end, r))]
            parts = (rerun, ending, rejoin)
            out.append({**m, "from_start": from_start, "from_session": session, "finished": bool(finished),
                        "rerun_rounds": rounds,
                        "early_updates": early,
                        "rerun": rerun, "ending": ending, "rejoin": rejoin,
                        "refusal": nothing, "messages": sum(p["messages"] for p in parts),
                        "wire_bytes": sum(p["wire_bytes"] for p in parts)})
    sums = {key: _sum_parts(x[key] for x in out) for key in RESUME_PARTS}
    return {"view": view, "resumes": out, **sums, "all": _sum_parts(sums.values())}


# --------------------------------------------------------------------------------------------
# What the devices sent or received again: a resume's or reconnect's cost as an agent's ledger tells it


#: Application kinds a device sends or receives once per round (``round`` 0: per run) in an
#: uninterrupted session, where a later copy of the same round is one sent or received again
#: (see :func:`repeat_bytes`); ``round_start`` once per round and topic.
REPEAT_KINDS = ("join", "round_start", "global", "update", "receipt", "finish")

#: The control packets that set a connection up: those of a connection after the first are a
#: reconnection's (see :func:`repeat_bytes`).
CONNECTION_KINDS = ("CONNECT", "CONNACK", "SUBSCRIBE", "SUBACK")

#: The parts of :func:`repeat_bytes`, in the order told.
REPEAT_PARTS = ("again", "dup", "reconnect")

#: SQL (after :func:`_view`'s ``WITH v``): the ids of the ``again`` part. A *group* is one device's
#: (``federation``, ``node``) rows of one kind, direction and round (and topic, for ``round_start``);
#: a *copy* is one message: its transfer (a chunked message's chunk rows), else its envelope
#: (``sender``, ``seq``), else the row alone (a ledger without seq); a *piece* is one chunk of a
#: copy (or the whole unchunked copy). Counted: every row but the first row of each piece of the
#: group's first copy, and every ``resend`` row.
_AGAIN_IDS = """SELECT id FROM (
    SELECT id, kind,
      MIN(id) OVER (PARTITION BY federation, node, kind, dir, round, t) AS group_first,
      MIN(id) OVER (PARTITION BY federation, node, kind, dir, round, t, copy) AS copy_first,
      MIN(id) OVER (PARTITION BY federation, node, kind, dir, round, t, copy, chunk_index) AS piece_first
    FROM (SELECT id, federation, node, kind, dir, round, chunk_index,
            CASE WHEN kind = 'round_start' THEN topic ELSE '' END AS t,
            COALESCE('transfer ' || transfer_id, 'message ' || sender || ' ' || seq, 'row ' || id) AS copy
          FROM v WHERE NOT ctl AND kind IN ({kinds})))
  WHERE kind = 'resend' OR copy_first != group_first OR id != piece_first""".format(
    kinds=", ".join(f"'{k}'" for k in (*REPEAT_KINDS, "resend")))

#: SQL: each device's (``federation``, ``node``) first row that is not a control packet (any
#: event: its first message, sent or not); the connection made before it is the device's first.
_FIRST_MESSAGE = f"""SELECT federation, node, MIN(id) AS first_id FROM ledger
    WHERE side = 'agent' AND NOT {IS_CONTROL} GROUP BY federation, node"""

#: SQL (after ``WITH v``): the ids of the ``reconnect`` part: a device's connection set-up packets
#: from its first CONNECT after its first message on.
_RECONNECT_IDS = """SELECT v.id FROM v JOIN (
      SELECT c.federation, c.node, MIN(c.id) AS from_id FROM v c JOIN ({first}) f USING (federation, node)
      WHERE c.kind = 'CONNECT' AND c.id > f.first_id GROUP BY c.federation, c.node) b USING (federation, node)
    WHERE v.kind IN ({kinds}) AND v.id >= b.from_id""".format(first=_FIRST_MESSAGE,
                                                              kinds=", ".join(f"'{k}'" for k in CONNECTION_KINDS))


#: The temporary table :func:`repeat_bytes` notes the counted rows' ids in (dropped when it returns).
_REPEAT_IDS = "fedfleet_repeat_ids"


def repeat_bytes(rows: LedgerSource) -> dict[str, Any]:
    """What the devices sent or received again, on the device links (agent-side rows; bytes =
    wire bytes): a resume's or reconnect's cost as a device's own ledger tells it, counted row by
    row, never estimated.

    A server stopped and resumed (``--resume``), a broker restarted, a link that broke: the device
    receives a round's ``global`` and ``round_start`` again, confirms the global again, sends its
    update again (and gets its receipt again), and after a broken connection connects again and
    MQTT retransmits what was in flight. A device's ledger keeps no note of the outage (a server's
    ledger notes its resumes: :func:`resume_bytes`), but each of these is a row that an
    uninterrupted session does not have. Per device (the ``federation`` and ``node`` of its
    rows), three parts:

    ``again``
        copies after the first: of :data:`REPEAT_KINDS`, one group per kind, direction and round
        (``join`` and its receipt: round 0), and for ``round_start`` per topic too (a round may
        bring one on ``down/round_start`` and one on the device's own topic, both first copies);
        every row of a group's later copies (a copy: one transfer of a chunked message, else one
        envelope ``sender``/``seq``, else one row), and a chunk, or an unchunked message, of its
        first copy recorded again (the same message delivered twice); and every ``resend`` row
        (a request for missing chunks, sent or received).
    ``dup``
        every ``PUBLISH-DUP`` row: a PUBLISH sent or received again after a reconnect (MQTT
        retransmission).
    ``reconnect``
        the connection set-up packets (:data:`CONNECTION_KINDS`: CONNECT, CONNACK, SUBSCRIBE,
        SUBACK) from the first CONNECT the device sent after its first message on. A device
        connects (its first connection: an MQTT 5 trial and the connect retries included) before
        it sends or receives anything, so every later connection is a reconnection (a restarted
        agent process writing on to the same ledger makes one too).

    Whatever made a message go again counts: the ledger does not say why (a server resume, a
    broker restart, an update's receipt later than ``receipt_timeout_s``, a global re-sent in
    smaller packets after a broker refused its size, a join re-sent while no server answered:
    a device started before its server). Not counted, as no row ties them to the outage: the
    acknowledgements (PUBACK) of the messages counted (a control packet names no message),
    keepalive pings, DISCONNECT, the ``online`` status a device publishes again after a
    reconnect (a row like its first one), and a ``round_start`` re-sent on the device's own
    topic after a broadcast one (the server's copy for a device that came back). A ledger whose
    device has no CONNECT row at all (written without control packets: a transport that does not
    report them, or an older fedfleet) cannot tell its ``dup`` and ``reconnect`` parts: that
    device is listed in ``without_control``.

    Args:
        rows: ledger rows (in ledger order, or with their ``id``) or an open ledger connection.

    Returns:
        ``view`` (``"device"``), ``again``, ``dup``, ``reconnect`` (each: ``messages``,
        ``up_bytes``, ``down_bytes``, ``wire_bytes``, ``control_messages``; ``kinds``: per
        ``kind`` and ``direction``, ``control``, ``messages``, ``wire_bytes``, in the order first
        recorded; ``rounds``: per ``round`` (None: the session row of :func:`by_round`),
        ``messages``, ``wire_bytes``), ``all`` (the sums of the three), ``by_client`` (per
        device with rows counted, by id: ``client``, ``messages``, ``up_bytes``, ``down_bytes``,
        ``wire_bytes``) and ``without_control`` (the devices whose rows hold no CONNECT, sorted:
        their ``dup`` and ``reconnect`` are unknown, not 0; [] when every device's are known).
    """
    with_v, params = _view("device")
    with ledger_db(rows, ordered=True, keep_ids=True) as db:
        # each counted row's id and part, found once (the window queries), then summed per part; the
        # transaction its inserts open (a read of the ledger) ends with it, unless the caller had one open
        was_open = db.in_transaction
        db.execute(f"CREATE TEMP TABLE {_REPEAT_IDS} (id INTEGER PRIMARY KEY, part TEXT NOT NULL)")
        try:
            for name, ids in (("again", _AGAIN_IDS), ("dup", "SELECT id FROM v WHERE kind = 'PUBLISH-DUP'"),
                              ("reconnect", _RECONNECT_IDS)):
                db.execute(f"{with_v} INSERT INTO temp.{_REPEAT_IDS} SELECT id, ? FROM ({ids})", (*params, name))
            parts = {name: _part(db, with_v, params, f"id IN (SELECT id FROM temp.{_REPEAT_IDS} WHERE part = ?)",
                                 (name,)) for name in REPEAT_PARTS}
            clients = query(db, f"{with_v} SELECT node AS client, COUNT(*) AS messages, "
                                "COALESCE(SUM(CASE WHEN dir = 'up' THEN wire END), 0) AS up_bytes, "
                                "COALESCE(SUM(CASE WHEN dir = 'down' THEN wire END), 0) AS down_bytes, "
                                f"COALESCE(SUM(wire), 0) AS wire_bytes FROM v WHERE id IN (SELECT id FROM temp."
                                f"{_REPEAT_IDS}) GROUP BY node ORDER BY node", params)
        finally:
            db.execute(f"DROP TABLE temp.{_REPEAT_IDS}")
            if db.in_transaction and not was_open:
                db.commit()
        without = [n for (n,) in db.execute(
            "SELECT DISTINCT node FROM (SELECT node FROM ledger WHERE side = 'agent' GROUP BY federation, node "
            "HAVING SUM(kind = 'CONNECT') = 0) ORDER BY node")]
    return {"view": "device", **parts, "all": _sum_parts(parts.values()), "by_client": clients,
            "without_control": without}
