"""FedORGP, client half (Guo et al., arXiv 2502.16119; SPECS.md §6.5; the server half, with the
orthogonality-regularised global prototypes, is :mod:`broker_server.strategies.fedorgp`).

Each device keeps its own architecture (any with the agreed feature width d and a head
``Linear(d, C)`` named ``classifier``); only class prototypes travel (``share = "none"``). Per
batch (z = f_k(x) ∈ R^{B×d}, global prototypes P from the server):

    L = CE(h(z), y) + λ_c · mean_b (1 − cos(z_b, P_{y_b}))

(:func:`~edge_agent.algorithms.fedocp.cosine_alignment`; rows whose class has no global
prototype are left out; round 1, before any P, is CE alone), λ_c = ``lambda_client`` from the
server (the paper's best, 100). The head keeps its own random initialisation, and the upload is
the class-mean features of the trained model in eval mode
(:func:`~edge_agent.algorithms.fedtgp.eval_prototypes`: ``prototypes`` float32 [k, d],
``proto_classes`` int64 [k], ``proto_counts`` int64 [k]). Inference: the model's own head
(SPECS §6.5).

This is FedOCP's client with its orthogonal initialisation, orthogonality loss and contrastive
loss off and λ_a = λ_c: FedOCP built on FedORGP's client (SPECS §3), so the two share one
training loop (:class:`~edge_agent.algorithms.fedocp.FedOCPClient`) and differ only in these keys.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ._base import LocalResult, TrainConfig
from ._registry import register_client_algorithm
from .fedocp import FedOCPClient

#: the client's λ_c when the server sends none (the paper's best; SPECS §6.5)
LAMBDA_CLIENT = 100.0


def fedocp_params(params: Mapping[str, object]) -> dict[str, object]:
    """FedOCP's round keys that make its client FedORGP's: ``lambda_align`` = the server's
    ``lambda_client`` (default :data:`LAMBDA_CLIENT`), no orthogonal init, ``lambda_orth`` =
    ``lambda_con`` = 0; every other key is kept.

    Raises:
        ValueError: ``lambda_client`` not a finite number ≥ 0 (named).
    """
    raw = params.get("lambda_client", LAMBDA_CLIENT)
    try:
        lam = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"lambda_client must be a number >= 0, got {raw!r}") from None
    if not (np.isfinite(lam) and lam >= 0):
        raise ValueError(f"lambda_client must be finite and >= 0, got {lam}")
    return {**params, "lambda_align": lam, "orth_init": False, "lambda_orth": 0.0, "lambda_con": 0.0}


@register_client_algorithm("fedorgp")
class FedORGPClient(FedOCPClient):
    """FedORGP client (module docstring): CE + λ_c · cosine alignment, eval-mode prototypes up,
    the own head for inference.

    Args:
        precision: ``"fp32"`` or ``"fp16"`` (CUDA autocast), as for FedAvg.

    Raises:
        ValueError: unknown ``precision``; (from :meth:`local_round`) a negative or non-finite
            ``lambda_client``.
    """

    name = "fedorgp"
    share = "none"
    buffers = "average"

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_id: str = "", client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """FedOCP's round with :func:`fedocp_params`; the metrics drop FedOCP's
        ``ocp_orth_error`` (FedORGP does not regularise its head)."""
        res = super().local_round(model, global_tensors, x, y, config, round=round, client_id=client_id,
                                  client_index=client_index, device=device, params=fedocp_params(params or {}),
                                  global_extras=global_extras)
        metrics = {k: v for k, v in res.metrics.items() if k != "ocp_orth_error"}
        return LocalResult(tensors=res.tensors, num_samples=res.num_samples, train_loss=res.train_loss,
                           metrics=metrics, extras=res.extras)
