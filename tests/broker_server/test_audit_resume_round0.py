"""What a resume after round 0 added (:func:`broker_server.audit.resume_bytes`): the two resumes
its note's ``registry`` tells apart.

A server killed during round 1 has round 0's checkpoint, written once the devices had joined:
it holds their registry. Resumed from it, the server knows them, and devices that kept running
come back through their ``online`` status without joining again: the interrupted session's
joins are the run's own, and only what the resumed session added is extra, as after any later
round. A resume with no checkpoint at all is the whole run again, every device joining it: there
the interrupted session's connections and joins are the extra ones.

The federations here are real (an :class:`AggregationServer` and one :class:`EdgeAgent` thread
per device over the in-process broker, the server's last will included): the server dies on
the first update of round 1 (its transport aborted: the broker publishes its retained
``offline``) and is resumed on the same ledger; its twin is the same federation uninterrupted.
What the resumed run has beyond its twin is, to the byte, what the audit says its resume added,
on the device links and on the server link.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from helpers.memory_federation import Device, Killed, digits_model, start_agents

from broker_server.audit import audit_report, render_text
from broker_server.audit._format import resume_cells, resume_line, resume_notes
from broker_server.resumes import note_fresh_run, note_resume
from broker_server.server import AggregationServer, ServerSettings, server_will
from broker_server.strategies.fedavg import FedAvg
from edge_agent.algorithms.fedavg import FedAvgClient
from protocol.channel import Channel
from protocol.ledger import Ledger
from protocol.memory_transport import MemoryBroker

CIDS = ["dev-a", "dev-b", "dev-c"]
ROUNDS = 2


def _devices(digits) -> dict[str, Device]:
    return {cid: Device(FedAvgClient(), digits.train.x[40 * i:40 * i + 40], digits.train.y[40 * i:40 * i + 40])
            for i, cid in enumerate(CIDS)}


def _server(run: Path, hub: MemoryBroker, digits, ledger: Ledger) -> AggregationServer:
    """The federation's server on ``hub`` (with its last will, as ``fedfleet server`` connects)."""
    return AggregationServer(
        channel=Channel(hub.connect("server", will=server_will("mem")), node_id="server", side="server",
                        federation="mem", ledger=ledger),
        strategy=FedAvg(participation_rate=1.0), model=digits_model(), test=digits.test,
        settings=ServerSettings(rounds=ROUNDS, quorum=len(CIDS), round_deadline_s=120, join_timeout_s=120,
                                expected_clients=len(CIDS)),
        run_dir=run)


def _dies_on_first_update(server: AggregationServer) -> None:
    """``server`` dies (:class:`Killed`) when the first update of round 1 reaches it: every device
    has round 1's global, the checkpoint is round 0's."""
    def observe(kind: str, rnd: int, client, info) -> None:
        if kind == "reported" and rnd == 1:
            raise Killed
    server.on_event = observe


def _finish(server: AggregationServer, threads, errors) -> None:
    summary = server.run()
    server.close("run finished")
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert summary.rounds_completed == ROUNDS


def _twin(tmp: Path, digits) -> Path:
    """The same federation uninterrupted, in a folder of the same name length."""
    run = tmp / "run-t"
    run.mkdir()
    ledger = Ledger(run / "ledger.sqlite")
    note_fresh_run(ledger)
    hub = MemoryBroker()
    server = _server(run, hub, digits, ledger)
    _, threads, errors = start_agents(hub, _devices(digits), agent_ledger=ledger)
    try:
        _finish(server, threads, errors)
    finally:
        server.store.close()
        ledger.close()
    return run


def _resumed(tmp: Path, digits, *, agents_restart: bool) -> Path:
    """Killed on round 1's first update, resumed from round 0's checkpoint on the same ledger.
    ``agents_restart`` False: the agents keep running on the same broker and come back through
    their ``online`` status; True: they stopped with the server and new ones join a new broker."""
    run = tmp / "run-r"
    run.mkdir()
    ledger = Ledger(run / "ledger.sqlite")
    note_fresh_run(ledger)
    hub = MemoryBroker()
    first = _server(run, hub, digits, ledger)
    _dies_on_first_update(first)
    agents, threads, errors = start_agents(hub, _devices(digits), agent_ledger=ledger)
    try:
        with pytest.raises(Killed):
            first.run()
    finally:
        first.channel.transport.abort()  # the process is gone: no DISCONNECT, the broker publishes its will
        first.store.close()
    if agents_restart:
        for a in agents:
            a.stop()
        for t in threads:
            t.join(60)
        assert not errors, errors
        hub = MemoryBroker()
    before_id = ledger.last_row_id()
    second = _server(run, hub, digits, ledger)
    ckpt = second.checkpoints.load()
    assert ckpt is not None and ckpt.round == 0 and len(ckpt.registry) == len(CIDS)
    note_resume(ledger, after_round=ckpt.round, after_id=before_id, registry=len(ckpt.registry))
    second.resume(ckpt)
    if agents_restart:
        _, threads, errors = start_agents(hub, _devices(digits), agent_ledger=ledger)
    try:
        _finish(second, threads, errors)
    finally:
        second.store.close()
        ledger.close()
    return run


def _joins(run: Path, side: str, *, after_id: int) -> int:
    db = sqlite3.connect(run / "ledger.sqlite")
    try:
        return db.execute("SELECT COUNT(*) FROM messages WHERE side = ? AND kind = 'join' AND id > ? "
                          "AND event IN ('sent', 'received')", (side, after_id)).fetchone()[0]
    finally:
        db.close()


def _note(run: Path) -> dict:
    db = sqlite3.connect(run / "ledger.sqlite")
    try:
        (value,) = db.execute("SELECT value FROM meta WHERE key = 'resumes'").fetchone()
    finally:
        db.close()
    (note,) = json.loads(value)
    return note


@pytest.fixture(scope="module")
def twin(tmp_path_factory, digits) -> Path:
    return _twin(tmp_path_factory.mktemp("twin"), digits)


def test_devices_that_come_back_after_a_round_0_resume_cost_only_what_the_resumed_session_added(
        tmp_path, digits, twin):
    """Round 0's checkpoint holds the registry; the agents kept running and come back through their
    ``online`` status (no join in the resumed session). The interrupted session's joins are the
    run's own: without the attributed bytes the run is its twin, byte for byte, on either link."""
    run = _resumed(tmp_path, digits, agents_restart=False)
    note = _note(run)
    assert (note["after_round"], note["registry"]) == (0, len(CIDS))
    assert _joins(run, "server", after_id=note["after_id"]) == _joins(run, "agent", after_id=note["after_id"]) == 0
    rep, twin_rep = audit_report(run), audit_report(twin)
    assert twin_rep["resume"] is None
    for view in ("device", "server"):
        got = rep["resume"][view]
        (x,) = got["resumes"]
        assert (x["after_round"], x["registry"], x["from_start"], x["rerun_rounds"]) == (0, 3, False, [1]), view
        assert not any(k["kind"] == "join" for k in x["rejoin"]["kinds"]), view  # no device joined again
        without = rep["totals"][view]["all"]["wire_bytes"] - got["all"]["wire_bytes"]
        assert without == twin_rep["totals"][view]["all"]["wire_bytes"], view
    dev = rep["resume"]["device"]
    flat = " ".join(render_text(rep).split())
    assert (f"Resumed after round 0 (1 resume: its checkpoint held the devices that had joined): "
            f"{dev['all']['wire_bytes']:,} of the {rep['totals']['device']['all']['wire_bytes']:,} device-link bytes "
            f"belong to it: {dev['rerun']['wire_bytes']:,} re-sent (round 1's first attempt, sent again after the "
            f"resume") in flat
    assert (f"{dev['rejoin']['wire_bytes']:,} reconnecting (the resumed session's connections and statuses: its "
            f"devices came back without joining again); {twin_rep['totals']['device']['all']['wire_bytes']:,} "
            "without them.") in flat
    assert "before its first checkpoint" not in flat and "with no checkpoint" not in flat
    assert [c[2] for c in resume_cells(rep) if c[0] == "device"][2] == (
        "reconnecting (its devices came back without joining again)")
    notes = " ".join(resume_notes(rep, "device"))
    assert "whose checkpoint held the devices that had joined (round 0's registry)" in notes
    assert "had no checkpoint to go on from" not in notes


def test_devices_that_join_again_after_a_round_0_resume_count_those_joins(tmp_path, digits, twin):
    """Round 0's checkpoint holds the registry, but the agents stopped with the server and new ones
    join the resumed session: those joins (and their connections, statuses) are what an
    uninterrupted run would not have made, counted as reconnecting; the interrupted session's
    joins stay the run's own. Without the attributed bytes the run is its twin, byte for byte."""
    run = _resumed(tmp_path, digits, agents_restart=True)
    note = _note(run)
    assert _joins(run, "server", after_id=note["after_id"]) == len(CIDS)
    rep, twin_rep = audit_report(run), audit_report(twin)
    joins = {}
    for view in ("device", "server"):
        got = rep["resume"][view]
        (x,) = got["resumes"]
        assert (x["from_start"], x["rerun_rounds"]) == (False, [1]), view
        joins[view] = [k for k in x["rejoin"]["kinds"] if k["kind"] == "join"]
        assert sum(k["messages"] for k in joins[view]) == len(CIDS), view  # the joins made again
        without = rep["totals"][view]["all"]["wire_bytes"] - got["all"]["wire_bytes"]
        assert without == twin_rep["totals"][view]["all"]["wire_bytes"], view
    line = resume_line(rep, "device")
    assert line is not None and "reconnecting (the resumed session's connections and joins)" in line
    assert [c[2] for c in resume_cells(rep) if c[0] == "device"][2] == "reconnecting and joining again"
