"""FedPGP, client half: prototype-guided gradient projection (SPECS.md §2; the seed summary of
Liu, Fan, Zhang, "FedPGP: Prototype-guided gradient projection for non-IID federated learning",
Neurocomputing 2026; no code of the paper exists anywhere we can read, so every choice the seed
leaves open is a named ``[algorithm]`` key below, with its default and the reason).

The network is split at a layer L: f = tail_{>L} ∘ body_{≤L}, z = body(x) flattened to d_L
entries. Per round the client

1. loads the global model (FedAvg's, ``share = "all"``) and the global prototype pool
   Π = {(π_j, y_j, n_j)} broadcast with it (none in round 1: plain SGD then);
2. trains E epochs of SGD on cross-entropy. At every step, after ``backward()``, the training-step
   hook :meth:`FedPGPClient.before_step` takes the prototype-induced gradient

       g_p = ∇_θ L_p,   L_p = Σ_j w_j · CE(tail(π_j), y_j) / Σ_j w_j

   over the parameters after L (zero for the layers ≤ L, which the pool does not reach) and,
   per projection unit ℓ (a module's weight and bias together), where ⟨g_ℓ, g_{p,ℓ}⟩ < 0,
   replaces the batch gradient by its projection onto the half-space ⟨g, g_p⟩ ≥ 0
   (:func:`project_conflicting`, the single-constraint GEM / A-GEM projection):

       g_ℓ ← g_ℓ − (⟨g_ℓ, g_{p,ℓ}⟩ / ‖g_{p,ℓ}‖²) · g_{p,ℓ}

   g_p itself never updates the weights;
3. after training, in eval mode and without gradients, takes the class representations z of its
   whole shard at L and turns them into **mixed prototypes** (:func:`mixed_prototypes`: per
   class, shuffled and cut into groups of at least ``mix_size`` samples, each group's mean one
   prototype with its group size as count), uploaded as extras with the model.

Keys (``[algorithm]``, sent by the server in ``round_start.config``), each a guess SPECS §2.2/§7
names, and why the default is what it is:

- ``proto_layer`` (``""``): L. ``""`` (or ``"features"``) = the penultimate feature
  ``model.features(x)`` (SPECS §2.2's natural default: the pool then costs C·G·d floats and the
  layers after L are the classifier alone, so g_p per step is one tiny forward/backward). Any
  other value names a top-level layer of ``model.backbone`` (``"conv2"``, ``"pool2"``, ``"fc"``
  of the light CNN; ``"layer3"`` of a zoo ResNet …); the representation is that layer's output,
  flattened; the layers after it in ``backbone`` and the head are the "downstream" layers.
- ``mix_size`` (8): smallest group size s of a mixed prototype. SPECS §2.2's suggestion; s ≥ 2. A
  class with N_c ≥ s samples gives ⌊N_c/s⌋ prototypes (groups of s … 2s−1 samples); a class
  with 2 ≤ N_c < s gives one prototype of all N_c; a class with one sample gives none, so no
  single sample's representation ever leaves the device.
- ``pool_groups`` (4, server only): G, see :mod:`broker_server.strategies.fedpgp`.
- ``pool_weighting`` (``"count"``): w_j in L_p. ``"count"`` (w_j = n_j): each pool prototype
  stands for n_j samples, so L_p approximates the global ERM loss at the layers after L to first
  order; ``"uniform"`` (w_j = 1) is the other reading.
- ``gp_every`` (``"step"``): g_p recomputed at every step from the current weights (GEM's rule;
  with the default L this costs one forward/backward of ≤ C·G rows through the classifier), or
  ``"round"``: once, at the received global model (SPECS §2.2's cheaper guess; g_p then goes
  stale as the local weights move).
- ``projection`` (``"conflict"``): ``"conflict"`` = FedPGP (project only where ⟨g, g_p⟩ < 0);
  and three controls for the reproduction, each removing one mechanism:
  ``"always"`` = project on every step onto the hyperplane ⟨g, g_p⟩ = 0 (removes the g_p
  component whatever its sign; "projection every step vs only on conflict"),
  ``"add"`` = no projection, the pool used as a plain loss term (g ← g + g_p; "no projection"),
  ``"unused"`` = prototypes uploaded, pooled and broadcast, g_p computed and conflicts counted,
  the gradient never touched (FedAvg's training with FedPGP's traffic; "uploaded but unused").
- ``projection_unit`` (``"module"``): one projection per module (weight and bias concatenated;
  SPECS §2.2's choice), or ``"tensor"``: one per parameter tensor.

Eval-mode details: the pool is forwarded through the downstream layers with those modules in
eval mode (a BatchNorm there normalises the pool with its running statistics and does not
update them from it); the representations for the prototypes are computed in eval mode.

Wire (extras): up ``mixed_protos`` float32 [M, d_L], ``mixed_classes`` int64 [M] (ascending),
``mixed_counts`` int64 [M] (≥ 2); down ``pool_protos`` float32 [P, d_L], ``pool_classes`` int64
[P], ``pool_counts`` int64 [P]. Update metrics: ``pgp_layer_steps`` (downstream units × steps
with a pool), ``pgp_conflicts`` (those with ⟨g, g_p⟩ < 0), ``pgp_projected`` (those whose
gradient was changed); the server logs their shares per round.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ModelError
from ._base import FeatureModel, IntLike, LocalResult, StepContext, TrainConfig
from ._registry import register_client_algorithm
from .fedprox import LocalSGDClient

#: Extras names (update: the client's mixed prototypes; global: the pool).
MIXED_PROTOS, MIXED_CLASSES, MIXED_COUNTS = "mixed_protos", "mixed_classes", "mixed_counts"
POOL_PROTOS, POOL_CLASSES, POOL_COUNTS = "pool_protos", "pool_classes", "pool_counts"

PROJECTIONS = ("conflict", "always", "add", "unused")
GP_EVERY = ("step", "round")
POOL_WEIGHTINGS = ("count", "uniform")
UNITS = ("module", "tensor")

#: Defaults of the keys (module docstring gives the reasons).
MIX_SIZE = 8
POOL_GROUPS = 4


@dataclass(frozen=True, slots=True)
class PGPSettings:
    """The client's FedPGP keys (module docstring).

    Raises (from :meth:`from_params`):
        ValueError: a value outside its choices, ``mix_size`` not an int ≥ 2 (a group of one
            would upload that sample's representation).
    """

    proto_layer: str = ""
    mix_size: int = MIX_SIZE
    pool_weighting: str = "count"
    gp_every: str = "step"
    projection: str = "conflict"
    projection_unit: str = "module"

    @classmethod
    def from_params(cls, params: Mapping[str, object]) -> PGPSettings:
        """The keys of ``params`` (a round's config) over the defaults, checked."""
        def choice(key: str, allowed: tuple[str, ...], default: str) -> str:
            v = params.get(key, default)
            if v not in allowed:
                raise ValueError(f"{key} must be one of {allowed}, got {v!r}")
            return str(v)

        mix = params.get("mix_size", MIX_SIZE)
        if isinstance(mix, bool) or int(cast(IntLike, mix)) != mix or int(cast(IntLike, mix)) < 2:
            raise ValueError(f"mix_size must be an int >= 2 (no single sample's representation leaves), got {mix!r}")
        layer = params.get("proto_layer", "")
        if not isinstance(layer, str):
            raise ValueError(f"proto_layer must be a layer name (text), got {layer!r}")
        return cls(proto_layer=layer, mix_size=int(cast(IntLike, mix)),
                   pool_weighting=choice("pool_weighting", POOL_WEIGHTINGS, "count"),
                   gp_every=choice("gp_every", GP_EVERY, "step"),
                   projection=choice("projection", PROJECTIONS, "conflict"),
                   projection_unit=choice("projection_unit", UNITS, "module"))


# ------------------------------------------------------------------ the projection (pure)


def project_conflicting(g: torch.Tensor, g_p: torch.Tensor, *, always: bool = False) -> tuple[torch.Tensor, bool]:
    """The minimal Euclidean change of ``g`` that satisfies ⟨g', g_p⟩ ≥ 0 (pure; inputs untouched).

    g' = g − (⟨g, g_p⟩ / ‖g_p‖²)·g_p when ⟨g, g_p⟩ < 0, else g (the Euclidean projection onto
    the half-space {v : ⟨v, g_p⟩ ≥ 0}; GEM's single-constraint rule). Then ⟨g', g_p⟩ = 0 and
    ‖g'‖² = ‖g‖² − ⟨g, g_p⟩²/‖g_p‖² ≤ ‖g‖². With ``always`` the same formula is applied whenever
    ⟨g, g_p⟩ ≠ 0 (projection onto the hyperplane ⟨v, g_p⟩ = 0, the "project every step"
    control). The dot product and the norm are taken in float64.

    Args:
        g: the batch gradient of one unit, float tensor of any shape.
        g_p: the prototype gradient, same shape.
        always: project onto the hyperplane whatever the sign of ⟨g, g_p⟩.

    Returns:
        (g' in ``g``'s dtype and shape, whether g was changed). A zero (or non-finite) g_p
        constrains nothing: ``(g, False)``, never NaN.

    Raises:
        ValueError: shapes differ.
    """
    if g.shape != g_p.shape:
        raise ValueError(f"gradient shapes differ: {tuple(g.shape)} and {tuple(g_p.shape)}")
    a = g_p.detach().to(torch.float64)
    norm2 = float((a * a).sum())
    if not (norm2 > 0 and math.isfinite(norm2)):
        return g, False
    dot = float((g.detach().to(torch.float64) * a).sum())
    if not (dot < 0 or (always and dot != 0)):
        return g, False
    return (g.detach().to(torch.float64) - (dot / norm2) * a).to(g.dtype), True


# ------------------------------------------------------------------ mixed prototypes (pure)


def mixed_prototypes(z: np.ndarray, y: np.ndarray, mix_size: int,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group means of same-class representations (module docstring, ``mix_size``).

    Per class c in ascending order with N_c ≥ 2 samples: the indices are permuted with ``rng``
    and cut by ``numpy.array_split`` into max(1, ⌊N_c/s⌋) groups; each group's mean (float64,
    then float32) is one prototype, its size the count. Classes with one sample give nothing.

    Args:
        z: float [N, d] representations. y: int [N] labels. mix_size: s ≥ 1.
        rng: the generator of the permutations.

    Returns:
        (prototypes float32 [M, d], classes int64 [M] ascending, counts int64 [M] ≥ 2);
        M = 0 gives shapes [0, d], [0], [0].

    Raises:
        ValueError: shapes disagree or ``mix_size`` < 1.
    """
    z = np.asarray(z)
    y = np.asarray(y)
    if z.ndim != 2 or y.shape != (z.shape[0],):
        raise ValueError(f"representations [N, d] with labels [N] expected, got {z.shape} and {y.shape}")
    if mix_size < 1:
        raise ValueError(f"mix_size must be >= 1, got {mix_size}")
    protos, classes, counts = [], [], []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        if idx.size < 2:
            continue
        for group in np.array_split(rng.permutation(idx), max(1, idx.size // mix_size)):
            protos.append(z[group].astype(np.float64).mean(axis=0))
            classes.append(int(c))
            counts.append(int(group.size))
    if not protos:
        return np.zeros((0, z.shape[1]), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return (np.stack(protos).astype(np.float32), np.asarray(classes, np.int64), np.asarray(counts, np.int64))


# ------------------------------------------------------------------ the split at layer L


class LayerSplit:
    """A model cut at layer L: :meth:`encode` x → z [N, d_L] (flattened), :meth:`decode`
    z → logits through the layers after L, :meth:`units` their parameters grouped for the
    projection.

    Args:
        model: a :class:`~edge_agent.algorithms._base.FeatureModel` (``features``, ``head``);
            for a named layer also ``backbone``, an ``nn.Sequential`` of named layers.
        layer: ``""``/``"features"`` (the penultimate feature) or a top-level layer name of
            ``model.backbone``.

    Raises:
        ModelError: the model has no ``features``/``head``, or no backbone layer of that name
            (the message lists them).
    """

    def __init__(self, model: torch.nn.Module, layer: str) -> None:
        if not callable(getattr(model, "features", None)) or not callable(getattr(model, "head", None)):
            raise ModelError("FedPGP needs a model with features(x) and head(z) (the light CNN, the zoo)")
        self.model = model
        self.layer = layer
        self.tail: torch.nn.Module | None = None
        self.body: torch.nn.Module | None = None
        if layer not in ("", "features"):
            backbone = getattr(model, "backbone", None)
            if not isinstance(backbone, torch.nn.Sequential):
                raise ModelError(f"proto_layer {layer!r}: the model has no backbone nn.Sequential to cut")
            names = [n for n, _ in backbone.named_children()]
            if layer not in names:
                raise ModelError(f"proto_layer {layer!r} is not a backbone layer; the layers are: {', '.join(names)}")
            i = names.index(layer)
            self.body, self.tail = backbone[:i + 1], backbone[i + 1:]
        self.shape: tuple[int, ...] | None = None

    def downstream(self) -> list[torch.nn.Module]:
        """The modules after L whose parameters g_p reaches: the backbone's tail, then the head's
        classifier (``model.classifier``; the whole model's head when it has none)."""
        head = getattr(self.model, "classifier", None)
        out = [] if self.tail is None else [self.tail]
        return out + [head if isinstance(head, torch.nn.Module) else self.model]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """z = body(x), flattened to [N, d_L] (the layer's output shape is kept for :meth:`decode`)."""
        z = cast(FeatureModel, self.model).features(x) if self.body is None else self.body(x)
        self.shape = tuple(z.shape[1:])
        return z.reshape(z.shape[0], -1)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Logits of flattened representations z [P, d_L] through the layers after L.

        Raises:
            ModelError: d_L differs from the layer's (:meth:`encode` sets it).
        """
        if self.shape is None:
            raise ModelError("LayerSplit.decode before encode: the layer's output shape is unknown")
        if z.shape[1] != int(np.prod(self.shape)):
            raise ModelError(f"prototypes of width {z.shape[1]}, layer {self.layer or 'features'!r} has "
                             f"{int(np.prod(self.shape))} entries ({list(self.shape)})")
        z = z.reshape(z.shape[0], *self.shape)
        if self.tail is not None:
            z = self.tail(z)
        return cast(FeatureModel, self.model).head(z)

    def units(self, unit: str) -> list[list[torch.nn.Parameter]]:
        """The downstream trainable parameters in projection units: one list per module with
        parameters of its own (``"module"``), or one per tensor (``"tensor"``); model order."""
        out: list[list[torch.nn.Parameter]] = []
        seen: set[int] = set()
        for root in self.downstream():
            for module in root.modules():
                own = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
                seen.update(id(p) for p in own)
                if own:
                    out += [own] if unit == "module" else [[p] for p in own]
        return out


@contextlib.contextmanager
def eval_mode(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Every module (and submodule) of ``modules`` in eval mode inside the block, its own
    training flag restored after."""
    flags = [(m, m.training) for root in modules for m in root.modules()]
    try:
        for m, _ in flags:
            m.eval()
        yield
    finally:
        for m, was in flags:
            m.train(was)


def prototype_gradient(split: LayerSplit, units: list[list[torch.nn.Parameter]], pool: torch.Tensor,
                       classes: torch.Tensor, weights: torch.Tensor) -> list[torch.Tensor]:
    """g_p per unit: the gradient of L_p = Σ_j w_j·CE(tail(π_j), y_j) / Σ_j w_j over each
    unit's parameters, flattened and concatenated (float32 [Σ numel]); ``p.grad`` untouched.

    Args:
        split: the model cut at L. units: :meth:`LayerSplit.units`.
        pool: π, float32 [P, d_L]; classes: int64 [P]; weights: float32 [P] (> 0).
    """
    params = [p for u in units for p in u]
    with eval_mode(split.downstream()), torch.enable_grad():
        per = F.cross_entropy(split.decode(pool), classes, reduction="none")
        loss = (per * weights).sum() / weights.sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    flat = [torch.zeros_like(p).reshape(-1) if gr is None else gr.detach().reshape(-1) for p, gr in zip(params, grads,
                                                                                                    strict=True)]
    out, i = [], 0
    for u in units:
        out.append(torch.cat(flat[i:i + len(u)]))
        i += len(u)
    return out


@register_client_algorithm("fedpgp")
class FedPGPClient(LocalSGDClient):
    """FedPGP client (module docstring): FedAvg's round with the projection in the training-step
    hook and mixed prototypes uploaded as extras.

    Attributes (this round's, for tests and metrics): ``layer_steps``, ``conflicts``,
    ``projected`` (counts over downstream units × steps), ``settings``.

    Args:
        precision: ``"fp32"`` or ``"fp16"`` (CUDA autocast), as FedAvg.
    """

    name = "fedpgp"
    share = "all"
    buffers = "average"

    def __init__(self, *, precision: str = "fp32") -> None:
        super().__init__(precision=precision)
        self.settings = PGPSettings()
        self.layer_steps = self.conflicts = self.projected = 0
        self._split: LayerSplit | None = None
        self._units: list[list[torch.nn.Parameter]] = []
        self._pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._gp: list[torch.Tensor] | None = None
        self._shard: tuple[torch.Tensor, torch.Tensor, int, int, torch.device] | None = None

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_id: str = "", client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """FedAvg's round (:class:`LocalSGDClient`) with the projection; extras = the mixed
        prototypes; metrics add ``pgp_layer_steps``, ``pgp_conflicts``, ``pgp_projected``.

        Raises:
            ModelError: a bad ``proto_layer``, or a pool whose width is not the layer's.
            ValueError: a key out of its range (module docstring).
        """
        self.settings = PGPSettings.from_params(params or {})
        self._shard = (x, y, round, client_index, torch.device(device))
        try:
            res = super().local_round(model, global_tensors, x, y, config, round=round, client_id=client_id,
                                      client_index=client_index, device=device, params=params,
                                      global_extras=global_extras)
        finally:
            self._shard, self._pool, self._gp = None, None, None
        metrics = {**res.metrics, "pgp_layer_steps": float(self.layer_steps), "pgp_conflicts": float(self.conflicts),
                   "pgp_projected": float(self.projected)}
        return LocalResult(tensors=res.tensors, num_samples=res.num_samples, train_loss=res.train_loss,
                           metrics=metrics, extras=res.extras)

    def begin_round(self, model: torch.nn.Module, config: TrainConfig, params: Mapping[str, object],
                    global_extras: Mapping[str, np.ndarray]) -> None:
        """Cut the model at L, read the pool (none in round 1), take g_p at the global model
        when ``gp_every = "round"``; the objective stays cross-entropy.

        Raises:
            ModelError: bad layer name, malformed pool, or a pool width that is not d_L.
        """
        assert self._shard is not None  # set by local_round
        x, _, _, _, device = self._shard
        split = LayerSplit(model, self.settings.proto_layer)
        with torch.no_grad(), eval_mode([model]):
            split.encode(x[:1].to(device))  # the layer's output shape (decode needs it)
        self._split, self._units = split, split.units(self.settings.projection_unit)
        self.layer_steps = self.conflicts = self.projected = 0
        self._pool, self._gp = None, None
        if POOL_PROTOS in global_extras and len(global_extras.get(POOL_CLASSES, ())):
            p, c, n = (np.asarray(global_extras.get(k)) for k in (POOL_PROTOS, POOL_CLASSES, POOL_COUNTS))
            if p.ndim != 2 or c.shape != (p.shape[0],) or n.shape != (p.shape[0],):
                raise ModelError(f"pool of shapes {p.shape}, {c.shape}, {n.shape}: [P, d], [P], [P] expected")
            num_classes = int(getattr(model, "num_classes", 0) or 0)
            if num_classes and (c.min() < 0 or c.max() >= num_classes):
                raise ModelError(f"pool classes out of [0, {num_classes}): {sorted(set(c.tolist()))}")
            weights = n.astype(np.float32) if self.settings.pool_weighting == "count" else np.ones(len(c), np.float32)
            self._pool = (torch.as_tensor(p.astype(np.float32), device=device),
                          torch.as_tensor(c.astype(np.int64), device=device), torch.as_tensor(weights, device=device))
            split.decode(self._pool[0][:0])  # width check before any step
            if self.settings.gp_every == "round":
                self._gp = prototype_gradient(split, self._units, *self._pool)
        return None

    def before_step(self, model: torch.nn.Module, context: StepContext) -> None:
        """Per downstream unit: count the step, and where the settings say so replace the batch
        gradient (``p.grad``, true gradients) by :func:`project_conflicting`'s result (or add g_p
        under ``projection = "add"``). Nothing before the first pool arrives."""
        if self._pool is None or self._split is None:
            return
        gp_all = self._gp if self._gp is not None else prototype_gradient(self._split, self._units, *self._pool)
        mode = self.settings.projection
        for unit, gp in zip(self._units, gp_all, strict=True):
            if all(p.grad is None for p in unit):
                continue
            g = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in unit])
            self.layer_steps += 1
            conflict = float((g.double() * gp.double()).sum()) < 0
            self.conflicts += int(conflict)
            if mode == "unused":
                continue
            if mode == "add":
                new, changed = g + gp, bool(gp.abs().sum() > 0)
            else:
                new, changed = project_conflicting(g, gp, always=mode == "always")
            if not changed:
                continue
            self.projected += 1
            i = 0
            for p in unit:
                n = p.numel()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(new[i:i + n].view_as(p))
                i += n

    def end_round(self, model: torch.nn.Module, config: TrainConfig) -> dict[str, np.ndarray]:
        """The mixed prototypes of the trained model's layer-L representations (eval mode, no
        gradients, the whole shard in batches), grouped with a generator seeded by (seed,
        round, client index)."""
        assert self._shard is not None and self._split is not None
        x, y, round, client_index, device = self._shard
        zs = []
        with torch.no_grad(), eval_mode([model]):
            for start in range(0, int(x.shape[0]), 256):
                zs.append(self._split.encode(x[start:start + 256].to(device)).float().cpu())
        z = torch.cat(zs).numpy()
        rng = np.random.default_rng([config.seed, round, client_index])
        protos, classes, counts = mixed_prototypes(z, y.numpy(), self.settings.mix_size, rng)
        return {MIXED_PROTOS: protos, MIXED_CLASSES: classes, MIXED_COUNTS: counts}
