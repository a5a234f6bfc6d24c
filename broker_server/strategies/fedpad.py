"""FedPAD, server half: prototype-aware decoupled aggregation (SPECS.md §1.3, the paper version).

Zhang, Wan, Long, "FedPAD: prototype-aware decoupled aggregation under domain imbalance",
*Neurocomputing* 695 (2026) 133967, Algorithm 1. With m clients reporting in round t, client i
sending its model w_i^t and prototypes {p_i^{(k),t} : k ∈ K_i^t}, and P_g^{t−1} the global
prototypes of the previous round (classes K_g^{t−1}):

- deviation      d_i^t = Σ_{k ∈ K_i^t ∩ K_g^{t−1}} ||p_i^{(k),t} − p_g^{(k),t−1}||₂       (SPECS §1.3 step 5)
- prototype weights  θ^t = softmax(γ·d^t), the maximiser of ⟨θ, d⟩ − (1/γ) Σ θ_i log θ_i on the simplex
- global prototypes  p_g^{(k),t} = Σ_{i: k ∈ K_i} θ_i p_i^{(k)} / Σ_{i: k ∈ K_i} θ_i
- model weights   α^t = softmax(−θ^t / τ)
- global model    w^t = Σ_i α_i^t w_i^t

Round 1 (no P_g yet; SPECS [guess]): θ = α = 1/m. The module-level functions are that math
(numpy in, numpy out); :class:`FedPAD` checks the updates, calls them and keeps the state.

Decisions beyond the paper (all documented where they are made):

- γ defaults to 0.1 (SPECS §1.4: not given; measured scale of d in :data:`DEFAULT_GAMMA`).
- The clients' prototype term is the reference code's ``nn.MSELoss`` (mean over the F features,
  ``proto_loss = "mse"``) unless ``proto_loss = "sum"`` (SPECS' per-sample squared norm, F times
  larger); see :func:`edge_agent.algorithms.fedpad.prototype_alignment_loss`.
- Ablations as keys: ``lambda_proto = 0`` (no prototype term), ``fixed_alpha`` (α ≡ 1/m),
  ``prototype_mix = "uniform"`` (global prototypes without θ); the last two together are
  "θ/α off" (plain mean of the models, plain per-class mean of the prototypes).
- Integer model entries (BatchNorm ``num_batches_tracked``; the light CNN has none) are taken
  from the first reporting client in client-id order; every floating entry, BatchNorm running
  statistics included, is α-weighted (the paper's w = Σ α_i w_i; the public code averages BN
  statistics unweighted, SPECS §1.3).
- Partial participation: m is the number of clients that reported this round; θ, α and the
  prototype mix are over them. A class that no reporting client holds keeps its previous global
  prototype (so its clients keep an alignment target), see :func:`aggregate_prototypes`.
- The Lipschitz bound of SPECS §1.5 is stated with ‖d − d'‖_∞ and is off by a factor 2 in that
  form; :func:`prototype_weights` gives the bound that holds (with the oscillation max − min).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from edge_agent.algorithms.fedpad import (
    DEFAULT_LAMBDA_PROTO,
    DEFAULT_PROTO_LOSS,
    PROTO_CLASSES,
    PROTO_COUNTS,
    PROTO_LOSSES,
    PROTOTYPES,
)

from ..aggregate import weighted_average
from ._base import BufferedAccumulator, ClientResult, GlobalUpdate, RoundPlan
from ._registry import register_strategy
from .fedavg import FedAvg
from .fedproto import PrototypeAccumulator, check_prototype_extras

#: τ, the model-weight temperature (SPECS §1.4: seed and code, 0.1).
DEFAULT_TAU = 0.1

#: γ, the inverse temperature of θ = softmax(γ·d). SPECS §1.4: not given in the paper (only a
#: sensitivity plot), so this default is ours, set from the scale of d we measured: d_i is a sum
#: over up to C classes of L2 distances between 64-d light-CNN features, and on the domain-silo
#: benchmarks (10 clients 3/4/2/1, ≤ 800 training images per domain, rounds 2–5, 2 local epochs)
#: d_i was 4–8 on PACS (spread max − min ≈ 2.5–3.6) and 10–31 on Digits (spread 8–21). θ and α recomputed from those d:
#:
#: ====  =======================================  ==========================================
#: γ     PACS: θ_max / α_min–α_max                 Digits: θ_max / α_min–α_max
#: ====  =======================================  ==========================================
#: 0.1   0.12 / 0.08–0.12 (soft reweighting)       0.15–0.33 / 0.008–0.15
#: 0.3   0.17 / 0.05–0.15                          0.30–0.88 / 0.000–0.17 (outlier dropped)
#: 1.0   0.35–0.42 / 0.003–0.17                    0.85–1.0 / 0.000 every round (θ one-hot)
#: ====  =======================================  ==========================================
#:
#: At γ = 1 θ is one-hot on Digits and FedPAD degenerates into "average all but the most
#: deviant client"; γ = 0.1 keeps θ and α graded on both benchmarks, so it is the default. It is
#: a plain constant in feature units, not rescaled by the data (the paper's θ is softmax(γ·d)):
#: a model with larger features wants a smaller γ (``[algorithm] gamma``); γ → 0 gives
#: θ = α = 1/m. ``tools/reproduce_fedpad.py`` sweeps it over four decades and reports α's spread.
DEFAULT_GAMMA = 0.1

#: How the global prototypes mix the clients': θ-weighted (``"theta"``, the paper) or with equal
#: weights per class (``"uniform"``: the "no θ-weighted prototype aggregation" ablation, SPECS §1.7).
PROTOTYPE_MIXES = ("theta", "uniform")


def _softmax(z: np.ndarray) -> np.ndarray:
    """softmax(z)_i = exp(z_i − max z) / Σ_j exp(z_j − max z), float64 [m] (shift-stable)."""
    e = np.exp(z - z.max())
    return e / e.sum()


def _vector(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    """``values`` as a non-empty finite float64 vector, else ValueError naming ``name``."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or v.size == 0 or not np.isfinite(v).all():
        raise ValueError(f"{name} must be a non-empty finite vector, got shape {v.shape}")
    return v


def prototype_deviation(prototypes: np.ndarray, classes: np.ndarray, global_prototypes: np.ndarray,
                        global_classes: np.ndarray) -> float:
    """d_i = Σ_{k ∈ K_i ∩ K_g} ||p_i^{(k)} − p_g^{(k)}||₂ (FedPAD Algorithm 1; SPECS §1.3 step 5):
    a sum of unsquared Euclidean distances over the classes the client and the previous global
    prototypes share.

    Args:
        prototypes: the client's, float [k, F].
        classes: their class ids, int [k], distinct.
        global_prototypes: float [K, F].
        global_classes: int [K], distinct.

    Returns:
        d_i ≥ 0 in feature units (float); 0.0 when no class is shared.

    Raises:
        ValueError: mismatched lengths or feature widths.
    """
    p, c = np.asarray(prototypes, np.float64), np.asarray(classes)
    g, gc = np.asarray(global_prototypes, np.float64), np.asarray(global_classes)
    if p.ndim != 2 or g.ndim != 2 or p.shape[0] != c.shape[0] or g.shape[0] != gc.shape[0]:
        raise ValueError(f"prototypes [k, F] with classes [k] expected, got {p.shape}/{c.shape} and "
                         f"{g.shape}/{gc.shape}")
    shared, i_local, i_global = np.intersect1d(c, gc, assume_unique=True, return_indices=True)
    if shared.size == 0:
        return 0.0
    if p.shape[1] != g.shape[1]:
        raise ValueError(f"client prototypes have {p.shape[1]} features, the global ones {g.shape[1]}")
    return float(np.linalg.norm(p[i_local] - g[i_global], axis=1).sum())


def prototype_weights(d: Sequence[float] | np.ndarray, gamma: float) -> np.ndarray:
    """θ = softmax(γ·d) (FedPAD, SPECS §1.3 step 5): the closed-form maximiser of
    ⟨θ, d⟩ − (1/γ) Σ_i θ_i log θ_i over the simplex Δ_m. Larger deviation, larger θ_i.

    Lipschitz bound (SPECS §1.5, corrected): ``||θ(d) − θ(d')||₁ ≤ (γ/2)·(max_i δ_i − min_i δ_i)
    ≤ γ·||d − d'||_∞`` with δ = d − d'. Proof: along z + sδ the derivative of softmax is
    θ ⊙ (γδ − ⟨θ, γδ⟩), whose L1 norm is γ times the mean absolute deviation of δ under θ, at most
    half its range. SPECS states (γ/2)·||d − d'||_∞, which fails for m = 2, d = 0, d' = (ε, −ε)
    (‖Δθ‖₁ → γε).

    Args:
        d: deviations, float [m], finite.
        gamma: γ ≥ 0 (0 gives 1/m).

    Returns:
        θ, float64 [m], positive, summing to 1.

    Raises:
        ValueError: empty or non-finite ``d``; negative or non-finite ``gamma``.
    """
    if not np.isfinite(gamma) or gamma < 0:
        raise ValueError(f"gamma must be finite and ≥ 0, got {gamma}")
    return _softmax(gamma * _vector(d, "d"))


def model_weights(theta: Sequence[float] | np.ndarray, tau: float) -> np.ndarray:
    """α = softmax(−θ/τ) (FedPAD, SPECS §1.3 step 5): larger prototype weight, smaller model weight.

    Lipschitz bound (SPECS §1.5): ``||α(θ) − α(θ')||₁ ≤ (1/(2τ))·||θ − θ'||₁``; combined with
    :func:`prototype_weights`, the weight drift ``||α^t − α^{t−1}||₁ ≤ (γ/(4τ))·(max δ − min δ)
    ≤ (γ/(2τ))·||d^t − d^{t−1}||_∞`` (SPECS writes γ/(4τ)·||·||_∞: false by a factor up to 2).

    Args:
        theta: float [m], finite.
        tau: τ > 0.

    Returns:
        α, float64 [m], positive, summing to 1.

    Raises:
        ValueError: empty or non-finite ``theta``; ``tau`` not a positive finite number.
    """
    if not np.isfinite(tau) or tau <= 0:
        raise ValueError(f"tau must be a positive finite number, got {tau}")
    return _softmax(-_vector(theta, "theta") / tau)


def fedpad_weights(d: Sequence[float] | np.ndarray | None, m: int, *, gamma: float, tau: float,
                   fixed_alpha: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(θ, α) for one round: ``d`` → θ = softmax(γ·d) → α = softmax(−θ/τ) (SPECS §1.3 step 5).

    Args:
        d: deviations float [m], or ``None`` when there are no global prototypes yet (round 1):
            then θ = α = 1/m (SPECS §1.3 [guess]).
        m: number of clients (must equal ``len(d)`` when ``d`` is given).
        gamma, tau: see :func:`prototype_weights`, :func:`model_weights`.
        fixed_alpha: the "α ≡ 1/m" ablation (SPECS §1.7): α = 1/m whatever θ.

    Returns:
        (θ, α), float64 [m] each.

    Raises:
        ValueError: ``m`` < 1 or ≠ ``len(d)``; as the two functions above.
    """
    if m < 1 or (d is not None and len(d) != m):
        raise ValueError(f"m must be ≥ 1 and equal len(d), got m={m}, d={None if d is None else len(d)}")
    uniform = np.full(m, 1.0 / m)
    theta = uniform if d is None else prototype_weights(d, gamma)
    alpha = uniform if (d is None or fixed_alpha) else model_weights(theta, tau)
    return theta, alpha


def aggregate_prototypes(prototypes: Sequence[np.ndarray], classes: Sequence[np.ndarray],
                         theta: Sequence[float] | np.ndarray, *,
                         previous: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Class-wise θ-weighted global prototypes (FedPAD, SPECS §1.3 step 5):
    ``p_g^{(k)} = Σ_{i: k ∈ K_i} θ_i p_i^{(k)} / Σ_{i: k ∈ K_i} θ_i``, the weights renormalised over
    the clients that sent class k (SPECS [guess]; the public code renormalises too).

    Args:
        prototypes: per client i, float [k_i, F].
        classes: per client i, int [k_i], distinct.
        theta: float [m], ≥ 0; a client with θ_i = 0 (e.g. softmax underflow at γ·Δd > 745)
            adds nothing.
        previous: the previous global prototypes ``(float [K, F], int [K])``; a class in it that
            no client (with θ_i > 0) sent is kept unchanged (partial participation), a class a
            client sent is replaced. ``None`` keeps nothing.

    Returns:
        (global prototypes float32 [K', F], class ids int64 [K'] ascending): every class some
        client sent (and, with ``previous``, every earlier class); K' = 0 gives [0, 0] and [0].
        The weighted sums are FedProto's :class:`~broker_server.strategies.fedproto.PrototypeAccumulator`
        (float64) with per-client weight θ_i.

    Raises:
        ValueError: ``prototypes``, ``classes`` and ``theta`` of different lengths; mismatched
            shapes or feature widths; negative θ.
    """
    th = np.asarray(theta, dtype=np.float64)
    if not (len(prototypes) == len(classes) == th.size) or th.ndim != 1:
        raise ValueError(f"{len(prototypes)} prototype sets, {len(classes)} class sets, {th.size} weights")
    if (th < 0).any() or not np.isfinite(th).all():
        raise ValueError("theta must be finite and ≥ 0")
    acc = PrototypeAccumulator("uniform")
    for p, c, t in zip(prototypes, classes, th, strict=False):
        acc.add(p, c, weight=float(t))
    if previous is not None and np.asarray(previous[1]).size:
        gp, gc = np.asarray(previous[0], np.float32), np.asarray(previous[1], np.int64)
        if acc.dim is not None and gp.shape[1] != acc.dim:
            raise ValueError(f"previous prototypes have {gp.shape[1]} features, the clients' {acc.dim}")
        sent = [np.asarray(c) for c, t in zip(classes, th, strict=False) if t > 0]
        keep = ~np.isin(gc, np.concatenate(sent) if sent else np.zeros(0, np.int64))
        if keep.any():
            acc.add(gp[keep], gc[keep], weight=1.0)  # alone in their class: the same rows come back
    return acc.result()


def alpha_drift(previous_clients: Sequence[str], previous_alpha: Sequence[float] | np.ndarray,
                clients: Sequence[str], alpha: Sequence[float] | np.ndarray) -> tuple[float | None, int]:
    """Weight drift ||α^t − α^{t−1}||₁ over the clients present in both rounds.

    Under full participation the two client sets are equal and this is exactly the L1 distance of
    SPECS §1.5. Under partial participation each α is first restricted to the common clients and
    renormalised to sum 1 there (a restricted softmax is again a softmax, so the bounds of
    :func:`model_weights` still apply to the restricted vectors), then compared.

    Args:
        previous_clients, previous_alpha: the last aggregated round's client ids and α [m'].
        clients, alpha: this round's client ids and α [m].

    Returns:
        (drift in [0, 2], or ``None`` when fewer than 2 clients are common — with one common
        client the renormalised weights are both 1, which says nothing; number of common clients).

    Raises:
        ValueError: ids and weights of different lengths.
    """
    if len(previous_clients) != len(previous_alpha) or len(clients) != len(alpha):
        raise ValueError("client ids and weights differ in length")
    prev = dict(zip(previous_clients, np.asarray(previous_alpha, np.float64), strict=False))
    now = dict(zip(clients, np.asarray(alpha, np.float64), strict=False))
    common = sorted(set(prev) & set(now))
    if len(common) < 2:
        return None, len(common)
    a = np.array([now[c] for c in common])
    b = np.array([prev[c] for c in common])
    return float(np.abs(a / a.sum() - b / b.sum()).sum()), len(common)


def _head_shape(tensors: Sequence[np.ndarray]) -> tuple[int, int] | None:
    """(C, F) of the model's classifier: the last 2-D entry in manifest order (the light CNN's
    ``classifier.weight`` [C, F]); ``None`` when the model has no 2-D entry."""
    for t in reversed(tensors):
        if np.ndim(t) == 2:
            return int(t.shape[0]), int(t.shape[1])
    return None


@register_strategy("fedpad")
class FedPAD(FedAvg):
    """FedPAD strategy: θ-weighted class prototypes, α = softmax(−θ/τ)-weighted models.

    ``share = "all"``. Aggregation needs every client's prototypes before any model weight is
    known, so the round's updates are buffered (:class:`BufferedAccumulator`, memory grows with
    the reporting clients) and :meth:`aggregate` runs once at the end, in client-id order.

    Args:
        participation_rate, min_clients, train_config: as :class:`FedAvg`.
        tau: τ > 0 (default 0.1, SPECS §1.4).
        gamma: γ ≥ 0 (default :data:`DEFAULT_GAMMA` = 0.1; SPECS §1.4 gives none).
        lambda_proto: λ ≥ 0 of the clients' prototype term (default 0.1), sent in every round's
            config; 0 is the λ = 0 ablation.
        fixed_alpha: the α ≡ 1/m ablation: unweighted model mean; θ still mixes the prototypes.
        proto_loss: the scale of the clients' prototype term, ``"mse"`` (default: mean over the
            features, the reference code's ``nn.MSELoss``) or ``"sum"`` (summed over them, SPECS'
            formula read literally; F times larger); sent in every round's config, see
            :func:`edge_agent.algorithms.fedpad.prototype_alignment_loss` for why.
        prototype_mix: ``"theta"`` (default, the paper) or ``"uniform"`` (each class's global
            prototype is the plain mean of the clients that sent it; θ is still computed and
            still sets α). With ``fixed_alpha = true`` too, neither weight is used: θ/α off.

    These come from the ``[algorithm]`` table of the run configuration; an unknown key is a
    TypeError of the constructor.

    Raises:
        ValueError: a parameter out of range (and as :class:`FedAvg`).
    """

    name = "fedpad"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

    def __init__(self, *, participation_rate: float = 1.0, min_clients: int = 1,
                 train_config: Mapping[str, float | int | str | bool] | None = None, tau: float = DEFAULT_TAU,
                 gamma: float = DEFAULT_GAMMA, lambda_proto: float = DEFAULT_LAMBDA_PROTO,
                 fixed_alpha: bool = False, proto_loss: str = DEFAULT_PROTO_LOSS,
                 prototype_mix: str = "theta") -> None:
        super().__init__(participation_rate=participation_rate, min_clients=min_clients, train_config=train_config)
        if not np.isfinite(tau) or tau <= 0:
            raise ValueError(f"tau must be a positive finite number, got {tau}")
        if not np.isfinite(gamma) or gamma < 0:
            raise ValueError(f"gamma must be finite and ≥ 0, got {gamma}")
        if not np.isfinite(lambda_proto) or lambda_proto < 0:
            raise ValueError(f"lambda_proto must be finite and ≥ 0, got {lambda_proto}")
        if not isinstance(fixed_alpha, bool):
            raise ValueError(f"fixed_alpha must be true or false, got {fixed_alpha!r}")
        if proto_loss not in PROTO_LOSSES:
            raise ValueError(f"proto_loss must be one of {PROTO_LOSSES}, got {proto_loss!r}")
        if prototype_mix not in PROTOTYPE_MIXES:
            raise ValueError(f"prototype_mix must be one of {PROTOTYPE_MIXES}, got {prototype_mix!r}")
        self.proto_loss, self.prototype_mix = proto_loss, prototype_mix
        self.tau, self.gamma = float(tau), float(gamma)
        self.lambda_proto, self.fixed_alpha = float(lambda_proto), fixed_alpha
        self.prototypes: np.ndarray | None = None        # P_g: float32 [K, F]
        self.proto_classes: np.ndarray | None = None     # int64 [K]
        self.prev_clients: list[str] = []                # clients of the last aggregated round
        self.prev_alpha = np.zeros(0)                    # their α

    def configure_round(self, round: int, available: Sequence[str], rng: np.random.Generator) -> RoundPlan:
        """FedAvg's client selection; the config also carries ``lambda_proto`` and ``proto_loss``
        for the clients."""
        plan = super().configure_round(round, available, rng)
        return RoundPlan(selected=plan.selected, config={**plan.config, "lambda_proto": self.lambda_proto,
                                                         "proto_loss": self.proto_loss})

    def accumulator(self, round: int, current: Sequence[np.ndarray]) -> BufferedAccumulator:
        """Buffer the round (α needs all prototypes first); :meth:`aggregate` runs at the end."""
        return BufferedAccumulator(self, round, current)

    def global_extras(self) -> dict[str, np.ndarray]:
        """``{"prototypes": float32 [K, F], "proto_classes": int64 [K]}`` once global prototypes
        exist (after the first aggregated round); ``{}`` before."""
        if self.prototypes is None or self.proto_classes is None or self.proto_classes.size == 0:
            return {}
        return {PROTOTYPES: self.prototypes.copy(), PROTO_CLASSES: self.proto_classes.copy()}

    def validate(self, result: ClientResult) -> str | None:
        """Reason to refuse a malformed FedPAD update, or ``None``.

        Checks: the three extras are present; ``prototypes`` is floating [k, F] with k ≥ 1 and
        F the model's feature width (the classifier's input width, and that of the global
        prototypes); ``proto_classes`` and ``proto_counts`` are integer [k]; class ids lie in
        [0, C) (C = the classifier's output width) and are distinct; counts are ≥ 1 and sum to
        at most ``num_samples``. Finiteness is checked by the server before.
        """
        ex = result.extras
        head = _head_shape(result.tensors)
        width = head[1] if head else (self.prototypes.shape[1] if self.prototypes is not None else None)
        # names, dtypes, lengths, unique ids in [0, C), counts ≥ 1
        reason = check_prototype_extras(ex, dim=width, num_classes=head[0] if head else None)
        if reason:
            return reason
        p, n = np.asarray(ex[PROTOTYPES]), np.asarray(ex[PROTO_COUNTS])
        if p.shape[0] < 1:
            return "no prototypes: a client with samples has at least one class"
        if self.prototypes is not None and self.prototypes.shape[0] and p.shape[1] != self.prototypes.shape[1]:
            return f"prototype width {p.shape[1]} differs from the global prototypes' {self.prototypes.shape[1]}"
        total = sum(int(x) for x in n)  # Python ints: numpy's int64 sum wraps (4 × 2**62 → 0)
        if total > result.num_samples:
            return f"proto_counts sum to {total}, more than num_samples={result.num_samples}"
        return None

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """One FedPAD server step (module docstring): d → θ → (P_g, α) → w = Σ α_i w_i.

        Args:
            round: the round number (for the logged metrics).
            current: the global model (unused: FedPAD replaces it by the α-mix).
            results: validated updates (any order; processed in client-id order).

        Returns:
            The round's :class:`GlobalUpdate`: the new global model (each entry in its input
            dtype), the new global prototypes (``extras`` and ``state``, with this round's clients
            and α) and the round's metrics, committed by the driver only when finite and
            encodable; ``None`` (no change) when ``results`` is empty. The strategy is not
            modified. The metrics (logged for the round that commits them only; lists in
            client-id order): ``fedpad_clients`` (ids), ``fedpad_d`` (deviations, feature units;
            ``null`` in round 1), ``fedpad_theta``, ``fedpad_alpha`` (weights summing to 1),
            ``fedpad_alpha_drift`` (||α^t − α^{t−1}||₁ over the clients of both rounds, see
            :func:`alpha_drift`; ``null`` in the first aggregated round or with < 2 common
            clients), ``fedpad_alpha_drift_clients``, ``fedpad_global_classes`` (classes holding
            a global prototype) and ``fedpad_round``.

        Raises:
            ValueError: an update without valid prototype extras (call :meth:`validate` first),
                or models of different shapes/dtypes.
        """
        if not results:
            return None
        ordered = sorted(results, key=lambda r: r.client_id)
        for r in ordered:
            reason = self.validate(r)
            if reason:
                raise ValueError(f"update of {r.client_id}: {reason}")
        clients = [r.client_id for r in ordered]
        protos = [np.asarray(r.extras[PROTOTYPES]) for r in ordered]
        classes = [np.asarray(r.extras[PROTO_CLASSES]) for r in ordered]
        g_protos, g_classes = self.prototypes, self.proto_classes
        previous = ((g_protos, g_classes) if g_protos is not None and g_classes is not None and g_classes.size > 0
                    else None)
        d = (np.array([prototype_deviation(p, c, previous[0], previous[1])
                       for p, c in zip(protos, classes, strict=False)])
             if previous is not None else None)
        theta, alpha = fedpad_weights(d, len(ordered), gamma=self.gamma, tau=self.tau, fixed_alpha=self.fixed_alpha)
        new_model = weighted_average([r.tensors for r in ordered], alpha)
        for j, t in enumerate(ordered[0].tensors):  # integer entries: the first client's (module docstring)
            if not np.issubdtype(np.asarray(t).dtype, np.floating):
                new_model[j] = np.array(t, copy=True)
        mix = theta if self.prototype_mix == "theta" else np.full(len(ordered), 1.0 / len(ordered))
        gp, gc = aggregate_prototypes(protos, classes, mix, previous=previous)
        drift, common = alpha_drift(self.prev_clients, self.prev_alpha, clients, alpha)
        metrics = {
            "fedpad_round": round, "fedpad_clients": clients,
            "fedpad_d": None if d is None else d.tolist(), "fedpad_theta": theta.tolist(),
            "fedpad_alpha": alpha.tolist(), "fedpad_alpha_drift": drift, "fedpad_alpha_drift_clients": common,
            "fedpad_global_classes": gc.tolist(),
        }
        extras = {PROTOTYPES: gp.copy(), PROTO_CLASSES: gc.copy()} if gc.size else {}
        return GlobalUpdate(tensors=new_model, extras=extras, metrics=metrics,
                            state={"prototypes": gp, "proto_classes": gc, "prev_clients": clients, "prev_alpha": alpha})

    def state_dict(self) -> dict:
        """Global prototypes, their classes, and the last round's clients and α (for resume)."""
        if self.prototypes is None or self.proto_classes is None:
            return {"prev_clients": list(self.prev_clients), "prev_alpha": np.asarray(self.prev_alpha, np.float64)}
        return {"prototypes": self.prototypes.copy(), "proto_classes": self.proto_classes.copy(),
                "prev_clients": list(self.prev_clients), "prev_alpha": np.asarray(self.prev_alpha, np.float64)}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (an empty dict = the start of a run)."""
        if "prototypes" in state:
            self.prototypes = np.asarray(state["prototypes"], np.float32)
            self.proto_classes = np.asarray(state["proto_classes"], np.int64)
        else:
            self.prototypes = self.proto_classes = None
        self.prev_clients = [str(c) for c in state.get("prev_clients", [])]
        self.prev_alpha = np.asarray(state.get("prev_alpha", np.zeros(0)), np.float64)
