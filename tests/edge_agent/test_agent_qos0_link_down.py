"""``[protocol] qos = 0``: an agent whose link is down (or breaks under the send) when it joins.
MQTT keeps no QoS 0 message for the reconnect, so the transport drops it
(:class:`~protocol.errors.PublishDropped`); the agent must wait for the link, up to the join's
``wait_s``, and send again, failing only at that deadline with a clear error. Before, ``join()``
let the PublishDropped through at once and the agent crashed."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers.waiting import wait_for

from edge_agent.agent import EdgeAgent
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.models import build_model
from protocol import topics
from protocol.channel import Channel
from protocol.errors import PublishDropped
from protocol.memory_transport import MemoryBroker, MemoryTransport
from protocol.messages import Kind


class BreakingLink:
    """A :class:`MemoryTransport` behind a link the test breaks and mends: while it is down, or
    for the next ``drops`` publishes (the link breaking under the send), a QoS 0 publish is dropped
    as MqttTransport drops it."""

    def __init__(self, inner: MemoryTransport) -> None:
        self.inner = inner
        self.client_id = inner.client_id
        self.up = threading.Event()
        self.up.set()
        self.drops = 0
        self.dropped = 0
        self.waiting = threading.Event()  # someone waits for the link

    @property
    def connected(self) -> bool:
        return self.up.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        if not self.up.is_set():
            self.waiting.set()
        return self.up.wait(timeout_s)

    def publish(self, topic, payload, *, qos=1, retain=False, wait_s=None):
        if qos == 0 and (self.drops or not self.up.is_set()):
            if self.drops:  # handed over, then lost with the connection: the link is down now
                self.drops -= 1
                self.up.clear()
            self.dropped += 1
            raise PublishDropped(f"{self.client_id}: QoS 0 PUBLISH to {topic} not sent: the connection was lost "
                                 "(test)", client_id=self.client_id, topic=topic)
        return self.inner.publish(topic, payload, qos=qos, retain=retain, wait_s=wait_s)

    def subscribe(self, filters, qos=1) -> None:
        self.inner.subscribe(filters, qos)

    def get(self, timeout_s):
        return self.inner.get(timeout_s)

    def close(self) -> None:
        self.inner.close()


def _agent(hub: MemoryBroker, link_of: dict) -> EdgeAgent:
    link = BreakingLink(hub.connect("dev-q0"))
    link_of["link"] = link
    rng = np.random.default_rng(0)
    return EdgeAgent(channel=Channel(link, node_id="dev-q0", side="agent", federation="mem", ledger=None, qos=0),
                     model=build_model("lightcnn", in_channels=1, image_size=8, num_classes=10),
                     algorithm=FedAvgClient(), x=rng.standard_normal((20, 1, 8, 8)).astype(np.float32),
                     y=rng.integers(0, 10, 20), num_classes=10, client_index=0, idle_timeout_s=120,
                     train_defaults=TrainConfig())


def test_a_qos0_join_whose_link_breaks_waits_for_the_link_and_sends_again() -> None:
    """The online status is dropped as the link breaks under it; ``join(wait_s=30)`` waits for
    the link (no raise) and, once it is back, sends the status again, then the join: one status
    and one join reach the broker, and the dropped copy is counted undeliverable."""
    hub = MemoryBroker()
    box: dict = {}
    agent = _agent(hub, box)
    link: BreakingLink = box["link"]
    link.drops = 1
    errors: list[BaseException] = []

    def join() -> None:
        try:
            agent.join(wait_s=30.0)
        except BaseException as exc:  # noqa: BLE001 (the test looks at it)
            errors.append(exc)

    joiner = threading.Thread(target=join)
    joiner.start()
    assert wait_for(lambda: link.waiting.is_set() or errors, 30.0)
    assert errors == [] and link.waiting.is_set() and link.dropped == 1  # dropped, and waiting for the link
    link.up.set()
    joiner.join(30.0)
    assert not joiner.is_alive() and errors == []
    sent = [m.topic for m in hub.published]
    assert sent == [topics.status("mem", "dev-q0"), topics.up("mem", "dev-q0", Kind.JOIN)]
    assert agent.channel.undeliverable == 1


def test_a_qos0_join_whose_link_stays_down_fails_at_its_deadline_with_a_clear_error() -> None:
    """The link is down from the start and stays down: the agent waits for it rather than send
    into a dead link, tries once at the join's deadline (dropped: still down) and fails with a
    PublishDropped that says what was not sent and within how long; nothing reached the broker."""
    hub = MemoryBroker()
    box: dict = {}
    agent = _agent(hub, box)
    link: BreakingLink = box["link"]
    link.up.clear()
    with pytest.raises(PublishDropped, match=r"dev-q0: online status not sent within 0.2 s .*link is down"):
        agent.join(wait_s=0.2)
    assert hub.published == [] and link.waiting.is_set() and link.dropped == 1
