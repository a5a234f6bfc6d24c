"""FedMCP++, client half: zero-parameter collaboration through soft predictions and prototypes.

SPECS.md §5 (FedMCP++, *Sensors*; no public code, the architecture is reconstructed in §5.1).
Every device keeps a whole private model — the light CNN backbone, a private expert head
(:class:`~edge_agent.models.LightCNN`'s ``classifier``, ``Linear(64, 10)``) and two private
projections ``P_s: R^64 → R^32`` (features) and ``P_t: R^10 → R^32`` (teacher soft predictions)
held by the :class:`FedMCPClient` instance. No parameter ever leaves the device
(``share = "none"``). What travels, per round and client (SPECS §5.2), computed on a public
**proxy set** of P labelled test samples (default 1000, :func:`edge_agent.data.proxy_split`,
excluded from evaluation):

* ``soft_predictions`` float32 ``[P, C]`` = ``softmax(head(backbone(x)) / T)``, T = 1.5;
* ``prototypes`` float32 ``[C, d]`` = per-class mean backbone feature over the proxy samples of
  that class (by the proxy labels).

With C = 10, d = 64, P = 1000 and the fp32 codec that is 40,000 + 2,560 = **42,560 tensor bytes**.
The server (``broker_server/strategies/fedmcp.py``) returns an accuracy-weighted teacher
``p_T`` ``[P, C]`` and ``P_T`` ``[C, d]`` as the extras ``teacher_soft_predictions`` and
``teacher_prototypes`` of the next ``global``.

One round of a device (SPECS §5.4; the task fixes this order, which gives the same sequence of
steps as the seed's "local CE → upload → receive teacher → KD → InfoNCE → prototype step"):

1. when a teacher came with the round's ``global`` (not in round 1), on the proxy set:
   (a) **KD**: ``align_epochs`` passes of mini-batch SGD on ``kd_weight · T² · KL(p_T ‖ p_i)``
   (:func:`distillation_loss`); (b) **InfoNCE**: ``align_epochs`` passes on
   ``infonce_weight · L_NCE`` with anchor ``P_s(features(x_b))``, positive ``P_t(p_T(x_b))`` of
   the same sample, the other samples of the batch as negatives, cosine similarity and
   temperature τ = 1.5 (:func:`info_nce_loss`); (c) **prototype alignment**: one gradient step
   on ``α · Σ_c ||P_i,c − P_T,c||²`` with the prototypes recomputed differentiably on the proxy
   set (:func:`prototype_alignment_backward`);
2. **local cross-entropy**: ``local_epochs`` (1) epochs of SGD with momentum on the private
   shard (:func:`~edge_agent.algorithms.fedavg.sgd_epochs`);
3. the upload: soft predictions and prototypes on the proxy set, through ONNX Runtime when it
   is installed and ``onnx_soft_predictions`` is on (the exported model is the one just
   trained), else torch; the metric ``soft_predictions_backend`` says which ran.

Every stage can be switched off (``kd``, ``infonce``, ``proto_align``; the seed advises
switching prototype alignment off for data-scarce RGB sets). Hyperparameters arrive in the
round's config (the strategy puts them there, see :class:`FedMCPParams`); the alignment stages
use the round's ``lr``, ``momentum`` and ``weight_decay`` and batches of ``proxy_batch_size``.
[guess, SPECS §5.4: loss weights, α, the KD/InfoNCE passes and batch size are not in the seed.]
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import tempfile
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data import PROXY_SIZE, ArraySplit, Dataset, proxy_split
from ..errors import ModelError
from ..models.training import train_mode
from ._base import ClientAlgorithm, FeatureModel, IntLike, LocalResult, TrainConfig, step_hook
from ._registry import register_client_algorithm
from .fedavg import _check_precision, _to_device, sgd_epochs, shuffle_generator

log = logging.getLogger(__name__)

#: Names of what a FedMCP++ client uploads (``LocalResult.extras``).
UPLOAD_EXTRAS = ("soft_predictions", "prototypes")
#: Names of the teacher the server broadcasts (``Global.extras``).
TEACHER_EXTRAS = ("teacher_soft_predictions", "teacher_prototypes")
#: KL directions of the distillation term: ``"forward"`` = KL(p_T ‖ p_i) (Hinton et al. 2015,
#: the standard; default), ``"reverse"`` = KL(p_i ‖ p_T) (the formula as the seed writes it).
KD_DIRECTIONS = ("forward", "reverse")


# --------------------------------------------------------------------------------------------
# Hyperparameters and the proxy set
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FedMCPParams:
    """The FedMCP++ hyperparameters shared by the strategy (from the ``[algorithm]`` table) and
    the clients (from the round's config). Defaults: SPECS.md §5.2/§5.4.

    Attributes:
        kd: run the distillation stage (1a).
        kd_weight: weight of ``T² · KL`` (1.0 [guess]).
        kd_direction: one of :data:`KD_DIRECTIONS` (``"forward"``, KL(p_T ‖ p_i) [guess: the seed
            writes KL(p_i ‖ p_T), SPECS §5.4 chooses the standard direction]).
        temperature: T of the soft predictions and of the KD term, > 0 (1.5 [seed]).
        infonce: run the InfoNCE stage (1b).
        infonce_weight: weight of the InfoNCE loss (1.0 [guess]).
        tau_nce: InfoNCE temperature τ, > 0 (1.5 [seed]).
        proto_align: run the one prototype-alignment step (1c).
        alpha_proto: α of ``α · Σ_c ||P_i,c − P_T,c||²`` (a sum over the C × d entries), ≥ 0
            (0.01 [guess: not in the seed]; measured here with lr 0.05, momentum 0.9, one step:
            on MNIST, 10 IID clients, 3 rounds, mean client accuracy 0.964 with every stage and
            α = 0.01 vs 0.959 for Local, but 0.825 with α = 0.1; α = 1 sent 3 digits clients to
            chance level — the step's gradient is ~10× the backbone's weight norm there).
        proxy_batch_size: mini-batch size on the proxy set, ≥ 1 (64 [guess]).
        align_epochs: passes over the proxy set of each of the KD and InfoNCE stages, ≥ 1 (1 [guess]).
        onnx_soft_predictions: compute the upload through ONNX Runtime when available.

    Raises:
        ValueError: a value of the wrong type or out of range (the message names it).
    """

    kd: bool = True
    kd_weight: float = 1.0
    kd_direction: str = "forward"
    temperature: float = 1.5
    infonce: bool = True
    infonce_weight: float = 1.0
    tau_nce: float = 1.5
    proto_align: bool = True
    alpha_proto: float = 0.01
    proxy_batch_size: int = 64
    align_epochs: int = 1
    onnx_soft_predictions: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "bool" and type(v) is not bool:
                raise ValueError(f"{f.name} must be true or false, got {v!r}")
            if f.type == "int" and (type(v) is not int or v < 1):
                raise ValueError(f"{f.name} must be an integer >= 1, got {v!r}")
            if f.type == "float" and (isinstance(v, bool) or not isinstance(v, int | float)
                                      or not math.isfinite(v) or v < 0):
                raise ValueError(f"{f.name} must be a finite number >= 0, got {v!r}")
        for name in ("temperature", "tau_nce"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.kd_direction not in KD_DIRECTIONS:
            raise ValueError(f"kd_direction must be one of {KD_DIRECTIONS}, got {self.kd_direction!r}")

    @classmethod
    def from_mapping(cls, params: Mapping[str, object], defaults: Mapping[str, object] | None = None) -> FedMCPParams:
        """The hyperparameters named in ``params`` over ``defaults`` over the class defaults;
        other keys (the round's ``lr``, ``update_codec`` …) are ignored. Integers are accepted
        for float fields and 0/1 for booleans (a round config may carry either).

        Raises:
            ValueError: as the constructor.
        """
        kw: dict[str, Any] = {}  # values as they came; __post_init__ checks each field's type
        for f in dataclasses.fields(cls):
            for source in (defaults or {}, params):
                if f.name in source:
                    v = source[f.name]
                    if f.type == "float" and isinstance(v, int) and not isinstance(v, bool):
                        v = float(v)
                    if f.type == "bool" and type(v) is int and v in (0, 1):
                        v = bool(v)
                    kw[f.name] = v
        return cls(**kw)

    def as_config(self) -> dict[str, bool | int | float | str]:
        """The hyperparameters as ``round_start.config`` scalars."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def proxy_sets(dataset: Dataset, params: Mapping[str, object], seed: int) -> tuple[ArraySplit, ArraySplit]:
    """The public proxy set and the evaluation rest of ``dataset.test`` for a run:
    :func:`edge_agent.data.proxy_split` with ``size = params["proxy_size"]`` (default
    :data:`~edge_agent.data.PROXY_SIZE`, 1000) and ``seed = params["proxy_seed"]`` (default: the
    run seed). The server and every agent call this with the same arguments.

    Raises:
        DataError: a size outside ``[1, len(test))``.
        ValueError: ``proxy_size`` / ``proxy_seed`` not integers.
    """
    size = _int_param("proxy_size", params.get("proxy_size", PROXY_SIZE))
    pseed = _int_param("proxy_seed", params.get("proxy_seed", seed))
    return proxy_split(dataset.test, size, pseed)


def _int_param(name: str, v: object) -> int:
    """``v`` as an ``int``; ValueError naming ``name`` when it is not an integer (a bool is not)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return int(v)


def proxy_digest(proxy_y: np.ndarray) -> str:
    """Fingerprint of a proxy set: the first 16 hex characters of the SHA-256 of its labels
    (int64, little-endian). Server and clients compare it to catch a proxy drawn with another
    size or seed (their soft predictions would be matched against the wrong samples)."""
    return hashlib.sha256(np.ascontiguousarray(proxy_y, dtype="<i8").tobytes()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Pure math (tensors in, tensors out)
# --------------------------------------------------------------------------------------------


def distillation_loss(student_logits: torch.Tensor, teacher_probs: torch.Tensor, temperature: float,
                      direction: str = "forward") -> torch.Tensor:
    """Temperature-scaled distillation loss ``T² · KL`` averaged over the batch.

    Hinton et al., "Distilling the Knowledge in a Neural Network", 2015, §2 (the T² factor keeps
    the gradient scale independent of T); SPECS.md §5.4 (1). With ``p_i = softmax(z / T)``:

    * ``"forward"``: ``T² · mean_b Σ_c p_T[b,c] · (log p_T[b,c] − log p_i[b,c])`` = T²·KL(p_T ‖ p_i)
      (a zero teacher entry contributes 0: ``0 · log 0 = 0``);
    * ``"reverse"``: ``T² · mean_b Σ_c p_i[b,c] · (log p_i[b,c] − log p_T[b,c])`` = T²·KL(p_i ‖ p_T),
      the seed's formula; teacher entries are clamped to ≥ 1e-12 inside the log.

    Args:
        student_logits: float ``[B, C]``, unnormalised (differentiable).
        teacher_probs: float ``[B, C]``, rows on the simplex (a constant: not differentiated).
        temperature: T > 0.
        direction: one of :data:`KD_DIRECTIONS`.

    Returns:
        A scalar tensor (nats × T²); 0 for B = 0.

    Raises:
        ValueError: unknown ``direction``, shape mismatch, T ≤ 0.
    """
    if direction not in KD_DIRECTIONS:
        raise ValueError(f"direction must be one of {KD_DIRECTIONS}, got {direction!r}")
    if student_logits.shape != teacher_probs.shape or student_logits.dim() != 2:
        raise ValueError(f"student logits {list(student_logits.shape)} and teacher {list(teacher_probs.shape)} "
                         "must both be [B, C]")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if student_logits.shape[0] == 0:
        return student_logits.sum() * 0.0
    log_p = F.log_softmax(student_logits / temperature, dim=1)
    teacher = teacher_probs.detach().to(log_p.dtype)
    if direction == "forward":
        kl = (torch.xlogy(teacher, teacher) - teacher * log_p).sum(1)
    else:
        kl = (log_p.exp() * (log_p - teacher.clamp_min(1e-12).log())).sum(1)
    return temperature ** 2 * kl.mean()


def info_nce_loss(anchors: torch.Tensor, positives: torch.Tensor, tau: float) -> torch.Tensor:
    """InfoNCE with in-batch negatives and cosine similarity (SPECS.md §5.4 (2); van den Oord
    et al., "Representation Learning with Contrastive Predictive Coding", 2018, eq. 4):

    ``L = mean_b −log( exp(cos(u_b, v_b)/τ) / Σ_{b'} exp(cos(u_b, v_{b'})/τ) )``

    i.e. the cross-entropy of the similarity matrix ``S[b, b'] = cos(u_b, v_{b'}) / τ`` against
    the diagonal. [guess: cosine rather than dot product.]

    Args:
        anchors: ``u`` float ``[B, k]`` (``P_s(features)``).
        positives: ``v`` float ``[B, k]`` (``P_t(teacher soft predictions)``), row b the
            positive of anchor b, the other rows its negatives.
        tau: τ > 0.

    Returns:
        A scalar tensor (nats); exactly 0 for B = 1 (no negatives), 0 for B = 0.

    Raises:
        ValueError: shape mismatch, τ ≤ 0.
    """
    if anchors.shape != positives.shape or anchors.dim() != 2:
        raise ValueError(f"anchors {list(anchors.shape)} and positives {list(positives.shape)} must both be [B, k]")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if anchors.shape[0] == 0:
        return anchors.sum() * 0.0
    sim = F.normalize(anchors, dim=1) @ F.normalize(positives, dim=1).T / tau
    return F.cross_entropy(sim, torch.arange(anchors.shape[0], device=anchors.device))


def class_prototypes(features: torch.Tensor, labels: torch.Tensor,
                     num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class mean feature (FedProto, Tan et al., AAAI 2022, eq. 5:
    ``c_k = (1/|D_k|) Σ_{(x,y)∈D_k} f(x)``); differentiable with respect to ``features``.

    Args:
        features: float ``[N, d]``.
        labels: int64 ``[N]`` in ``[0, num_classes)``.
        num_classes: C ≥ 1.

    Returns:
        ``(protos, counts)``: ``protos`` ``[C, d]`` in ``features``' dtype, a **zero row** for a
        class without samples; ``counts`` int64 ``[C]``.

    Raises:
        ValueError: shapes, or a label out of range.
    """
    if features.dim() != 2 or labels.dim() != 1 or labels.shape[0] != features.shape[0]:
        raise ValueError(f"features [N, d] and labels [N] expected, got {list(features.shape)} and "
                         f"{list(labels.shape)}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes})")
    counts = torch.bincount(labels, minlength=num_classes)
    sums = features.new_zeros((num_classes, features.shape[1])).index_add(0, labels, features)
    return sums / counts.clamp_min(1).to(features.dtype).unsqueeze(1), counts


def prototype_alignment_backward(features_fn, x: torch.Tensor, labels: torch.Tensor, teacher_protos: torch.Tensor,
                                 alpha: float, *, batch_size: int, device: torch.device) -> float:
    """Accumulate into ``.grad`` the gradient of ``α · Σ_{c present} ||P_c − P_T,c||²`` where
    ``P_c`` is the mean of ``features_fn(x)`` over the samples of class c (SPECS.md §5.4 (3)).

    Memory stays one mini-batch of activations (the device may be a Raspberry Pi): pass 1
    computes the prototypes without a graph; pass 2 back-propagates, batch by batch,
    ``Σ_n g_n · f(x_n)`` with the constant ``g_n = 2α (P_{y_n} − P_T,{y_n}) / |D_{y_n}|``, whose
    gradient equals that of the loss (∂L/∂f(x_n) = g_n). Classes without proxy samples are left
    out (their teacher row carries no information).

    Args:
        features_fn: ``x [B, ...] -> features [B, d]`` (``model.features``).
        x: proxy inputs float32 ``[P, ...]`` (CPU; batches are moved to ``device``).
        labels: proxy labels int64 ``[P]`` (CPU).
        teacher_protos: ``P_T`` float32 ``[C, d]`` (on ``device``).
        alpha: α ≥ 0.
        batch_size: samples per forward pass, ≥ 1.
        device: where the model lives.

    Returns:
        The loss value before the step (float).

    Raises:
        ValueError: as :func:`class_prototypes`; a prototype width that differs from ``d``.
    """
    num_classes = int(teacher_protos.shape[0])
    with torch.no_grad():
        feats = torch.cat([features_fn(_to_device(x[s:s + batch_size], device)) for s in range(0, len(x), batch_size)])
        protos, counts = class_prototypes(feats.double(), labels.to(device), num_classes)
    if protos.shape != teacher_protos.shape:
        raise ValueError(f"prototypes {list(protos.shape)} and teacher prototypes {list(teacher_protos.shape)} differ")
    present = (counts > 0).unsqueeze(1)
    diff = torch.where(present, protos - teacher_protos.double(), torch.zeros_like(protos))
    loss = float(alpha * (diff ** 2).sum())
    coef = (2.0 * alpha * diff / counts.clamp_min(1).double().unsqueeze(1)).float()
    for s in range(0, len(x), batch_size):
        f = features_fn(_to_device(x[s:s + batch_size], device))
        (coef[labels[s:s + batch_size].to(device)] * f).sum().backward()
    return loss


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------


class _AlignedModel(nn.Module):
    """The device model and its two private projections as one module, so that one optimizer
    (and :func:`sgd_epochs`) trains them together in the InfoNCE stage."""

    def __init__(self, model: nn.Module, proj_s: nn.Linear, proj_t: nn.Linear) -> None:
        super().__init__()
        self.model, self.proj_s, self.proj_t = model, proj_s, proj_t


def _seeded_linear(fan_in: int, fan_out: int, generator: torch.Generator) -> nn.Linear:
    """``nn.Linear(fan_in, fan_out)`` with PyTorch's default initialisation (weight and bias
    ``U(−1/√fan_in, 1/√fan_in)``) drawn from ``generator``, never from the global RNG (agents
    of a simulated fleet train on concurrent threads)."""
    lin = nn.utils.skip_init(nn.Linear, fan_in, fan_out)
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        for p in (lin.weight, lin.bias):
            nn.init.uniform_(p, -bound, bound, generator=generator)
    return lin


@register_client_algorithm("fedmcp")
class FedMCPClient(ClientAlgorithm):
    """FedMCP++ client (see the module docstring for the round).

    Args:
        precision: ``"fp32"`` or ``"fp16"`` (CUDA autocast for every SGD stage).
        proxy_x: the public proxy inputs, float32 ``[P, C, H, W]`` (read-only is fine: never
            written); from :meth:`setup_kwargs`.
        proxy_y: the proxy labels, int64 ``[P]``.
        projection_dim: k, the width of ``P_s`` and ``P_t`` (32, SPECS §5.1).
        onnx_providers: ONNX Runtime execution providers for the soft predictions, in order
            of preference (the device's runtime plan has them).
        onnx_threads: ONNX Runtime intra-op threads (1: many agents share a machine in a
            simulation); None = ONNX Runtime's default.

    Attributes:
        proj_s, proj_t: the private projections (``None`` until the first alignment stage).

    Raises:
        ValueError: unknown precision; proxy arrays of the wrong dtype or shape.
    """

    name = "fedmcp"
    share = "none"
    buffers = "average"
    borrows_model = True  # its model between rounds is its state entries (ClientAlgorithm)

    #: Defaults of :class:`FedMCPParams` that a subclass (EnsKD) changes.
    hyperparameter_defaults: Mapping[str, object] = {}

    def __init__(self, *, precision: str = "fp32", proxy_x: np.ndarray, proxy_y: np.ndarray, projection_dim: int = 32,
                 onnx_providers: tuple[str, ...] = ("CPUExecutionProvider",), onnx_threads: int | None = 1) -> None:
        _check_precision(precision)
        if not isinstance(proxy_x, np.ndarray) or proxy_x.dtype != np.float32 or proxy_x.ndim != 4:
            raise ValueError("proxy_x must be a float32 array [P, C, H, W]")
        if not isinstance(proxy_y, np.ndarray) or proxy_y.dtype != np.int64 or proxy_y.shape != (proxy_x.shape[0],):
            raise ValueError(f"proxy_y must be an int64 array [{proxy_x.shape[0]}]")
        self.precision = precision
        self.proxy_x_np, self.proxy_y_np = proxy_x, proxy_y
        with warnings.catch_warnings():  # a read-only array shared by the fleet; only ever read
            warnings.simplefilter("ignore", UserWarning)
            self.proxy_x = torch.from_numpy(np.ascontiguousarray(proxy_x))
            self.proxy_y = torch.from_numpy(np.ascontiguousarray(proxy_y))
        self.projection_dim = int(projection_dim)
        self.onnx_providers = tuple(onnx_providers)
        self.onnx_threads = onnx_threads
        self.digest = proxy_digest(proxy_y)
        self.proj_s: nn.Linear | None = None
        self.proj_t: nn.Linear | None = None
        self._onnx_warned = False

    # ---------------------------------------------------------------- setup hooks

    @classmethod
    def setup_kwargs(cls, dataset: Dataset, params: Mapping[str, object], seed: int) -> dict[str, np.ndarray]:
        """Constructor arguments that depend on the data: ``proxy_x`` and ``proxy_y`` of
        :func:`proxy_sets` (the ``[algorithm]`` table's ``proxy_size`` / ``proxy_seed``)."""
        proxy, _ = proxy_sets(dataset, params, seed)
        return {"proxy_x": proxy.x, "proxy_y": proxy.y}

    @classmethod
    def eval_split(cls, dataset: Dataset, params: Mapping[str, object], seed: int) -> ArraySplit:
        """The test samples a device evaluates on: the test split minus the proxy set."""
        return proxy_sets(dataset, params, seed)[1]

    # ---------------------------------------------------------------- the round

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_id: str = "", client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """One FedMCP++ round: alignment to last round's teacher (when there is one), local CE,
        then the proxy-set upload.

        Args:
            model: the private device model (``features``/``head`` as
                :class:`~edge_agent.models.LightCNN`), on ``device``; trained in place.
            global_tensors: must be ``()`` (nothing is shared).
            x, y: the private shard, float32 ``[N, C, H, W]`` and int64 ``[N]``.
            config: the round's SGD settings (lr, momentum, batch size, epochs, seed).
            params: the round config; :class:`FedMCPParams` keys plus ``proxy_size`` and
                ``proxy_digest`` when the server sends them (checked against this device's proxy).
            global_extras: ``teacher_soft_predictions`` ``[P, C]`` and ``teacher_prototypes``
                ``[C, d]``, or ``{}`` (round 1: no alignment).

        Returns:
            ``LocalResult(tensors=(), num_samples=N, train_loss=mean CE of the last epoch,
            metrics, extras={"soft_predictions": [P, C] float32, "prototypes": [C, d] float32})``.
            Metrics: ``train_accuracy``, ``train_seconds``, ``proxy_accuracy`` (own soft
            predictions vs the proxy labels), ``soft_predictions_backend`` (``"onnxruntime"`` or
            ``"torch"``), and ``kd_loss``, ``infonce_loss`` (mean weighted loss of the stage's
            last pass), ``proto_loss`` (before the step) for the stages that ran.

        Raises:
            ModelError: tensors for a model that shares none; a proxy set that differs from the
                server's; teacher arrays of the wrong shape.
            ValueError: a bad hyperparameter; fp16 on a non-CUDA device.
        """
        _check_precision(self.precision, device)
        device = torch.device(device)
        if len(global_tensors):
            raise ModelError(f"FedMCP++ shares no model tensors, got {len(global_tensors)}")
        params = dict(params or {})
        hp = FedMCPParams.from_mapping(params, self.hyperparameter_defaults)
        self._check_proxy(params)
        t0 = time.perf_counter()
        generator = shuffle_generator(config.seed, round, client_index)
        metrics: dict[str, float | str] = {}
        teacher = self._teacher(model, global_extras or {}, device)
        if teacher is not None:
            metrics.update(self._align(model, teacher, config, hp, generator, device, client_index))
        loss, acc = sgd_epochs(model, x, y, config, generator, device, precision=self.precision,
                               before_step=step_hook(self), step_round=round)
        soft, protos, backend = self.proxy_outputs(model, hp.temperature, use_onnx=hp.onnx_soft_predictions,
                                                   device=device)
        metrics.update(train_accuracy=acc, train_seconds=time.perf_counter() - t0, soft_predictions_backend=backend,
                       proxy_accuracy=float((soft.argmax(1) == self.proxy_y_np).mean()))
        return LocalResult(tensors=(), num_samples=int(y.shape[0]), train_loss=loss, metrics=metrics,
                           extras={"soft_predictions": soft, "prototypes": protos})

    def _check_proxy(self, params: Mapping[str, object]) -> None:
        size, digest = params.get("proxy_size"), params.get("proxy_digest")
        if size is not None and int(cast(IntLike, size)) != len(self.proxy_y_np):
            raise ModelError(f"the server's proxy set has {size} samples, this device's {len(self.proxy_y_np)}: "
                             "use the same [algorithm] proxy_size and proxy_seed on both sides")
        if digest is not None and str(digest) != self.digest:
            raise ModelError(f"the server's proxy set (digest {digest}) differs from this device's ({self.digest}): "
                             "use the same data set, proxy_size and proxy_seed on both sides")

    def _teacher(self, model: nn.Module, extras: Mapping[str, np.ndarray],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(p_T [P, C], P_T [C, d])`` on ``device`` from the global's extras, or None when the
        server sent no teacher. Decoded rows of ``p_T`` are clamped at 0 and renormalised to sum
        to 1 (a lossy codec leaves them off by up to C·max/254 for int8)."""
        if not all(name in extras for name in TEACHER_EXTRAS):
            return None
        soft = np.asarray(extras["teacher_soft_predictions"], dtype=np.float32)
        protos = np.asarray(extras["teacher_prototypes"], dtype=np.float32)
        head = cast(FeatureModel, model).classifier
        num_classes, feature_dim = int(head.out_features), int(head.in_features)
        if soft.shape != (len(self.proxy_y_np), num_classes):
            raise ModelError(f"teacher_soft_predictions {list(soft.shape)}, expected "
                             f"[{len(self.proxy_y_np)}, {num_classes}] (proxy samples × classes)")
        if protos.shape != (num_classes, feature_dim):
            raise ModelError(f"teacher_prototypes {list(protos.shape)}, expected [{num_classes}, {feature_dim}]")
        p = torch.from_numpy(soft).clamp_min(0)
        total = p.sum(1, keepdim=True)
        p = torch.where(total > 0, p / total.clamp_min(1e-12), torch.full_like(p, 1.0 / num_classes))
        return p.to(device), torch.from_numpy(protos).to(device)

    def _projections(self, model: nn.Module, seed: int, client_index: int,
                     device: torch.device) -> tuple[nn.Linear, nn.Linear]:
        """``(P_s, P_t)`` on ``device``, created on first use (seeded by the run seed and client index)."""
        if self.proj_s is None or self.proj_t is None:
            head = cast(FeatureModel, model).classifier
            g = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + 7_919 * (client_index + 1)) % (2**63 - 1))
            self.proj_s = _seeded_linear(int(head.in_features), self.projection_dim, g)
            self.proj_t = _seeded_linear(int(head.out_features), self.projection_dim, g)
        self.proj_s.to(device)
        self.proj_t.to(device)
        return self.proj_s, self.proj_t

    def _align(self, model: nn.Module, teacher: tuple[torch.Tensor, torch.Tensor], config: TrainConfig,
               hp: FedMCPParams, generator: torch.Generator, device: torch.device,
               client_index: int) -> dict[str, float]:
        """Stages 1a–1c on the proxy set; returns their loss metrics."""
        p_t, protos_t = teacher
        out: dict[str, float] = {}
        stage_cfg = dataclasses.replace(config, local_epochs=hp.align_epochs, batch_size=hp.proxy_batch_size)
        index = torch.arange(len(self.proxy_y))  # the "labels" of a proxy batch are its sample indices

        if hp.kd:
            def kd_loss(m: nn.Module, xb: torch.Tensor, ib: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                logits = m(xb)
                return hp.kd_weight * distillation_loss(logits, p_t[ib], hp.temperature, hp.kd_direction), logits

            out["kd_loss"], _ = sgd_epochs(model, self.proxy_x, index, stage_cfg, generator, device,
                                           precision=self.precision, loss_fn=kd_loss)
        if hp.infonce:
            joint = _AlignedModel(model, *self._projections(model, config.seed, client_index, device))

            def nce_loss(m: nn.Module, xb: torch.Tensor, ib: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                aligned = cast(_AlignedModel, m)  # sgd_epochs passes back the module it trains: joint
                z = cast(FeatureModel, aligned.model).features(xb)
                loss = info_nce_loss(aligned.proj_s(z), aligned.proj_t(p_t[ib]), hp.tau_nce)
                return hp.infonce_weight * loss, z

            out["infonce_loss"], _ = sgd_epochs(joint, self.proxy_x, index, stage_cfg, generator, device,
                                                precision=self.precision, loss_fn=nce_loss)
        if hp.proto_align:
            train_mode(model)
            opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                                  weight_decay=config.weight_decay)
            opt.zero_grad(set_to_none=True)
            out["proto_loss"] = prototype_alignment_backward(model.features, self.proxy_x, self.proxy_y, protos_t,
                                                             hp.alpha_proto, batch_size=hp.proxy_batch_size,
                                                             device=device)
            opt.step()
        return out

    # ---------------------------------------------------------------- the upload

    def proxy_outputs(self, model: nn.Module, temperature: float, *, use_onnx: bool = True,
                      device: torch.device | str = "cpu") -> tuple[np.ndarray, np.ndarray, str]:
        """Soft predictions and class prototypes of ``model`` on the proxy set.

        Through ONNX Runtime when ``use_onnx`` and the ``onnx``/``onnxruntime`` packages import:
        the model is exported (:func:`edge_agent.onnx_runtime.export_onnx`, outputs logits and
        features) to a temporary file and run by :class:`~edge_agent.onnx_runtime.OnnxModel`
        (``soft_predictions``, ``class_prototypes``) on this instance's providers. Any failure
        there (missing package, export or runtime error) falls back to torch, logged once. The
        torch path computes the same formulas: logits → float64 ``softmax(z / T)`` → float32,
        and float64 class means of the features → float32.

        Args:
            model: the device model (``features``, ``head``); its training flag is restored.
            temperature: T > 0.
            use_onnx: try ONNX Runtime first.
            device: where ``model`` lives (torch path).

        Returns:
            ``(soft_predictions float32 [P, C], prototypes float32 [C, d], backend)`` with
            ``backend`` ``"onnxruntime"`` or ``"torch"``. A class absent from the proxy set has a
            zero prototype row.
        """
        fm = cast(FeatureModel, model)
        num_classes = int(fm.classifier.out_features)
        if use_onnx:
            try:
                from ..onnx_runtime import OnnxModel, export_onnx

                with tempfile.TemporaryDirectory(prefix="fedmcp-") as tmp:
                    path = export_onnx(model, Path(tmp) / "proxy.onnx", outputs=("logits", "features"),
                                       input_shape=tuple(self.proxy_x_np.shape[1:]))
                    om = OnnxModel(path, providers=self.onnx_providers, threads=self.onnx_threads)
                    soft = om.soft_predictions(self.proxy_x_np, temperature)
                    protos, _ = om.class_prototypes(self.proxy_x_np, self.proxy_y_np, num_classes)
                return soft, protos, "onnxruntime"
            except (ImportError, ModelError) as exc:
                if not self._onnx_warned:
                    log.warning("FedMCP++ soft predictions through torch: %s (%s)",
                                "ONNX Runtime unavailable" if isinstance(exc, ImportError)
                                else "the ONNX export or session failed", exc)
                    self._onnx_warned = True
        was_training = model.training
        model.eval()
        try:
            logits, feats = [], []
            with torch.inference_mode():
                for s in range(0, len(self.proxy_x), 512):
                    z = fm.features(self.proxy_x[s:s + 512].to(device))
                    feats.append(z.double().cpu())
                    logits.append(fm.head(z).double().cpu())
            soft = torch.softmax(torch.cat(logits) / temperature, dim=1).float().numpy()
            class_means, _ = class_prototypes(torch.cat(feats), self.proxy_y, num_classes)
        finally:
            model.train(was_training)
        return soft, class_means.float().numpy(), "torch"
