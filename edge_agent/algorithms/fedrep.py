"""FedRep, client half: alternating head / representation training, only the representation travels.

Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared Representations for Personalized
Federated Learning", ICML 2021, Algorithm 1 (SPECS §6.16; code: PFLlib ``clientrep.py``). In each
round client i

1. loads the global representation φ (the backbone, ``backbone.*`` entries) into its model,
2. trains its private head h_i with φ frozen for τ_h epochs (``head_epochs``),
3. trains φ with h_i frozen for τ_φ epochs (``local_epochs`` of the round's TrainConfig),
4. uploads φ; the server averages the representations (:class:`broker_server.strategies.fedrep.FedRep`).

The head never leaves the device: it lives in the agent's model object, which the agent keeps
for the whole run, so client-side evaluation (``[server] client_eval = true``) scores each
client's personal model (backbone φ_i after step 3, head h_i).

``head_epochs`` defaults to 1 as in PFLlib (``plocal_epochs``); the paper runs about 10 head
epochs per round — set ``[algorithm] head_epochs = 10`` for the paper's setting.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import torch

from ._base import LocalResult, TrainConfig, step_hook
from ._registry import register_client_algorithm
from .fedavg import _check_precision, sgd_epochs, shuffle_generator
from .fedper import FedPerClient

#: Default head epochs per round (PFLlib ``plocal_epochs``; the paper uses ~10).
HEAD_EPOCHS = 1


def is_backbone(name: str) -> bool:
    """True for a ``state_dict``/parameter name of the shared representation (``backbone.*``),
    the same rule as ``shared_indices(names, "backbone")``."""
    return name.startswith("backbone.")


@contextmanager
def frozen(model: torch.nn.Module, which: Callable[[str], bool]) -> Iterator[None]:
    """Freeze the parameters of ``model`` whose name satisfies ``which`` for the ``with`` block.

    Frozen parameters get ``requires_grad = False``, so backward leaves their ``.grad`` at
    ``None`` and ``torch.optim.SGD`` skips them (no step, no weight decay, no momentum): they are
    bit-identical after the block. Every parameter's previous ``requires_grad`` is restored on
    exit, also when the block raises.
    """
    saved = [(p, p.requires_grad) for _, p in model.named_parameters()]
    try:
        for name, p in model.named_parameters():
            if which(name):
                p.requires_grad_(False)
        yield
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)


def head_epochs_param(params: Mapping[str, object] | None) -> int:
    """``head_epochs`` from the round's config (default :data:`HEAD_EPOCHS`).

    Raises:
        ValueError: not an integer ≥ 1.
    """
    raw = (params or {}).get("head_epochs", HEAD_EPOCHS)
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or int(raw) != raw or raw < 1:
        raise ValueError(f"head_epochs must be an integer >= 1, got {raw!r}")
    return int(raw)


@register_client_algorithm("fedrep")
class FedRepClient(FedPerClient):
    """FedRep client: head epochs with the backbone frozen, then backbone epochs with the head frozen.

    Upload per round: the backbone only (``share = "backbone"``); for the light CNN on 28×28
    grayscale 105,216 parameters × 4 bytes = 420,864 body bytes of tensor data.

    Round config (``params``): ``head_epochs`` (int ≥ 1, default 1), put there by the server
    strategy from ``[algorithm] head_epochs``.

    Args:
        precision: ``"fp32"`` (default) or ``"fp16"`` (CUDA autocast), as for FedAvg.

    Raises:
        ValueError: unknown ``precision``.
    """

    name = "fedrep"
    share = "backbone"
    buffers = "average"

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_id: str = "", client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """Load the global backbone, train head then backbone, return the backbone.

        Both phases draw their batch order from one generator (:func:`shuffle_generator` of
        ``config.seed``, ``round``, ``client_index``), the head phase first; each phase has its
        own fresh SGD optimizer (lr, momentum, weight decay of ``config``), as PFLlib's two
        optimizers.

        Returns:
            LocalResult with the backbone arrays (float32, manifest order), ``num_samples =
            len(y)``, ``train_loss`` / ``train_accuracy`` of the last backbone epoch, and
            ``head_train_loss`` / ``head_train_accuracy`` of the last head epoch in ``metrics``.
            A shard of zero samples trains nothing and returns ``num_samples = 0`` (not sent).

        Raises:
            ModelError: ``global_tensors`` are not the model's backbone.
            ValueError: bad ``head_epochs``; ``fp16`` on a non-CUDA device; ``batch_size`` < 1.
        """
        _check_precision(self.precision, device)
        head_epochs = head_epochs_param(params)
        t0 = time.perf_counter()
        self.load_global(model, global_tensors)
        gen = shuffle_generator(config.seed, round, client_index)
        with frozen(model, is_backbone):
            head_loss, head_acc = sgd_epochs(model, x, y, dataclasses.replace(config, local_epochs=head_epochs),
                                             gen, device, precision=self.precision, before_step=step_hook(self),
                                             step_round=round)
        with frozen(model, lambda name: not is_backbone(name)):
            loss, acc = sgd_epochs(model, x, y, config, gen, device, precision=self.precision,
                                   before_step=step_hook(self), step_round=round)
        return LocalResult(tensors=self.upload_tensors(model), num_samples=int(y.shape[0]), train_loss=loss,
                           metrics={"train_accuracy": acc, "head_train_loss": head_loss,
                                    "head_train_accuracy": head_acc, "train_seconds": time.perf_counter() - t0})
