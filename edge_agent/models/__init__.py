"""Client models: the zoo, users' factories, model groups and parameter manifests.

The zoo (:func:`list_models`): ``lightcnn`` (:class:`LightCNN`, the light CNN of SPECS §5.1) and
torchvision-based nets for small images with BatchNorm (:mod:`edge_agent.models.zoo`:
``resnet18``, ``resnet8``, ``mobilenet_v2``, ``mobilenet_v2_small``, ``inception_small``). A user's own model is named
by its factory, ``"package.module:function"``, called with the keywords among ``in_channels,
image_size, num_classes, feature_dim`` it accepts. Every model offers ``features(x) -> [N, d]``
(the prototype, d = ``feature_dim``), ``head(z) -> logits``, ``backbone.*`` parameter names for
the feature extractor and ``classifier.weight [C, d]`` for the head; :func:`make_model` (the one
place a model is made, for devices and the server) builds and checks that.
Named model groups (``htfe4-cpu``, ``fleet`` …): :data:`MODEL_GROUPS`, :func:`get_group`.

A *manifest* (:func:`model_manifest`) lists a model's ``state_dict`` entries as
``(name, shape, dtype)``; :func:`manifest_hash` condenses it to 16 hex characters so that an
agent and the server can check, before exchanging tensors, that they hold the same architecture.
"""

from __future__ import annotations

from . import zoo  # noqa: F401  (registers the torchvision-based nets)
from ._registry import (
    MODEL_KEYWORDS,
    build_model,
    check_model,
    is_factory_path,
    list_models,
    make_model,
    register_model,
    resolve_model,
)
from .group import MODEL_GROUPS, assign_model, get_group, group_architectures, list_groups
from .lightcnn import LightCNN
from .manifest import Manifest, manifest_hash, model_manifest
from .training import drop_batch_counters, train_mode

__all__ = [
    "MODEL_GROUPS",
    "MODEL_KEYWORDS",
    "LightCNN",
    "Manifest",
    "assign_model",
    "build_model",
    "check_model",
    "drop_batch_counters",
    "get_group",
    "group_architectures",
    "is_factory_path",
    "list_groups",
    "list_models",
    "make_model",
    "manifest_hash",
    "model_manifest",
    "register_model",
    "resolve_model",
    "train_mode",
]
