"""FedGH, client half (Yi, Wang, Liu, Yu, Yu, "FedGH: Heterogeneous Federated Learning with
Generalized Global Header", ACM MM 2023; SPECS.md §6.4; code conventions of HtFLlib
``clientgh``).

Each device keeps its own architecture (any with the agreed feature width d and a head
``Linear(d, C)``). Round t:

1. when the server sent a global head (every round after the first), it **overwrites** the
   device's head: ``classifier.weight ← head_weight`` [C, d], ``classifier.bias ← head_bias`` [C];
2. the whole model is trained with cross-entropy alone, ``L = CE(h(f(x)), y)``;
3. the class prototypes p_c = mean_{i: y_i = c} f(x_i) of the trained model, eval mode, no
   gradients, over the whole shard (:func:`~edge_agent.algorithms.fedtgp.eval_prototypes`) are
   uploaded as ``prototypes`` float32 [k, d], ``proto_classes`` int64 [k], ``proto_counts``
   int64 [k]. No model parameter leaves the device (``share = "none"``).

Inference: the device's own model (its body and the head it last trained), as in HtFLlib.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..errors import ModelError
from ._base import LocalResult, TrainConfig
from ._registry import register_client_algorithm
from .fedproto import PrototypeClient
from .fedtgp import eval_prototypes


def load_global_head(model: torch.nn.Module, weight: np.ndarray, bias: np.ndarray) -> None:
    """Copy the server's head into ``model.classifier`` (in place).

    Args:
        weight: float [C, d]; bias: float [C].

    Raises:
        ModelError: no ``classifier`` Linear with a bias, or shapes other than the model's.
    """
    head = getattr(model, "classifier", None)
    if not isinstance(head, torch.nn.Linear) or head.bias is None:
        raise ModelError("FedGH needs a model whose head is a torch.nn.Linear with a bias, named 'classifier'")
    w, b = np.asarray(weight), np.asarray(bias)
    if tuple(w.shape) != tuple(head.weight.shape) or tuple(b.shape) != tuple(head.bias.shape):
        raise ModelError(f"global head {list(w.shape)} / {list(b.shape)} received, the model's is "
                         f"{list(head.weight.shape)} / {list(head.bias.shape)}")
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(w.astype(np.float32)).to(head.weight.device, head.weight.dtype))
        head.bias.copy_(torch.from_numpy(b.astype(np.float32)).to(head.bias.device, head.bias.dtype))


@register_client_algorithm("fedgh")
class FedGHClient(PrototypeClient):
    """FedGH client (module docstring): the global head in, CE training, eval-mode prototypes out.

    Args:
        precision: ``"fp32"`` or ``"fp16"`` (CUDA autocast), as for FedAvg.

    Raises:
        ValueError: unknown ``precision``.
    """

    name = "fedgh"
    share = "none"
    buffers = "average"

    def feature_loss(self, global_extras: Mapping[str, np.ndarray], params: Mapping[str, object],
                     num_classes: int, device: torch.device):
        """None: FedGH trains with cross-entropy alone."""
        return None

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_id: str = "", client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """Overwrite the head with ``head_weight`` / ``head_bias`` when sent, train with CE,
        upload the eval-mode prototypes of the trained model.

        Raises:
            ModelError: a global head of another shape, or only one of its two arrays.
        """
        extras = global_extras or {}
        if ("head_weight" in extras) != ("head_bias" in extras):
            raise ModelError("FedGH: the global head needs both head_weight and head_bias")
        if "head_weight" in extras:
            load_global_head(model, extras["head_weight"], extras["head_bias"])
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
