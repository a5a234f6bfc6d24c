"""FedPAD, client half: local training with a prototype-alignment term, then class prototypes.

Zhang, Wan, Long, "FedPAD: prototype-aware decoupled aggregation under domain imbalance",
*Neurocomputing* 695 (2026) 133967, Algorithm 1 — the paper version as written down in
SPECS.md §1.3 (not the public code variant of §1.8). Each round client i

1. loads the global model w^{t−1} and reads the global prototypes P_g^{t−1} from the round's
   ``global`` extras (absent in round 1);
2. runs E local epochs of SGD on ``L_i(w) = CE(h(g_w(x)), y) + λ · L_proto`` (SPECS §1.3 step 2),
   with ``L_proto = (1/(B·F)) Σ_{b : y_b ∈ K_g} ||g_w(x_b) − p_g^{(y_b)}||²₂`` over a batch of B
   samples and F features (``proto_loss = "mse"``, the default: ``nn.MSELoss`` as the reference
   code) or F times that (``"sum"``: the per-sample squared norm as SPECS writes it); a sample
   whose class has no global prototype adds nothing (round 1: CE only), see
   :func:`prototype_alignment_loss`;
3. after training, in eval mode, computes ``p_i^{(k)} = mean_{(x, y) ∈ D_i, y = k} g_w(x)`` for every
   class k present in its shard (SPECS §1.3 step 3; absent classes are omitted, never zeros);
4. uploads its whole model (``share = "all"``) and, as update extras, ``prototypes`` float32
   [k, F], ``proto_classes`` int64 [k] (ascending) and ``proto_counts`` int64 [k] (samples per class).

g_w is the light CNN's ``features`` (the 64-d penultimate feature, F = 64) and h its ``head``.
The server half is :class:`broker_server.strategies.fedpad.FedPAD`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ModelError
from ._base import FeatureModel, FloatLike, LocalResult, TrainConfig, step_hook
from ._registry import register_client_algorithm
from .fedavg import (
    FedAvgClient,
    _check_precision,
    _to_device,
    sgd_epochs,
    shuffle_generator,
)
from .fedproto import PrototypeSums, prototype_mse, prototype_table

#: λ, the weight of the prototype-alignment term (SPECS §1.4, from the paper; the code uses 1).
DEFAULT_LAMBDA_PROTO = 0.1

#: How the prototype term is scaled (:func:`prototype_alignment_loss`): the mean over the F
#: features (``"mse"``, ``nn.MSELoss`` of the reference code; the default) or their sum (``"sum"``).
PROTO_LOSSES = ("mse", "sum")
DEFAULT_PROTO_LOSS = "mse"

#: Names of the update extras a FedPAD client sends and of the global extras it reads.
PROTOTYPES, PROTO_CLASSES, PROTO_COUNTS = "prototypes", "proto_classes", "proto_counts"


@torch.no_grad()
def model_prototypes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, *,
                     batch_size: int = 1000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Class prototypes of ``model.features`` over a whole shard, in eval mode, without gradients.

    Args:
        model: with ``features(x) -> [N, F]`` (the light CNN), on ``device``; left in eval mode.
        x: float32 [N, C, H, W] (CPU; moved to ``device`` batch by batch).
        y: int64 [N].
        device: where the model lives.
        batch_size: images per forward pass (memory only; the result does not depend on it
            beyond float32 rounding of the features themselves).

    Returns:
        ``(prototypes, classes, counts)``: float32 [k, F] (class means, summed in float64),
        int64 [k] (ascending, the k distinct labels), int64 [k] (samples per class, ≥ 1). A
        class without samples never appears (no zero/NaN rows); N = 0 gives k = 0.

    Raises:
        ValueError: ``batch_size`` < 1; a label outside [0, model.num_classes).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    model.eval()
    device = torch.device(device)
    fm = cast(FeatureModel, model)
    sums = PrototypeSums(int(fm.num_classes))
    for s in range(0, int(x.shape[0]), batch_size):
        sums.add(fm.features(_to_device(x[s:s + batch_size], device)), _to_device(y[s:s + batch_size], device))
    return sums.result()


def prototype_alignment_loss(features: torch.Tensor, labels: torch.Tensor, table: torch.Tensor,
                             has: torch.Tensor, scale: str = DEFAULT_PROTO_LOSS) -> torch.Tensor:
    """FedPAD's instance-to-prototype term (SPECS §1.3 step 2), in one of two scales:

    - ``"mse"`` (default): ``L_proto = (1/(B·F)) Σ_{b : has[y_b]} ||z_b − p_g^{(y_b)}||²₂``, the
      element mean of ``nn.MSELoss`` over the batch's B·F entries — what the reference code
      (Leyuan111/FedPAD, RethinkFL's ``MSELoss``) computes, and FedProto's
      :func:`~edge_agent.algorithms.fedproto.prototype_mse`;
    - ``"sum"``: ``L_proto = (1/B) Σ_{b : has[y_b]} ||z_b − p_g^{(y_b)}||²₂``, the per-sample squared
      norm summed over the F features, as SPECS writes the formula: F times ``"mse"``.

    Why the default is ``"mse"``: with λ = 0.1 the two differ by a factor F in the weight of the
    term (F = 64 for the light CNN: λ·F = 6.4 under ``"sum"``), and the reference code's
    ``MSELoss`` is the element mean. In the Digits domain-silo reproduction at lr 0.05 (the records
    of ``benchmarks/fedpad.md`` made before this key existed, i.e. ``"sum"``) two of three seeds
    jumped in training loss in round 2, when the term first applies, and ended at chance level.
    ``"sum"`` stays available as the formula read literally; ``tools/reproduce_fedpad.py`` sweeps
    both scales and λ.

    Samples whose class has no global prototype contribute 0 but still count in B (the FedProto
    code convention); when every class has one — FedPAD from round 2 on under full
    participation — ``"sum"`` is exactly ``mean_over_batch ||g_w(x) − p_g^{(y)}||²``.

    Args:
        features: z, float [B, F] (differentiable).
        labels: int64 [B].
        table: float32 [C, F] from :func:`~edge_agent.algorithms.fedproto.prototype_table`.
        has: bool [C], the classes with a global prototype.
        scale: ``"mse"`` or ``"sum"`` (:data:`PROTO_LOSSES`).

    Returns:
        A float32 scalar tensor (0 for B = 0 or no sample with a prototype).

    Raises:
        ValueError: ``scale`` not one of :data:`PROTO_LOSSES`.
    """
    if scale not in PROTO_LOSSES:
        raise ValueError(f"proto_loss must be one of {PROTO_LOSSES}, got {scale!r}")
    if features.shape[0] == 0:
        return features.float().sum() * 0.0
    mse = prototype_mse(features, labels, table, has)
    return mse if scale == "mse" else features.shape[1] * mse


@register_client_algorithm("fedpad")
class FedPADClient(FedAvgClient):
    """FedPAD client: local SGD on CE + λ·L_proto, then class prototypes of the trained model.

    Reads ``lambda_proto`` (λ, default 0.1) and ``proto_loss`` (``"mse"`` default, or ``"sum"``;
    :func:`prototype_alignment_loss`) from the round config (``params``) and the global
    prototypes from ``global_extras`` (``prototypes`` float [K, F], ``proto_classes`` int [K]);
    ``lambda_proto = 0`` is the λ = 0 ablation (plain CE, prototypes still uploaded).

    Upload per round: the whole model (float32, as FedAvg) and the extras ``prototypes`` float32
    [k, F], ``proto_classes`` int64 [k], ``proto_counts`` int64 [k] for the k ≤ C classes present:
    for the light CNN (F = 64) and 10 classes at most 10·64·4 + 10·8 + 10·8 = 2,720 bytes of
    tensor data.

    The model must have ``features(x) -> [N, F]``, ``head(z) -> [N, C]`` and ``num_classes``
    (:class:`edge_agent.models.LightCNN`).

    Args:
        precision: ``"fp32"`` (default) or ``"fp16"`` (CUDA autocast), as for FedAvg; prototypes
            are always computed in float32.

    Raises:
        ValueError: unknown ``precision``.
    """

    name = "fedpad"
    share = "all"
    buffers = "average"


    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_id: str = "", client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """Load the global model, train on CE + λ·L_proto, compute prototypes, return both.

        Returns:
            LocalResult: the trained model's arrays (manifest order), ``num_samples = len(y)``,
            ``train_loss`` = mean CE + λ·L_proto over the last epoch, metrics ``train_accuracy``,
            ``train_seconds``, ``proto_classes_aligned`` (classes with a global prototype), and
            the three prototype extras. A shard of zero samples trains nothing and returns
            ``num_samples = 0`` with empty prototype arrays (the agent does not send it).

        Raises:
            ModelError: ``global_tensors`` do not match the model.
            ModelError: malformed global prototypes (mismatched lengths, class ids outside
                [0, C) or repeated, a feature width other than the model's).
            ValueError: ``fp16`` on a non-CUDA device; ``batch_size`` < 1; ``lambda_proto``
                negative or not finite; ``proto_loss`` not one of :data:`PROTO_LOSSES`.
        """
        _check_precision(self.precision, device)
        t0 = time.perf_counter()
        device = torch.device(device)
        params = params or {}
        extras = global_extras or {}
        lam = float(cast(FloatLike, params.get("lambda_proto", DEFAULT_LAMBDA_PROTO)))
        if not np.isfinite(lam) or lam < 0:
            raise ValueError(f"lambda_proto must be finite and ≥ 0, got {lam}")
        scale = str(params.get("proto_loss", DEFAULT_PROTO_LOSS))
        if scale not in PROTO_LOSSES:
            raise ValueError(f"proto_loss must be one of {PROTO_LOSSES}, got {scale!r}")
        fm = cast(FeatureModel, model)
        table: torch.Tensor | None = None
        has: torch.Tensor | None = None  # set together with table
        if PROTOTYPES in extras and PROTO_CLASSES in extras:
            table, has = prototype_table(extras[PROTOTYPES], extras[PROTO_CLASSES], int(fm.num_classes), device)
            if table.shape[1] != int(fm.feature_dim):
                raise ModelError(f"global prototypes have {table.shape[1]} features, the model has {fm.feature_dim}")
        self.load_global(model, global_tensors)

        loss_fn = None
        if table is not None and has is not None and lam > 0 and bool(has.any()):
            def loss_fn(m: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                net = cast(FeatureModel, m)
                z = net.features(xb)
                logits = net.head(z)
                return F.cross_entropy(logits, yb) + lam * prototype_alignment_loss(z, yb, table, has, scale), logits

        loss, acc = sgd_epochs(model, x, y, config, shuffle_generator(config.seed, round, client_index), device,
                               precision=self.precision, loss_fn=loss_fn,
                               before_step=step_hook(self), step_round=round)
        protos, classes, counts = model_prototypes(model, x, y, device, batch_size=max(config.batch_size, 256))
        return LocalResult(
            tensors=self.upload_tensors(model), num_samples=int(y.shape[0]), train_loss=loss,
            metrics={"train_accuracy": acc, "train_seconds": time.perf_counter() - t0,
                     "proto_classes_aligned": int(has.sum()) if has is not None and loss_fn is not None else 0},
            extras={PROTOTYPES: protos, PROTO_CLASSES: classes, PROTO_COUNTS: counts})
