"""The torch operations whose CPU bits the portable settings cannot pin, written so that they can.

:mod:`broker_server.numerics` pins the kernels that read their choice from the environment (ATen's
build, oneDNN's ISA, MKL's branch, numpy's dispatch, OpenBLAS's core). A few of ATen's elementwise
kernels still give other bits on another CPU under those settings: measured with torch 2.14.1 under
portable numerics, ``torch.sqrt`` (float32 and float64, so ``pow(x, 0.5)``, ``torch.cdist`` and
the ``exp_avg_sq.sqrt()`` of ``torch.optim.Adam``, ``AdamW`` and ``RMSprop``), ``tan`` (float64),
``atan`` (float32), ``asin`` and ``acos`` gave other bits on this project's Intel Xeon (AVX-512)
than under qemu's Intel Haswell-v4 and AMD EPYC-v3 models, which agreed with each other; none
of the MKL settings (``MKL_CBWR``, ``MKL_ENABLE_INSTRUCTIONS``) moved them to the emulated bits.
Their results are not the correctly rounded ones either (``torch.sqrt`` of 1,280 float32 values:
208 differ from the rounded float64 root natively, 189 under qemu). exp, log, tanh, sigmoid, sin,
cos, erf, softplus, norms (``linalg.vector_norm``, ``F.normalize``), batch and layer norm, std and
var agreed. FedTGP's server loss took ``torch.sqrt`` of its squared distances: its records made on
an AMD EPYC re-ran on the Intel Xeon to another accuracy (CIFAR-10 Dir(0.1), seed 0: 62.93 % and
63.05 %), the first difference in the 8th digit of round 1's prototypes.

The square root is an IEEE basic operation that every x86 CPU rounds correctly in hardware
(``sqrtps``/``sqrtpd``); numpy's ``sqrt`` runs those instructions, so :func:`sqrt` takes its
forward from numpy on the CPU, the backward from exact multiplications and divisions, and
:class:`Adam` is ``torch.optim.Adam``'s update (single-tensor branch, same order of operations)
with that root. ``tools/check_numerics.py`` includes both in its reference digest, compared with
qemu's CPU models by ``tests/broker_server/test_numerics.py``. Other devices (CUDA) use
``torch.sqrt``, correctly rounded there; their bits are not claimed portable.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

__all__ = ["Adam", "sqrt"]

_NUMPY_DTYPES = (torch.float32, torch.float64)


def _root(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of ``x`` (no autograd), a new tensor of ``x``'s dtype,
    shape and device: numpy's on CPU float32/float64, else ``torch.sqrt``."""
    if x.device.type == "cpu" and x.dtype in _NUMPY_DTYPES:
        with np.errstate(invalid="ignore"):  # a negative entry gives NaN quietly, as torch.sqrt's
            return torch.from_numpy(np.asarray(np.sqrt(x.detach().numpy())))  # a 0-d root is a numpy scalar
    return torch.sqrt(x.detach())


class _Sqrt(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN401
        y = _root(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN401
        (y,) = ctx.saved_tensors
        return grad / (2 * y)  # torch.sqrt's own backward: d√x/dx = 1 / (2√x)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """Element-wise √x, correctly rounded and the same bits on any x86-64 CPU (module docstring),
    differentiable: the gradient is ``grad / (2·√x)`` as ``torch.sqrt``'s (inf at 0, as there).

    Args:
        x: a floating tensor of any shape (float32/float64 on CPU take numpy's root; other dtypes
            and devices ``torch.sqrt``). Negative entries give NaN, as ``torch.sqrt``.

    Returns:
        A new tensor of ``x``'s shape, dtype and device.
    """
    return _Sqrt.apply(x)


class Adam(torch.optim.Optimizer):
    """``torch.optim.Adam`` (Kingma & Ba, ICLR 2015, Algorithm 1; L2 ``weight_decay`` added to the
    gradient, no AMSGrad) with the correctly rounded root of :func:`sqrt`: the same update, in
    the order of operations of torch's single-tensor branch, per parameter p with gradient g at
    step t:

        g ← g + weight_decay·p
        m ← m + (g − m)·(1 − β₁)            (``lerp``)
        v ← β₂·v + (1 − β₂)·g²
        p ← p − (lr / (1 − β₁ᵗ)) · m / (√v / √(1 − β₂ᵗ) + eps)

    Its ``state_dict`` has torch's keys (``step`` a float32 0-d tensor, ``exp_avg``,
    ``exp_avg_sq``), so each loads the other's.

    Args:
        params: the parameters (or parameter groups).
        lr: step size (> 0); betas: (β₁, β₂) in [0, 1); eps: ≥ 0; weight_decay: ≥ 0.

    Raises:
        ValueError: a value out of range, naming it.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"Adam lr must be > 0, got {lr!r}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Adam betas must lie in [0, 1), got {betas!r}")
        if not eps >= 0:
            raise ValueError(f"Adam eps must be >= 0, got {eps!r}")
        if not weight_decay >= 0:
            raise ValueError(f"Adam weight_decay must be >= 0, got {weight_decay!r}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: ANN401
        """One update of every parameter with a gradient; ``closure`` (re-evaluates the loss) as
        torch's optimisers. Returns the closure's loss, else None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise ValueError("Adam does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                step = float(state["step"])
                if group["weight_decay"] != 0:
                    grad = grad.add(p, alpha=group["weight_decay"])
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)
                bias_correction1 = 1 - beta1 ** step
                bias_correction2 = 1 - beta2 ** step
                step_size = group["lr"] / bias_correction1
                denom = (_root(exp_avg_sq) / (bias_correction2 ** 0.5)).add_(group["eps"])
                p.addcdiv_(exp_avg, denom, value=-step_size)
        return loss
