"""Devices that drop out of an open round, over real brokers (Mosquitto and amqtt, digits, 3
agents, quorum 2, 3 rounds), and updates refused while they are decoded:

* a device whose link breaks as round 2's ``global`` reaches it (global and round_start lost,
  the broker publishes its last will) reconnects, says ``online`` and gets the round again on
  its own topics: round 2 closes with all three updates, the device trains each round once;
* a device that loses power while it trains round 2 (its last will arrives, it never returns)
  is dropped after the 1 s grace: round 2 closes on the other two and names it;
* an update whose body cannot be decoded gets exactly one refusal receipt, the device sends it
  once (no resends although its receipt timeout is 1 s), and the round closes on the others.

Round deadlines are 60 s: a round that waited for its deadline would make the assertions on
who reported fail; no assertion is on wall-clock time."""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

import msgpack
import pytest
from helpers.federation import read_metrics, read_summary, small_config

from broker_server.simulate import simulate
from protocol.messages import decode, read_header

pytestmark = pytest.mark.slow


def _cfg(kind: str, **server) -> object:
    return small_config(run={"name": "back", "rounds": 3}, broker={"kind": kind},
                        server={"round_deadline_s": 60.0, **server})


def _rows(run_dir: Path, where: str, params: tuple = ()) -> list[sqlite3.Row]:
    db = sqlite3.connect(f"file:{run_dir / 'ledger.sqlite'}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        return list(db.execute(f"SELECT * FROM messages WHERE {where} ORDER BY id", params))
    finally:
        db.close()


def test_device_whose_link_broke_during_the_global_gets_the_round_again(tmp_path: Path, broker_kind: str,
                                                                         caplog) -> None:
    """client-002's connection is cut (no DISCONNECT) the moment round 2's broadcast global
    reaches it: that global and the round_start after it are lost. Once paho reconnected and
    the agent said online, the server sends it round 2 on ``down/client-002/global`` and
    ``down/client-002/round_start``: round 2 closes with 3 updates (``resent_to`` = [client-002],
    nobody dropped), no broadcast global is sent twice, and client-002 trained 3 rounds in all
    (none twice); a second copy of its round-2 update, if the race let the broadcast round_start
    through, is answered as a duplicate."""
    cut = threading.Event()

    def hook(i, agent):
        if i != 2:
            return
        tr = agent.channel.transport
        paho = tr._client
        deliver = paho.on_message

        def on_message(client, userdata, msg):
            if (not cut.is_set() and msg.topic.endswith("/down/global")
                    and decode(bytes(msg.payload)).envelope.round == 2):
                cut.set()
                tr.drop_link()  # the link breaks as the global arrives: this copy is lost
                return
            deliver(client, userdata, msg)

        paho.on_message = on_message

    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="broker_server.server"):
        res = simulate(_cfg(broker_kind), run_dir=run_dir, agent_hook=hook)
    assert cut.is_set()
    m = read_metrics(run_dir)
    assert res.rounds_completed == 3 and read_summary(run_dir)["agent_errors"] == []
    assert (m[1]["clients_reported"], m[1]["resent_to"], m[1]["dropped"]) == (3, ["client-002"], [])
    assert {a.client_id: a.rounds_trained for a in res.agents}["client-002"] == 3
    copies = _rows(run_dir, "side = 'server' AND event = 'sent' AND topic LIKE '%/down/client-002/global'")
    assert [r["round"] for r in copies] == [2]
    broadcasts = _rows(run_dir, "side = 'server' AND event = 'sent' AND topic LIKE '%/down/global'")
    assert [r["round"] for r in broadcasts] == [1, 2, 3]
    ups = _rows(run_dir, "side = 'agent' AND node = 'client-002' AND event = 'sent' AND kind = 'update' AND round = 2")
    # one round-2 update, or two when the broadcast round_start still got through before the cut
    # (the agent then trained on it and, given the per-device copy, sends its update again):
    # any second copy is answered as a duplicate and never counted twice
    late_dups = sum(x["duplicates"] for x in m[1:])  # answered in round 2, or in round 3 if it came after the close
    assert len(ups) in (1, 2) and late_dups == len(ups) - 1, (len(ups), late_dups)
    assert any("client-002 is back online during round 2" in r.getMessage() for r in caplog.records)


class _PowerLoss(Exception):
    """Raised on the dead device's own thread after it vanished (ends its agent)."""


def test_device_whose_last_will_arrives_is_dropped_after_the_grace(tmp_path: Path, broker_kind: str,
                                                                   caplog) -> None:
    """client-002 vanishes (socket closed, no DISCONNECT: the broker publishes its last will)
    while it trains round 2. With ``offline_grace_s`` = 1 s the server stops waiting for it:
    round 2 closes on the other two (not skipped, ``dropped`` = [client-002], also in
    ``summary.json`` ``refusals.dropped``), and round 3 selects the two online devices."""
    gone = threading.Event()

    def hook(i, agent):
        if i != 2:
            return
        real = agent.algorithm.local_round

        def local_round(*args, **kwargs):
            if kwargs.get("round") == 2:
                agent.channel.transport.abort()
                gone.set()
                raise _PowerLoss("client-002 lost power while training round 2")
            return real(*args, **kwargs)

        agent.algorithm.local_round = local_round

    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="broker_server.server"):
        res = simulate(_cfg(broker_kind, offline_grace_s=1.0), run_dir=run_dir, agent_hook=hook)
    assert gone.is_set()
    m = read_metrics(run_dir)
    assert res.rounds_completed == 3
    assert (m[1]["clients_reported"], m[1]["skipped"], m[1]["dropped"], m[1]["unreported"]) == \
        (2, False, ["client-002"], [])
    assert (m[2]["clients_selected"], m[2]["clients_reported"]) == (2, 2)
    summary = read_summary(run_dir)
    assert summary["refusals"]["dropped"] == {"2": ["client-002"]}
    assert [e for e in summary["agent_errors"] if "client-002 lost power" not in e] == []
    assert any("client-002 dropped" in r.getMessage() for r in caplog.records)


def test_update_refused_while_decoding_is_answered_once_and_sent_once(tmp_path: Path, broker_kind: str) -> None:
    """client-000's round-1 update leaves with its header intact and its body replaced by a byte
    that is no msgpack (``0xc1``). The server refuses it while decoding and answers it: one
    receipt for that update's seq, refused; client-000 (receipt timeout 5 s, 3 resends allowed)
    sends no copy; round 1 closes on the other two (``invalid`` 1 =
    ``rejected_by_reason["invalid"]``), round 2 counts all three; the server's ledger row of
    those bytes is ``rejected`` with client-000's sender and seq."""
    garbled: list[int] = []

    def hook(i, agent):
        if i != 0:
            return
        agent.receipt_timeout_s = 5.0  # the answer comes long before on a loaded machine too
        tr = agent.channel.transport
        real = tr.publish

        def publish(topic, payload, **kw):
            if topic.endswith("/update") and not garbled:
                env = msgpack.unpackb(payload, raw=False)
                header = read_header(payload)
                assert header is not None
                garbled.append(header[3])
                payload = msgpack.packb([*env[:6], b"\xc1"], use_bin_type=True)
            return real(topic, payload, **kw)

        tr.publish = publish

    run_dir = tmp_path / "run"
    res = simulate(_cfg(broker_kind, quorum=2), run_dir=run_dir, agent_hook=hook)
    (seq,) = garbled
    m = read_metrics(run_dir)
    assert res.rounds_completed == 3
    assert (m[0]["clients_reported"], m[0]["invalid"], m[0]["rejected_by_reason"]) == (2, 1, {"invalid": 1})
    assert m[1]["clients_reported"] == 3
    sent = _rows(run_dir, "side = 'agent' AND node = 'client-000' AND event = 'sent' AND kind = 'update' "
                          "AND round = 1")
    assert [r["seq"] for r in sent] == [seq]
    answers = _rows(run_dir, "side = 'agent' AND node = 'client-000' AND event = 'received' AND kind = 'receipt' "
                             "AND round = 1")
    assert len(answers) == 1
    (refused,) = _rows(run_dir, "side = 'server' AND event = 'rejected'")
    assert (refused["kind"], refused["sender"], refused["seq"], refused["round"]) == ("update", "client-000", seq, 1)
    summary = read_summary(run_dir)
    assert summary["refusals"]["invalid"] == sum(summary["refusals"]["rejected_by_reason"].values()) == 1
