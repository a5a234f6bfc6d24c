"""What every client algorithm receives and returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Local training settings for one round (from ``round_start.config`` over the config defaults).

    Attributes:
        local_epochs: passes over the local shard (E).
        batch_size: samples per SGD step (B).
        lr: SGD learning rate.
        momentum: SGD momentum (0 = plain SGD).
        weight_decay: L2 penalty coefficient.
        seed: base seed; each round's shuffling uses a private generator seeded from it.
    """

    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0

    @classmethod
    def from_mapping(cls, base: "TrainConfig", overrides: Mapping[str, object]) -> "TrainConfig":
        """``base`` with the known keys of ``overrides`` applied (unknown keys are ignored:
        tolerant on the wire)."""
        kw = {}
        for name in ("local_epochs", "batch_size", "seed"):
            if name in overrides:
                kw[name] = int(overrides[name])  # type: ignore[arg-type]
        for name in ("lr", "momentum", "weight_decay"):
            if name in overrides:
                kw[name] = float(overrides[name])  # type: ignore[arg-type]
        return TrainConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, **kw})


@dataclass(frozen=True, slots=True)
class LocalResult:
    """What a client algorithm produced in one round.

    Attributes:
        tensors: arrays to upload, in model-manifest order.
        num_samples: samples trained on (the FedAvg weight).
        train_loss: mean loss over the last local epoch.
        metrics: extra scalars (``train_seconds``, ``train_accuracy`` …).
    """

    tensors: tuple[np.ndarray, ...]
    num_samples: int
    train_loss: float
    metrics: dict[str, float] = field(default_factory=dict)


class ClientAlgorithm(Protocol):
    """The client half of an algorithm."""

    name: str

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_index: int,
                    device: torch.device) -> LocalResult: ...
