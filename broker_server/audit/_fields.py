"""What ``global`` and ``update`` bodies are made of: the ledger's ``fields`` column, summed in
SQL with SQLite's JSON functions (``json_each`` over each row's JSON object).

The column is a JSON object of body field → bytes, written by the encoder
(:mod:`protocol.ledger`): ``{"tensors": 423412, "num_samples": 3, …}``. A sender's row breaks
``extras`` down per entry (``extras.<name>`` keys beside an ``extras`` map header); a receiver's
row holds one lump ``extras``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._queries import WHOLE_MESSAGE, LedgerSource, ledger_db, query

#: The side that sends each direction (its rows break the body down per ``extras`` entry).
_SENDER_SIDE = {"up": "agent", "down": "server"}
_RECEIVER_SIDE = {"up": "server", "down": "agent"}

#: SQL: a JSON value as an integer the way Python's ``int()`` reads it (None: not a number).
_INT_VALUE = """CASE j.type WHEN 'integer' THEN j.value WHEN 'real' THEN CAST(j.value AS INTEGER)
    WHEN 'true' THEN 1 WHEN 'false' THEN 0
    WHEN 'text' THEN CASE WHEN trim(j.value, ' ' || char(9, 10, 11, 12, 13)) GLOB '[0-9]*'
                           AND trim(j.value, ' ' || char(9, 10, 11, 12, 13)) NOT GLOB '*[^0-9]*'
                          THEN CAST(trim(j.value, ' ' || char(9, 10, 11, 12, 13)) AS INTEGER) END END"""

#: ``chosen``: the whole-message rows of one kind, direction, side (parameters: kind, direction,
#: side, the event to leave out). ``parts``: the tensor-bearing candidates of each row's fields
#: (``tensors``, ``extras.<name>``, and the lump ``extras`` of a row without per-entry keys) with
#: their bytes ``n``, wire order ``ord`` (row, then key position), whether the field carries
#: tensor values (``bearing``: an empty ``tensors`` list is 1 byte, 0x90) and its share of the
#: row's ``raw_bytes`` (the whole of it when it is the row's one bearing field, 0 when it bears
#: nothing, else NULL: unknown).
_PARTS = f"""WITH chosen AS (
    SELECT id, client, round, envelope_bytes, body_bytes, raw_bytes, transfer_id, codec, fields FROM ledger
    WHERE kind = ? AND direction = ? AND {WHOLE_MESSAGE} AND side = ? AND event != ?),
  entry AS (
    SELECT c.id, c.raw_bytes, c.codec, j.key AS name, j.id AS jid, {_INT_VALUE} AS n
    FROM chosen c, json_each(CASE WHEN json_valid(c.fields) THEN
                                  CASE WHEN json_type(c.fields) = 'object' THEN c.fields END END) j),
  per_entry AS (SELECT id, MAX(substr(name, 1, 7) = 'extras.') AS pe FROM entry GROUP BY id),
  cand AS (
    SELECT e.*, NOT (e.name = 'tensors' AND e.n <= 1) AS bearing FROM entry e JOIN per_entry p USING (id)
    WHERE e.n IS NOT NULL AND (e.name = 'tensors' OR substr(e.name, 1, 7) = 'extras.'
                               OR (e.name = 'extras' AND NOT p.pe))),
  parts AS (
    SELECT cand.*, ROW_NUMBER() OVER (ORDER BY cand.id, cand.jid) AS ord,
      CASE WHEN NOT bearing THEN 0 WHEN SUM(bearing) OVER (PARTITION BY cand.id) = 1 THEN raw_bytes END AS share
    FROM cand)
"""


def field_codecs(codec: str) -> dict[str, str]:
    """The codec of each tensor-bearing body field from a sender's ``codec`` column.

    The column holds one codec for the whole message (``"fp32"``, ``"int8+zstd"``, ``"topk:0.01"``),
    or, when ``extras`` entries use other codecs (``[protocol] extras_codec``), the model
    tensors' codec (only when the message has model tensors) followed by ``name=codec`` pairs:
    ``"fp32,soft_predictions=int8+zstd"`` (see :meth:`protocol.channel.Channel.send`).

    Returns:
        ``{field: codec}`` with the keys ``"tensors"`` and ``"extras.<name>"``; ``"*"`` maps to
        the codec of every field not listed ({} for an empty column). Integer arrays always travel
        raw whatever the codec says (:func:`protocol.tensors.encode_tensor`).
    """
    codec = codec.strip()
    if not codec:
        return {}
    if "=" not in codec:
        return {"*": codec}
    out: dict[str, str] = {}
    for part in codec.split(","):
        name, eq, value = part.partition("=")
        if eq:
            out[f"extras.{name.strip()}"] = value.strip()
        elif part.strip():
            out["tensors"] = part.strip()
    return out


def _group(db: Any, kind: str, direction: str, source: str, params: tuple) -> dict[str, Any] | None:
    """The :func:`body_fields` dict of one (kind, direction) read from ``source``'s rows, or None
    when that side has none."""
    (msg,) = query(db, _PARTS + """SELECT COUNT(*) AS messages, COALESCE(SUM(transfer_id IS NOT NULL), 0) AS chunked,
        COALESCE(SUM(envelope_bytes + body_bytes), 0) AS message_bytes, COALESCE(SUM(body_bytes), 0) AS body,
        COALESCE(SUM(raw_bytes), 0) AS raw, (SELECT COUNT(*) FROM (SELECT DISTINCT client, round FROM chosen))
        AS client_rounds, (SELECT COALESCE(MAX(pe), 0) FROM per_entry) AS per_entry FROM chosen""", params)
    msgs = msg["messages"]
    if not msgs:
        return None
    per_field = query(db, _PARTS + """SELECT name, COUNT(*) AS messages, SUM(n) AS bytes, MIN(ord) AS first,
        CASE WHEN SUM(share IS NULL) > 0 THEN NULL ELSE SUM(share) END AS raw_bytes
        FROM parts GROUP BY name ORDER BY name != 'tensors', first""", params)
    codecs: dict[str, set[str]] = {}
    for name, codec in db.execute(_PARTS + "SELECT DISTINCT name, codec FROM parts WHERE bearing", params):
        # The sender's column names a codec per field (field_codecs); a receiver's is its first float tensor's.
        named = field_codecs(codec) if source == "sender" else {}
        value = named.get(name, named.get("*", codec if source == "receiver" else ""))
        if value:
            codecs.setdefault(name, set()).add(value)
    (param,) = query(db, _PARTS + "SELECT COALESCE(SUM(n), 0) AS n FROM parts WHERE name = 'tensors' AND bearing",
                     params)
    extras_names = [f["name"].removeprefix("extras.") for f in per_field if f["name"] != "tensors"]
    message_bytes = msg["message_bytes"]
    tensor = sum(f["bytes"] for f in per_field if f["name"] == "tensors")
    extras = sum(f["bytes"] for f in per_field if f["name"] != "tensors")
    other = message_bytes - tensor - extras
    fields = [{"field": f["name"], "messages": f["messages"], "bytes": f["bytes"], "mean_bytes": f["bytes"] / msgs,
               "share": f["bytes"] / message_bytes if message_bytes else None,
               "codec": ",".join(sorted(codecs.get(f["name"], ()))), "raw_bytes": f["raw_bytes"]}
              for f in per_field]
    fields.append({"field": "other", "messages": msgs, "bytes": other, "mean_bytes": other / msgs,
                   "share": other / message_bytes if message_bytes else None, "codec": "", "raw_bytes": None})
    return {"kind": kind, "direction": direction, "source": source, "extras_per_entry": bool(msg["per_entry"]),
            "messages": msgs, "chunked_messages": msg["chunked"], "client_rounds": msg["client_rounds"],
            "message_bytes": message_bytes, "body_bytes": msg["body"], "tensor_bytes": tensor,
            "extras_bytes": extras, "other_bytes": other, "raw_bytes": msg["raw"], "encoded_bytes": tensor + extras,
            "parameter_bytes": param["n"], "extras_names": extras_names,
            "mean_message_bytes": message_bytes / msgs, "fields": fields}


def body_fields(rows: LedgerSource) -> list[dict[str, Any]]:
    """What ``global`` and ``update`` messages are made of, field by field, from the ledger.

    Each message counts **once, as its sender encoded it**: uploads (``update``, up) from the
    agents' rows, downloads (``global``, down) from the server's rows, so a broadcast counts once,
    whatever the number of agents that received it. Only whole-message rows count
    (:func:`whole_message`): the ``event='message'`` row of a chunked transfer (its chunk rows
    carry no fields) or the unchunked ``sent`` row. A ledger without the sender's rows (an
    agent's own ledger has no server rows) falls back to the receiver's whole-message rows
    (``source='receiver'``): their ``extras`` is one lump (entries and map header).

    Bytes are those of the encoded message, before signing, encryption and chunking:
    ``message_bytes`` = envelope_bytes + body_bytes = ``tensor_bytes`` (model ``tensors``) +
    ``extras_bytes`` (every ``extras.<name>`` entry: key + encoded array) + ``other_bytes``
    (everything else: envelope header and msgpack framing, the scalar body fields such as
    ``num_samples``, ``metrics``, ``meta``, and the 1–3 byte ``extras`` map header). The MQTT
    framing, chunk framing, signatures and encryption of each packet are in :func:`by_kind`.
    A ``fields`` column that is not a JSON object contributes no field (its message still counts,
    in ``other``); field values are read as integers as Python's ``int()`` would.

    Args:
        rows: ledger rows in ledger order, or an open ledger connection (see :mod:`._queries`).

    Returns:
        One dict per (kind, direction) that has messages, ``global`` first: ``kind``,
        ``direction``, ``source`` (``'sender'``/``'receiver'``), ``extras_per_entry`` (bool),
        ``messages``, ``chunked_messages``, ``client_rounds`` (distinct (client, round) pairs;
        a broadcast's client is ``'*'``), ``message_bytes``, ``body_bytes``, ``tensor_bytes``,
        ``extras_bytes``, ``other_bytes``, ``parameter_bytes`` (the ``tensors`` bytes of the messages
        that carried model tensors: 0 when every ``tensors`` field is the empty list, 1 byte each,
        as for the prototype methods), ``extras_names`` (the extras entries, in order of first
        appearance), ``raw_bytes`` (the ledger's ``raw_bytes``: tensor and
        extras values before the codec, ``size × itemsize``), ``encoded_bytes`` (tensor_bytes +
        extras_bytes: what ``raw_bytes`` became), ``mean_message_bytes``, and ``fields``: one
        dict per field — ``tensors`` first, then each ``extras.<name>`` in order of first
        appearance (or the lump ``extras``), then ``other`` — with ``field``, ``messages`` (that
        carried it), ``bytes``, ``mean_bytes`` (per message of the kind, so the means add up to
        ``mean_message_bytes``), ``share`` (of ``message_bytes``), ``codec`` (as configured,
        from the sender's ``codec`` column — :func:`field_codecs`; on a receiver's row the codec
        of its first float tensor; several joined by commas; '' for ``other`` and an empty
        ``tensors`` list) and ``raw_bytes``: the field's bytes before the codec where the
        ledger tells them apart — the message's ``raw_bytes`` when the field is its only
        tensor-bearing field, 0 for an empty ``tensors`` list — else None (several tensor-bearing
        fields share one ``raw_bytes``; see the kind's ``raw_bytes`` and ``encoded_bytes``).
    """
    out = []
    with ledger_db(rows) as db:
        for kind, direction in (("global", "down"), ("update", "up")):
            group = _group(db, kind, direction, "sender", (kind, direction, _SENDER_SIDE[direction], "received"))
            if group is None:
                group = _group(db, kind, direction, "receiver", (kind, direction, _RECEIVER_SIDE[direction], "sent"))
            if group is not None:
                out.append(group)
    return out


def field_bytes_per_client_round(fields: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Model-tensor and extras bytes per client per round, from :func:`body_fields`.

    For each direction, the group's ``tensor_bytes`` and ``extras_bytes`` divided by its
    ``client_rounds``: per update a client sent in a round (up), and per global a client
    received in a round (down: a broadcast, client ``'*'``, is one per round and reaches every
    client whole).

    Returns:
        ``up_tensor_bytes_per_client_round``, ``up_extras_bytes_per_client_round``,
        ``down_tensor_bytes_per_client_round``, ``down_extras_bytes_per_client_round`` (bytes;
        None where the direction has no message).
    """
    out: dict[str, float | None] = {f"{d}_{p}_bytes_per_client_round": None
                                    for d in ("up", "down") for p in ("tensor", "extras")}
    for g in fields:
        n = g.get("client_rounds") or 0
        if n:
            out[f"{g['direction']}_tensor_bytes_per_client_round"] = g["tensor_bytes"] / n
            out[f"{g['direction']}_extras_bytes_per_client_round"] = g["extras_bytes"] / n
    return out
