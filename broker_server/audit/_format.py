"""Cells of the audit's tables, shared by the text and HTML renderers: counts, byte sizes,
shares, accuracies, seconds, and the rows of the body-fields table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._report import device_ledger


def count(value: int) -> str:
    """An integer with thousands separators: ``8708`` → ``'8,708'``."""
    return f"{value:,}"


def human(n_bytes: int) -> str:
    """Bytes in binary units: B, KiB, MiB, GiB."""
    if n_bytes < 1024:
        return f"{n_bytes} B"
    for unit, scale in (("KiB", 1024), ("MiB", 1024**2), ("GiB", 1024**3)):
        if n_bytes < scale * 1024 or unit == "GiB":
            return f"{n_bytes / scale:,.1f} {unit}"
    raise AssertionError("unreachable")


def pct(share: float | None) -> str:
    """A fraction as a percentage with one decimal (``'—'`` for None)."""
    return "—" if share is None else f"{100 * share:.1f} %"


def acc(value: float | None) -> str:
    """An accuracy (fraction) as a percentage with two decimals (``'—'`` for None)."""
    return "—" if value is None else f"{100 * value:.2f} %"


def secs(value: float | None) -> str:
    """Seconds with one decimal (``'—'`` for None)."""
    return "—" if value is None else f"{value:,.1f} s"


def kbps(value: float | None) -> str:
    """A link speed in kbit/s (``'—'`` for None)."""
    return "—" if value is None else f"{value:g} kbit/s"


def mean(value: float | None) -> str:
    """A mean number of bytes, rounded to whole bytes, with thousands separators (``'—'`` for None)."""
    return "—" if value is None else f"{value:,.0f}"


def target_text(row: Mapping[str, Any]) -> str:
    """Bytes to the target of a :func:`comparison_row`, with the round that reached it;
    ``'not reached'``; ``'—'`` for a run that records no accuracy (a device's own folder), and
    ``'— (no device-link rows)'`` for a ledger of the server's side alone (a ``fedfleet server``
    run's: what the devices' links carried is in their own folders)."""
    if row.get("bytes_to_target") is None:
        if row.get("device_rows") == 0 and row.get("final_accuracy") is not None:
            return "— (no device-link rows)"
        return "not reached" if row.get("final_accuracy") is not None else "—"
    return f"{count(row['bytes_to_target'])} ({human(row['bytes_to_target'])}, round {row['target_round']})"


def _rounds_span(last: int) -> str:
    """``"round 1"``, ``"rounds 1–3"``."""
    return "round 1" if last == 1 else f"rounds 1–{last}"


def target_parts_text(parts: Mapping[str, Any] | None) -> str:
    """What the bytes to a target are made of, in the rows of the per-round table (from
    :func:`._queries.cumulative_parts`): e.g. ``"= 16,957,840 of rounds 1–2 + 8,795 of round 0 (of
    its 9,965) + 3,818 of the session row (217 control packets, of its 5,650): the traffic outside
    the rounds counts as far as it was recorded before round 2's last row"``; '' for None or
    nothing counted."""
    if not parts or not parts.get("wire_bytes"):
        return ""
    last = parts["last_round"]
    terms = [f"{count(parts['rounds_bytes'])} of {_rounds_span(last)}"]
    if parts["round0_messages"]:
        whole = parts["round0_all_bytes"]
        terms.append(f"{count(parts['round0_bytes'])} of round 0"
                     + ("" if parts["round0_bytes"] == whole else f" (of its {count(whole)})"))
    if parts["session_messages"]:
        n, ctl = parts["session_messages"], parts["session_control_messages"]
        what = (f"{count(n)} control packet{'s' if n != 1 else ''}" if ctl == n
                else f"{count(n)} packets, {count(ctl)} of them control packets")
        whole = parts["session_all_bytes"]
        terms.append(f"{count(parts['session_bytes'])} of the session row ({what}"
                     + ("" if parts["session_bytes"] == whole else f", of its {count(whole)}") + ")")
    out = "= " + " + ".join(terms)
    if len(terms) > 1:
        out += (": the traffic outside the rounds counts as far as it was recorded before "
                f"round {last}'s last row")
    return out


#: What ``up`` and ``down`` mean on each link, control packets included (the ledger's direction:
#: up = towards the server, whichever side wrote the row; :meth:`protocol.channel.Channel._on_packet`).
DIRECTION_MEANING = {
    "device": ("up = what a device sends the broker: its uploads and its control packets (CONNECT, SUBSCRIBE, "
               "PUBACK for a download, PINGREQ, DISCONNECT); down = what the broker sends a device: its downloads "
               "and CONNACK, SUBACK, PUBACK for an upload, PINGRESP."),
    "server": ("up = towards the server: what the broker sends the server, i.e. the devices' uploads, statuses and "
               "last wills as delivered to it, and CONNACK, SUBACK, PUBACK for the server's own PUBLISH, PINGRESP; "
               "down = what the server sends the broker: its downloads (each broadcast once) and its CONNECT, "
               "SUBSCRIBE, PUBACK for an upload it received, PINGREQ, DISCONNECT."),
}

def unsent_line(tot: Mapping[str, Any]) -> str | None:
    """The line under a link's totals when PUBLISH packets were cut short (the totals dict's
    ``unsent_bytes`` of its ``all``): their bytes the socket never took count in the body,
    envelope and MQTT columns (whole packets) and not in wire B; ``None`` when there were none."""
    n = tot.get("all", {}).get("unsent_bytes", 0)
    if not n:
        return None
    return (f"{count(n)} bytes of PUBLISH packets cut short by a lost connection (or a close) count in the body, "
            "envelope and MQTT columns but never went out: wire B leaves them out.")


#: Columns of a per-kind table (:func:`kind_cells`).
KIND_COLUMNS = ("kind", "dir", "messages", "body B", "envelope B", "MQTT B", "control B", "wire B", "overhead")


def kind_cells(kinds: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Rows of a per-kind table (columns :data:`KIND_COLUMNS`) of :func:`._queries.by_kind`."""
    return [[k["kind"], k["direction"], count(k["messages"]), count(k["body_bytes"]), count(k["envelope_bytes"]),
             count(k["mqtt_bytes"]), count(k.get("control_bytes", 0)), count(k["wire_bytes"]),
             pct(k["overhead_share"])] for k in kinds]


#: Who sends a side's PUBLISH packets, and on which link (:func:`delivery_lines`).
_SENDER = {"agent": "the devices (device links)", "server": "the server (server link)"}


def delivery_lines(dv: Mapping[str, Any] | None) -> list[str]:
    """One line per side that sent PUBLISH packets: what the broker did with them (the report's
    ``deliveries``); a report from before ``by_side`` gets one line for both sides together."""
    if not dv:
        return []

    def line(who: str, d: Mapping[str, Any]) -> str:
        return (f"PUBLISH packets sent by {who}: {count(d['acked'])} acknowledged by the broker, "
                f"{count(d['handed'])} handed over without acknowledgement, {count(d['refused'])} refused by the "
                "broker" + (f", {count(d['dropped'])} lost with the connection before the socket took them whole "
                            "(QoS 0, or unsent at close)" if d.get("dropped") else "")
                + (f", {count(d['not_handed'])} never handed to the MQTT client (its offline buffer full, or the "
                   "transport closed: none of their bytes were sent)" if d.get("not_handed") else "")
                + (f", {count(d['unknown'])} without a delivery record (older ledger)" if d["unknown"] else "")
                + (f"; {count(d['undeliverable'])} message(s) given up" if d["undeliverable"] else "")
                + (f"; {count(d['not_sent'])} QoS 0 message(s) not sent (the link was down: not refused by the "
                   "broker, which never saw them)" if d.get("not_sent") else ""))

    sides = dv.get("by_side")
    if sides is None:
        return [line("both sides together", dv)]
    return [line(_SENDER[side], d) for side, d in sides.items()
            if d.get("sent") or d["refused"] or d["undeliverable"] or d.get("not_sent") or d.get("dropped")
            or d.get("not_handed")]


#: How the text names each of ``deliveries``' ``refusals`` by its ``what``.
REFUSAL_LABELS = {"refused": "refused", "given up": "given up after the broker's refusals",
                  "not sent": "not sent (link down, QoS 0)", "not handed": "never handed to the MQTT client"}


def refusal_line(r: Mapping[str, Any]) -> str:
    """``"  refused (server server, round_start, 1×): reason"``; a QoS 0 message the channel could
    not send: ``"  not sent (link down, QoS 0) (server server, undeliverable, 1×): reason"``."""
    label = REFUSAL_LABELS.get(r.get("what") or "refused", "refused")
    return f"  {label} ({r['side']} {r['node']}, {r['kind']}, {r['count']}×): {r['reason']}"


def directions_label(link: Mapping[str, Any] | None) -> str:
    """The estimated directions of a ``link_time`` (``'up+down'``, ``'up'`` …; ``'—'`` for none)."""
    dirs = (link or {}).get("directions") or []
    return "+".join(dirs) if dirs else "—"


FIELDS_TITLE = ("Body fields of global and update messages (each message once, as its sender encoded it: "
                "uploads from the agents' rows, downloads from the server's, so a broadcast counts once; "
                "a chunked message once, not per chunk)")


#: Columns of the body-fields table: *msgs* = messages that carried the field, *B/msg carrying* =
#: its bytes per such message, *B/msg of kind* = its bytes per message of the kind (these add up
#: to the whole message's mean; a field that only some messages carry, e.g. a teacher absent in
#: round 1, is smaller here than in the column before).
FIELD_COLUMNS = ("kind", "dir", "field", "codec", "msgs", "bytes", "B/msg carrying", "B/msg of kind", "share",
                 "raw B")


def field_cells(fields: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Table cells of :func:`body_fields` (columns :data:`FIELD_COLUMNS`): one row per field,
    then the whole message."""
    out = []
    for g in fields:
        for f in g["fields"]:
            out.append([g["kind"], g["direction"], f["field"], f["codec"], count(f["messages"]), count(f["bytes"]),
                        mean(f["bytes"] / f["messages"] if f["messages"] else None), mean(f["mean_bytes"]),
                        pct(f["share"]),
                        "—" if f["raw_bytes"] is None else count(f["raw_bytes"])])
        out.append([g["kind"], g["direction"], "= message", "", count(g["messages"]), count(g["message_bytes"]),
                    mean(g["mean_message_bytes"]), mean(g["mean_message_bytes"]),
                    pct(1.0 if g["message_bytes"] else None), count(g["raw_bytes"])])
    return out


def field_notes(fields: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per kind: messages, chunked ones, and the tensor values before and after the codec."""
    out = []
    for g in fields:
        ratio = f" ({pct(g['encoded_bytes'] / g['raw_bytes'])} of raw)" if g["raw_bytes"] else ""
        source = ("" if g["source"] == "sender" else
                  "; receiver's rows (no sender rows in this ledger): extras counted as one lump")
        out.append(f"{g['kind']} ({g['direction']}): {count(g['messages'])} messages, {count(g['chunked_messages'])} "
                   f"chunked; tensors + extras {count(g['encoded_bytes'])} B encoded from {count(g['raw_bytes'])} B "
                   f"raw{ratio}{source}")
        if g.get("parameter_bytes") == 0 and g["messages"]:
            names = ", ".join(g.get("extras_names") or []) or "none"
            out.append(f"{g['kind']} ({g['direction']}): no model parameter in any message (0 B of model tensors: "
                       f"every tensors field is an empty list); the body's arrays are extras only: {names}")
    out.append("other = envelope, msgpack framing, scalar body fields (num_samples, metrics, meta …), extras map "
               "header.")
    out.append("raw B = tensor values before the codec; per field only where it is a message's one tensor-bearing "
               "field (else —).")
    return out


def overhead_parts(tot: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(part, bytes) of one totals dict: body, envelope, signatures and encryption (when any), MQTT
    header + topic, control packets; they add up to its ``wire_bytes`` plus its ``unsent_bytes``
    (PUBLISH packets cut short by a lost connection count whole in the parts)."""
    parts = [("body", tot["body_bytes"]), ("envelope", tot["envelope_bytes"]),
             ("MQTT header + topic", tot["mqtt_bytes"]), ("control packets", tot.get("control_bytes", 0))]
    if tot.get("sig_bytes") or tot.get("enc_bytes"):
        parts[2:2] = [("signatures", tot.get("sig_bytes", 0)), ("encryption", tot.get("enc_bytes", 0))]
    return parts


def short_run_labels(paths: Sequence[str]) -> list[str]:
    """Short, distinct names for run folders in a table: each path's last component, or its last
    two, three … when those collide (the full paths are listed under the table)."""
    parts = [Path(p).parts or (p,) for p in paths]
    for depth in range(1, max(len(x) for x in parts) + 1 if parts else 1):
        labels = [str(Path(*x[-depth:])) for x in parts]
        if len(set(labels)) == len(labels):
            return labels
    return list(paths)



#: The line of a report whose ledger its writer did not close (``ledger_closed`` False).
UNCLEAN_CLOSE = ("Ledger not closed cleanly (its writer crashed, was killed or is still running): rows it had not "
                 "committed are missing")


# --------------------------------------------------------------------------------------------
# What a --resume added (the report's ``resume``: :func:`._report.resume_report`)

_LINK = {"device": "device-link", "server": "server-link"}


def rounds_text(rounds: Sequence[int]) -> str:
    """``[3]`` → ``"round 3"``, ``[3, 4]`` → ``"rounds 3 and 4"``, ``[3, 4, 5]`` → ``"rounds 3–5"``
    (consecutive), else ``"rounds 3, 5 and 7"``."""
    rs = sorted(rounds)
    if len(rs) == 1:
        return f"round {rs[0]}"
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"rounds {rs[0]}–{rs[-1]}"
    return "rounds " + ", ".join(map(str, rs[:-1])) + f" and {rs[-1]}"


def _after_text(after_rounds: Sequence[int], earlier_unknown: bool = False, from_start: bool = True) -> str:
    """``"resumed after round 2 (1 resume)"``, ``"resumed 2 times (after rounds 2 and 5)"``; with
    ``earlier_unknown``: ``"resumed after round 2 (1 resume noted)"``, ``"resumed after rounds 2
    and 5 (2 resumes noted)"``. Round 0 of a resume ``from_start`` (some resume after round 0
    started the run again from its joins: no registry to go on from) is no checkpoint yet:
    ``"resumed before its first checkpoint (1 resume: the run started again from round 1)"``;
    else round 0 is the checkpoint of the devices that had joined: ``"resumed after round 0 (1
    resume: its checkpoint held the devices that had joined)"``."""
    n = len(after_rounds)
    if list(after_rounds) == [0] and from_start:
        return ("resumed before its first checkpoint ("
                + ("1 resume noted)" if earlier_unknown else "1 resume: the run started again from round 1)"))
    if list(after_rounds) == [0]:
        return ("resumed after round 0 ("
                + ("1 resume noted)" if earlier_unknown else "1 resume: its checkpoint held the devices that had "
                                                             "joined)"))
    none_yet = "; round 0: no checkpoint yet" if 0 in after_rounds and from_start else ""
    if earlier_unknown:
        return f"resumed after {rounds_text(after_rounds)} ({n} resume{'s' if n != 1 else ''} noted{none_yet})"
    if n == 1:
        return f"resumed after round {after_rounds[0]} (1 resume)"
    return f"resumed {n} times (after {rounds_text(after_rounds)}{none_yet})"


def _sessions_before(resumes: Sequence[Mapping[str, Any]]) -> str:
    """The sessions the resumes went on from: ``"its first session"``, ``"the session before"``,
    ``"the sessions before"``."""
    if len(resumes) > 1:
        return "the sessions before"
    return "its first session" if resumes[0].get("from_session") == 0 else "the session before"


def _rerun_text(resumes: Sequence[Mapping[str, Any]]) -> str:
    """What the re-sent bytes are: ``"round 3's first attempt"``, or that no round had begun (or
    that the run had finished); then the update copies the devices sent again before the resumed
    server opened their round (``early_updates``), when there are any."""
    rounds = sorted({r for x in resumes for r in x["rerun_rounds"]})
    early = sum(x.get("early_updates") or 0 for x in resumes)
    also = (f", and {count(early)} update {'copy' if early == 1 else 'copies'} sent again before the resumed server "
            f"opened {'its' if early == 1 else 'their'} round" if early else "")
    if not rounds and resumes and all(x.get("finished") for x in resumes):
        return "the run had finished: no round was run again" + also
    if not rounds:
        if all(x["after_round"] == 0 for x in resumes):
            return "no round had begun before it stopped" + also
        return "no round after the checkpoint had begun before it stopped" + also
    return f"{rounds_text(rounds)}'s first attempt, sent again after the resume" + also


def _from_start(x: Mapping[str, Any]) -> bool:
    """Whether resume ``x`` (of :func:`resume_bytes`) started the run again from its joins (no
    registry to go on from); a dict without ``from_start`` (made before it was told): after round 0."""
    return bool(x.get("from_start", x["after_round"] == 0))


def _joined_again(x: Mapping[str, Any]) -> bool:
    """Whether resume ``x``'s reconnecting part holds a ``join`` (a device joined again)."""
    return any(k["kind"] == "join" for k in x["rejoin"]["kinds"])


def _rejoin_text(resumes: Sequence[Mapping[str, Any]]) -> str:
    """What the reconnecting bytes are: the resumed session's connections and joins (its
    connections and statuses where no device joined again: they came back), or, for a resume
    from the start (no registry to go on from: the resumed session is a whole run), the
    interrupted one's."""
    from_start = {_from_start(x) for x in resumes}
    if from_start == {True}:
        return ("the interrupted session's connections and joins: with no checkpoint, the resumed session connected "
                "and joined again from the start")
    if from_start == {False}:
        if not any(_joined_again(x) for x in resumes):
            return "the resumed session's connections and statuses: its devices came back without joining again"
        return "the resumed session's connections and joins"
    return "connections and joins made again"


def _attempts(n: int) -> str:
    """``"a refused --resume attempt"``, ``"2 refused --resume attempts"``."""
    return "a refused --resume attempt" if n == 1 else f"{n} refused --resume attempts"


def _unknown_line(resume: Mapping[str, Any]) -> str:
    """The line of a resume whose bytes cannot be told apart: a ledger written before resumes
    were noted (with ``summary.json``'s resume), or one whose note is unreadable or implausible."""
    said = resume["after_rounds"]
    problem = resume.get("problem")
    if problem is None:
        return (f"Resumed (last after round {said[-1]}, says summary.json), but this ledger was "
                "written before resumes were noted in it: the bytes of the interrupted attempt and of the "
                "reconnection are counted with the run's, and which they are is unknown.")
    head = (f"Resumed (last after round {said[-1]}, says summary.json), but this ledger's" if said
            else "This ledger's")
    return (f"{head} resumes note is {problem} ({resume.get('why')}): the attribution is unknown (the bytes of any "
            "interrupted attempt and reconnection are counted with the run's).")


def resume_line(report: Mapping[str, Any], view: str) -> str | None:
    """One sentence on what the run's resumes added to ``view`` (bytes = wire bytes), or None for
    a run never resumed: e.g. ``"Resumed after round 2 (1 resume): 279,768 of the 1,609,073
    device-link bytes belong to it: 276,034 re-sent (round 3's first attempt, sent again after the
    resume), 16 ending the interrupted session (control packets, statuses, finish) and 3,718
    reconnecting (the resumed session's connections and joins); 1,329,305 without them."``; a
    refused ``--resume`` attempt (the checkpoint did not load) is told as one that added its
    connections: ``"Not resumed: a refused --resume attempt added 0 of the 1,329,285 device-link
    bytes (its connections); 1,329,285 without them."``"""
    resume = report.get("resume")
    if not resume:
        return None
    if not resume["noted"]:
        return _unknown_line(resume)
    earlier_unknown = bool(resume.get("earlier_unknown"))
    rb = resume[view]
    wire = report["totals"][view]["all"]["wire_bytes"]
    added = rb["all"]["wire_bytes"]
    went_on, refused = resume["count"], resume.get("refused") or 0
    one = went_on + refused == 1
    tail = (f"resumes before {'this one' if one else 'the first of these'}, if any, were not noted: their bytes "
            "count in the first session, so the bytes without them are unknown." if earlier_unknown
            else f"{count(wire - added)} without them.")
    refusal = (f"{count(rb['refusal']['wire_bytes'])} by {_attempts(refused)} ({'its' if refused == 1 else 'their'} "
               "connections)")
    if not went_on:
        return (f"Not resumed: {_attempts(refused)} added {count(added)} of the {count(wire)} {_LINK[view]} bytes "
                f"({'its' if refused == 1 else 'their'} connections); {tail}")
    went = [x for x in rb["resumes"] if not x.get("refused")]
    after = _after_text(resume["after_rounds"], earlier_unknown, from_start=any(_from_start(x) for x in went))
    finished = all(x.get("finished") for x in went)  # each continued a run that had finished
    if finished:
        after += f", continued after {'its finish' if len(went) == 1 else 'each finish'}"
    ending = (f"{count(rb['ending']['wire_bytes'])} for the finish and goodbyes of {_sessions_before(went)}"
              if finished
              else f"{count(rb['ending']['wire_bytes'])} ending the interrupted session (control packets, statuses, "
                   "finish)")
    parts = [f"{count(rb['rerun']['wire_bytes'])} re-sent ({_rerun_text(went)})", ending,
             f"{count(rb['rejoin']['wire_bytes'])} reconnecting ({_rejoin_text(went)})",
             *([refusal] if refused else [])]
    return (f"{after[0].upper()}{after[1:]}: {count(added)} of the {count(wire)} {_LINK[view]} bytes belong to "
            f"{'it' if one else 'them'}: {', '.join(parts[:-1])} and {parts[-1]}; {tail}")


def resume_cell(row: Mapping[str, Any]) -> str:
    """The ``resume B`` cell of a :func:`comparison_row`: the bytes its resumes added,
    ``"unknown"`` when its ledger does not tell them, ``"≥ N"`` when resumes before the first
    noted one count in the first session; ``"N (server link)"`` for a resumed run whose ledger
    has only the server's rows (the other columns are device-link bytes); for a device's own
    ledger (``resume_note`` ``"device ledger"``, which notes no resume) ``"N again"``, the bytes it
    sent or received again (``repeat_bytes``; ``"≥ N again"`` when its control packets are not
    recorded)."""
    if row.get("resume_note") == "device ledger":
        if row.get("repeat_bytes") is None:
            return "—"
        return ("≥ " if row.get("repeat_note") else "") + f"{count(row['repeat_bytes'])} again"
    if row["resume_bytes"] is None:
        return "unknown"
    return (("≥ " if row.get("resume_note") == "earlier not noted" else "") + count(row["resume_bytes"])
            + (" (server link)" if row.get("resume_link") == "server" and (row["resumed_after"] or row["resume_bytes"])
               else ""))


#: Columns of the resume table (:func:`resume_cells`).
RESUME_COLUMNS = ("link", "resumed after", "part", "messages", "up B", "down B", "wire B", "share of wire")


def resume_cells(report: Mapping[str, Any]) -> list[list[str]]:
    """Rows of the resume table (columns :data:`RESUME_COLUMNS`): per link with rows, per resume,
    the re-sent, ending (of a finished run: its finish and goodbyes) and reconnecting parts, or
    one row for a refused attempt, then the link's total ([] when the resumes are not noted)."""
    resume = report.get("resume") or {}
    out: list[list[str]] = []
    for view in ("device", "server"):
        rb = resume.get(view)
        wire = report["totals"][view]["all"]["wire_bytes"]
        if rb is None or not report["totals"][view]["all"]["messages"]:
            continue

        def cells(after: str, part: str, t: Mapping[str, Any], view: str = view, wire: int = wire) -> list[str]:
            return [view, after, part, count(t["messages"]), count(t["up_bytes"]), count(t["down_bytes"]),
                    count(t["wire_bytes"]), pct(t["wire_bytes"] / wire if wire else None)]

        for x in rb["resumes"]:
            after = f"round {x['after_round']}"
            if x.get("refused"):
                out.append(cells(after, "a refused --resume attempt: its connections", x["refusal"]))
                continue
            rerun = (f"re-sent: {rounds_text(x['rerun_rounds'])}'s first attempt" if x["rerun_rounds"]
                     else "re-sent: nothing (the run had finished)" if x.get("finished")
                     else "re-sent: nothing (no round had begun)")
            if x.get("early_updates"):
                n = x["early_updates"]
                rerun += (f"; {count(n)} update {'copy' if n == 1 else 'copies'} sent again before "
                          f"{'its' if n == 1 else 'their'} round opened")
            out.append(cells(after, rerun, x["rerun"]))
            out.append(cells(after, f"continued after its finish: the finish and goodbyes of {_sessions_before([x])}"
                             if x.get("finished") else "ending the interrupted session", x["ending"]))
            out.append(cells(after, "reconnecting: the interrupted session's connections and joins"
                             if _from_start(x) else "reconnecting and joining again" if _joined_again(x)
                             else "reconnecting (its devices came back without joining again)", x["rejoin"]))
        out.append(cells("all", "total", rb["all"]))
    return out


def _kinds_text(kinds: Sequence[Mapping[str, Any]]) -> str:
    """``"global (down) 3× 164,997 B, …, control packets 8× 32 B"`` of one part's ``kinds``."""
    merged: dict[tuple[str, str], list[int]] = {}
    ctl = [0, 0]
    for k in kinds:
        if k["control"]:
            ctl[0] += k["messages"]
            ctl[1] += k["wire_bytes"]
            continue
        m = merged.setdefault((k["kind"], k["direction"]), [0, 0])
        m[0] += k["messages"]
        m[1] += k["wire_bytes"]
    parts = [f"{kind} ({d}) {count(n)}× {count(b)} B"
             for (kind, d), (n, b) in sorted(merged.items(), key=lambda kv: -kv[1][1])]
    if ctl[0]:
        parts.append(f"control packets {count(ctl[0])}× {count(ctl[1])} B")
    return ", ".join(parts) or "nothing"


def resume_notes(report: Mapping[str, Any], view: str) -> list[str]:
    """The lines under the resume table: each part by kind and where the per-round table counts
    it (in ``view``), then what the parts are ([] when the resumes are not noted)."""
    resume = report.get("resume") or {}
    rb = resume.get(view)
    if rb is None:
        return []
    out = []
    refused = any(x.get("refused") for x in rb["resumes"])
    for name, key in (("Re-sent", "rerun"), ("Ending", "ending"), ("Reconnecting", "rejoin"),
                      *([("Refused --resume attempts", "refusal")] if refused else [])):
        kinds = [k for x in rb["resumes"] for k in x[key]["kinds"]]
        where: dict[Any, int] = {}
        for x in rb["resumes"]:
            for r in x[key]["rounds"]:
                where[r["round"]] = where.get(r["round"], 0) + r["wire_bytes"]
        rows = ", ".join(f"{'session' if r is None else f'round {r}'} {count(b)} B"
                         for r, b in sorted(where.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))
        out.append(f"{name} ({_LINK[view]} bytes), by kind: {_kinds_text(kinds)}"
                   + (f"; in the per-round table: {rows}" if rows else "") + ".")
    out.append("Re-sent: the interrupted session's rows of the rounds after the checkpoint it was resumed from (the "
               "resumed session ran those rounds again), and the copies of its updates the devices sent again to the"
               " resumed session before it opened their round (not answered: sent once more when it opened). Ending:"
               " that session's rows without a round (control packets, statuses) after the first of them, or after "
               "its last row of the rounds kept where that comes first, and its finish; a control packet names no "
               "message, so an acknowledgement (4 B) may fall on either side. Reconnecting: the resumed session's "
               "rows without a round (connections, joins, statuses: the interrupted devices' last wills among them) "
               "before its first download of a round after the checkpoint; an uninterrupted run connects and joins "
               "once. Every attempt's bytes stay in the totals: they crossed the wire.")
    if any(x.get("finished") for x in rb["resumes"]):
        out.append("A run continued after its finish (resumed with more rounds): its finish and the goodbyes after "
                   "it (offline statuses, DISCONNECTs) count as its ending; nothing is re-sent.")
    if any(_from_start(x) and not x.get("refused") for x in rb["resumes"]):
        out.append("A resume after round 0 had no checkpoint to go on from: the resumed session ran the run again "
                   "from its connections and joins, as an uninterrupted run does, so every row of the interrupted "
                   "session is extra: its rounds re-sent, its ending, and its connections and joins (counted as "
                   "reconnecting).")
    if any(x["after_round"] == 0 and not _from_start(x) and not x.get("refused") for x in rb["resumes"]):
        out.append("A resume after round 0 whose checkpoint held the devices that had joined (round 0's registry) "
                   "went on from their joins, as after any later round: the interrupted session's connections and "
                   "joins are the run's own, and what the resumed session added before its first round (its "
                   "connections, the devices' statuses as they came back, any join made again) is reconnecting.")
    if refused:
        out.append("A refused --resume attempt (its checkpoint did not load: nothing was continued) added all its "
                   "session's rows, its connections; the next resume, if any, goes on from the session before it, "
                   "and a run never continued keeps its ending as its own.")
    return out


def resume_column(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the comparison of :func:`comparison_row` rows has a ``resume B`` column: a run was
    resumed, or its ledger's resumes cannot be told (its note is unreadable …), or a device's own
    ledger sent or received something again (:func:`resume_cell`)."""
    def said(r: Mapping[str, Any]) -> bool:
        if r.get("resume_note") == "device ledger":
            return bool(r.get("repeat_bytes"))
        return bool(r["resumed_after"]) or r["resume_bytes"] != 0
    return any(said(r) for r in rows)


def resume_legend(reports: Sequence[Mapping[str, Any]], *, code: str = "`") -> str:
    """What the comparison's ``resume B`` column holds (after ``"resume B: "``): for runs whose
    ledger has the server's rows, the bytes their resumes added (``0: never resumed`` …), and for a
    device's own ledger :data:`RESUME_B_DEVICE`; each only when a run of that sort is compared.
    ``code``: the quotes around a command (a backtick in text, none in HTML)."""
    out = []
    if any(not device_ledger(r) for r in reports):
        out.append("device-link bytes a run's resumes added (its interrupted attempt's rounds, sent again after the "
                   "resume, that session's ending and the resumed session's reconnection; counted in up B and down B, "
                   "as they crossed the wire), or, marked (server link), server-link bytes of a ledger with only the "
                   f"server's rows (a {code}fedfleet server{code} run's); 0: never resumed; unknown: its ledger does "
                   "not tell them apart; ≥ N: those of the resumes it noted (earlier ones were not).")
    if any(device_ledger(r) for r in reports):
        out.append(RESUME_B_DEVICE)
    return " ".join(out)


#: The ``resume B`` legend of the comparison (text and HTML) for a device's own ledger.
RESUME_B_DEVICE = ("N again: a device's own ledger, where no resume is noted (its server's ledger notes them): "
                   "the bytes it sent or received again, its resume/reconnect cost (its run's \"Resume/reconnect "
                   "cost\" line); ≥ N again: its MQTT control packets are not recorded, so neither are its "
                   "retransmissions and reconnections.")

_PART_TEXT = {"again": "copies after the first", "dup": "retransmitted by MQTT", "reconnect": "reconnecting"}


def _repeat_kinds_text(kinds: Sequence[Mapping[str, Any]]) -> str:
    """``"update (up) 2× 1,130 B, global (down) 1× 2,062 B"`` of a :func:`._queries.repeat_bytes`
    part's ``kinds``, largest first (control packets by their own kind)."""
    merged: dict[tuple[str, str], list[int]] = {}
    for k in kinds:
        m = merged.setdefault((k["kind"], k["direction"]), [0, 0])
        m[0] += k["messages"]
        m[1] += k["wire_bytes"]
    return ", ".join(f"{kind} ({d}) {count(n)}× {count(b)} B"
                     for (kind, d), (n, b) in sorted(merged.items(), key=lambda kv: -kv[1][1]))


def repeat_line(report: Mapping[str, Any]) -> str | None:
    """One sentence on what the devices sent or received again (:func:`._queries.repeat_bytes`:
    a resume's or reconnect's cost as the devices' own ledgers tell it), or None for a ledger
    without device-link rows, and for one with the server's rows too where nothing was (a run
    whose resumes, if any, its ``resume`` tells): e.g. ``"Resume/reconnect cost on the device links (what was sent or
    received again): 3,207 of the 8,107 bytes, in 4 messages: 3,193 B copies after the first
    (global (down) 1× 2,062 B, join (up) 1× 566 B, update (up) 1× 565 B), 0 B retransmitted by MQTT
    and 14 B reconnecting (CONNECT (up) 1× 14 B)."``; ``"…: 0 B: no copy of a message after the
    first, no MQTT retransmission, no reconnection."`` when nothing was; devices whose ledger
    records no control packets are named, their retransmissions and reconnections unknown (and
    the bytes said "at least")."""
    again = report.get("repeats")
    if not again or not (again["all"]["messages"] or device_ledger(report)):
        return None
    head = "Resume/reconnect cost on the device links (what was sent or received again): "
    wire = report["totals"]["device"]["all"]["wire_bytes"]
    without = again.get("without_control") or []
    unknown = (f"; the retransmissions and reconnections of {', '.join(without)} are unknown (no MQTT control "
               f"packets in {'its' if len(without) == 1 else 'their'} ledger)" if without else "")
    total = again["all"]
    if not total["messages"]:
        return (head + "0 B: no copy of a message after the first, no MQTT retransmission, no reconnection"
                + unknown + ".")
    parts = []
    for name in ("again", "dup", "reconnect"):
        part = again[name]
        kinds = _repeat_kinds_text(part["kinds"])
        parts.append(f"{count(part['wire_bytes'])} B {_PART_TEXT[name]}" + (f" ({kinds})" if kinds else ""))
    return (head + f"{'at least ' if without else ''}{count(total['wire_bytes'])} of the {count(wire)} bytes, in "
            f"{count(total['messages'])} message{'s' if total['messages'] != 1 else ''}: {parts[0]}, {parts[1]} and "
            f"{parts[2]}" + unknown + ".")


#: What :func:`repeat_line`'s bytes are, and what they leave out (under the line when it counts any).
REPEAT_NOTE = ("Copies after the first: of a join, round_start (per topic), global, update, receipt or finish of one "
               "round, every copy after the first one a device sent or received (and a message delivered to it twice), "
               "and every resend request; MQTT retransmissions: PUBLISH-DUP rows; reconnecting: CONNECT, CONNACK, "
               "SUBSCRIBE and SUBACK from the first CONNECT after a device's first message on. Counted row by row, "
               "whatever made the message go again (the ledger does not say why: a server resume, a broker restart, "
               "a receipt later than the device waits for, a global re-sent smaller after the broker refused its "
               "size, a join re-sent before a server answered). Not counted, as no row ties them to it: their "
               "acknowledgements (PUBACK), keepalive pings, the online status a device publishes again after a "
               "reconnect, and a round_start re-sent on a device's own topic after a broadcast one. Counted in the "
               "totals above, as they crossed the wire.")


def repeat_client_cells(report: Mapping[str, Any]) -> list[list[str]]:
    """Rows (client, messages, up B, down B, wire B) of what each device sent or received again,
    when more than one device did ([] otherwise: the line says it all)."""
    clients = (report.get("repeats") or {}).get("by_client") or []
    if len(clients) < 2:
        return []
    return [[c["client"], count(c["messages"]), count(c["up_bytes"]), count(c["down_bytes"]), count(c["wire_bytes"])]
            for c in clients]


def fleet_line(fleet: Mapping[str, Any]) -> str:
    """The fleet total (:func:`._report.fleet_total`) in one line: e.g. ``"Fleet total of federation
    trial (3 device ledgers): up 1,500 B, down 6,000 B, 7,500 B in 12 messages; sent or
    received again (resume/reconnect cost): 2,062 B in 1 message"``."""
    unknown = fleet.get("repeat_unknown") or []
    again = (f"; sent or received again (resume/reconnect cost): {'≥ ' if unknown else ''}"
             f"{count(fleet['repeat_bytes'])} B in {count(fleet['repeat_messages'])} "
             f"message{'s' if fleet['repeat_messages'] != 1 else ''}"
             + (f" (retransmissions and reconnections of {', '.join(unknown)} unknown)" if unknown else "")
             if "repeat_bytes" in fleet else "")
    runs, more = fleet["runs"], fleet.get("ledgers", fleet["runs"]) - fleet["runs"]
    ledgers = (f"{runs} device ledger{'s' if runs != 1 else ''}"
               + (f"; {more} other ledger{'s' if more != 1 else ''}, without device-link rows (a server's), "
                  f"add{'s' if more == 1 else ''} nothing" if more else ""))
    return (f"Fleet total of federation {fleet['federation']} ({ledgers}): "
            f"up {count(fleet['up_bytes'])} B, down {count(fleet['down_bytes'])} B, {count(fleet['wire_bytes'])} B "
            f"in {count(fleet['messages'])} messages" + again)
