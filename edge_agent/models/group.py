"""Model groups: which architecture each device of a fleet runs, and the named groups.

A named group (:data:`MODEL_GROUPS`, ``[model] group = "htfe4-cpu"``) is a fixed mix in the
spirit of HtFLlib's HtFE groups (SPECS §3.1: HtFE4 = FedAvgCNN, GoogLeNet, MobileNetV2,
ResNet18, assigned ``models[i % len(models)]``); every member ends in the agreed prototype width
``feature_dim`` and a ``Linear(feature_dim, C)`` head, so only prototype methods (FedProto,
FedTGP, FedGH, FedOCP) can federate them. Parameters and one SGD step on one core, 3×32×32,
batch 32, feature_dim 64, 10 classes (``tools/bench_model_zoo.py``, this machine):

=====================  ============  ============  ==========  ================================
architecture           parameters    MACs/image    step (ms)   role
=====================  ============  ============  ==========  ================================
``lightcnn``           136,874       1,753,728     28          small CNN (HtFE's FedAvgCNN)
``resnet8``            82,202        12,505,728    84          ResNet-style (``BasicBlock``)
``mobilenet_v2_small`` 491,274       1,762,240     ~150        MobileNet-style (width 0.5)
``inception_small``    34,322        11,263,616    181         GoogLeNet-style (``Inception``)
``mobilenet_v2``       2,306,506     24,531,072    592         torchvision MobileNetV2
``resnet18``           11,202,314    555,451,008   1,548       torchvision ResNet-18
=====================  ============  ============  ==========  ================================

``htfe4-cpu`` (the first four) costs about 0.45 s for one step of each member; a 20-client
CIFAR-10 round (2,250 training images per client, 71 steps, 5 clients per architecture) is about
5 × 71 × 0.45 ≈ 160 s of one core, so it fits a 2-core machine. ``htfe4`` is the same mix with
the full torchvision MobileNetV2 and ResNet-18 (≈ 20 min of one core per round: a GPU or a real
fleet). ``htfe5-cpu`` adds ``mobilenet_v2`` as a fifth, heavier member. ``fleet`` is bound to
the firmware profiles of ``firmware_profiles/`` in order of multiply-accumulates: a Raspberry
Pi 4 gets the smallest net (the light CNN), a Pi 5 the half-width MobileNetV2 (depthwise convs,
made for ARM cores), the Jetson Nano / Xavier NX the Inception / ResNet-8 nets, the Jetson Orin
(and an x86 CUDA box) ResNet-18, an x86 CPU ResNet-8. (Depthwise convs are slow per MAC on
x86 PyTorch: the step times above are not in MAC order.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from edge_agent.errors import ModelError

__all__ = ["MODEL_GROUPS", "assign_model", "get_group", "group_architectures", "list_groups"]

Group = Sequence[str] | Mapping[str, str]
"""A model group: a list of architectures (device ``i`` runs ``group[i % len(group)]``), or a
mapping firmware profile name -> architecture (other profiles run the default name)."""

#: The named groups (module docstring): a tuple is round-robin by shard index, a dict is by
#: firmware profile.
MODEL_GROUPS: dict[str, tuple[str, ...] | dict[str, str]] = {
    "htfe4-cpu": ("lightcnn", "resnet8", "mobilenet_v2_small", "inception_small"),
    "htfe5-cpu": ("lightcnn", "resnet8", "mobilenet_v2_small", "inception_small", "mobilenet_v2"),
    "htfe4": ("lightcnn", "resnet18", "mobilenet_v2", "inception_small"),
    "fleet": {"rpi4": "lightcnn", "rpi5": "mobilenet_v2_small", "jetson-nano": "inception_small",
              "jetson-xavier-nx": "resnet8", "jetson-orin-nano": "resnet18",
              "x86-cpu": "resnet8", "x86-cuda": "resnet18"},
}


def list_groups() -> list[str]:
    """The names of :data:`MODEL_GROUPS`, sorted."""
    return sorted(MODEL_GROUPS)


def get_group(name: str) -> tuple[str, ...] | dict[str, str]:
    """A named group: a tuple of architectures (round-robin) or a dict profile -> architecture
    (a copy: changing it changes nothing here).

    Raises:
        ModelError: an unknown name (the message lists the known ones).
    """
    if name not in MODEL_GROUPS:
        raise ModelError(f"unknown model group {name!r}; the named groups are {', '.join(list_groups())} "
                         "(or give a list of model names, or a table of firmware profile = model name)")
    g = MODEL_GROUPS[name]
    return dict(g) if isinstance(g, dict) else tuple(g)


def assign_model(default: str, group: Group, *, shard: int, profile: str) -> str:
    """The architecture device ``shard`` (0-based shard index) with firmware ``profile`` runs.

    Args:
        default: ``[model] name``: the architecture when ``group`` is empty, or when it is a
            mapping without ``profile``.
        group: ``()``, a list (round-robin by shard index: ``group[shard % len(group)]``) or a
            mapping by profile name.
        shard: the device's shard index ``i`` (>= 0).
        profile: the device's firmware profile name.

    Raises:
        ModelError: a negative shard index.
    """
    if shard < 0:
        raise ModelError(f"shard index must be >= 0, got {shard}")
    if isinstance(group, Mapping):
        return group.get(profile, default)
    if group:
        return group[shard % len(group)]
    return default


def group_architectures(default: str, group: Group) -> list[str]:
    """Every architecture a fleet with this group may run, distinct, in first-use order.

    A list group: its entries and ``default`` (the server's own model). A mapping: its values and
    ``default`` (the profiles it does not name).
    """
    names = [default, *(group.values() if isinstance(group, Mapping) else group)]
    return list(dict.fromkeys(names))
