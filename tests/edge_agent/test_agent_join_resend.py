"""An agent whose join goes unanswered (published before the server had subscribed, say) sends it
again, and the server's answer to any of its joins counts as the answer to its own."""

from __future__ import annotations

import threading
import time

import numpy as np
from helpers.waiting import wait_for

from edge_agent.agent import EdgeAgent
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.models import build_model
from protocol import topics
from protocol.channel import Channel
from protocol.memory_transport import MemoryBroker
from protocol.messages import Finish, Join, Kind, Receipt, decode


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
