"""FedOCP, server half: trainable global prototypes refined by a contrastive loss (SPECS.md §3.3;
the client half, with the orthogonal initialisation and the local loss, is
:mod:`edge_agent.algorithms.fedocp`).

The server keeps trainable class embeddings and a two-layer generator, the network FedTGP uses
(:func:`~broker_server.strategies._prototype_net.prototype_net`): ``P_c = G(Emb(c))``,
G = Linear(d, d) → ReLU → Linear(d, d). Each round, from the uploaded client prototypes
{(p, c)} (one per local class per client):

1. ``server_epochs`` epochs of SGD (lr ``server_lr``, batch ``server_batch``, shuffled by a
   generator seeded with (``server_seed``, round)) on the contrastive loss

       L_s = mean_b −log( exp(cos(p_b, P_{c_b})/τ_s) / Σ_{c'} exp(cos(p_b, P_{c'})/τ_s) )

   (a client prototype and its class's global prototype are the positive pair, the other
   classes' global prototypes the negatives; :func:`~edge_agent.algorithms.fedocp.prototype_infonce`,
   the same function the clients use), all C generated prototypes recomputed every step;
2. the refined P_c of every class (eval mode, detached, float32) are broadcast as FedProto's
   ``prototypes`` [C, d] / ``proto_classes`` [C].

Every value SPECS does not fix is an ``[algorithm]`` key (SPECS §7.3), with its default and why:

============================  ========  ========================================================
key                           default   reason
============================  ========  ========================================================
``lambda_align``              1.0       λ_a of L_align = mean(1 − cos(z, P_y)): FedORGP's code
                                        default λ_c = 1 (its paper's best 100 is for its own
                                        loss without L_con)
``lambda_orth``               1.0       λ_o of ‖ŴŴᵀ − I‖_F: unstated (sensitivity plot only);
                                        1 keeps it on the CE scale
``lambda_con``                1.0       λ_c of the client InfoNCE: unstated; 1 as above
``tau_client``, ``tau_server``  0.1     τ of both InfoNCE losses: unstated; 0.1, the usual
                                        temperature for cosine logits (SupCon 0.07–0.1)
``server_epochs``             100       FedTGP's, the same generator; FedORGP uses 1, which in
                                        a few-round run leaves the prototypes near random
``server_lr``                 0.01      FedORGP and FedTGP (= the clients' lr)
``server_batch``              32        FedORGP §5.1 (batch 32 for client and server)
``server_seed``               0         the generator's initial weights and the shuffling
``server_orth_init``          false     Emb rows = √d × orthogonal anchors instead of N(0, 1)
                                        (the FedDOR abstract's "orthogonally initializing
                                        prototype embeddings"; SPECS §7.3 open)
``anchor_seed``               0         the shared seed of the clients' orthogonal heads
``anchor_steps``              2000      optimisation steps of the anchors when C > d (hpn)
``orth_init``                 true      ablation switch: false = clients keep a random head
``server_contrastive``        true      ablation switch: false = global prototypes are the
                                        unweighted class means of the uploads (FedProto's rule)
``client_orthogonality``      true      ablation switch: false sends λ_o = 0
``client_contrastive``        true      ablation switch: false sends λ_c = 0
============================  ========  ========================================================

The network's state is the strategy's (checkpointed); the round trains a copy, so nothing changes
before the driver commits. Metrics: ``prototype_classes``, ``global_prototype_cosine`` (the mean
cosine between the broadcast prototypes of different classes), ``ocp_server_loss`` (the last
batch's), ``ocp_anchor_mismatches`` (updates whose ``ocp_anchor_digest`` differs from the
server's own anchors; each one also logged as a warning).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ._base import ClientResult, GlobalUpdate, RoundPlan
from ._prototype_net import PrototypeUploads, mean_interclass_cosine
from ._registry import register_strategy
from ._trained_prototypes import TrainedPrototypes, trained_update
from .fedavg import FedAvg
from .fedopt import check_range
from .fedproto import PrototypeAccumulator

if TYPE_CHECKING:
    import numpy.random

log = logging.getLogger(__name__)

LAMBDA_ALIGN = 1.0
LAMBDA_ORTH = 1.0
LAMBDA_CON = 1.0
TAU = 0.1
SERVER_EPOCHS = 100
SERVER_LR = 0.01
SERVER_BATCH = 32
ANCHOR_STEPS = 2000


def _int(key: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key} must be an int >= {low}, got {value!r}")
    return value


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


class FedOCPAccumulator(PrototypeUploads):
    """One round of :class:`FedOCP`: the uploaded prototypes, then the server's training (or,
    with ``server_contrastive = false``, FedProto's class means)."""

    def __init__(self, strategy: FedOCP, round: int) -> None:
        super().__init__(strategy, round)
        self.mismatches = 0

    def add(self, result: ClientResult) -> None:
        """Keep one client's prototypes; count (and log) an anchor digest other than the server's.

        Raises:
            ValueError: a width that differs from the round's earlier uploads.
        """
        super().add(result)
        expected = self.strategy.anchor_digest()
        got = result.metrics.get("ocp_anchor_digest")
        if expected is not None and got is not None and got != expected:
            self.mismatches += 1
            log.warning("fedocp round %d: %s holds orthogonal anchors with digest %s, the server's are %s "
                        "(another platform computed another matrix); its prototypes are used", self.round,
                        result.client_id, got, expected)

    def trained(self, protos: np.ndarray, classes: np.ndarray) -> GlobalUpdate | None:
        s = self.strategy
        order = sorted(self.pairs)
        metrics: dict[str, float | int] = {"ocp_anchor_mismatches": self.mismatches}
        if not s.server_contrastive:  # the ablation: FedProto's unweighted class means
            acc = PrototypeAccumulator("uniform")
            for k in order:
                acc.add(*self.pairs[k])
            glob, ids = acc.result()
            metrics["prototype_classes"] = int(ids.size)
            if ids.size >= 2:
                metrics["global_prototype_cosine"] = mean_interclass_cosine(glob)
            return GlobalUpdate(tensors=[], extras={"prototypes": glob, "proto_classes": ids},
                                state={"prototypes": glob, "proto_classes": ids}, metrics=metrics)
        import torch

        from edge_agent.algorithms.fedocp import orthogonal_anchors, prototype_infonce

        def anchors(num_classes: int, dim: int) -> np.ndarray | None:
            """Emb's first rows: √d × the orthogonal anchors with ``server_orth_init``."""
            if not s.server_orth_init:
                return None
            return orthogonal_anchors(num_classes, dim, s.server_seed, s.anchor_steps) * math.sqrt(dim)

        glob, state, last = self.train_network(
            protos, classes, lambda p, c, centers: prototype_infonce(
                p, c, centers, torch.ones(centers.shape[0], dtype=torch.bool), s.tau_server), embedding=anchors)
        if last == last:
            metrics["ocp_server_loss"] = last
        return trained_update(glob, state, metrics)


@register_strategy("fedocp")
class FedOCP(TrainedPrototypes):
    """FedOCP strategy: FedProto's exchange and validation, contrastively trained prototypes.

    Args:
        lambda_align, lambda_orth, lambda_con, tau_client, tau_server, server_epochs, server_lr,
        server_batch, server_seed, server_orth_init, anchor_seed, anchor_steps, orth_init,
        server_contrastive, client_orthogonality, client_contrastive: the table of the module
        docstring.
        participation_rate, min_clients, train_config: as :class:`FedAvg`.

    Raises:
        ValueError: a value out of range or of the wrong type, naming the key.

    C and d come from the bound model's classifier (:meth:`bind_model`); unbound, from the
    network's embedding once trained, else from the first round's uploads.
    """

    name = "fedocp"
    accumulator_class = FedOCPAccumulator

    def __init__(self, *, lambda_align: float = LAMBDA_ALIGN, lambda_orth: float = LAMBDA_ORTH,
                 lambda_con: float = LAMBDA_CON, tau_client: float = TAU, tau_server: float = TAU,
                 server_epochs: int = SERVER_EPOCHS, server_lr: float = SERVER_LR, server_batch: int = SERVER_BATCH,
                 server_seed: int = 0, server_orth_init: bool = False, anchor_seed: int = 0,
                 anchor_steps: int = ANCHOR_STEPS, orth_init: bool = True, server_contrastive: bool = True,
                 client_orthogonality: bool = True, client_contrastive: bool = True, **base: object) -> None:
        super().__init__(server_epochs=server_epochs, server_lr=server_lr, server_batch=server_batch,
                         server_seed=server_seed, lambda_proto=0.0, **base)
        self.lambda_align = check_range("lambda_align", lambda_align, 0.0, np.inf)
        self.lambda_orth = check_range("lambda_orth", lambda_orth, 0.0, np.inf)
        self.lambda_con = check_range("lambda_con", lambda_con, 0.0, np.inf)
        self.tau_client = check_range("tau_client", tau_client, 0.0, np.inf, low_open=True)
        self.tau_server = check_range("tau_server", tau_server, 0.0, np.inf, low_open=True)
        self.anchor_seed = _int("anchor_seed", anchor_seed, 0)
        self.anchor_steps = _int("anchor_steps", anchor_steps, 0)
        self.server_orth_init = _bool("server_orth_init", server_orth_init)
        self.orth_init = _bool("orth_init", orth_init)
        self.server_contrastive = _bool("server_contrastive", server_contrastive)
        self.client_orthogonality = _bool("client_orthogonality", client_orthogonality)
        self.client_contrastive = _bool("client_contrastive", client_contrastive)
        self._digest: str | None = None

    def configure_round(self, round: int, available: Sequence[str], rng: numpy.random.Generator) -> RoundPlan:
        """FedAvg's client selection; the client keys of the module docstring in the config
        (λ_o and λ_c as 0 when their switch is off)."""
        plan = FedAvg.configure_round(self, round, available, rng)
        config = {**plan.config, "lambda_align": self.lambda_align,
                  "lambda_orth": self.lambda_orth if self.client_orthogonality else 0.0,
                  "lambda_con": self.lambda_con if self.client_contrastive else 0.0,
                  "tau_client": self.tau_client, "orth_init": self.orth_init, "anchor_seed": self.anchor_seed,
                  "anchor_steps": self.anchor_steps}
        return RoundPlan(selected=plan.selected, config=config)

    def anchor_digest(self) -> str | None:
        """The digest of the anchors the clients should hold (bound model only; ``None`` unbound
        or without the orthogonal init)."""
        if not self.orth_init or self.head is None:
            return None
        if self._digest is None:
            from edge_agent.algorithms.fedocp import anchor_digest, orthogonal_anchors

            self._digest = anchor_digest(orthogonal_anchors(*self.head, self.anchor_seed, self.anchor_steps))
        return self._digest
