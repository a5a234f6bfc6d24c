"""A whole federation in one process over a :class:`~protocol.memory_transport.MemoryBroker`:
an :class:`AggregationServer` and one :class:`EdgeAgent` thread per device, for tests that check
what went over the wire (``hub.published``) against hand computations."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from broker_server.server import AggregationServer, ServerSettings
from edge_agent.agent import EdgeAgent
from edge_agent.algorithms import TrainConfig
from edge_agent.models import build_model
from protocol.channel import Channel
from protocol.memory_transport import MemoryBroker
from protocol.messages import decode


@dataclass
class Device:
    """One device: its client algorithm, shard (float32 [N, 1, 8, 8], int64 [N]), profile and
    model (``None``: :func:`digits_model`; another architecture for a heterogeneous fleet, kept
    here so a test can evaluate it after the run)."""

    algorithm: object
    x: np.ndarray
    y: np.ndarray
    profile: str = "x86-cpu"
    model: torch.nn.Module | None = None


def digits_model() -> torch.nn.Module:
    """The light CNN for 1×8×8 digits, initialised from seed 0."""
    torch.manual_seed(0)
    return build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)


def federation_server(tmp: Path, hub: MemoryBroker, strategy, test, *, rounds: int, clients: int, quorum: int = 1,
                      global_delivery: str = "auto", overlap_evaluation: str = "auto", global_codec: str = "fp32",
                      server_ledger=None, eval_slot=None, eval_every: int = 1) -> AggregationServer:
    """The server of :func:`run_federation` (run folder ``tmp``, waiting for ``clients`` joins),
    not started; ``eval_slot``: held during an overlapped evaluation (``None``: nothing);
    ``eval_every``: its ``[server] eval_every``."""
    return AggregationServer(
        channel=Channel(hub.connect("server"), node_id="server", side="server", federation="mem",
                        ledger=server_ledger),
        strategy=strategy, model=digits_model(), test=test,
        settings=ServerSettings(rounds=rounds, quorum=quorum, round_deadline_s=60, join_timeout_s=30,
                                expected_clients=clients, global_delivery=global_delivery,
                                overlap_evaluation=overlap_evaluation, global_codec=global_codec,
                                eval_every=eval_every),
        run_dir=tmp, eval_slot=eval_slot)


def start_agents(hub: MemoryBroker, devices: dict[str, Device], *, batch_size: int = 16, agent_ledger=None,
                 train_lock=None, slots=None) -> tuple[list[EdgeAgent], list[threading.Thread], list[BaseException]]:
    """One :class:`EdgeAgent` thread per device (started), sharing ``train_lock`` (a semaphore of
    training slots, or ``None``) or ``slots`` (:class:`edge_agent.slots.TrainingSlots` the agents
    train on; ``None``: each its own thread and model). Returns (agents, threads, the errors any
    of them raised)."""
    agents = [EdgeAgent(channel=Channel(hub.connect(cid), node_id=cid, side="agent", federation="mem",
                                        ledger=agent_ledger),
                        model=d.model if d.model is not None else digits_model(), algorithm=d.algorithm, x=d.x,
                        y=d.y, num_classes=10, client_index=i,
                        idle_timeout_s=60, profile=d.profile,
                        info=None if d.model is None else {"model": type(d.model).__name__, "num_classes": 10,
                                                           "feature_dim": int(d.model.classifier.weight.shape[1])},
                        train_defaults=TrainConfig(local_epochs=1, batch_size=batch_size), train_lock=train_lock,
                        slots=slots)
              for i, (cid, d) in enumerate(devices.items())]
    errors: list[BaseException] = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # reported by the caller
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guarded(a.run), daemon=True) for a in agents]
    for t in threads:
        t.start()
    return agents, threads, errors


def run_federation(tmp: Path, hub: MemoryBroker, strategy, devices: dict[str, Device], test, *, rounds: int,
                   quorum: int = 1, batch_size: int = 16, global_delivery: str = "auto",
                   overlap_evaluation: str = "auto", global_codec: str = "fp32", server_ledger=None,
                   agent_ledger=None, train_lock=None, eval_slot=None, slots=None,
                   agents_out: list | None = None, eval_every: int = 1) -> AggregationServer:
    """Run ``rounds`` rounds; every agent must finish without an error.

    ``global_delivery`` / ``overlap_evaluation`` / ``eval_every``: the server's ``[server]`` settings;
    ``global_codec``: its ``[protocol] global_codec``;
    ``server_ledger`` / ``agent_ledger``: a :class:`~protocol.ledger.Ledger` for the server's
    channel / every agent's (``None``: none); ``train_lock``: the agents' shared training slots,
    ``eval_slot``: what the server holds while it evaluates during training (``None``: none);
    ``slots``: :class:`edge_agent.slots.TrainingSlots` the agents train on (``None``: each its own
    thread and model); ``agents_out``: a list the agents are appended to.

    Returns:
        The server (``metrics``, ``strategy``); the messages are in ``hub.published``.
    """
    server = federation_server(tmp, hub, strategy, test, rounds=rounds, clients=len(devices), quorum=quorum,
                               global_delivery=global_delivery, overlap_evaluation=overlap_evaluation,
                               global_codec=global_codec, server_ledger=server_ledger, eval_slot=eval_slot,
                               eval_every=eval_every)
    agents, threads, errors = start_agents(hub, devices, batch_size=batch_size, agent_ledger=agent_ledger,
                                           train_lock=train_lock, slots=slots)
    if agents_out is not None:
        agents_out.extend(agents)
    summary = server.run()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert summary.rounds_completed == rounds
    return server


class Killed(BaseException):
    """Stands for the server's process dying (nothing after it runs): see :func:`kill_before_line`."""


def kill_before_line(server: AggregationServer, round: int) -> None:
    """Make ``server`` die (:class:`Killed`) when it writes round ``round``'s metrics line, before
    the line reaches ``metrics.jsonl`` (the lines before it are written)."""
    append = server.store.append_metrics

    def dies(line: dict) -> None:
        if line["round"] == round:
            raise Killed
        append(line)

    server.store.append_metrics = dies  # type: ignore[method-assign]


def run_expecting(server: AggregationServer, hub: MemoryBroker, devices: dict[str, Device],
                  expected: type[BaseException], match: str | None = None) -> None:
    """Start the agents of ``devices``, run ``server`` until it raises ``expected`` (its message
    matching ``match``; the test fails otherwise), then stop the agents; none may have failed."""
    agents, threads, errors = start_agents(hub, devices)
    try:
        with pytest.raises(expected, match=match):
            server.run()
    finally:
        for a in agents:
            a.stop()
        for t in threads:
            t.join(30)
    assert not errors, errors


def wire(hub: MemoryBroker) -> list[tuple[str, str, object]]:
    """Every published message as (sender, topic, envelope)."""
    return [(m.sender, m.topic, decode(m.payload).envelope) for m in hub.published]
