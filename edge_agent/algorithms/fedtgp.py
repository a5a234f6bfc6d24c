"""FedTGP, client half (Zhang, Liu, Hua, Cao, "FedTGP: Trainable Global Prototypes with
Adaptive-Margin-Enhanced Contrastive Learning for Data and Model Heterogeneity in Federated
Learning", AAAI 2024; SPECS.md §6.2; code conventions of TsingZ0/FedTGP and HtFLlib
``clienttgp``).

The client is FedProto's (:class:`~edge_agent.algorithms.fedproto.FedProtoClient`): a private
model of any architecture with the agreed feature width d and class count C, trained on

    L = CE(h(z), y) + λ · MSE(z, T),   T_b = P_{y_b} (the global prototype of the sample's class)

with λ = ``lambda_proto`` (FedTGP's server sends 10, "following FedProto's official
implementation"); only prototypes travel (``share = "none"``). Two differences from FedProto:

* the local prototypes are collected **after** training, in eval mode and without gradients,
  over the whole shard (HtFLlib ``collect_protos``), not from the training forward passes;
* the global prototypes are the server's trainable ones for every class
  (:mod:`broker_server.strategies.fedtgp`). Inference: the nearest global prototype (FedProto's).

Extras as FedProto's: up ``prototypes`` float32 [k, d], ``proto_classes`` int64 [k],
``proto_counts`` int64 [k] (samples per class); down ``prototypes`` [K, d], ``proto_classes`` [K].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import numpy as np
import torch

from ._base import FeatureModel, LocalResult, TrainConfig
from ._registry import register_client_algorithm
from .fedproto import FedProtoClient, PrototypeSums, _num_classes


def eval_prototypes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device,
                    batch_size: int = 256) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class mean of ``model.features`` over (x, y), eval mode, no gradients (the model's
    training flag is restored after).

    Returns:
        (prototypes float32 [k, d], classes int64 [k] ascending, counts int64 [k]).
    """
    sums = PrototypeSums(_num_classes(model))
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, int(x.shape[0]), batch_size):
                xb = x[start:start + batch_size].to(device)
                sums.add(cast(FeatureModel, model).features(xb), y[start:start + batch_size].to(device))
    finally:
        model.train(was)
    return sums.result()


@register_client_algorithm("fedtgp")
class FedTGPClient(FedProtoClient):
    """FedTGP client: FedProto's training, prototypes recollected after it in eval mode."""

    name = "fedtgp"
    share = "none"
    buffers = "average"

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_id: str = "", client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """FedProto's round; the uploaded prototypes are those of the trained model in eval mode
        (``proto_counts`` = samples per class of the shard)."""
        res = super().local_round(model, global_tensors, x, y, config, round=round, client_id=client_id,
                                  client_index=client_index, device=device, params=params,
                                  global_extras=global_extras)
        if not res.num_samples:
            return res
        protos, classes, counts = eval_prototypes(model, x, y, torch.device(device))
        if protos.shape[0]:
            self.local_prototypes = (protos, classes)
        return LocalResult(tensors=res.tensors, num_samples=res.num_samples, train_loss=res.train_loss,
                           metrics=res.metrics,
                           extras={"prototypes": protos, "proto_classes": classes, "proto_counts": counts})
