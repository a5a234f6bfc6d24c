"""Who is back at a resumed server (``fedfleet server --resume``), message by message on the
in-process broker: the devices of the checkpoint's registry start offline, and each is said back
once (a ``back`` progress event and line, as a ``joined`` one, and an ``INFO`` record) when it is
first heard from again other than by a join: its ``online`` status kept by the broker (the
agent kept running while the server was down), a live one after its reconnect, or a message of
the run (an update for a round not open yet). A device that joins again (a live plain ``online``
is an agent starting: its join follows) is said by its ``joined`` line only, as is a device the
checkpoint does not know; a retained ``offline`` (its last will) brings nothing back.

Round 1 of the first server is scripted (four devices, each one update); the resumed server on a
fresh broker is handed each message as the broker would deliver it (the retain flag included)."""

from __future__ import annotations

import io
import logging
import time
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from helpers.memory_server import incoming, memory_server, status_payload, update_payload

from broker_server.progress import PlainProgress
from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol import topics
from protocol.messages import Envelope, Join, Kind, encode
from protocol.transport_base import Incoming

FED = "mem"
DEVICES = ["client-a", "client-b", "client-c", "client-d"]


def _join(srv, cid: str, seq: int) -> Incoming:
    join = Join(profile="rpi4", manifest_hash=srv.manifest_hash, num_samples=40,
                class_histogram=tuple([40] + [0] * 9))
    return incoming(topics.up(FED, cid, Kind.JOIN), encode(Envelope(round=0, sender=cid, seq=seq, body=join)).payload)


def test_a_resumed_server_says_each_device_of_its_checkpoint_back_once(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    like = list(state_arrays(model))
    rng = np.random.default_rng(0)
    feed: deque[Incoming] = deque(incoming(*update_payload(FED, c, 1, 2, like, rng)) for c in DEVICES)
    first = memory_server(tmp_path, model=model, clients=DEVICES, rounds=3,
                          feed=lambda: feed.popleft() if feed else None)
    assert first.run_round(1)["clients_reported"] == 4
    first.store.close()

    caplog.set_level(logging.INFO, logger="broker_server.server")
    srv = memory_server(tmp_path, model=build_model("lightcnn", in_channels=1, image_size=28, num_classes=10),
                        clients=[], rounds=3)
    ckpt = srv.checkpoints.load()
    assert ckpt is not None and ckpt.round == 1
    srv.resume(ckpt)
    assert srv.not_back == set(DEVICES) and srv.devices.online() == []
    out = io.StringIO()
    display = PlainProgress(3, stream=out, show_joins=True)
    events: list[tuple[str, str | None, dict]] = []

    def observe(kind: str, rnd: int, client: str | None, info: dict) -> None:
        events.append((kind, client, info))
        display.on_event(kind, rnd, client, info)

    srv.on_event = observe
    tr = srv.channel.transport

    def arrive(topic: str, payload: bytes, *, retain: bool = False) -> None:
        tr.deliver(Incoming(topic, payload, 1, retain, time.monotonic()))
        srv._handle(srv.channel.receive(0.0))

    arrive(*status_payload(FED, "client-a", "online", seq=7), retain=True)  # kept by the broker: a kept running
    arrive(*status_payload(FED, "client-b", "offline", "connection lost"), retain=True)  # its last will
    arrive(*status_payload(FED, "client-b", "online", "reconnected", seq=8))  # live, after its reconnect
    arrive(*status_payload(FED, "client-c", "online", seq=9))  # a restarted agent: its join follows
    join_c = _join(srv, "client-c", 10)
    arrive(join_c.topic, join_c.payload)
    arrive(*update_payload(FED, "client-d", 2, 11, like, rng))  # trained round 2 before the server stopped
    arrive(*status_payload(FED, "client-a", "online", "reconnected", seq=12))  # said once only
    join_new = _join(srv, "client-new", 1)
    arrive(join_new.topic, join_new.payload)

    assert [(k, c, i["online"], i.get("how")) for k, c, i in events] == [
        ("back", "client-a", 1, "its online status (kept by the broker)"),
        ("back", "client-b", 2, "its online status"),
        ("joined", "client-c", 3, None),
        ("back", "client-d", 4, "its update"),
        ("joined", "client-new", 5, None)]
    assert out.getvalue().splitlines() == [
        "back: client-a (x86-cpu, 100 samples), 1 online",
        "back: client-b (x86-cpu, 100 samples), 2 online",
        "joined: client-c (rpi4, 40 samples), 3 online",
        "back: client-d (x86-cpu, 100 samples), 4 online",
        "joined: client-new (rpi4, 40 samples), 5 online"]
    assert [r.getMessage() for r in caplog.records if " is back (" in r.getMessage()] == [
        "client-a is back (in the registry of the checkpoint of round 1; its online status (kept by the broker)): "
        "1 online",
        "client-b is back (in the registry of the checkpoint of round 1; its online status): 2 online",
        "client-d is back (in the registry of the checkpoint of round 1; its update): 4 online"]
    assert srv.not_back == set()
    assert srv.totals["early"] == 1  # client-d's update was not answered (round 2 is not open)
    srv.store.close()


def test_a_server_not_resumed_says_no_device_back(tmp_path: Path) -> None:
    """Without a resume nothing is ``back``: a joined device's status after a reconnect is
    presence bookkeeping only (and, during a round, the round re-sent to it)."""
    srv = memory_server(tmp_path, model=build_model("lightcnn", in_channels=1, image_size=28, num_classes=10),
                        clients=["client-a"], rounds=1)
    events: list[str] = []
    srv.on_event = lambda kind, rnd, client, info: events.append(kind)
    for state, detail, seq in (("offline", "connection lost", 0), ("online", "reconnected", 5)):
        topic, payload = status_payload(FED, "client-a", state, detail, seq)
        srv.channel.transport.deliver(Incoming(topic, payload, 1, False, time.monotonic()))
        srv._handle(srv.channel.receive(0.0))
    assert events == [] and srv.not_back == set() and srv.devices.online() == ["client-a"]
    srv.store.close()
