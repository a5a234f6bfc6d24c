"""The light CNN of SPECS §5.1 (FedMCP++ client model, reconstructed from the paper's parameter,
MAC and byte counts): the zoo's ``lightcnn``."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from edge_agent.errors import ModelError

from ._registry import register_model

__all__ = ["LightCNN"]


@register_model("lightcnn")
class LightCNN(nn.Module):
    """Light CNN of SPECS §5.1: a two-conv backbone to a 64-d feature, then a linear head.

    Backbone (``self.backbone``, an ``nn.Sequential`` with named layers)::

        conv1  Conv2d(C, 16, 3, padding=1)      [N, C, S, S]    -> [N, 16, S, S]
        relu1, pool1 MaxPool2d(2)                                -> [N, 16, S/2, S/2]
        conv2  Conv2d(16, 32, 3, padding=1)                      -> [N, 32, S/2, S/2]
        relu2, pool2 MaxPool2d(2)                                -> [N, 32, S/4, S/4]
        flatten                                                  -> [N, 32·(S/4)²]
        fc     Linear(32·(S/4)², feature_dim)                    -> [N, feature_dim]
        relu3  ReLU  (the final ReLU is a guess in SPECS §5.1)

    Head (``self.classifier``): ``Linear(feature_dim, num_classes)``. No BatchNorm, so the
    ``state_dict`` holds parameters only (no buffers).

    Backbone parameter counts (SPECS §5.1, feature_dim = 64): 105,216 for 1×28×28 input and
    136,224 for 3×32×32; backbone multiply-accumulates per image: 1,116,416 and 1,753,088.

    Parameter names (for partial sharing select ``backbone.*`` or ``classifier.*``):
    ``backbone.conv1.{weight,bias}``, ``backbone.conv2.{weight,bias}``,
    ``backbone.fc.{weight,bias}``, ``classifier.{weight,bias}``.

    Args:
        in_channels: C, 1 (grayscale) or 3 (RGB); any int >= 1 is accepted.
        image_size: S in pixels, input images are S×S; a multiple of 4, >= 4.
        num_classes: number of output logits, >= 1.
        feature_dim: width of the feature (backbone output), >= 1; SPECS uses 64.

    Raises:
        ModelError: an argument is not an int or is out of the ranges above.
    """

    def __init__(
        self,
        *,
        in_channels: int = 1,
        image_size: int = 28,
        num_classes: int = 10,
        feature_dim: int = 64,
    ) -> None:
        super().__init__()
        self.in_channels = _check_int("in_channels", in_channels, minimum=1)
        self.image_size = _check_int("image_size", image_size, minimum=4)
        if self.image_size % 4 != 0:
            raise ModelError(
                f"image_size must be a multiple of 4 (two 2×2 poolings), got {image_size}"
            )
        self.num_classes = _check_int("num_classes", num_classes, minimum=1)
        self.feature_dim = _check_int("feature_dim", feature_dim, minimum=1)
        side = self.image_size // 4
        self.backbone = nn.Sequential(
            OrderedDict(
                [
                    ("conv1", nn.Conv2d(self.in_channels, 16, kernel_size=3, padding=1)),
                    ("relu1", nn.ReLU()),
                    ("pool1", nn.MaxPool2d(2)),
                    ("conv2", nn.Conv2d(16, 32, kernel_size=3, padding=1)),
                    ("relu2", nn.ReLU()),
                    ("pool2", nn.MaxPool2d(2)),
                    ("flatten", nn.Flatten()),
                    ("fc", nn.Linear(32 * side * side, self.feature_dim)),
                    ("relu3", nn.ReLU()),
                ]
            )
        )
        self.classifier = nn.Linear(self.feature_dim, self.num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Backbone features.

        Args:
            x: images, float32 ``[N, C, S, S]`` (normalised as in :mod:`edge_agent.data`).

        Returns:
            float32 ``[N, feature_dim]`` (non-negative: the backbone ends in a ReLU).

        Raises:
            ModelError: ``x`` is not 4-D with ``C`` channels and ``S×S`` pixels.
        """
        expected = (self.in_channels, self.image_size, self.image_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != expected:
            raise ModelError(
                f"LightCNN expects input [N, {expected[0]}, {expected[1]}, {expected[2]}], "
                f"got {list(x.shape)}"
            )
        return self.backbone(x)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """Classifier logits from features.

        Args:
            z: features, float32 ``[N, feature_dim]``.

        Returns:
            logits, float32 ``[N, num_classes]`` (unnormalised; apply softmax for
            probabilities).

        Raises:
            ModelError: ``z`` is not ``[N, feature_dim]``.
        """
        if z.dim() != 2 or z.shape[1] != self.feature_dim:
            raise ModelError(f"LightCNN head expects [N, {self.feature_dim}], got {list(z.shape)}")
        return self.classifier(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``head(features(x))``: float32 ``[N, C, S, S]`` -> ``[N, num_classes]``.

        Raises:
            ModelError: as :meth:`features`.
        """
        return self.head(self.features(x))

    def backbone_parameter_count(self) -> int:
        """Number of scalar parameters in ``backbone`` (the count SPECS §5.1 quotes)."""
        return sum(p.numel() for p in self.backbone.parameters())

    def backbone_macs(self) -> int:
        """Multiply-accumulates of the backbone's conv and linear layers for one image.

        Formula (SPECS §5.1 "FLOPs"): ``S²·9·C·16 + (S/2)²·9·16·32 + 32·(S/4)²·feature_dim``;
        ReLU, pooling and bias additions are not counted.
        """
        s, c = self.image_size, self.in_channels
        conv1 = s * s * 9 * c * 16
        conv2 = (s // 2) ** 2 * 9 * 16 * 32
        fc = 32 * (s // 4) ** 2 * self.feature_dim
        return conv1 + conv2 + fc


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ModelError(f"{name} must be >= {minimum}, got {value}")
    return value
