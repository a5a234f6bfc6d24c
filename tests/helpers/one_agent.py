"""One edge agent with a device state file, driven round by round from a server channel on an
in-memory broker: the test sends each round's global and round_start, reads the update, and
answers it (accepted or refused) when it chooses."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

from edge_agent.agent import EdgeAgent
from edge_agent.algorithms import ClientAlgorithm, TrainConfig
from edge_agent.state import state_arrays
from edge_agent.state_store import DeviceStateStore
from helpers.waiting import wait_for
from protocol import topics
from protocol.channel import Channel
from protocol.memory_transport import MemoryBroker
from protocol.messages import Finish, Global, Kind, Receipt, RoundStart, Update, decode


class OneAgent:
    """``algorithm`` on ``model`` as device ``device`` of federation ``fed``, its state file at
    ``path``, trained on ``samples`` seeded random 1×8×8 images of 10 classes (batch 10); the
    agent's loop runs in a thread from construction until :meth:`close`. Every round's global is
    the model's weights as they are when the round starts."""

    def __init__(self, path: Path, *, model: torch.nn.Module, algorithm: ClientAlgorithm, fed: str, device: str,
                 samples: int = 20) -> None:
        self.fed, self.device = fed, device
        self.hub = MemoryBroker()
        self.model, self.alg = model, algorithm
        rng = np.random.default_rng(0)
        self.store = DeviceStateStore(path)
        self.agent = EdgeAgent(channel=Channel(self.hub.connect(device), node_id=device, side="agent", federation=fed,
                                               ledger=None),
                               model=model, algorithm=algorithm,
                               x=rng.standard_normal((samples, 1, 8, 8)).astype(np.float32),
                               y=rng.integers(0, 10, samples), num_classes=10, idle_timeout_s=120,
                               train_defaults=TrainConfig(batch_size=10), state_store=self.store)
        self.server = Channel(self.hub.connect("server"), node_id="server", side="server", federation=fed,
                              ledger=None)
        self.server.transport.subscribe(topics.server_filters(fed))
        self.thread = threading.Thread(target=self.agent.run, daemon=True)
        self.thread.start()

    def updates(self) -> list:
        """The device's update envelopes so far, in the order published."""
        envs = [decode(m.payload).envelope for m in self.hub.published
                if m.topic.startswith(f"fedfleet/v1/{self.fed}/up")]
        return [e for e in envs if isinstance(e.body, Update)]

    def round_without_it(self, rnd: int) -> None:
        """Start round ``rnd`` for another device only (the broadcast this device hears)."""
        self.server.send(topics.down(self.fed, Kind.ROUND_START),
                         RoundStart(selected=("someone-else",), deadline_s=600.0, config={}), round=rnd)

    def round(self, rnd: int, config: dict | None = None) -> object:
        """Start round ``rnd`` for the device (round config ``config``) and wait for its update
        (the envelope)."""
        n = len(self.updates())
        self.server.send(topics.down(self.fed, Kind.GLOBAL), Global(tensors=state_arrays(self.model),
                         meta={"manifest_hash": self.agent.manifest_hash}), round=rnd)
        self.server.send(topics.down(self.fed, Kind.ROUND_START),
                         RoundStart(selected=(self.device,), deadline_s=600.0, config=dict(config or {})), round=rnd)
        assert wait_for(lambda: len(self.updates()) > n)
        return self.updates()[-1]

    def answer(self, env, accepted: bool) -> None:
        """The server's receipt for update envelope ``env``."""
        self.server.send(topics.down_to(self.fed, self.device, Kind.RECEIPT),
                         Receipt(ref_kind=int(Kind.UPDATE), ref_seq=env.seq, accepted=accepted,
                                 reason="" if accepted else "refused by the test"),
                         round=env.round, recipient=self.device)

    def close(self) -> None:
        """Finish the run, wait for the agent's loop to end, close the state file."""
        self.server.send(topics.down(self.fed, Kind.FINISH), Finish(reason="completed", rounds_completed=9), round=9)
        self.thread.join(60)
        self.store.close()
