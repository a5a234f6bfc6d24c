"""An agent whose join goes unanswered (published before the server had subscribed, say) sends it
again, and the server's answer to any of its joins counts as the answer to its own."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
from helpers.waiting import wait_for

from edge_agent.agent import EdgeAgent
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.models import build_model
from protocol import topics
from protocol.channel import Channel, Received
from protocol.memory_transport import MemoryBroker
from protocol.messages import Chunk, Finish, Join, Kind, Receipt, decode


def _agent(transport, client_id: str, rng: np.random.Generator) -> EdgeAgent:
    """A FedAvg agent of 20 random 1×8×8 images on ``transport`` (federation ``mem``)."""
    return EdgeAgent(channel=Channel(transport, node_id=client_id, side="agent", federation="mem", ledger=None),
                     model=build_model("lightcnn", in_channels=1, image_size=8, num_classes=10),
                     algorithm=FedAvgClient(), x=rng.standard_normal((20, 1, 8, 8)).astype(np.float32),
                     y=rng.integers(0, 10, 20), num_classes=10, client_index=0, idle_timeout_s=120,
                     train_defaults=TrainConfig())


def test_an_unanswered_join_is_sent_again_and_any_answer_counts() -> None:
    hub = MemoryBroker()
    rng = np.random.default_rng(0)
    agent = _agent(hub.connect("dev-a"), "dev-a", rng)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("summary", agent.run()), daemon=True)
    t.start()
    # nobody answers: the broker saw the first join before any server subscribed
    joins = lambda: [m for m in hub.published if m.topic == topics.up("mem", "dev-a", Kind.JOIN)]  # noqa: E731
    assert wait_for(lambda: len(joins()) >= 2), "the unanswered join was not sent again"
    assert not agent.joined
    # a server now answers the FIRST join: it is the agent's own
    server = Channel(hub.connect("server"), node_id="server", side="server", federation="mem", ledger=None)
    server.transport.subscribe(topics.server_filters("mem"))
    seq = decode(joins()[0].payload).envelope.seq
    assert isinstance(decode(joins()[0].payload).envelope.body, Join)
    server.send(topics.down_to("mem", "dev-a", Kind.RECEIPT),
                Receipt(ref_kind=int(Kind.JOIN), ref_seq=seq, accepted=True, reason="", sha256=b""),
                round=0, recipient="dev-a")
    assert wait_for(lambda: agent.joined)
    n = len(joins())
    server.send(topics.down("mem", Kind.FINISH), Finish(reason="completed", rounds_completed=0), round=0)
    t.join(60)
    assert not t.is_alive() and "summary" in box
    assert len(joins()) == n  # joined: no join is sent again


def test_a_join_never_answered_gives_up_after_the_join_timeout_while_broadcasts_arrive() -> None:
    """An unenrolled device still hears the server's broadcasts (the server signs them; the device
    pins its key): the join timeout counts from the first join whatever arrives meanwhile."""
    import pytest

    from edge_agent.agent import AgentError
    from protocol.messages import Status

    hub = MemoryBroker()
    rng = np.random.default_rng(0)
    agent = _agent(hub.connect("dev-b"), "dev-b", rng)
    agent.join_timeout_s = 1.0
    server = Channel(hub.connect("server"), node_id="server", side="server", federation="mem", ledger=None)
    stop = threading.Event()

    def chatter() -> None:  # a message every 0.1 s on the agent's filters: the idle timeout never fires
        while not stop.is_set():
            server.send(topics.down_to("mem", "dev-b", Kind.STATUS), Status("online", "chatter"), round=0)
            time.sleep(0.1)

    t = threading.Thread(target=chatter, daemon=True)
    t.start()
    try:
        with pytest.raises(AgentError, match="no answer to its join within 1 s"):
            agent.run()
    finally:
        stop.set()
        t.join(5)
    assert not agent.joined and agent.join_refused is None


def test_the_answer_to_a_join_whose_wait_ended_first_counts() -> None:
    """The join sent again waits 5 s for its acknowledgement; a wait that ends first
    (PublishTimeout: a slow link, a busy broker) leaves the PUBLISH queued, and it reaches the
    server all the same. Here the transport delivers it, then says the wait ended: the server's
    answer to that join (its seq, the second join's) is the agent's own and it is joined. Before,
    the seq of a join whose send raised was never kept: the receipt was "for a join it did not
    send", ignored, and a device whose every re-sent join outlasted its wait never joined."""
    from protocol.errors import PublishTimeout

    hub = MemoryBroker()
    rng = np.random.default_rng(0)
    transport = hub.connect("dev-c")
    published = transport.publish
    join_topic = topics.up("mem", "dev-c", Kind.JOIN)
    sent_joins: list[int] = []

    def slow_ack(topic: str, payload: bytes, **kwargs) -> object:
        published(topic, payload, **kwargs)  # the broker has it
        if topic == join_topic:
            sent_joins.append(decode(payload).envelope.seq)
            if len(sent_joins) == 2:
                raise PublishTimeout(f"PUBLISH to {topic} not acknowledged within 5 s", topic=topic, handle=object())
        return None

    transport.publish = slow_ack  # type: ignore[method-assign]
    agent = _agent(transport, "dev-c", rng)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("summary", agent.run()), daemon=True)
    t.start()
    assert wait_for(lambda: len(sent_joins) >= 2), "the unanswered join was not sent again"
    server = Channel(hub.connect("server"), node_id="server", side="server", federation="mem", ledger=None)
    server.send(topics.down_to("mem", "dev-c", Kind.RECEIPT),
                Receipt(ref_kind=int(Kind.JOIN), ref_seq=sent_joins[1], accepted=True, reason="", sha256=b""),
                round=0, recipient="dev-c")
    assert wait_for(lambda: agent.joined, 30.0)
    server.send(topics.down("mem", Kind.FINISH), Finish(reason="completed", rounds_completed=0), round=0)
    t.join(60)
    assert not t.is_alive() and "summary" in box


def test_a_join_in_chunks_whose_wait_ends_at_a_middle_chunk_reaches_the_server_whole_and_is_logged(caplog) -> None:
    """The agent's chunk size is 32 bytes, so each join is a chunked transfer. The join sent again
    waits 5 s for each chunk's acknowledgement; the wait for its chunk 2 ends first
    (PublishTimeout: the transport delivers the chunk, then says the wait ended). The chunks after
    it are handed over all the same: the server (which never asks for missing chunks here) gets
    the whole join, answers its seq, and the agent is joined. The agent's warning names the join
    and its chunks. Before, the chunks after chunk 2 were never published: the server got 2 of
    them and nothing more unless it asked for the rest."""
    from protocol.errors import PublishTimeout

    hub = MemoryBroker()
    rng = np.random.default_rng(0)
    server = Channel(hub.connect("server"), node_id="server", side="server", federation="mem", ledger=None,
                     resend_after_s=3600.0)
    server.transport.subscribe(topics.server_filters("mem"))
    transport = hub.connect("dev-d")
    published = transport.publish
    join_topic = topics.up("mem", "dev-d", Kind.JOIN)
    transfers: list[bytes] = []  # the transfer id of each join, in order
    counts: list[int] = []

    def slow_ack(topic: str, payload: bytes, **kwargs) -> object:
        published(topic, payload, **kwargs)  # the broker has it
        if topic == join_topic:
            chunk = decode(payload).envelope.body
            assert isinstance(chunk, Chunk), chunk
            if chunk.transfer_id not in transfers:
                transfers.append(chunk.transfer_id)
                counts.append(chunk.count)
            if len(transfers) == 2 and chunk.index == 1:
                raise PublishTimeout(f"PUBLISH to {topic} not acknowledged within 5 s", topic=topic, handle=object())
        return None

    transport.publish = slow_ack  # type: ignore[method-assign]
    agent = _agent(transport, "dev-d", rng)
    agent.channel.chunk_bytes = 32
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("summary", agent.run()), daemon=True)
    joins: list[int] = []  # the seq of each join the server got whole
    with caplog.at_level(logging.WARNING, logger="edge_agent.agent"):
        t.start()
        deadline = time.monotonic() + 30.0
        while len(joins) < 2 and time.monotonic() < deadline:
            item = server.receive(1.0)
            if isinstance(item, Received) and isinstance(item.envelope.body, Join):
                joins.append(item.envelope.seq)
        assert len(joins) == 2, joins
        assert len(transfers) == 2 and counts[1] >= 3, counts
        server.send(topics.down_to("mem", "dev-d", Kind.RECEIPT),
                    Receipt(ref_kind=int(Kind.JOIN), ref_seq=joins[1], accepted=True, reason="", sha256=b""),
                    round=0, recipient="dev-d")
        assert wait_for(lambda: agent.joined, 30.0)
        server.send(topics.down("mem", Kind.FINISH), Finish(reason="completed", rounds_completed=0), round=0)
        t.join(60)
    assert not t.is_alive() and "summary" in box
    warned = [r.getMessage() for r in caplog.records if "could not send the join again" in r.getMessage()]
    assert len(warned) == 1, warned
    assert (f"join of round 0 (seq {joins[1]}) in {counts[1]} chunks: the wait for chunk 2 ended first; "
            f"all {counts[1]} handed to the MQTT client") in warned[0]
    assert not [m for m in hub.published if m.topic.endswith("/resend")]  # nobody asked for a chunk again



@pytest.mark.parametrize(("stalls", "seq"), [("online status", 1), ("join", 2)])
def test_a_first_join_whose_wait_ends_first_is_taken_as_not_answered_yet(stalls: str, seq: int, caplog) -> None:
    """The first ``online`` status (seq 1), or the first join (seq 2), waits up to 30 s for its
    acknowledgement and the wait ends first (PublishTimeout: a slow link; the transport delivers
    the message, then says the wait ended). The message is queued, not lost: the agent says so in
    a WARNING and goes on (after the status: with its first join), waiting for the server's answer
    as for any join not answered yet. The server answers the first join (seq 2): the agent is
    joined, and ends at the server's finish. Before, ``run()`` raised the PublishTimeout, and
    ``fedfleet-agent`` ended in a traceback."""
    from protocol.errors import PublishTimeout

    hub = MemoryBroker()
    rng = np.random.default_rng(0)
    transport = hub.connect("dev-e")
    published = transport.publish
    topic = topics.status("mem", "dev-e") if stalls == "online status" else topics.up("mem", "dev-e", Kind.JOIN)
    stalled: list[int] = []

    def slow_ack(t: str, payload: bytes, **kwargs) -> object:
        published(t, payload, **kwargs)  # the broker has it
        if t == topic and not stalled:
            stalled.append(decode(payload).envelope.seq)
            raise PublishTimeout(f"PUBLISH to {t} not acknowledged within 30 s", topic=t, handle=object())
        return None

    transport.publish = slow_ack  # type: ignore[method-assign]
    agent = _agent(transport, "dev-e", rng)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("summary", agent.run()), daemon=True)
    joins = lambda: [m for m in hub.published if m.topic == topics.up("mem", "dev-e", Kind.JOIN)]  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="edge_agent.agent"):
        t.start()
        assert wait_for(lambda: len(joins()) >= 1), "no join was sent"
        first = decode(joins()[0].payload).envelope.seq
        assert (stalled, first) == ([seq], 2)
        server = Channel(hub.connect("server"), node_id="server", side="server", federation="mem", ledger=None)
        server.send(topics.down_to("mem", "dev-e", Kind.RECEIPT),
                    Receipt(ref_kind=int(Kind.JOIN), ref_seq=first, accepted=True, reason="", sha256=b""),
                    round=0, recipient="dev-e")
        assert wait_for(lambda: agent.joined, 30.0)
        server.send(topics.down("mem", Kind.FINISH), Finish(reason="completed", rounds_completed=0), round=0)
        t.join(60)
    assert not t.is_alive() and "summary" in box and box["summary"].finished
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w for w in warned if "not acknowledged within 30 s" in w] == [
        f"dev-e: its {stalls} (seq {seq}) is not acknowledged by the broker yet (PUBLISH to {topic} not acknowledged "
        "within 30 s): it stays queued and goes out as the link moves"
        + ("; waiting for the server's answer to it (the join is sent again every 5 s, doubling to 30 s)"
           if stalls == "join" else "")], warned
