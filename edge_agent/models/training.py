"""Train mode that keeps frozen layers frozen."""

from __future__ import annotations

from torch import nn

__all__ = ["train_mode"]


def train_mode(model: nn.Module) -> nn.Module:
    """Put ``model`` into training mode, except modules whose own parameters are all frozen.

    ``model.train()`` alone would let a frozen BatchNorm layer (``weight`` and ``bias`` with
    ``requires_grad = False``, as FedRep's head phase or a fine-tuning freeze leaves them) go on
    updating its running mean and variance from every batch, so a "frozen" layer would drift.
    Here each module that has parameters of its own (``recurse=False``), all of them frozen, is
    switched back to eval mode: BatchNorm then normalises with its stored statistics and does
    not update them, Dropout of such a module is off. Modules without parameters of their own
    (ReLU, pooling, containers) follow ``model.train()``.

    Args:
        model: any module.

    Returns:
        ``model`` (for chaining).
    """
    model.train()
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own and not any(p.requires_grad for p in own):
            module.eval()
    return model
