"""FedGH, server half: a generalised global head trained on the uploaded prototypes (Yi et al.,
ACM MM 2023; SPECS.md §6.4; HtFLlib ``servergh``). The client half is
:mod:`edge_agent.algorithms.fedgh`.

The server keeps one head ``h(p) = W p + b`` (W ∈ R^{C×d}, b ∈ R^C), initialised once as
``torch.nn.Linear(d, C)`` from ``server_seed`` (PyTorch's default uniform initialiser, as the
code's copy of a fresh model head). Each round, from the uploaded prototypes {(p, c)}:

    ``server_epochs`` (1) epochs of SGD (lr ``server_lr`` = 0.01, minibatches of ``server_batch``
    = 10 = HtFLlib's client batch, shuffled by a generator seeded with (``server_seed``, round)) on
    L = CE(W p + b, c);  one step: W ← W − η·(1/B) Σ_b (softmax(W p_b + b) − e_{c_b}) p_bᵀ,
    b ← b − η·(1/B) Σ_b (softmax(W p_b + b) − e_{c_b}).

The trained head is broadcast as the extras ``head_weight`` float32 [C, d] and ``head_bias``
float32 [C]; every device overwrites its own head with it before training (the down traffic is
C·(d + 1)·4 bytes, the up traffic prototypes only: no model parameter leaves a device). Before
the first aggregation nothing is broadcast (each device starts from its own head). Metrics:
``gh_server_loss`` (the last batch's), ``prototype_classes`` (classes in the round's uploads),
``head_row_cosine`` (the mean cosine between different rows of W, FedGH's stand-in for the
global prototypes' separation). The head is the strategy's state (checkpointed); the round trains
a copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._base import ClientResult, GlobalUpdate, fold
from ._prototype_net import PrototypeUploads, mean_interclass_cosine
from ._registry import register_strategy
from ._trained_prototypes import ServerTrained

SERVER_EPOCHS = 1
SERVER_LR = 0.01
SERVER_BATCH = 10


def train_head(weight: np.ndarray, bias: np.ndarray, protos: np.ndarray, classes: np.ndarray, *, epochs: int,
               lr: float, batch: int, seed: int) -> tuple[np.ndarray, np.ndarray, float]:
    """SGD on CE(W p + b, c) from (``weight`` [C, d], ``bias`` [C]) over (``protos`` [N, d],
    ``classes`` int [N]) as the module docstring; returns (W float32, b float32, the last batch's
    loss, NaN when no step ran). The inputs are not modified."""
    import torch
    import torch.nn.functional as F

    w = torch.tensor(np.asarray(weight, np.float32), requires_grad=True)
    b = torch.tensor(np.asarray(bias, np.float32), requires_grad=True)
    opt = torch.optim.SGD([w, b], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    p_t, c_t = torch.from_numpy(np.asarray(protos, np.float32)), torch.from_numpy(np.asarray(classes, np.int64))
    last = float("nan")
    for _ in range(epochs):
        perm = torch.randperm(len(c_t), generator=gen)
        for start in range(0, len(c_t), batch):
            idx = perm[start:start + batch]
            loss = F.cross_entropy(p_t[idx] @ w.T + b, c_t[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            last = float(loss.detach())
    return w.detach().numpy().copy(), b.detach().numpy().copy(), last


def initial_head(num_classes: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``torch.nn.Linear(dim, num_classes)``'s weight [C, d] and bias [C] from ``seed`` (the global
    RNG untouched)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lin = torch.nn.Linear(dim, num_classes)
    return lin.weight.detach().numpy().copy(), lin.bias.detach().numpy().copy()


@register_strategy("fedgh")
class FedGH(ServerTrained):
    """FedGH strategy: FedProto's prototype validation, a server-trained global head down.

    Args:
        server_epochs (1), server_lr (0.01), server_batch (10), server_seed (0): module docstring.
        participation_rate, min_clients, train_config: as :class:`FedAvg`.

    Raises:
        ValueError: a value out of range.

    C and d come from the bound model's classifier; unbound, from the head once trained, else
    from the first round's uploads (d = their width, C = the largest class id + 1).
    """

    name = "fedgh"

    def __init__(self, *, server_epochs: int = SERVER_EPOCHS, server_lr: float = SERVER_LR,
                 server_batch: int = SERVER_BATCH, server_seed: int = 0, **base: object) -> None:
        super().__init__(server_epochs=server_epochs, server_lr=server_lr, server_batch=server_batch,
                         server_seed=server_seed, lambda_proto=0.0, **base)
        self.head_weight = np.zeros((0, 0), np.float32)
        self.head_bias = np.zeros(0, np.float32)

    def accumulator(self, round: int, current: Sequence[np.ndarray]) -> FedGHAccumulator:  # type: ignore[override]
        """Buffers the round's (prototype, class) pairs; trains the head at the close."""
        return FedGHAccumulator(self, round)

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """The round's trained head from ``results`` (``None`` when none came back)."""
        return fold(self.accumulator(round, current), results)

    def global_extras(self) -> dict[str, np.ndarray]:
        """``head_weight`` [C, d] and ``head_bias`` [C] float32; ``{}`` before the first round."""
        if not self.head_bias.size:
            return {}
        return {"head_weight": self.head_weight, "head_bias": self.head_bias}

    def state_dict(self) -> dict:
        return {"head_weight": self.head_weight, "head_bias": self.head_bias}

    def load_state_dict(self, state: dict) -> None:
        self.head_weight = np.asarray(state.get("head_weight", np.zeros((0, 0))), np.float32)
        self.head_bias = np.asarray(state.get("head_bias", np.zeros(0)), np.float32)


class FedGHAccumulator(PrototypeUploads):
    """One round of :class:`FedGH`: the uploaded prototypes, then the head's training (an upload's
    width must be the trained head's, once there is one)."""

    def known_width(self) -> int | None:
        s = self.strategy
        return int(s.head_weight.shape[1]) if s.head_bias.size else None

    def trained(self, protos: np.ndarray, classes: np.ndarray) -> GlobalUpdate | None:
        s = self.strategy
        if s.head_bias.size:
            w0, b0 = s.head_weight, s.head_bias
        else:
            num_classes, dim = s.head if s.head is not None else (int(classes.max()) + 1, int(protos.shape[1]))
            w0, b0 = initial_head(num_classes, dim, s.server_seed)
        if w0.shape[1] != self.dim or classes.max() >= w0.shape[0]:
            raise ValueError(f"uploads of width {self.dim} / class {int(classes.max())} for a head {list(w0.shape)}")
        w, b, last = train_head(w0, b0, protos, classes, epochs=s.server_epochs, lr=s.server_lr,
                                batch=s.server_batch, seed=s.server_seed * 1_000_003 + self.round)
        metrics: dict[str, float | int] = {"prototype_classes": int(np.unique(classes).size),
                                           "head_row_cosine": mean_interclass_cosine(w)}
        if last == last:
            metrics["gh_server_loss"] = last
        return GlobalUpdate(tensors=[], extras={"head_weight": w, "head_bias": b},
                            state={"head_weight": w, "head_bias": b}, metrics=metrics)
