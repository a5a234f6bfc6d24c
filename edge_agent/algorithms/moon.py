"""MOON, client half: model-contrastive local training (SPECS.md §6.7).

Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021, §3.3 (local objective; the
equation numbers could not be checked here, the paper is not in the store). With z = R_w(x) the
representation of the local model being trained, z_glob = R_{w^t}(x) of the received global
model and z_prev = R_{w_i^{t−1}}(x) of this client's previous local model (both frozen):

    ℓ_con = −log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) )
    ℓ     = ℓ_sup(w; (x, y)) + μ · ℓ_con(w; w_i^{t−1}; w^t; x)

sim = cosine similarity, ℓ_sup = cross-entropy, ℓ_con averaged over the batch.

Choices: the representation is the model's feature ``model.features(x)`` (PFLlib ``clientmoon``:
the base output, no projection head; the official code adds a 2-layer projection head of width
256, which the zoo models lack). Defaults μ = 1 (``mu``; the official value for CIFAR-100 and
Tiny-ImageNet, 5 for CIFAR-10) and τ = 0.5 (``tau``, official). The frozen models run in eval mode
(a BatchNorm there normalises with its running statistics and is not updated). The previous
local model is the one this device trained last (kept on the device for the whole run, whether
or not the server accepted that update, as in the official code's per-party model pool); before
a device has trained once there is none and ℓ = ℓ_sup: in PFLlib the previous model is then the
initial model, equal to the global one in round 1, which makes ℓ_con the constant log 2 with no
gradient — the same training.

Uploads the model as FedAvg; the server half is FedAvg (:mod:`broker_server.strategies.moon`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from ._base import FeatureModel, TrainConfig
from ._registry import register_client_algorithm
from .fedavg import LossFn
from .fedprox import LocalSGDClient, read_param

#: Defaults (module docstring).
MU = 1.0
TAU = 0.5


def moon_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """ℓ_con averaged over the batch (module docstring).

    Args:
        z: the local representations, float [B, d] (differentiable).
        z_glob, z_prev: the global and previous models' representations, float [B, d] (detached
            by the caller).
        tau: τ > 0.

    Returns:
        Scalar tensor. Written as ``logsumexp`` − positive term, so large 1/τ does not overflow.
    """
    pos = F.cosine_similarity(z, z_glob, dim=1) / tau
    neg = F.cosine_similarity(z, z_prev, dim=1) / tau
    return (torch.logsumexp(torch.stack([pos, neg], dim=1), dim=1) - pos).mean()


@register_client_algorithm("moon")
class MoonClient(LocalSGDClient):
    """MOON client (module docstring). Keeps the previous local model (a copy of this device's
    model after its last round) between rounds.

    Args:
        precision: ``"fp32"`` or ``"fp16"``, as FedAvg.
    """

    name = "moon"
    share = "all"
    buffers = "average"
    device_state = "its previous local model (the contrastive negative)"

    def __init__(self, *, precision: str = "fp32") -> None:
        super().__init__(precision=precision)
        self.previous: torch.nn.Module | None = None
        # a previous model read from the device's state file, built on the next round's model
        self._previous_state: dict[str, np.ndarray] | None = None

    def device_state_arrays(self, *, settled: bool = True) -> dict[str, np.ndarray]:
        """The previous local model's state entries as ``{"previous.<entry>": array}`` (``{}``
        before the device has trained); the last trained model whatever the answer to its
        update (``settled`` changes nothing: MOON's negative is the device's own last model)."""
        if self._previous_state is not None:
            return {f"previous.{k}": v.copy() for k, v in self._previous_state.items()}
        if self.previous is None:
            return {}
        return {f"previous.{k}": v.detach().to("cpu", copy=True).numpy() for k, v in self.previous.state_dict().items()}

    def load_device_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore the previous local model (built on the next round's model, whose entries it
        must have; ``{}``: none, as before round 1).

        Raises:
            ValueError: a name without the ``previous.`` prefix.
        """
        bad = [k for k in arrays if not k.startswith("previous.")]
        if bad:
            raise ValueError(f"MOON's device state is the previous model's entries 'previous.*', got {bad}")
        self.previous = None
        self._previous_state = {k.removeprefix("previous."): np.array(v, copy=True) for k, v in arrays.items()} or None

    def check_device_state(self, model: torch.nn.Module) -> None:
        """The kept previous model has this model's state entries, of their shapes.

        Raises:
            ValueError: other entries or shapes.
        """
        if self._previous_state is None:
            return
        want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in self._previous_state.items()}
        if got != want:
            diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
            raise ValueError(f"the kept previous model differs from this model in {len(diff)} entries, "
                             f"first {diff[:3]}")

    def begin_round(self, model: torch.nn.Module, config: TrainConfig, params: Mapping[str, object],
                    global_extras: Mapping[str, np.ndarray]) -> LossFn | None:
        """CE + μ·ℓ_con against frozen copies of the just-loaded global model and the previous
        local model; CE alone before a previous model exists or with μ = 0.

        Raises:
            ValueError: ``mu`` < 0 or ``tau`` ≤ 0.
        """
        mu = read_param(params, "mu", MU)
        tau = read_param(params, "tau", TAU)
        if not tau > 0:
            raise ValueError(f"tau must be > 0, got {tau}")
        if self._previous_state is not None:  # read from the state file: now there is a model to build it on
            prev_model = copy.deepcopy(model)
            ref = prev_model.state_dict()
            if set(ref) != set(self._previous_state):
                raise ValueError(f"MOON's kept previous model has entries {sorted(self._previous_state)[:3]} …, "
                                 f"this model {sorted(ref)[:3]} …")
            prev_model.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)).to(ref[k].device)
                                        for k, v in self._previous_state.items()})
            self.previous, self._previous_state = prev_model.eval().requires_grad_(False), None
        if self.previous is None or mu == 0:
            return None
        glob = copy.deepcopy(model).eval().requires_grad_(False)
        prev = self.previous.eval().requires_grad_(False)

        def loss_fn(m: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            fm = cast(FeatureModel, m)
            z = fm.features(xb)
            logits = fm.head(z)
            with torch.no_grad():
                zg = cast(FeatureModel, glob).features(xb)
                zp = cast(FeatureModel, prev).features(xb)
            return F.cross_entropy(logits, yb) + mu * moon_contrastive_loss(z, zg, zp, tau), logits

        return loss_fn

    def end_round(self, model: torch.nn.Module, config: TrainConfig) -> dict[str, np.ndarray]:
        """Keep a frozen copy of the trained model as next round's previous local model."""
        self.previous = copy.deepcopy(model).eval().requires_grad_(False)
        return {}
