"""Client models and their parameter manifests.

The one architecture so far is :class:`LightCNN`, the light CNN of SPECS §5.1 (FedMCP++ client
model, reconstructed from the paper's parameter, MAC and byte counts). Models are registered by
name (:func:`register_model`, :func:`build_model`, :func:`list_models`).

A *manifest* (:func:`model_manifest`) lists a model's ``state_dict`` entries as
``(name, shape, dtype)``; :func:`manifest_hash` condenses it to 16 hex characters so that an
agent and the server can check, before exchanging tensors, that they hold the same architecture.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import nn

from edge_agent.errors import ModelError

__all__ = [
    "LightCNN",
    "Manifest",
    "build_model",
    "list_models",
    "manifest_hash",
    "model_manifest",
    "register_model",
]

Manifest = list[tuple[str, tuple[int, ...], str]]
"""``[(state_dict name, shape, dtype name such as "float32"), ...]`` in state_dict order."""

_MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Class/function decorator that registers a model constructor under ``name``.

    Raises:
        ModelError: ``name`` is already registered, or is not a non-empty lower-case string.
    """
    if not isinstance(name, str) or not name or name != name.lower():
        raise ModelError(f"model names must be non-empty lower-case strings, got {name!r}")

    def decorator(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _MODELS:
            raise ModelError(f"model name {name!r} is already registered")
        _MODELS[name] = factory
        return factory

    return decorator


def list_models() -> list[str]:
    """Return the registered model names, sorted."""
    return sorted(_MODELS)


def build_model(name: str = "lightcnn", **kwargs: object) -> nn.Module:
    """Construct a registered model by name.

    Args:
        name: one of :func:`list_models` (default ``"lightcnn"``).
        **kwargs: keyword arguments of the model's constructor (e.g. ``in_channels=3,
            image_size=32, num_classes=10`` for :class:`LightCNN`).

    Returns:
        A freshly initialised model (float32 parameters, on the CPU, in training mode).

    Raises:
        ModelError: unknown name (the message lists the known ones), an unknown keyword, or
            invalid architecture arguments.
    """
    try:
        factory = _MODELS[name]
    except (KeyError, TypeError):
        raise ModelError(
            f"unknown model {name!r}; known models: {', '.join(list_models())}"
        ) from None
    try:
        return factory(**kwargs)
    except TypeError as exc:
        raise ModelError(f"bad arguments for model {name!r}: {exc}") from exc


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


def model_manifest(model: nn.Module) -> Manifest:
    """List a model's ``state_dict`` entries.

    Args:
        model: any ``torch.nn.Module``.

    Returns:
        ``[(name, shape, dtype), ...]`` in ``state_dict`` order; ``shape`` a tuple of Python
        ints, ``dtype`` the torch dtype name without the ``torch.`` prefix (``"float32"``).
        Buffers (e.g. BatchNorm running stats) are included, as they are in the state dict.
    """
    return [
        (name, tuple(int(d) for d in tensor.shape), str(tensor.dtype).removeprefix("torch."))
        for name, tensor in model.state_dict().items()
    ]


def manifest_hash(manifest: Sequence[tuple[str, Sequence[int], str]]) -> str:
    """Short fingerprint of a manifest.

    Canonical form: ``json.dumps([[name, [dims...], dtype], ...], separators=(",", ":"),
    ensure_ascii=True)`` encoded as UTF-8, in the manifest's order (order matters). The result
    is the **first 16 hex characters** (64 bits) of the SHA-256 of those bytes.

    Args:
        manifest: as returned by :func:`model_manifest`.

    Returns:
        16 lower-case hex characters.

    Raises:
        ModelError: an entry is not ``(str, sequence of int, str)``.
    """
    canonical: list[list[object]] = []
    for entry in manifest:
        try:
            name, shape, dtype = entry
            dims = [int(d) for d in shape]
        except (TypeError, ValueError) as exc:
            raise ModelError(
                f"bad manifest entry {entry!r}: expected (name, shape, dtype)"
            ) from exc
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise ModelError(f"bad manifest entry {entry!r}: name and dtype must be strings")
        canonical.append([name, dims, dtype])
    text = json.dumps(canonical, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ModelError(f"{name} must be >= {minimum}, got {value}")
    return value
