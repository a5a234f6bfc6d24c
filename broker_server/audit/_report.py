"""The report model: :func:`audit_report` gathers every query of one run folder into a plain,
JSON-serialisable dict, and :func:`comparison_row` flattens one report into a line of the
comparison of several runs. The renderers (:mod:`._text`, :mod:`._html`, :mod:`._csv`) read
only these dicts."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..resumes import implausible_resumes, read_resumes
from ._cost import accuracy_curve, final_accuracy, first_round_reaching, link_time_s
from ._fields import body_fields, field_bytes_per_client_round
from ._load import METRICS_NAME, clean_close, open_ledger, read_meta, read_metrics
from ._queries import (
    VIEWS,
    by_client,
    by_kind,
    by_round,
    by_round_kind,
    cumulative_parts,
    deliveries,
    federations,
    rejected,
    rejected_totals,
    repeat_bytes,
    resume_bytes,
    totals,
    training_rounds,
)

#: Default target accuracy (a fraction) for "bytes to reach the target".
DEFAULT_TARGET = 0.95


def audit_report(run_dir: str | Path, *, target: float = DEFAULT_TARGET, uplink_kbps: float | None = None,
                 downlink_kbps: float | None = None) -> dict[str, Any]:
    """The whole audit of a run folder as a JSON-serialisable dict (byte counts in bytes), queried
    straight from ``RUN_DIR/ledger.sqlite`` (read-only).

    Args:
        run_dir: the run folder.
        target: accuracy (fraction) for ``target`` below.
        uplink_kbps, downlink_kbps: link speeds (kbit/s) for ``link_time``; both None: no estimate.

    Keys:
        ``run``: ``path``, ``federation`` (the ledger's ``meta`` value, else the federation(s)
        named in the rows, else None), ``rounds`` (distinct round numbers in the ledger),
        ``metrics_rounds`` (records in ``metrics.jsonl``).
        ``totals``: ``{"device": totals(rows, "device"), "server": totals(rows, "server")}``.
        ``by_round``, ``by_round_kind``, ``by_client``, ``by_kind``: device view.
        ``by_kind_server``: :func:`by_kind` of the server link.
        ``fields``: :func:`body_fields` (what ``global``/``update`` bodies are made of, each
        message once as its sender encoded it).
        ``rejected``: :func:`rejected`; ``deliveries``: :func:`deliveries` (PUBLISH packets
        acknowledged, handed over, refused by the broker, in all and per side: ``by_side``);
        ``rejected_totals``: ``messages``, ``payload_bytes``, ``wire_bytes``.
        ``final_accuracy``: fraction in [0, 1] from the last metrics record with an ``accuracy``,
        or None.
        ``accuracy_curve``: :func:`accuracy_curve`.
        ``target``: ``accuracy`` (the target), ``round`` (first round reaching it, or None),
        ``bytes`` (:func:`bytes_to_target`, or None: not reached), ``parts`` (what ``bytes`` is
        made of in the per-round rows: :func:`cumulative_parts`; None: not reached).
        ``link_time``: :func:`link_time_s`, or None when no speed was given.
        ``ledger_closed``: False when the ledger file was not closed by its writer (still in WAL
        mode: the writer crashed, was killed or is still running; see :func:`._load.clean_close`).
        ``resume``: :func:`resume_report` (None: the run was never resumed).
        ``repeats``: :func:`repeat_bytes`, what the devices sent or received again (their
        resume/reconnect cost as their own ledgers tell it; None: the ledger has no device-link rows).

    Raises:
        AuditError: see :func:`load_run`.
        ValueError: a link speed is not positive.
    """
    run = Path(run_dir)
    db = open_ledger(run)
    try:
        meta = read_meta(db)
        metrics = read_metrics(run / METRICS_NAME)
        federation = meta.get("federation")
        if federation is None:
            names = federations(db)
            federation = ", ".join(names) if names else None
        target_round = first_round_reaching(metrics, target)
        curve = accuracy_curve(metrics, db)  # its rounds include target_round (the same metrics records)
        link = None
        if uplink_kbps is not None or downlink_kbps is not None:
            link = link_time_s(db, uplink_kbps, downlink_kbps)
        device = totals(db, "device")
        device_rows = device["all"]["messages"]
        return {
            "run": {"path": str(run), "federation": federation, "rounds": training_rounds(db),
                    "metrics_rounds": len(metrics)},
            "totals": {view: device if view == "device" else totals(db, view) for view in VIEWS},
            "by_round": by_round(db, "device"),
            "by_round_kind": by_round_kind(db, "device"),
            "by_client": by_client(db, "device"),
            "by_kind": by_kind(db, "device"),
            "by_kind_server": by_kind(db, "server"),
            "fields": body_fields(db),
            "rejected": rejected(db),
            "rejected_totals": rejected_totals(db),
            "deliveries": deliveries(db),
            "final_accuracy": final_accuracy(metrics),
            "accuracy_curve": curve,
            # a ledger without device-link rows (a `fedfleet server` run's: the server's side alone) says
            # nothing of what the devices' links carried to the target: no figure, not 0
            "target": {"accuracy": target, "round": target_round,
                       "bytes": next((p["cumulative_bytes"] for p in curve if p["round"] == target_round), None)
                       if device_rows else None,
                       "parts": None if target_round is None else cumulative_parts(db, target_round)},
            "link_time": link,
            "ledger_closed": clean_close(db),
            "resume": resume_report(db, meta, run),
            "repeats": repeat_bytes(db) if device_rows else None,
        }
    finally:
        db.close()


def _summary_resumed_after(run: Path) -> int | None:
    """``resumed_after`` of ``RUN_DIR/summary.json`` (the checkpoint round of the session that
    finished the run), or None: never resumed, no summary, or one that cannot be read."""
    try:
        value = json.loads((run / "summary.json").read_text(encoding="utf-8")).get("resumed_after")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def resume_report(db: sqlite3.Connection, meta: Mapping[str, str], run: Path) -> dict[str, Any] | None:
    """What the resumes of a run added to its ledger (bytes = wire bytes).

    The ledger keeps every attempt's rows (they crossed the wire); the resumes its ``meta`` notes
    (:mod:`broker_server.resumes`) say which of them an uninterrupted run would not have sent
    (:func:`resume_bytes`).

    Returns:
        None when the run was never resumed (its ledger notes none; or a ledger from before resumes
        were noted whose ``summary.json`` names no resume). Else ``noted`` (bool), ``problem``,
        ``why``, ``after_rounds`` (the checkpoint round each resume went on from, in order),
        ``count`` (resumes that went on; None when not noted), ``refused`` (refused ``--resume``
        attempts: noted, but the checkpoint did not load, so nothing was continued; their
        ``after_round`` is not in ``after_rounds``), ``earlier_unknown`` (the first resume noted
        found no usable note in a ledger with rows: sessions before it, if any, cannot be told
        apart, their bytes count in the first session's, and the bytes the run would have sent
        uninterrupted are unknown), ``device`` and ``server``:
        :func:`resume_bytes` of each view. ``noted`` False: the bytes cannot be told apart, and
        ``device`` and ``server`` are None; ``problem`` says why: None, a ledger written before
        resumes were noted, of a run whose ``summary.json`` says it was resumed after
        ``after_rounds[0]`` (its last resume; earlier ones cannot be known); ``"unreadable"`` or
        ``"implausible"``, a note that is not a list of resumes or one no run could have written
        (:func:`broker_server.resumes.read_resumes`, :func:`~broker_server.resumes.implausible_resumes`:
        beyond the ledger's last round or row, negative, repeated), ``why`` saying what is wrong
        (``after_rounds``: ``summary.json``'s resume, or []).
    """
    note = read_resumes(meta)
    summary_after = _summary_resumed_after(run)
    problem, why = (None, None) if note.state in ("absent", "noted") else (note.state, note.why)
    if note.state == "absent" and summary_after is None:
        return None
    if note.state == "noted":
        marks = note.marks or []
        if not marks:
            return None
        last_id, last_round = db.execute(
            "SELECT COALESCE(MAX(id), 0), MAX(CASE WHEN round >= 1 THEN round END) FROM ledger").fetchone()
        why = implausible_resumes(marks, last_id=last_id, last_round=last_round)
        if why is None:
            went_on = [m for m in marks if not m.get("refused")]
            return {"noted": True, "problem": None, "why": None, "after_rounds": [m["after_round"] for m in went_on],
                    "count": len(went_on), "refused": len(marks) - len(went_on),
                    "earlier_unknown": bool(marks[0].get("earlier_unknown")),
                    **{view: resume_bytes(db, marks, view) for view in VIEWS}}
        problem = "implausible"
    return {"noted": False, "problem": problem, "why": why,
            "after_rounds": [] if summary_after is None else [summary_after], "count": None, "refused": None,
            "earlier_unknown": False, "device": None, "server": None}


def resume_view(report: Mapping[str, Any]) -> str:
    """The view a run's resume is told in: the device links, or the server link where the ledger
    has no agent rows (``fedfleet server``: each device keeps its own ledger)."""
    return "device" if report["totals"]["device"]["all"]["messages"] else "server"


def fleet_total(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The sum over several runs of one federation (the agent folders of one fleet, each device's
    own ledger), as the text, HTML and JSON (``fleet_total``) outputs give it.

    Returns:
        ``federation``, ``runs`` (the number of device ledgers: those with device-link rows; a
        server's folder adds none), ``ledgers`` (every ledger summed, those without device-link
        rows included), ``up_bytes``, ``down_bytes``,
        ``wire_bytes`` (device links, wire bytes), ``messages`` (their rows, control packets
        included), ``repeat_bytes`` and ``repeat_messages`` (what the devices sent or received
        again: the sums of each report's ``repeats`` ``all``, :func:`repeat_bytes`; a ledger
        without device-link rows adds 0) and ``repeat_unknown`` (devices whose ledger records no
        control packets, so that their retransmissions and reconnections are not in
        ``repeat_bytes``: ``repeats`` ``without_control``, sorted); ``None`` for a single run or
        runs of different (or unknown) federations, whose sum means nothing.
    """
    feds = {r["run"].get("federation") for r in reports}
    if len(reports) < 2 or len(feds) != 1 or None in feds:
        return None
    dev = [r["totals"]["device"] for r in reports]
    again = [r["repeats"] for r in reports if r.get("repeats")]
    return {"federation": feds.pop(), "runs": sum(1 for d in dev if d["all"]["messages"]), "ledgers": len(reports),
            "up_bytes": sum(d["up"]["wire_bytes"] for d in dev),
            "down_bytes": sum(d["down"]["wire_bytes"] for d in dev),
            "wire_bytes": sum(d["all"]["wire_bytes"] for d in dev), "messages": sum(d["all"]["messages"] for d in dev),
            "repeat_bytes": sum(a["all"]["wire_bytes"] for a in again),
            "repeat_messages": sum(a["all"]["messages"] for a in again),
            "repeat_unknown": sorted({n for a in again for n in a.get("without_control", [])})}


def fleet_total_omitted(reports: Sequence[Mapping[str, Any]]) -> str | None:
    """Why several runs have no fleet total (:func:`fleet_total` is ``None``), in one line; ``None``
    for a single run, or when they have one."""
    if len(reports) < 2 or fleet_total(reports) is not None:
        return None
    feds = [r["run"].get("federation") for r in reports]
    unknown = sum(1 for f in feds if f is None)
    if unknown:
        return (f"No fleet total: {unknown} of the {len(reports)} ledgers record no federation, so they cannot be "
                "told to be of one fleet")
    return (f"No fleet total: the ledgers are of {len(set(feds))} federations ({', '.join(sorted(set(feds)))}); "
            "a fleet total sums the ledgers of one")


def device_ledger(report: Mapping[str, Any]) -> bool:
    """Whether ``report`` is of a device's own ledger (an agent's ``--out`` folder: device-link
    rows, none of the server's, and no resume noted): its server's resumes are noted in the
    server's ledger, not there, so the bytes it sent or received again (``repeats``) tell what
    they cost it."""
    return (bool(report["totals"]["device"]["all"]["messages"]) and not report["totals"]["server"]["all"]["messages"]
            and not report.get("resume"))


def comparison_row(report: Mapping[str, Any]) -> dict[str, Any]:
    """One run's line of the comparison (device links; bytes in bytes, times in seconds).

    Returns:
        ``run`` (path), ``federation``, ``rounds``, ``final_accuracy`` (fraction or None),
        ``up_bytes``, ``down_bytes``, ``wire_bytes`` (device-link wire bytes), ``overhead_share``,
        ``target`` (fraction), ``target_round`` and ``bytes_to_target`` (None: not reached, or
        ``device_rows`` 0), ``device_rows`` (the ledger's device-link rows: 0 in a ledger of the
        server's side alone, whose device-link figures are then not known, not 0),
        and from ``link_time`` (None without link speeds): ``uplink_kbps``, ``downlink_kbps``,
        ``up_max_s``, ``down_max_s``, ``time_max_s`` (parallel clients), ``up_sum_s``,
        ``down_sum_s``, ``time_sum_s`` (sum over clients); and from ``fields``
        (:func:`field_bytes_per_client_round`; None without it): ``up_tensor_bytes_per_client_round``,
        ``up_extras_bytes_per_client_round``, ``down_tensor_bytes_per_client_round``,
        ``down_extras_bytes_per_client_round``; and from ``resume`` (:func:`resume_report`, on
        ``resume_link``: ``"device"``, or ``"server"`` for a ledger with only the server's rows,
        a ``fedfleet server`` run's: :func:`resume_view`): ``resumed_after`` (the rounds the run
        was resumed after; [] never resumed),
        ``resume_bytes``, ``resume_rerun_bytes``, ``resume_ending_bytes``, ``resume_rejoin_bytes``,
        ``resume_refused_bytes`` (what the resumes added: all, re-sent, ending the interrupted
        session, reconnecting, refused ``--resume`` attempts; 0
        never resumed, None when the ledger does not tell them: see ``resume_note``),
        ``wire_bytes_without_resume`` (the link's wire bytes − ``resume_bytes``; None when unknown, as
        when resumes before the first noted one count in the first session) and ``resume_note``
        (:func:`resume_note`); a device's own ledger (:func:`device_ledger`), which notes no resume
        whether its server was resumed or not, has ``resume_bytes`` … ``wire_bytes_without_resume``
        None and ``resume_note`` ``"device ledger"`` (its cost is in the ``repeat_*`` columns);
        and from ``repeats`` (:func:`repeat_bytes`; None without device-link rows):
        ``repeat_bytes``, ``repeat_messages`` (what the devices sent or received again: their
        resume/reconnect cost as their own ledgers tell it), ``repeat_again_bytes`` (copies after
        the first), ``repeat_dup_bytes`` (MQTT retransmissions), ``repeat_reconnect_bytes``
        (reconnections) and ``repeat_note`` (``""``, or ``"control packets not recorded"``: the
        ledger of a device in it has no control packets, so its retransmissions and reconnections
        are not counted).
    """
    dev = report["totals"]["device"]
    tgt = report.get("target") or {}
    link = report.get("link_time") or {}
    return {
        "run": report["run"]["path"], "federation": report["run"].get("federation"),
        "rounds": report["run"].get("rounds"), "final_accuracy": report.get("final_accuracy"),
        "up_bytes": dev["up"]["wire_bytes"], "down_bytes": dev["down"]["wire_bytes"],
        "wire_bytes": dev["all"]["wire_bytes"], "overhead_share": dev["all"]["overhead_share"],
        "target": tgt.get("accuracy"), "target_round": tgt.get("round"), "bytes_to_target": tgt.get("bytes"),
        "device_rows": dev["all"]["messages"],
        "uplink_kbps": link.get("uplink_kbps"), "downlink_kbps": link.get("downlink_kbps"),
        "up_max_s": link.get("up_max_s"), "down_max_s": link.get("down_max_s"),
        "time_max_s": link.get("max_s"),
        "up_sum_s": link.get("up_sum_s"), "down_sum_s": link.get("down_sum_s"),
        "time_sum_s": link.get("sum_s"),
        **field_bytes_per_client_round(report.get("fields") or []),
        **_resume_columns(report),
        **_repeat_columns(report),
    }


def _repeat_columns(report: Mapping[str, Any]) -> dict[str, Any]:
    """The ``repeat_*`` columns of :func:`comparison_row` (device links, wire bytes)."""
    again = report.get("repeats")
    if not again:
        return {"repeat_bytes": None, "repeat_messages": None, "repeat_again_bytes": None, "repeat_dup_bytes": None,
                "repeat_reconnect_bytes": None, "repeat_note": ""}
    return {"repeat_bytes": again["all"]["wire_bytes"], "repeat_messages": again["all"]["messages"],
            "repeat_again_bytes": again["again"]["wire_bytes"], "repeat_dup_bytes": again["dup"]["wire_bytes"],
            "repeat_reconnect_bytes": again["reconnect"]["wire_bytes"],
            "repeat_note": "control packets not recorded" if again.get("without_control") else ""}


def resume_note(resume: Mapping[str, Any] | None) -> str:
    """What the comparison says of how a run's resumes are known (``resume_note``): ``""`` (never
    resumed, or noted in full), ``"not noted"`` (a ledger written before resumes were noted),
    ``"unreadable"``, ``"implausible"`` (its note), ``"earlier not noted"`` (resumes before the
    first noted one, if any, count in the first session: see :func:`resume_report`)."""
    if not resume:
        return ""
    if not resume["noted"]:
        return resume.get("problem") or "not noted"
    return "earlier not noted" if resume.get("earlier_unknown") else ""


def _resume_columns(report: Mapping[str, Any]) -> dict[str, Any]:
    """The resume columns of :func:`comparison_row` (bytes of the link the resume is told in:
    :func:`resume_view`, ``resume_link``)."""
    resume = report.get("resume")
    link = resume_view(report)
    wire_bytes = report["totals"][link]["all"]["wire_bytes"]
    if device_ledger(report):  # not "0: never resumed": the server's resumes are not noted in a device's ledger
        return {"resumed_after": [], "resume_link": link, "resume_bytes": None, "resume_rerun_bytes": None,
                "resume_ending_bytes": None, "resume_rejoin_bytes": None, "resume_refused_bytes": None,
                "wire_bytes_without_resume": None, "resume_note": "device ledger"}
    if not resume:
        return {"resumed_after": [], "resume_link": link, "resume_bytes": 0, "resume_rerun_bytes": 0,
                "resume_ending_bytes": 0, "resume_rejoin_bytes": 0, "resume_refused_bytes": 0,
                "wire_bytes_without_resume": wire_bytes, "resume_note": ""}
    told = resume.get(link)
    if told is None:
        return {"resumed_after": list(resume["after_rounds"]), "resume_link": link, "resume_bytes": None,
                "resume_rerun_bytes": None, "resume_ending_bytes": None, "resume_rejoin_bytes": None,
                "resume_refused_bytes": None, "wire_bytes_without_resume": None, "resume_note": resume_note(resume)}
    added = told["all"]["wire_bytes"]
    return {"resumed_after": list(resume["after_rounds"]), "resume_link": link, "resume_bytes": added,
            "resume_rerun_bytes": told["rerun"]["wire_bytes"], "resume_ending_bytes": told["ending"]["wire_bytes"],
            "resume_rejoin_bytes": told["rejoin"]["wire_bytes"], "resume_refused_bytes": told["refusal"]["wire_bytes"],
            "wire_bytes_without_resume": None if resume.get("earlier_unknown") else wire_bytes - added,
            "resume_note": resume_note(resume)}
