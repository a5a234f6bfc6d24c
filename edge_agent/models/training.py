"""Train mode that keeps frozen layers frozen."""

from __future__ import annotations

from torch import nn

__all__ = ["drop_batch_counters", "train_mode"]


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


def drop_batch_counters(model: nn.Module) -> nn.Module:
    """Remove the int64 ``num_batches_tracked`` buffer of every BatchNorm layer that does not
    need it, so that the model's state is all float32.

    The counter only matters with ``momentum=None`` (a cumulative average of the batch
    statistics); with a momentum (PyTorch's default 0.1) BatchNorm never reads it. An integer
    entry in the state would travel through float codecs (fp16, int8, top-k) and be averaged as if
    it were a weight, so the zoo drops it: the state dict then holds weights, biases,
    ``running_mean`` and ``running_var`` (float32) only, and ``load_state_dict`` takes such a
    dict (a counter entry in it is ignored). Layers with ``momentum=None`` keep it.

    Args:
        model: any module (changed in place).

    Returns:
        ``model``.
    """
    for module in model.modules():
        if (isinstance(module, nn.modules.batchnorm._NormBase) and module.momentum is not None
                and getattr(module, "num_batches_tracked", None) is not None):
            module.num_batches_tracked = None
            # BatchNorm adds the counter to a state dict without version metadata (a plain dict,
            # as edge_agent.state.load_arrays builds) before loading; take it out again
            module.register_load_state_dict_pre_hook(_drop_counter_key)
    return model


def _drop_counter_key(module: nn.Module, state_dict: dict, prefix: str, *args: object) -> None:
    state_dict.pop(prefix + "num_batches_tracked", None)
