"""The common half of the strategies whose server trains its global prototypes (FedTGP, FedOCP,
FedORGP; SPECS §6.2, §3.3, §6.5): FedProto's exchange and validation, the server keys of the
prototype network (:mod:`broker_server.strategies._prototype_net`), its state in the checkpoint,
and a round folded by the strategy's own accumulator, which brings the loss."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from ._base import ClientResult, GlobalUpdate, fold
from ._prototype_net import PrototypeUploads, mean_interclass_cosine
from .fedopt import check_range
from .fedproto import FedProto


class ServerTrained(FedProto):
    """FedProto's exchange with a server that trains on the uploaded prototypes each round
    (FedGH's head; the prototype networks of :class:`TrainedPrototypes`): the four server keys.

    Args:
        server_epochs: epochs over the round's uploads (int ≥ 0).
        server_lr: SGD learning rate (> 0).
        server_batch: uploads per step (int ≥ 1).
        server_seed: the initial weights and the shuffling (int ≥ 0).
        lambda_proto: FedProto's λ sent to the clients (0: the method's clients use their own keys).
        base: as :class:`FedProto` (participation_rate, min_clients, train_config).

    Raises:
        ValueError: a value out of range or of the wrong type, naming the key.
    """

    share = "none"
    buffers = "average"
    model_requirement = "prototype"
    instructions = ()
    #: FedProto's keys this family sets itself (uniform class means; λ_proto only where the method
    #: sends one, FedTGP, which declares it again): not ``[algorithm]`` keys
    #: (:func:`edge_agent.plugins.accepted_keywords`)
    fixed_keywords: ClassVar[tuple[str, ...]] = ("weighting", "lambda_proto")

    def __init__(self, *, server_epochs: int, server_lr: float, server_batch: int, server_seed: int,
                 lambda_proto: float = 0.0, **base: object) -> None:
        super().__init__(lambda_proto=lambda_proto, weighting="uniform", **base)
        for key, value, low in (("server_epochs", server_epochs, 0), ("server_batch", server_batch, 1),
                                ("server_seed", server_seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{key} must be an int >= {low}, got {value!r}")
        self.server_epochs, self.server_batch, self.server_seed = server_epochs, server_batch, server_seed
        self.server_lr = check_range("server_lr", server_lr, 0.0, np.inf, low_open=True)


class TrainedPrototypes(ServerTrained):
    """:class:`ServerTrained` with a prototype network (abstract: a subclass names its
    :attr:`accumulator_class`, whose ``result`` trains the network with the method's loss;
    :meth:`~broker_server.strategies._prototype_net.PrototypeUploads.train_network`).

    Args and Raises: as :class:`ServerTrained`.
    """

    #: the round's accumulator: collects the uploads and trains the network at the close
    accumulator_class: ClassVar[type[PrototypeUploads]]

    def __init__(self, *, server_epochs: int, server_lr: float, server_batch: int, server_seed: int,
                 lambda_proto: float = 0.0, **base: object) -> None:
        super().__init__(server_epochs=server_epochs, server_lr=server_lr, server_batch=server_batch,
                         server_seed=server_seed, lambda_proto=lambda_proto, **base)
        self.generator_state: list[np.ndarray] = []  # the prototype network's state, in state_dict order

    def accumulator(self, round: int, current: Sequence[np.ndarray]) -> PrototypeUploads:  # type: ignore[override]
        """Buffers the round's (prototype, class) pairs; trains the prototypes at the close."""
        return self.accumulator_class(self, round)

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """The round's trained prototypes from ``results`` (``None`` when none came back)."""
        return fold(self.accumulator(round, current), results)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "generator_state": list(self.generator_state)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.generator_state = [np.asarray(a, np.float32) for a in state.get("generator_state", [])]


def trained_update(glob: np.ndarray, state: list[np.ndarray], metrics: dict[str, float | int]) -> GlobalUpdate:
    """The round's global of a :class:`TrainedPrototypes` strategy: every class's prototype
    ``glob`` float32 [C, d] broadcast as ``prototypes`` / ``proto_classes`` (int64 [C]), the
    network's ``state`` committed as ``generator_state``, and ``metrics`` with
    ``prototype_classes`` and ``global_prototype_cosine`` (the mean cosine between different
    classes' prototypes) added."""
    ids = np.arange(glob.shape[0], dtype=np.int64)
    metrics = {**metrics, "prototype_classes": int(glob.shape[0]),
               "global_prototype_cosine": mean_interclass_cosine(glob)}
    return GlobalUpdate(tensors=[], extras={"prototypes": glob, "proto_classes": ids},
                        state={"prototypes": glob, "proto_classes": ids, "generator_state": state}, metrics=metrics)
