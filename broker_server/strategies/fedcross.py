"""FedCross, server half: multi-model cross-aggregation (Hu et al., "FedCross: Towards Accurate
Federated Learning via Multi-Model Cross-Aggregation", ICDE 2024, Algorithm 1; SPECS §6.10;
details of PFLlib's ``servercross.py``).

The server keeps M middleware models w_1 … w_M (M = ``models``; 0 = the number of devices asked
in round 1). Round t:

1. M available devices are drawn at random; the i-th gets middleware model i
   (its instruction ``cross_slot`` = i; the models travel as the ``global``'s extras).
2. Device i trains w_i locally and uploads w_i'; a model whose device did not report stays.
3. **Cross-aggregation** (paper Eq. (3)): w_i ← α·w_i' + (1 − α)·w_{c(i)}', α = ``alpha``
   (0.99), with the collaborator c(i) by ``collab``: ``"least"`` (default, the paper's best) — the
   model least similar to w_i', ``"most"`` — the most similar, ``"round_robin"`` —
   (i + (t mod (M − 1)) + 1) mod M. Similarity (PFLlib): the sum over layer chunks (consecutive
   pairs of state entries, weight and bias) of the chunks' cosine similarity. PFLlib adds the last
   chunk's cosine a second time; that is left out here. Before round ``first_stage_bound`` every
   middleware model is set to the global instead.
4. The **global** (the evaluated model) is the sample-weighted mean Σ n_k w_k' / Σ n_k of the
   round's trained models, as PFLlib's ``aggregate_parameters`` of the uploads.

Cost: a broadcast ``global`` carries the mean and all M middleware models ((M + 1) × the model)
to every online device. With per-device delivery (``[server] global_delivery``; ``"auto"``
chooses it when 2·M·P < (N + 1)·(M + 1)·P bytes, P = one model: always, for M ≤ N online devices)
:meth:`FedCross.device_global` gives each selected device only its own slot's model, as the
global's tensors and without extras: one model per device, 1/(M + 1) of the broadcast's model
bytes (1/M of its middleware bytes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from edge_agent.algorithms.fedcross import SLOT_KEY, extras_name, flatten_state, unflatten_state

from ..aggregate import weighted_average
from ._base import ClientResult, GlobalUpdate, RoundPlan, Scalar, Strategy
from ._registry import register_strategy

COLLAB = ("least", "most", "round_robin")


def chunk_similarity(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """Σ over chunks (entries 0–1, 2–3, …) of cos(chunk_a, chunk_b) (float64; a zero chunk
    counts 0)."""
    s = 0.0
    for i in range(0, len(a), 2):
        x = np.concatenate([np.asarray(t, np.float64).ravel() for t in a[i:i + 2]])
        y = np.concatenate([np.asarray(t, np.float64).ravel() for t in b[i:i + 2]])
        den = float(np.linalg.norm(x) * np.linalg.norm(y))
        s += float(x @ y) / den if den > 0 else 0.0
    return s


def collaborators(models: Sequence[Sequence[np.ndarray]], rule: str, round: int) -> list[int]:
    """c(i) of every model i (module docstring, step 3)."""
    m = len(models)
    if m < 2:
        return list(range(m))
    if rule == "round_robin":
        off = round % (m - 1) + 1
        return [(i + off) % m for i in range(m)]
    sim = np.array([[chunk_similarity(models[i], models[j]) if i != j else np.nan for j in range(m)]
                    for i in range(m)])
    pick = np.nanargmin if rule == "least" else np.nanargmax
    return [int(pick(sim[i])) for i in range(m)]


def cross_aggregate(models: Sequence[Sequence[np.ndarray]], collab: Sequence[int],
                    alpha: float) -> list[list[np.ndarray]]:
    """w_i ← α·w_i + (1 − α)·w_{c(i)} for every i (inputs unchanged; dtypes kept)."""
    return [[(alpha * np.asarray(x, np.float64) + (1 - alpha) * np.asarray(y, np.float64)).astype(np.asarray(x).dtype)
             for x, y in zip(models[i], models[collab[i]], strict=True)] for i in range(len(models))]


@register_strategy("fedcross")
class FedCross(Strategy):
    """FedCross (module docstring). ``[algorithm]`` keys: ``models`` (0), ``alpha`` (0.99),
    ``collab`` (``"least"``), ``first_stage_bound`` (0)."""

    name = "fedcross"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = (SLOT_KEY,)

    def __init__(self, *, participation_rate: float = 1.0, min_clients: int = 1,
                 train_config: Mapping[str, Scalar] | None = None, models: int = 0, alpha: float = 0.99,
                 collab: str = "least", first_stage_bound: int = 0) -> None:
        if collab not in COLLAB:
            raise ValueError(f"collab = {collab!r} must be one of {COLLAB}")
        if first_stage_bound < 0:
            raise ValueError(f"first_stage_bound = {first_stage_bound!r} must be >= 0 (rounds)")
        if not 0 <= alpha <= 1 or models < 0 or not 0 < participation_rate <= 1:
            raise ValueError(f"alpha ({alpha}) must be in [0, 1], models ({models}) >= 0, participation_rate "
                             f"({participation_rate}) in (0, 1]")
        self.participation_rate, self.min_clients = participation_rate, min_clients
        self.train_config = dict(train_config or {})
        self.models, self.alpha, self.collab, self.first_stage_bound = int(models), alpha, collab, first_stage_bound
        self.initial: list[np.ndarray] = []
        self.middleware: list[list[np.ndarray]] = []
        self.assignment: dict[str, int] = {}

    def bind_model(self, model) -> None:
        """The initial model, copied into every middleware model once M is known."""
        self.initial = [v.detach().cpu().numpy().copy() for v in model.state_dict().values()]

    def configure_round(self, round: int, available: Sequence[str], rng: np.random.Generator) -> RoundPlan:
        """Draw M devices and give the i-th ``cross_slot`` = i."""
        if not self.middleware:
            m = self.models or max(self.min_clients, round_(self.participation_rate * len(available)))
            self.models = m
            self.middleware = [[a.copy() for a in self.initial] for _ in range(m)]
        chosen = list(rng.permutation(sorted(available)))[:self.models]
        self.assignment = {str(c): i for i, c in enumerate(chosen)}
        return RoundPlan(selected=tuple(sorted(self.assignment)), config=dict(self.train_config),
                         instructions={c: {SLOT_KEY: i} for c, i in self.assignment.items()})

    def global_extras(self) -> dict[str, np.ndarray]:
        """The M middleware models, flattened."""
        return {extras_name(i): flatten_state(w) for i, w in enumerate(self.middleware)}

    def device_global(self, round: int, client_id: str, tensors: Sequence[np.ndarray],
                      extras: Mapping[str, np.ndarray]) -> tuple[Sequence[np.ndarray], Mapping[str, np.ndarray]] | None:
        """A selected device's own global: its middleware model w_i (i = its ``cross_slot``) as
        the tensors (shaped and typed as ``tensors``, the state entries in manifest order), no
        extras; the client half trains the tensors of a global without middleware extras
        (:class:`~edge_agent.algorithms.fedcross.FedCrossClient`). ``None`` for a device without
        a slot this round (the round's global)."""
        slot = self.assignment.get(client_id)
        if slot is None:
            return None
        mine = self.middleware[slot]
        if len(mine) != len(tensors):  # the model's state entries, every one shared (share = all, buffers average)
            raise ValueError(f"FedCross: middleware model {slot} has {len(mine)} arrays, the global {len(tensors)}")
        own = tuple(np.asarray(w).astype(np.asarray(t).dtype, copy=False) for w, t in zip(mine, tensors, strict=True))
        return own, {}

    def validate(self, result: ClientResult) -> str | None:
        """Refuse an update from a device without a slot this round."""
        return None if result.client_id in self.assignment else f"{result.client_id} was given no middleware model"

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """Steps 2–4 of the module docstring."""
        if not results:
            return None
        trained = [list(w) for w in self.middleware]
        for r in results:
            trained[self.assignment[r.client_id]] = [np.asarray(t) for t in r.tensors]
        glob = weighted_average([r.tensors for r in results], [r.num_samples for r in results])
        if round >= self.first_stage_bound:
            collab = collaborators(trained, self.collab, round)
            new = cross_aggregate(trained, collab, self.alpha)
        else:
            collab = list(range(len(trained)))
            new = [[np.asarray(g).copy() for g in glob] for _ in trained]
        return GlobalUpdate(tensors=glob, state={"middleware": new},
                            metrics={"fedcross_collaborators": collab,
                                     "fedcross_slots": {r.client_id: self.assignment[r.client_id] for r in results}})

    def state_dict(self) -> dict:
        """The middleware models (flat), M and the initial model."""
        return {"models": self.models, "middleware": [flatten_state(w) for w in self.middleware]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (needs :meth:`bind_model` first, for the shapes)."""
        if not state:
            return
        self.models = int(state["models"])
        self.middleware = [unflatten_state(np.asarray(f), self.initial) for f in state["middleware"]]


def round_(x: float) -> int:
    """Python's round of ``x`` to an int (the name ``round`` is a hook argument here)."""
    return int(round(x))
