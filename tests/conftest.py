"""Shared pytest fixtures for the fedfleet test suite (plain helpers are in tests/helpers/).

- ``broker_kind``: parametrized over ``"mosquitto"`` (marked ``mosquitto``) and ``"amqtt"``; the
  Mosquitto case goes through ``helpers.brokers.require_mosquitto()`` (skip without the binary,
  fail when CI == "true").
- ``embedded_broker``: a running ``EmbeddedBroker`` of ``broker_kind``, logging under ``tmp_path``.
- ``digits`` / ``digits_model``: scikit-learn's digits, and a LightCNN (1×8×8) trained two epochs
  on its train split (≈ 0.9 accuracy); one of each per test module.
- ``memory_hub``: a fresh in-memory MQTT broker (:class:`protocol.memory_transport.MemoryBroker`).
- ``_offline`` (autouse): torchvision downloads are disabled for every test.

Threads: before torch is first imported, ``OMP_NUM_THREADS=1`` and ``OMP_WAIT_POLICY=PASSIVE``
are set (unless already set) for this process and every process a test starts. The models are
tiny and a test often runs several agents (threads or processes) at once on 2 cores, where
OpenMP's default of one spinning thread per core made a training round of 600 digits take
15-30 s instead of 1 s. Agents whose runtime plan sets more torch threads
(``edge_agent.device.apply``) still do so; their idle OpenMP threads then sleep instead of spin.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.brokers import BROKER_KINDS, require_mosquitto

from broker_server.embedded_broker import EmbeddedBroker
from protocol.memory_transport import MemoryBroker


@pytest.fixture(
    params=[pytest.param("mosquitto", marks=pytest.mark.mosquitto), "amqtt"],
    ids=list(BROKER_KINDS),
)
def broker_kind(request: pytest.FixtureRequest) -> str:
    """Name of a broker implementation; the Mosquitto case goes through ``require_mosquitto()``."""
    if request.param == "mosquitto":
        require_mosquitto()
    return request.param


@pytest.fixture
def embedded_broker(broker_kind: str, tmp_path: Path) -> Iterator[EmbeddedBroker]:
    """A started ``EmbeddedBroker(kind=broker_kind)``; stopped after the test. Log in ``tmp_path``."""
    with EmbeddedBroker(kind=broker_kind, workdir=tmp_path / f"broker-{broker_kind}") as broker:
        yield broker


@pytest.fixture(scope="module")
def digits():
    """scikit-learn's digits as a fedfleet data set (1×8×8 images, 10 classes; offline)."""
    from edge_agent.data import load_dataset

    return load_dataset("digits")


@pytest.fixture(scope="module")
def digits_model(digits) -> torch.nn.Module:
    """A LightCNN (1×8×8) trained for two epochs on the digits train split (~0.9 accuracy)."""
    from edge_agent.algorithms import TrainConfig
    from edge_agent.algorithms.fedavg import sgd_epochs
    from edge_agent.models import build_model

    torch.manual_seed(0)
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    config = TrainConfig(local_epochs=2, batch_size=32, lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: one thread is fastest, and immune to a busy machine
    try:
        sgd_epochs(model, torch.from_numpy(np.array(digits.train.x)),
                   torch.from_numpy(np.array(digits.train.y)), config, generator,
                   torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    return model.eval()


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never download: torchvision downloads are disabled for every test."""
    monkeypatch.setenv("FEDFLEET_OFFLINE", "1")


@pytest.fixture
def memory_hub() -> MemoryBroker:
    """A fresh in-memory MQTT broker for a whole federation in one process."""
    return MemoryBroker()
