"""The model factory: a small CNN with fedfleet's interface (``features``, ``head``, a
``classifier`` Linear and ``backbone.*`` names), built for the data set's shape."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """conv 3×3 (8) → ReLU → 2×2 max-pool → Linear(8·(S/2)², d) → ReLU = the features
    ``[N, d]``; ``classifier`` = Linear(d, num_classes)."""

    def __init__(self, num_classes: int, in_channels: int, image_size: int, feature_dim: int) -> None:
        super().__init__()
        half = image_size // 2
        self.backbone = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Flatten(), nn.Linear(8 * half * half, feature_dim), nn.ReLU())
        self.classifier = nn.Linear(feature_dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.classifier(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def make(num_classes: int, in_channels: int, image_size: int, feature_dim: int = 32) -> SmallCNN:
    """fedfleet calls this with the data set's shape and ``[model] feature_dim``."""
    return SmallCNN(num_classes, in_channels, image_size, feature_dim)
