"""An aggregation server without a network: :class:`AggregationServer` on a
:class:`protocol.memory_transport.MemoryBroker`, for round logic tested message by message.

``memory_server(...)`` joins ``clients`` through the server's real handling path (each join is
published by that client's own connection to the broker and received by the server's channel);
the test then scripts the uploads: ``feed`` is asked for the next message whenever the server's
receive queue is empty, so a test holds one message at a time however many it sends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from broker_server.server import AggregationServer, ServerSettings
from broker_server.strategies import get_strategy
from edge_agent.data import ArraySplit
from protocol import topics
from protocol.channel import Channel
from protocol.ledger import Ledger
from protocol.memory_transport import MemoryBroker, MemoryTransport
from protocol.messages import Envelope, Join, Kind, Receipt, Status, Update, decode, encode
from protocol.transport_base import Incoming


def incoming(topic: str, payload: bytes) -> Incoming:
    """``payload`` as delivered on ``topic`` now (QoS 1, not retained)."""
    return Incoming(topic, payload, 1, False, time.monotonic())


def memory_server(tmp: Path, *, model, clients: list[str], rounds: int = 2,
                  feed: Callable[[], Incoming | list[Incoming] | None] | None = None, keep: bool = True,
                  strategy=None, test: ArraySplit | None = None, num_samples: int = 100, fed: str = "mem",
                  deadline_s: float = 600.0, offline_grace_s: float = 30.0,
                  ledger: Ledger | None = None) -> AggregationServer:
    """An :class:`AggregationServer` (quorum 1, round deadline ``deadline_s`` seconds, grace
    ``offline_grace_s`` for a device whose last will came, run folder ``tmp``, the server's byte
    ``ledger`` or none) on a memory broker, with ``clients`` joined (``num_samples`` each, all of class 0).

    Args:
        feed: called when the server's queue is empty; each :class:`Incoming` it returns (one, or
            a list published at once) is published on the broker by its sender's connection
            (``None``: nothing to send now).
        keep: keep every message the server sends in ``srv.channel.transport.sent``.
        strategy: default FedAvg (``min_clients = 1``); test: default four blank 1×28×28 images.
    """
    broker = MemoryBroker()
    devices: dict[str, MemoryTransport] = {}

    def device(topic: str) -> MemoryTransport:
        cid = topics.parse(topic).client_id or "feed"
        if cid not in devices:
            devices[cid] = broker.connect(cid)
        return devices[cid]

    def on_idle() -> None:
        got = feed() if feed is not None else None
        for item in [] if got is None else got if isinstance(got, list) else [got]:
            if item.received_at > time.monotonic():  # an arrival scripted for later: handed over as is
                tr.deliver(item)
            else:
                device(item.topic).publish(item.topic, item.payload, qos=item.qos)

    tr = broker.connect("server", keep_sent=keep, on_idle=on_idle if feed is not None else None)
    ch = Channel(tr, node_id="server", side="server", federation=fed, ledger=ledger)
    if test is None:
        test = ArraySplit(np.zeros((4, 1, 28, 28), np.float32), np.zeros(4, np.int64), 10)
    srv = AggregationServer(channel=ch, strategy=strategy or get_strategy("fedavg", min_clients=1), model=model,
                            test=test, settings=ServerSettings(rounds=rounds, quorum=1, round_deadline_s=deadline_s,
                                                               expected_clients=len(clients),
                                                               offline_grace_s=offline_grace_s),
                            run_dir=tmp)
    for cid in clients:
        join = Join(profile="x86-cpu", manifest_hash=srv.manifest_hash, num_samples=num_samples,
                    class_histogram=tuple([num_samples] + [0] * 9))
        topic = topics.up(fed, cid, Kind.JOIN)
        device(topic).publish(topic, encode(Envelope(round=0, sender=cid, seq=1, body=join)).payload)
        srv._handle(ch.receive(0.0))
    return srv


def update_payload(fed: str, cid: str, rnd: int, seq: int, like: list[np.ndarray], rng: np.random.Generator,
                   num_samples: int = 100) -> tuple[str, bytes]:
    """(topic, payload) of an update from ``cid`` for round ``rnd``: tensors shaped like ``like``,
    floats drawn from N(0, 0.01²) with ``rng``, others copied."""
    tensors = tuple((rng.standard_normal(t.shape) * 0.01).astype(t.dtype) if np.issubdtype(t.dtype, np.floating)
                    else np.array(t) for t in like)
    upd = Update(tensors=tensors, num_samples=num_samples, train_loss=0.5)
    return topics.up(fed, cid, Kind.UPDATE), encode(Envelope(round=rnd, sender=cid, seq=seq, body=upd)).payload


def status_payload(fed: str, cid: str, state: str, detail: str = "", seq: int = 0,
                   holds: tuple[int, int, int] | None = None) -> tuple[str, bytes]:
    """(topic, payload) of a ``status`` of ``cid`` (seq 0: a last will, as the broker publishes it);
    ``holds``: an ``online``'s (global_round, start_round, update_round), ``None``: not said."""
    g, st, up = holds if holds is not None else (None, None, None)
    body = Status(state, detail, global_round=g, start_round=st, update_round=up)
    return topics.status(fed, cid), encode(Envelope(round=0, sender=cid, seq=seq, body=body)).payload


def sent_on(tr: MemoryTransport, suffix: str) -> list:
    """Decoded envelopes of every message the server's transport ``tr`` sent on a topic ending in ``suffix``."""
    return [decode(p).envelope for t, p in tr.sent if t.endswith(suffix)]


def receipts_to(tr: MemoryTransport, cid: str) -> list[tuple[int, Receipt]]:
    """(round, Receipt) of every receipt the server's transport ``tr`` sent to ``cid``, in order."""
    out = []
    for topic, payload in tr.sent:
        if topic.endswith(f"/{cid}/receipt"):
            env = decode(payload).envelope
            out.append((env.round, env.body))
    return out
