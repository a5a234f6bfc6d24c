"""The torchvision-based part of the model zoo, sized for small (8–32 px) images.

Every net here has the interface of :class:`~edge_agent.models.LightCNN`: ``features(x)`` ->
``[N, feature_dim]`` (global average pooling, then a ``Linear`` projection to ``feature_dim`` and a
ReLU), ``head(z)`` -> logits (``classifier``, ``Linear(feature_dim, num_classes)``); every feature
extractor parameter is named ``backbone.*``. All have BatchNorm: ``running_mean`` and
``running_var`` are state entries (so in the manifest, and exchanged like weights unless the
strategy keeps buffers local); the int64 ``num_batches_tracked`` counters, unused with a momentum,
are dropped (:func:`~edge_agent.models.training.drop_batch_counters`), so the state is all float32.
No weights are downloaded (``weights=None``): torchvision's own initialisation.

========================  =======================================================  ==========
name                      body (before pooling)                                    width
========================  =======================================================  ==========
``resnet18``              torchvision ``resnet18``, 3×3 stride-1 stem, no max-pool   512
``resnet8``               3×3 stem to 16 channels, one torchvision ``BasicBlock``     64
                          per stage (16, 32/2, 64/2): 7 convs + the projection
``mobilenet_v2``          torchvision ``mobilenet_v2`` features, stride-1 stem       1280
``mobilenet_v2_small``    torchvision ``mobilenet_v2`` (width 0.5) features, stride-2  160
                          stem, the final 1×1 conv to 1280 dropped
``inception_small``       3×3 stem (32), torchvision GoogLeNet ``Inception``         112
                          (→56), 2×2 max-pool, ``Inception`` (→112)
========================  =======================================================  ==========

torchvision is imported when a net is built, not when this module is.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from edge_agent.errors import ModelError

from ._registry import register_model
from .lightcnn import _check_int
from .training import drop_batch_counters

__all__ = ["PooledNet"]


class PooledNet(nn.Module):
    """A convolutional body, global average pooling, a projection to the prototype, a head.

    ``backbone`` is ``nn.Sequential(*body layers, pool, flatten, fc, relu)``: body layers keep their
    names (``backbone.conv1.weight``, ``backbone.layer1.0.bn1.running_mean`` …), ``fc`` is
    ``Linear(width, feature_dim)``. ``classifier`` is ``Linear(feature_dim, num_classes)``.

    Args:
        body: ``(name, module)`` pairs mapping ``[N, C, S, S]`` to ``[N, width, h, w]``.
        width: channels the body ends with.
        arch: zoo name (shown in errors).
        in_channels, image_size, num_classes, feature_dim: as :class:`LightCNN`.

    Raises:
        ModelError: an argument is not an int or is out of range.
    """

    def __init__(self, body: list[tuple[str, nn.Module]], width: int, *, arch: str, in_channels: int,
                 image_size: int, num_classes: int, feature_dim: int) -> None:
        super().__init__()
        self.arch = arch
        self.in_channels = in_channels
        self.image_size = image_size
        self.num_classes = num_classes
        self.feature_dim = feature_dim
        self.backbone = nn.Sequential(OrderedDict([*body, ("pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten()),
                                                   ("fc", nn.Linear(width, feature_dim)), ("relu_out", nn.ReLU())]))
        self.classifier = nn.Linear(feature_dim, num_classes)
        drop_batch_counters(self)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Prototype features: float32 ``[N, C, S, S]`` -> ``[N, feature_dim]`` (non-negative).

        Raises:
            ModelError: ``x`` is not 4-D with ``C`` channels and ``S×S`` pixels.
        """
        expected = (self.in_channels, self.image_size, self.image_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != expected:
            raise ModelError(f"{self.arch} expects input [N, {expected[0]}, {expected[1]}, {expected[2]}], "
                             f"got {list(x.shape)}")
        return self.backbone(x)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """Logits: float32 ``[N, feature_dim]`` -> ``[N, num_classes]``.

        Raises:
            ModelError: ``z`` is not ``[N, feature_dim]``.
        """
        if z.dim() != 2 or z.shape[1] != self.feature_dim:
            raise ModelError(f"{self.arch} head expects [N, {self.feature_dim}], got {list(z.shape)}")
        return self.classifier(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``head(features(x))``: ``[N, C, S, S]`` -> ``[N, num_classes]``."""
        return self.head(self.features(x))


def _args(in_channels: object, image_size: object, num_classes: object, feature_dim: object) -> dict[str, int]:
    return {"in_channels": _check_int("in_channels", in_channels, minimum=1),
            "image_size": _check_int("image_size", image_size, minimum=1),
            "num_classes": _check_int("num_classes", num_classes, minimum=1),
            "feature_dim": _check_int("feature_dim", feature_dim, minimum=1)}


def _stem_conv(in_channels: int, out_channels: int) -> nn.Conv2d:
    """3×3 stride-1 stem conv without bias, initialised as torchvision initialises its convs."""
    conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
    return conv


@register_model("resnet18")
def resnet18(*, in_channels: int = 3, image_size: int = 32, num_classes: int = 10, feature_dim: int = 64) -> PooledNet:
    """torchvision ``resnet18`` (weights=None) for small images: ``conv1`` is a 3×3 stride-1 conv
    from ``in_channels`` (not 7×7 stride 2), no max-pool, the 1000-way ``fc`` dropped; 512 pooled
    channels -> ``Linear(512, feature_dim)``. Parameters: torchvision's 11,689,512 − 9,408 (7×7×3×64
    stem) + 576·C (3×3 stem) − 513,000 (fc) + 513·d (projection) + (d + 1)·classes.

    Raises:
        ModelError: an argument is not a positive int.
    """
    a = _args(in_channels, image_size, num_classes, feature_dim)
    from torchvision.models import resnet18 as tv_resnet18

    net = tv_resnet18(weights=None)
    body = [("conv1", _stem_conv(a["in_channels"], 64)), ("bn1", net.bn1), ("relu", net.relu),
            ("layer1", net.layer1), ("layer2", net.layer2), ("layer3", net.layer3), ("layer4", net.layer4)]
    return PooledNet(body, 512, arch="resnet18", **a)


def _basic_block(inplanes: int, planes: int, stride: int) -> nn.Module:
    from torchvision.models.resnet import BasicBlock

    downsample = None
    if stride != 1 or inplanes != planes:
        downsample = nn.Sequential(nn.Conv2d(inplanes, planes, kernel_size=1, stride=stride, bias=False),
                                   nn.BatchNorm2d(planes))
    block = BasicBlock(inplanes, planes, stride=stride, downsample=downsample)
    for m in block.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return block


@register_model("resnet8")
def resnet8(*, in_channels: int = 3, image_size: int = 32, num_classes: int = 10, feature_dim: int = 64) -> PooledNet:
    """A CIFAR-style ResNet-8: a 3×3 stem to 16 channels (BatchNorm, ReLU), then one torchvision
    ``BasicBlock`` per stage at 16, 32 (stride 2) and 64 (stride 2) channels (1×1 conv + BN
    shortcuts where the shape changes); 64 pooled channels -> ``Linear(64, feature_dim)``. Cheap
    on a 2-core CPU: 77,104 parameters before the projection for one input channel.

    Raises:
        ModelError: an argument is not a positive int.
    """
    a = _args(in_channels, image_size, num_classes, feature_dim)
    body = [("conv1", _stem_conv(a["in_channels"], 16)), ("bn1", nn.BatchNorm2d(16)), ("relu", nn.ReLU(inplace=True)),
            ("layer1", _basic_block(16, 16, 1)), ("layer2", _basic_block(16, 32, 2)),
            ("layer3", _basic_block(32, 64, 2))]
    return PooledNet(body, 64, arch="resnet8", **a)


@register_model("mobilenet_v2")
def mobilenet_v2(*, in_channels: int = 3, image_size: int = 32, num_classes: int = 10,
                 feature_dim: int = 64) -> PooledNet:
    """torchvision ``mobilenet_v2`` (weights=None, width 1.0) features with the first conv from
    ``in_channels`` at stride 1 (total stride 16, for small images); its 1280 pooled channels ->
    ``Linear(1280, feature_dim)`` (torchvision's dropout + 1000-way classifier dropped).
    Parameters: torchvision's 3,504,872 − 864 (stem 3×3×3×32) + 288·C − 1,281,000 (classifier)
    + 1281·d + (d + 1)·classes.

    Raises:
        ModelError: an argument is not a positive int.
    """
    a = _args(in_channels, image_size, num_classes, feature_dim)
    from torchvision.models import mobilenet_v2 as tv_mobilenet_v2
    from torchvision.ops.misc import Conv2dNormActivation

    net = tv_mobilenet_v2(weights=None)
    stem = Conv2dNormActivation(a["in_channels"], 32, stride=1, norm_layer=nn.BatchNorm2d, activation_layer=nn.ReLU6)
    nn.init.kaiming_normal_(stem[0].weight, mode="fan_out")
    net.features[0] = stem
    return PooledNet([("features", net.features)], 1280, arch="mobilenet_v2", **a)


@register_model("inception_small")
def inception_small(*, in_channels: int = 3, image_size: int = 32, num_classes: int = 10,
                    feature_dim: int = 64) -> PooledNet:
    """A small GoogLeNet-style net from torchvision's ``Inception`` block and ``BasicConv2d``
    (conv without bias, BatchNorm eps 0.001, ReLU): a 3×3 stem to 32 channels,
    ``Inception(32; 1×1 16, 3×3 16→24, "5×5" 4→8, pool-proj 8)`` -> 56 channels, a 2×2 max-pool
    (ceil mode), ``Inception(56; 32, 32→48, 8→16, 16)`` -> 112 channels; 112 pooled channels ->
    ``Linear(112, feature_dim)``. (torchvision's "5×5" branch uses a 3×3 kernel, a known quirk
    kept for its pretrained weights; it is kept here too.)

    Raises:
        ModelError: an argument is not a positive int.
    """
    a = _args(in_channels, image_size, num_classes, feature_dim)
    from torchvision.models.googlenet import BasicConv2d, Inception

    body = [("conv1", BasicConv2d(a["in_channels"], 32, kernel_size=3, padding=1)),
            ("inception1", Inception(32, 16, 16, 24, 4, 8, 8)),
            ("pool1", nn.MaxPool2d(2, ceil_mode=True)),
            ("inception2", Inception(56, 32, 32, 48, 8, 16, 16))]
    return PooledNet(body, 112, arch="inception_small", **a)


@register_model("mobilenet_v2_small")
def mobilenet_v2_small(*, in_channels: int = 3, image_size: int = 32, num_classes: int = 10,
                       feature_dim: int = 64) -> PooledNet:
    """torchvision ``mobilenet_v2`` (weights=None) at width multiplier 0.5 for a 2-core CPU: the
    first conv from ``in_channels`` at stride 2 (torchvision's own stride; total stride 32), its
    inverted-residual blocks up to the last one (160 channels), torchvision's final 1×1 conv to
    1280 channels and its classifier dropped; 160 pooled channels -> ``Linear(160, feature_dim)``.
    Measured on one core (3×32×32, batch 32, feature_dim 64): 0.25 M parameters, about 5× cheaper
    per step than ``mobilenet_v2`` (tools/bench_model_zoo.py prints the table).

    Raises:
        ModelError: an argument is not a positive int.
    """
    a = _args(in_channels, image_size, num_classes, feature_dim)
    from torchvision.models import mobilenet_v2 as tv_mobilenet_v2
    from torchvision.ops.misc import Conv2dNormActivation

    net = tv_mobilenet_v2(weights=None, width_mult=0.5)
    first = net.features[0][0].out_channels
    stem = Conv2dNormActivation(a["in_channels"], first, stride=2, norm_layer=nn.BatchNorm2d, activation_layer=nn.ReLU6)
    nn.init.kaiming_normal_(stem[0].weight, mode="fan_out")
    blocks = nn.Sequential(stem, *list(net.features)[1:-1])
    width = list(net.features)[-2].out_channels
    return PooledNet([("features", blocks)], width, arch="mobilenet_v2_small", **a)
