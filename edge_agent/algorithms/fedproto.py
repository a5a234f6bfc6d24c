"""FedProto, client half (Tan et al., "FedProto: Federated Prototype Learning across
Heterogeneous Clients", AAAI 2022; SPECS.md §6.1; code conventions of HtFLlib/PFLlib
``clientproto.py``).

Each round the device trains its private model on

    L = CE(h(z), y) + λ · MSE(z, T),     z = g(x) ∈ R^{B×d}

where row b of the target T is the global prototype P_{y_b} when the server has one for class
y_b, else z_b itself (detached), so that row adds nothing; the MSE is the mean over all B·d
entries (``nn.MSELoss`` as in HtFLlib). In round 1 (no global prototypes) L = CE. The local
prototype of class c is the mean feature of class c over **every training step of the round**
(all epochs), the convention of SPECS §6.1; only classes present locally are sent, with their
class ids and sample counts.

Two registered names share this file:

* ``fedproto`` (``share = "none"``): only prototypes travel; the model never leaves the device
  (HtFLlib/PFLlib). Inference (:meth:`FedProtoClient.predict`) is the nearest global prototype.
* ``fedproto-avg`` (``share = "all"``): the RethinkFL variant against which FedPAD is compared
  (Huang et al., CVPR'23 code ``models/fedproto.py``): the same local objective and prototypes,
  but the model is also FedAvg-averaged and evaluated with its own classifier head. ``share`` is a
  class attribute the agent reads before training, hence a second name rather than a parameter.

Uploaded extras (both names): ``prototypes`` float32 [k, d], ``proto_classes`` int64 [k]
(ascending, unique), ``proto_counts`` int64 [k] (features averaged per class, ≥ 1), k = number of
classes present. Received extras: ``prototypes`` float32 [K, d] and ``proto_classes`` int64 [K].
Hyperparameter (``round_start.config``): ``lambda_proto`` (λ, default 1.0; HtFLlib's scripts use 10).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Mapping
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ModelError
from ._base import ClientAlgorithm, FeatureModel, FloatLike, LocalResult, TrainConfig, step_hook
from ._registry import register_client_algorithm
from .fedavg import _check_precision, sgd_epochs, shuffle_generator


class PrototypeSums:
    """Per-class running sums of features: the local prototypes p_c = (1/n_c) Σ_{i: y_i = c} z_i.

    Sums are kept in float64 on the features' device (one [C, d] table), so the order of the
    batches does not change the result beyond float64 rounding.

    Args:
        num_classes: C; labels must lie in [0, C).
    """

    def __init__(self, num_classes: int) -> None:
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.num_classes = int(num_classes)
        self._sums: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None

    def add(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch: ``features`` [B, d] (any float dtype; detached here), ``labels`` int64 [B].

        Raises:
            ValueError: shapes disagree, a label outside [0, C), or d differs from earlier batches.
        """
        if features.dim() != 2 or labels.dim() != 1 or features.shape[0] != labels.shape[0]:
            raise ValueError(f"features [B, d] and labels [B] expected, got {list(features.shape)} and "
                             f"{list(labels.shape)}")
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes}), got [{int(labels.min())}, "
                             f"{int(labels.max())}]")
        z = features.detach().to(torch.float64)
        if self._sums is None or self._counts is None:  # both are set together, on the first batch
            self._sums = torch.zeros(self.num_classes, z.shape[1], dtype=torch.float64, device=z.device)
            self._counts = torch.zeros(self.num_classes, dtype=torch.int64, device=z.device)
        elif z.shape[1] != self._sums.shape[1]:
            raise ValueError(f"feature width {z.shape[1]} differs from the earlier {self._sums.shape[1]}")
        self._sums.index_add_(0, labels, z)
        self._counts.index_add_(0, labels, torch.ones_like(labels))

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The prototypes of the classes seen so far.

        Returns:
            (prototypes float32 [k, d], classes int64 [k] ascending, counts int64 [k] ≥ 1); k = 0
            (shapes [0, 0], [0], [0]) when nothing was added.
        """
        if self._sums is None or self._counts is None:  # both are set together, on the first batch
            return np.zeros((0, 0), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
        counts = self._counts.cpu()
        present = torch.nonzero(counts > 0).flatten()
        sums = self._sums.cpu()[present]
        n = counts[present]
        protos = (sums / n.unsqueeze(1).to(torch.float64)).to(torch.float32)
        return protos.numpy(), present.to(torch.int64).numpy(), n.numpy().astype(np.int64)


def prototype_table(prototypes: np.ndarray, classes: np.ndarray, num_classes: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter received prototypes into a dense table.

    Args:
        prototypes: float [K, d].
        classes: int [K], unique, in [0, num_classes).
        num_classes: C.
        device: where the table goes.

    Returns:
        (table float32 [C, d] with zeros in rows without a prototype, mask bool [C]).

    Raises:
        ModelError: shapes disagree, a class out of range or repeated.
    """
    p = np.asarray(prototypes)
    c = np.asarray(classes)
    if p.ndim != 2 or c.ndim != 1 or p.shape[0] != c.shape[0]:
        raise ModelError(f"prototypes [K, d] with classes [K] expected, got {p.shape} and {c.shape}")
    if c.size and (c.min() < 0 or c.max() >= num_classes or np.unique(c).size != c.size):
        raise ModelError(f"prototype classes must be unique and in [0, {num_classes}), got {c.tolist()}")
    table = torch.zeros(num_classes, p.shape[1], dtype=torch.float32, device=device)
    mask = torch.zeros(num_classes, dtype=torch.bool, device=device)
    idx = torch.as_tensor(c.astype(np.int64), device=device)
    table[idx] = torch.as_tensor(p.astype(np.float32), device=device)
    mask[idx] = True
    return table, mask


def prototype_mse(features: torch.Tensor, labels: torch.Tensor, table: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """FedProto's regulariser MSE(z, T) (SPECS §6.1; HtFLlib ``clientproto``).

    T_b = table[y_b] where ``mask[y_b]``, else z_b (detached: no contribution, but the row still
    counts in the mean). The mean runs over all B·d entries.

    Args:
        features: z, float [B, d].
        labels: int64 [B].
        table, mask: from :func:`prototype_table` ([C, d] float32, [C] bool).

    Returns:
        Scalar tensor (float32), differentiable in ``features``.
    """
    has = mask[labels]
    target = torch.where(has.unsqueeze(1), table[labels].to(features.dtype), features.detach())
    return F.mse_loss(features.float(), target.float())


def nearest_prototype_scores(features: torch.Tensor, table: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Class scores for nearest-prototype inference: score[n, c] = −‖z_n − P_c‖²₂, and −inf for
    classes without a prototype (FedProto inference, SPECS §6.1; the argmax is the nearest prototype).

    Args:
        features: z, float [N, d].
        table, mask: [C, d], [C] (see :func:`prototype_table`).

    Returns:
        float32 [N, C].
    """
    diff = features.float().unsqueeze(1) - table.unsqueeze(0)  # [N, C, d]
    scores = -(diff * diff).sum(dim=2)
    return scores.masked_fill(~mask.unsqueeze(0), float("-inf"))


def _num_classes(model: torch.nn.Module) -> int:
    """C: the model's ``num_classes``, else the rows of its ``classifier.weight`` [C, d] (the entry
    every fedfleet model has, :func:`edge_agent.models.check_model`).

    Raises:
        ModelError: neither gives a positive class count.
    """
    n = getattr(model, "num_classes", None)
    if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
        return n
    w = model.state_dict().get("classifier.weight")
    if w is not None and w.dim() == 2 and int(w.shape[0]) >= 1:
        return int(w.shape[0])
    raise ModelError("prototype algorithms need a model with features(x), head(z) and a classifier.weight [C, d] "
                     "entry (or num_classes), as LightCNN")


class PrototypeClient(ClientAlgorithm, abc.ABC):
    """Shared client loop of the prototype methods (FedProto, FPL): load the shared tensors, run
    :func:`~edge_agent.algorithms.fedavg.sgd_epochs` on CE + the method's feature term, collect
    the class prototypes from the training forward passes, upload them as extras.

    Subclasses set ``share`` and implement :meth:`feature_loss`; ``prototypes_from_last_epoch``
    chooses between the features of every step of the round (FedProto, ``False``) and those of
    the last local epoch only (FPL, ``True``: each sample once).

    Args:
        precision: ``"fp32"`` or ``"fp16"`` (CUDA autocast), as for FedAvg.

    Raises:
        ValueError: unknown ``precision``.
    """

    share = "none"
    borrows_model = True  # its model between rounds is its state entries (ClientAlgorithm)
    prototypes_from_last_epoch = False

    def __init__(self, *, precision: str = "fp32") -> None:
        _check_precision(precision)
        self.precision = precision
        self.local_prototypes: tuple[np.ndarray, np.ndarray] | None = None

    @abc.abstractmethod
    def feature_loss(self, global_extras: Mapping[str, np.ndarray], params: Mapping[str, object],
                     num_classes: int, device: torch.device):
        """The method's term added to CE, as ``term(z [B, d], y int64 [B]) -> scalar tensor``,
        or ``None`` for CE alone (e.g. round 1, before any global prototype)."""

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_id: str = "", client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """Load the shared tensors, train on CE + :meth:`feature_loss`, return the local
        prototypes as extras (and the shared model tensors).

        Returns:
            :class:`LocalResult` with ``tensors`` = the shared subset (``()`` for share
            ``"none"``), ``num_samples = len(y)``, ``train_loss`` = mean total loss of the last
            epoch, extras ``prototypes`` float32 [k, d], ``proto_classes`` int64 [k] ascending,
            ``proto_counts`` int64 [k] (features averaged per class), metrics
            ``train_accuracy``, ``train_seconds``.

        Raises:
            ModelError: the model lacks ``features``/``head`` or a class count (``num_classes``,
                else ``classifier.weight`` rows); malformed global extras; ``global_tensors`` do not
                match the model.
            ValueError: ``precision="fp16"`` on a non-CUDA device; a bad hyperparameter.
        """
        _check_precision(self.precision, device)
        t0 = time.perf_counter()
        num_classes = _num_classes(model)
        self.load_global(model, global_tensors)
        term = self.feature_loss(global_extras or {}, params or {}, num_classes, torch.device(device))
        n = int(y.shape[0])
        steps_per_epoch = -(-n // max(1, config.batch_size))
        first_recorded = (max(1, config.local_epochs) - 1) * steps_per_epoch if self.prototypes_from_last_epoch else 0
        sums = PrototypeSums(num_classes)
        step = 0

        def loss_fn(m: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal step
            fm = cast(FeatureModel, m)
            z = fm.features(xb)
            logits = fm.head(z)
            loss = F.cross_entropy(logits, yb)
            if term is not None:
                loss = loss + term(z, yb)
            if step >= first_recorded:  # sgd_epochs: ceil(N / B) batches per epoch, in order
                sums.add(z, yb)
            step += 1
            return loss, logits

        loss, acc = sgd_epochs(model, x, y, config, shuffle_generator(config.seed, round, client_index), device,
                               precision=self.precision, loss_fn=loss_fn,
                               before_step=step_hook(self), step_round=round)
        protos, classes, counts = sums.result()
        if protos.shape[0]:
            self.local_prototypes = (protos, classes)
        return LocalResult(tensors=self.upload_tensors(model), num_samples=n, train_loss=loss,
                           metrics={"train_accuracy": acc, "train_seconds": time.perf_counter() - t0},
                           extras={"prototypes": protos, "proto_classes": classes, "proto_counts": counts})


@register_client_algorithm("fedproto")
class FedProtoClient(PrototypeClient):
    """FedProto client: private model, prototypes up, global prototypes down (module docstring).

    State kept between rounds on the device: the latest global prototypes (for :meth:`predict`)
    and the last round's local prototypes (the fallback of :meth:`predict` before any global
    prototype exists). The model itself persists in the agent (``share = "none"``).

    Args:
        precision: ``"fp32"`` or ``"fp16"`` (CUDA autocast), as for FedAvg.

    Raises:
        ValueError: unknown ``precision``.
    """

    name = "fedproto"
    share = "none"
    buffers = "average"


    def __init__(self, *, precision: str = "fp32") -> None:
        super().__init__(precision=precision)
        self.global_prototypes: tuple[np.ndarray, np.ndarray] | None = None

    def feature_loss(self, global_extras: Mapping[str, np.ndarray], params: Mapping[str, object],
                     num_classes: int, device: torch.device):
        """λ · :func:`prototype_mse` against the round's global prototypes (``prototypes`` [K, d],
        ``proto_classes`` [K]); ``None`` in round 1 or with ``lambda_proto`` = 0.

        Raises:
            ValueError: ``params["lambda_proto"]`` (default 1.0) < 0.
            ModelError: malformed global prototypes.
        """
        lam = float(cast(FloatLike, params.get("lambda_proto", 1.0)))
        if not lam >= 0:
            raise ValueError(f"lambda_proto must be >= 0, got {lam}")
        self.global_prototypes = None
        if "prototypes" in global_extras and "proto_classes" in global_extras and len(global_extras["proto_classes"]):
            self.global_prototypes = (np.asarray(global_extras["prototypes"]),
                                      np.asarray(global_extras["proto_classes"]))
        if self.global_prototypes is None or lam == 0:
            return None
        table, mask = prototype_table(*self.global_prototypes, num_classes, device)
        return lambda z, yb: lam * prototype_mse(z, yb, table, mask)

    def predict(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Scores [N, C] float32 = −‖features(x) − P_c‖²₂ over the latest global prototypes P
        (−inf for classes without one), so the argmax is the nearest global prototype.

        Before any global prototype exists (client evaluation in round 1) the device's own
        prototypes of its last round stand in (HtFLlib reports accuracy 0 there instead);
        with neither, every score is −inf.

        Raises:
            ModelError: as :meth:`local_round`.
        """
        num_classes = _num_classes(model)
        protos = self.global_prototypes if self.global_prototypes is not None else self.local_prototypes
        dev = next(model.parameters()).device
        if protos is None:
            return torch.full((int(x.shape[0]), num_classes), float("-inf"), device=dev)
        table, mask = prototype_table(*protos, num_classes, dev)
        with torch.no_grad():
            return nearest_prototype_scores(cast(FeatureModel, model).features(x.to(dev)), table, mask)


@register_client_algorithm("fedproto-avg")
class FedProtoAvgClient(FedProtoClient):
    """FedProto as run in RethinkFL (Huang et al., CVPR'23 code) and FedPAD's comparison: the
    FedProto objective and prototypes, plus the whole model uploaded for FedAvg averaging
    (``share = "all"``); evaluation uses the model's own head (logits), not prototypes."""

    name = "fedproto-avg"
    share = "all"
    buffers = "average"


    def predict(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Logits ``model(x)`` [N, C] (the global model evaluated with its head)."""
        dev = next(model.parameters()).device
        with torch.no_grad():
            return model(x.to(dev))
