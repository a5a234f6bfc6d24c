"""The server-side trainable prototypes shared by FedTGP, FedOCP and FedORGP (SPECS §6.2, §3.3,
§6.5): one network ``P = G(Emb(c))`` and the loop that trains it on one round's uploaded
prototypes; each strategy brings its own loss. :class:`PrototypeUploads` collects a round's
uploads for FedTGP, FedOCP, FedORGP and FedGH.

    P_c = fc(ReLU(W · Emb(c) + b)),   Emb ∈ R^{C×d}, W ∈ R^{d×d}, fc: R^d → R^d

(hidden width = d, as TsingZ0/FedTGP and FedORGP), initialised from a seed with PyTorch's
default initialisers (Emb ~ N(0, 1), Linear uniform) without touching the global RNG.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from ._base import GlobalUpdate

#: loss(uploaded prototypes [B, d], their classes int64 [B], all generated prototypes [C, d]).
PrototypeLoss = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]


def prototype_net(num_classes: int, dim: int, seed: int, embedding: np.ndarray | None = None) -> torch.nn.Module:
    """The trainable prototypes' network (module docstring), initialised from ``seed``;
    ``net(torch.arange(C))`` → [C, d]. ``embedding`` (float [C, d]) replaces Emb's N(0, 1) rows
    (FedOCP's ``server_orth_init``)."""
    import torch
    from torch import nn

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Embedding(num_classes, dim), nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
    if embedding is not None:
        with torch.no_grad():
            net[0].weight.copy_(torch.from_numpy(np.asarray(embedding, np.float32)))  # type: ignore[operator]
    return net


def train_prototype_net(net: torch.nn.Module, protos: np.ndarray, classes: np.ndarray, loss: PrototypeLoss, *,
                        epochs: int, lr: float, batch: int, seed: int) -> tuple[np.ndarray, list[np.ndarray], float]:
    """Train ``net`` in place: ``epochs`` epochs of plain SGD (lr ``lr``) over the (prototype,
    class) pairs in minibatches of ``batch``, shuffled each epoch by a generator seeded with
    ``seed``; every step recomputes all C generated prototypes and minimises
    ``loss(p_batch, c_batch, net(arange(C)))``.

    Args:
        net: from :func:`prototype_net` (its embedding fixes C).
        protos: float32 [N, d]; classes: int64 [N] in [0, C).

    Returns:
        (the generated prototypes float32 [C, d] in eval mode, the network's state as a list of
        arrays in ``state_dict`` order, the last batch's loss — NaN when no step ran).
    """
    import torch

    num_classes = int(next(iter(net.state_dict().values())).shape[0])  # the embedding [C, d] comes first
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    p_t, c_t = torch.from_numpy(np.asarray(protos, np.float32)), torch.from_numpy(np.asarray(classes, np.int64))
    all_classes = torch.arange(num_classes)
    last = float("nan")
    net.train()
    for _ in range(epochs):
        perm = torch.randperm(len(c_t), generator=gen)
        for start in range(0, len(c_t), batch):
            idx = perm[start:start + batch]
            value = loss(p_t[idx], c_t[idx], net(all_classes))
            opt.zero_grad()
            value.backward()
            opt.step()
            last = float(value.detach())
    net.eval()
    with torch.no_grad():
        glob = net(all_classes).numpy().astype(np.float32)
    return glob, [t.detach().numpy().copy() for t in net.state_dict().values()], last


def load_net_state(net: torch.nn.Module, state: Sequence[np.ndarray]) -> None:
    """Load a state saved by :func:`train_prototype_net` (``state_dict`` order)."""
    import torch

    net.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in zip(net.state_dict(), state, strict=True)})


def mean_interclass_cosine(prototypes: np.ndarray) -> float:
    """The mean cosine similarity over the K(K−1)/2 pairs of different rows of ``prototypes``
    [K, d] (K ≥ 2; NaN otherwise); rows of zero length count as cosine 0."""
    p = np.asarray(prototypes, np.float64)
    if p.ndim != 2 or p.shape[0] < 2:
        return float("nan")
    n = np.linalg.norm(p, axis=1, keepdims=True)
    u = np.divide(p, n, out=np.zeros_like(p), where=n > 0)
    g = u @ u.T
    iu = np.triu_indices(p.shape[0], 1)
    return float(g[iu].mean())


class PrototypeUploads(ABC):
    """One round's uploaded prototypes (``extras`` ``prototypes`` float [k, d] and
    ``proto_classes`` int [k]) per client: the collecting half of FedTGP's, FedOCP's, FedORGP's
    and FedGH's accumulators, whose :meth:`trained` runs on :meth:`stacked` at the round's close.

    Raises (from :meth:`add`):
        ValueError: a width d other than the round's earlier uploads' (or :meth:`known_width`).
    """

    def __init__(self, strategy, round: int) -> None:  # noqa: ANN001  (the strategy of the subclass)
        self.strategy, self.round = strategy, round
        self.pairs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.dim: int | None = None

    def known_width(self) -> int | None:
        """The width an upload must have before any arrived this round (``None``: any)."""
        return None

    def add(self, result) -> None:  # noqa: ANN001  (a ClientResult)
        """Keep one client's prototypes (see the class's Raises)."""
        p = np.asarray(result.extras["prototypes"], np.float32)
        c = np.asarray(result.extras["proto_classes"]).astype(np.int64)
        if p.shape[0]:
            known = self.dim if self.dim is not None else self.known_width()
            if known is not None and p.shape[1] != known:
                where = "the head's" if self.dim is None else "this round's"
                raise ValueError(f"prototype width {p.shape[1]} differs from {where} {known}")
            self.dim = p.shape[1]
        self.pairs[result.client_id] = (p, c)

    def train_network(self, protos: np.ndarray, classes: np.ndarray, loss: PrototypeLoss,
                      embedding: Callable[[int, int], np.ndarray | None] | None = None
                      ) -> tuple[np.ndarray, list[np.ndarray], float]:
        """Train the strategy's prototype network on this round's uploads (:meth:`stacked`): a
        network of C classes and width d (the bound model's classifier; unbound, the trained
        network's embedding, else the uploads' largest class + 1 and their width), initialised
        from ``server_seed`` (the first round: ``embedding(C, d)`` may replace Emb's rows) or
        loaded from the strategy's ``generator_state``, then :func:`train_prototype_net` with the
        strategy's ``server_epochs``, ``server_lr``, ``server_batch`` and a shuffling seed of
        (``server_seed``, round). The strategy's state is not changed (the driver commits it).

        Returns:
            as :func:`train_prototype_net`: (prototypes float32 [C, d], network state, last loss).

        Raises:
            ValueError: uploads of another width than the network's, or a class id ≥ C.
        """
        s = self.strategy
        if s.head is not None:
            num_classes, dim = s.head
        elif s.generator_state:  # unbound, resumed: the embedding [C, d] of the trained network
            num_classes, dim = (int(v) for v in np.shape(s.generator_state[0]))
        else:
            num_classes, dim = int(classes.max()) + 1, self.dim
        if dim != self.dim or classes.max() >= num_classes:
            raise ValueError(f"uploads of width {self.dim} / class {int(classes.max())} for C={num_classes}, d={dim}")
        emb = embedding(num_classes, dim) if embedding is not None and not s.generator_state else None
        net = prototype_net(num_classes, dim, s.server_seed, embedding=emb)
        if s.generator_state:
            load_net_state(net, s.generator_state)
        return train_prototype_net(net, protos, classes, loss, epochs=s.server_epochs, lr=s.server_lr,
                                   batch=s.server_batch, seed=s.server_seed * 1_000_003 + self.round)

    def result(self) -> GlobalUpdate | None:
        """The round's global: :meth:`trained` on :meth:`stacked` (``None`` when no prototype
        arrived)."""
        uploads = self.stacked()
        if uploads is None or self.dim is None:
            return None
        return self.trained(*uploads)

    @abstractmethod
    def trained(self, protos: np.ndarray, classes: np.ndarray) -> GlobalUpdate | None:
        """The method's server training on the round's uploads, float32 [N, d] and int64 [N]
        (FedTGP's, FedOCP's, FedORGP's, FedGH's): its global."""

    def stacked(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(prototypes float32 [N, d], classes int64 [N]) of every upload in client-id order, or
        ``None`` when no prototype arrived."""
        order = sorted(self.pairs)
        if not order or self.dim is None:
            return None
        return (np.concatenate([self.pairs[k][0].reshape(-1, self.dim) for k in order]),
                np.concatenate([self.pairs[k][1] for k in order]))
