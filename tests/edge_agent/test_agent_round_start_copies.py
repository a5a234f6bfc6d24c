"""An agent that gets a round it already trained started again sends its update again (a
server resumed from a checkpoint, or one whose link broke, may have lost it), but once however
many copies of that ``round_start`` were queued meanwhile, and not for the server's copy to a
device that came back when its update went out on the connection made since (the copy answers
that reconnect: the update was not lost to it). A receipt that comes after the re-sends ran out
still counts, once."""

from __future__ import annotations

import threading

import numpy as np
from helpers.waiting import wait_for

from edge_agent.agent import EdgeAgent
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol import topics
from protocol.channel import Channel
from protocol.memory_transport import MemoryBroker
from protocol.messages import Finish, Global, Join, Kind, Receipt, RoundStart, Status, Update, decode

FED = "mem"
DEV = "dev-a"



class _Fleet:
    """One agent on a memory broker, with a server channel the test speaks through; the agent
    stops in ``on_trained`` (after publishing its update) until ``gate`` is set, and takes its
    training slot from ``lock``."""

    def __init__(self) -> None:
        self.hub = MemoryBroker()
        self.model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
        self.gate, self.trained, self.lock = threading.Event(), threading.Event(), threading.Lock()
        rng = np.random.default_rng(0)

        def on_trained(rnd, result, nbytes) -> None:
            self.trained.set()
            self.gate.wait(60)

        self.agent = EdgeAgent(channel=Channel(self.hub.connect(DEV), node_id=DEV, side="agent", federation=FED,
                                               ledger=None),
                               model=self.model, algorithm=FedAvgClient(),
                               x=rng.standard_normal((20, 1, 8, 8)).astype(np.float32), y=rng.integers(0, 10, 20),
                               num_classes=10, idle_timeout_s=120, train_defaults=TrainConfig(batch_size=10),
                               on_trained=on_trained, receipt_timeout_s=600.0, train_lock=self.lock)
        self.server = Channel(self.hub.connect("server"), node_id="server", side="server", federation=FED,
                              ledger=None)
        self.server.transport.subscribe(topics.server_filters(FED))
        self.thread = threading.Thread(target=self.agent.run, daemon=True)
        self.thread.start()
        join = next(iter(self._wait_for(Join)))
        self.server.send(topics.down_to(FED, DEV, Kind.RECEIPT), Receipt(ref_kind=int(Kind.JOIN), ref_seq=join.seq,
                         accepted=True), round=0, recipient=DEV)
        assert wait_for(lambda: self.agent.joined)
        self.start = RoundStart(selected=(DEV,), deadline_s=600.0, config={})

    def _wait_for(self, body_type) -> list:
        assert wait_for(lambda: self.sent(body_type)), f"no {body_type.__name__} from the agent"
        return self.sent(body_type)

    def sent(self, body_type) -> list:
        """Envelopes of ``body_type`` the agent published."""
        envs = [decode(m.payload).envelope for m in self.hub.published if m.topic.startswith(f"fedfleet/v1/{FED}/up")]
        return [e for e in envs if isinstance(e.body, body_type)]

    def open_round(self) -> None:
        self.server.send(topics.down(FED, Kind.GLOBAL), Global(tensors=state_arrays(self.model),
                         meta={"manifest_hash": self.agent.manifest_hash}), round=1)
        self.server.send(topics.down(FED, Kind.ROUND_START), self.start, round=1)

    def finish(self) -> None:
        self.gate.set()
        self.server.send(topics.down(FED, Kind.FINISH), Finish(reason="completed", rounds_completed=1), round=1)
        self.thread.join(60)
        assert not self.thread.is_alive()


def test_round_starts_queued_for_a_trained_round_are_answered_once() -> None:
    f = _Fleet()
    f.open_round()
    assert f.trained.wait(60)
    for _ in range(3):  # three copies queued while the agent is busy (a flapping link: one per reconnect)
        f.server.send(topics.down(FED, Kind.ROUND_START), f.start, round=1)
    f.gate.set()
    assert wait_for(lambda: len(f.sent(Update)) == 2)
    assert wait_for(lambda: f.agent.round_starts_not_answered == 2)  # the 2nd and 3rd copy of the batch
    f.finish()
    ups = f.sent(Update)
    assert [e.round for e in ups] == [1, 1] and ups[0].seq != ups[1].seq  # the original and one copy
    assert f.agent.resends == 1


def test_the_copy_answering_a_reconnect_is_not_answered_when_the_update_went_out_since() -> None:
    f = _Fleet()
    with f.lock:  # the agent waits for its training slot: the link breaks and comes back meanwhile
        f.open_round()
        assert wait_for(lambda: f.agent._training_round == 1)  # took round 1 up: it waits for its slot
        f.agent.channel.transport.drop_link()
        assert f.agent.channel.transport.connects == 2
    assert f.trained.wait(60)  # trained; its update went out on connection 2
    # the server's copy for a device that came back, on the device's own topic
    f.server.send(topics.down_to(FED, DEV, Kind.ROUND_START), f.start, round=1, recipient=DEV)
    f.gate.set()
    assert wait_for(lambda: f.agent.round_starts_not_answered == 1)
    assert len(f.sent(Update)) == 1
    # a broadcast copy (the server's link broke: it re-sends the round) is answered
    f.server.send(topics.down(FED, Kind.ROUND_START), f.start, round=1)
    assert wait_for(lambda: len(f.sent(Update)) == 2)
    f.finish()
    assert f.agent.round_starts_not_answered == 1 and f.agent.resends == 1


def test_a_copy_that_came_while_the_device_trained_is_not_answered() -> None:
    """The server re-sends round 1's round_start (its link came back) while the agent waits for
    its training slot: that copy was sent before the server could have the update, so once the
    agent has trained and sent its update it does not send it again for that copy (1 update, 1
    copy not answered). A copy that comes after the update is answered (the existing rule)."""
    f = _Fleet()
    f.gate.set()
    with f.lock:  # the agent waits for its training slot
        f.open_round()
        assert wait_for(lambda: f.agent._training_round == 1)  # took round 1 up: it waits for its slot
        f.server.send(topics.down(FED, Kind.ROUND_START), f.start, round=1)
    assert wait_for(lambda: f.agent.round_starts_not_answered == 1)
    assert len(f.sent(Update)) == 1 and f.agent.resends == 0
    f.server.send(topics.down(FED, Kind.ROUND_START), f.start, round=1)
    assert wait_for(lambda: len(f.sent(Update)) == 2)
    f.finish()
    assert f.agent.round_starts_not_answered == 1 and f.agent.resends == 1


def _onlines(f: _Fleet) -> list[Status]:
    """The agent's ``online`` statuses, in the order published."""
    envs = [decode(m.payload).envelope for m in f.hub.published if m.topic == topics.status(FED, DEV)]
    return [e.body for e in envs if isinstance(e.body, Status) and e.body.state == "online"]


def test_the_online_after_a_reconnect_says_what_the_device_holds() -> None:
    """(global_round, start_round, update_round) in each ``online``: (0, 0, 0) at join and after a
    reconnect before any round; (1, 1, 1) once round 1 is trained and its update awaits a
    receipt; (1, 1, 0) once the receipt came. Each reconnect's ``online`` is detailed
    ``reconnected``."""
    f = _Fleet()
    f.gate.set()
    f.agent.channel.transport.drop_link()
    assert wait_for(lambda: len(_onlines(f)) == 2)
    f.open_round()
    assert wait_for(lambda: len(f.sent(Update)) == 1)
    f.agent.channel.transport.drop_link()
    assert wait_for(lambda: len(_onlines(f)) == 3)
    (update,) = f.sent(Update)
    f.server.send(topics.down_to(FED, DEV, Kind.RECEIPT), Receipt(ref_kind=int(Kind.UPDATE), ref_seq=update.seq,
                  accepted=True), round=1, recipient=DEV)
    assert wait_for(lambda: f.agent.receipts_accepted == 1)
    f.agent.channel.transport.drop_link()
    assert wait_for(lambda: len(_onlines(f)) == 4)
    f.finish()
    assert [(s.detail, s.holds) for s in _onlines(f)] == [("", (0, 0, 0)), ("reconnected", (0, 0, 0)),
                                                         ("reconnected", (1, 1, 1)), ("reconnected", (1, 1, 0))]


def test_no_receipt_timeout_resend_while_the_last_copy_is_still_being_delivered() -> None:
    """An update without a receipt is sent again ``receipt_timeout_s`` (here 0 s) after the broker
    has its last copy, not before: while the channel says that copy is in flight (the link is
    down: the transport sends it after the reconnect) the timeout does not fire, however often
    it is looked at; once it is delivered, it does (1 update, then 2)."""
    f = _Fleet()
    f.gate.set()
    delivering = [True]
    f.agent.channel.in_flight = lambda seq: delivering[0]  # type: ignore[method-assign]
    f.agent.receipt_timeout_s = 0.0
    f.open_round()
    assert wait_for(lambda: len(f.sent(Update)) == 1 and f.agent._unacked is not None)
    looked = f.agent._unacked[3]
    assert wait_for(lambda: f.agent._unacked[3] > looked)  # looked at again since, while in flight
    looked = f.agent._unacked[3]
    assert wait_for(lambda: f.agent._unacked[3] > looked)
    assert len(f.sent(Update)) == 1 and f.agent.resends == 0
    delivering[0] = False
    assert wait_for(lambda: len(f.sent(Update)) == 2)
    f.finish()


def test_a_copy_followed_by_the_updates_receipt_is_answered_by_that_receipt(caplog) -> None:
    """While the agent is held after sending its update, the server sends round 1's round_start
    again (its link came back before it had the update), then counts the update and answers it:
    both wait in one batch, the copy first. The receipt, sent after the copy, says the server has
    the update: nothing is sent again (1 update, 1 copy not answered). The same receipt sent
    again (the answer to an ``online`` that crossed the first) is no stranger's: no warning."""
    import logging

    f = _Fleet()
    f.open_round()
    assert f.trained.wait(60)  # held in on_trained, its update published
    (update,) = f.sent(Update)
    receipt = Receipt(ref_kind=int(Kind.UPDATE), ref_seq=update.seq, accepted=True)
    f.server.send(topics.down_to(FED, DEV, Kind.ROUND_START), f.start, round=1, recipient=DEV)
    f.server.send(topics.down_to(FED, DEV, Kind.RECEIPT), receipt, round=1, recipient=DEV)
    with caplog.at_level(logging.WARNING, logger="edge_agent.agent"):
        f.gate.set()
        assert wait_for(lambda: f.agent.receipts_accepted == 1 and f.agent.round_starts_not_answered == 1)
        f.server.send(topics.down_to(FED, DEV, Kind.RECEIPT), receipt, round=1, recipient=DEV)
        f.finish()
    assert len(f.sent(Update)) == 1 and f.agent.resends == 0
    assert not [r for r in caplog.records if "did not send" in r.getMessage()]


def test_a_receipt_after_the_resends_ran_out_still_counts(caplog) -> None:
    """With ``receipt_timeout_s`` 0 and ``max_resends`` 2, an update never answered is sent 3
    times (the original and 2 re-sends); once the last copy's timeout passed too, one warning says
    the re-sends ran out and what happens next. A receipt that comes after that (a resumed server
    answering a copy) counts: 1 update acknowledged; the duplicate receipt for another copy of
    the same update does not count it twice."""
    import logging

    f = _Fleet()
    f.gate.set()
    f.agent.receipt_timeout_s = 0.0
    f.agent.max_resends = 2
    with caplog.at_level(logging.WARNING, logger="edge_agent.agent"):
        f.open_round()
        assert wait_for(lambda: len(f.sent(Update)) == 3 and f.agent._unacked is None)
    ups = f.sent(Update)
    assert [e.round for e in ups] == [1, 1, 1] and f.agent.resends == 2
    out = [r.getMessage() for r in caplog.records if "re-send" in r.getMessage()]
    assert out == [f"{DEV}: no receipt for the update of round 1 after 2 re-sends: not sent again unless the server "
                   "starts round 1 again (a receipt that comes later still counts)"]
    for copy in (ups[2], ups[0]):  # the receipt of the last copy, then a duplicate's for the first
        f.server.send(topics.down_to(FED, DEV, Kind.RECEIPT), Receipt(ref_kind=int(Kind.UPDATE), ref_seq=copy.seq,
                      accepted=True), round=1, recipient=DEV)
    assert wait_for(lambda: f.agent.receipts_accepted == 1)
    f.finish()
    assert f.agent.receipts_accepted == 1 and len(f.sent(Update)) == 3
