"""The algorithm contract: every registered algorithm's two halves agree on what they declare,
and every hook resolves to the base class's default or an override."""

from __future__ import annotations

import inspect

from broker_server.strategies import BUFFERS, MODEL_REQUIREMENTS, SHARES, Strategy, get_strategy_class, list_strategies
from edge_agent.algorithms import ClientAlgorithm, get_client_algorithm_class, list_client_algorithms

SERVER_HOOKS = ("setup_kwargs", "bind_model", "on_join", "configure_round", "config_for_round", "global_extras",
                "validate", "accumulator", "aggregate", "skipped_round", "commit", "aggregate_metrics", "evaluate",
                "round_metrics", "state_dict", "load_state_dict")
CLIENT_HOOKS = ("setup_kwargs", "eval_split", "local_round", "before_step", "predict", "on_update_receipt")

#: what the join admission reads: prototype-only methods admit any architecture.
PROTOTYPE_ONLY = {"fedproto", "fedtgp", "fedgh", "fedocp", "fedorgp", "fedmcp", "enskd", "local"}


def _resolves(cls: type, base: type, hook: str) -> bool:
    """The class that defines ``hook`` for ``cls`` is ``base`` or a subclass of it."""
    owner = next(k for k in cls.__mro__ if hook in k.__dict__)
    return owner is base or issubclass(owner, base)


def test_both_registries_hold_the_same_algorithms() -> None:
    assert list_strategies() == list_client_algorithms()


def test_every_algorithm_declares_its_contract_on_both_halves() -> None:
    for name in list_strategies():
        s, c = get_strategy_class(name), get_client_algorithm_class(name)
        assert issubclass(s, Strategy) and issubclass(c, ClientAlgorithm), name
        assert s.name == c.name == name
        # declared on the class itself or inherited from a registered parent, never the base's silent default
        assert s.share in SHARES and c.share == s.share, name
        assert s.buffers in BUFFERS and c.buffers == s.buffers, name
        assert s.model_requirement in MODEL_REQUIREMENTS, name
        assert (s.model_requirement == "prototype") == (name in PROTOTYPE_ONLY), name
        if s.model_requirement == "prototype":  # no parameter averaging without a common architecture
            assert s.share == "none", name
        assert isinstance(s.instructions, tuple) and all(isinstance(k, str) and k for k in s.instructions), name
        for hook in SERVER_HOOKS:
            assert _resolves(s, Strategy, hook), (name, hook)
        for hook in CLIENT_HOOKS:
            assert _resolves(c, ClientAlgorithm, hook), (name, hook)
        params = inspect.signature(c.local_round).parameters
        assert "client_id" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()), name


def test_the_base_defaults_are_the_documented_ones() -> None:
    class Bare(Strategy):  # only the required hook: aggregation
        def aggregate(self, round, current, results):
            return None

    b = Bare()
    assert (Bare.share, Bare.buffers, Bare.model_requirement, Bare.instructions) == ("all", "average", "manifest", ())
    assert b.global_extras() == {} and b.validate(None) is None and b.round_metrics() == {}
    assert b.skipped_round(1, None) is None and b.state_dict() == {}
    plan = b.configure_round(1, ["b", "a"], None)
    assert plan.selected == ("a", "b") and dict(plan.config) == {} and dict(plan.instructions) == {}
    assert ClientAlgorithm.share == "all" and ClientAlgorithm.buffers == "average"


def test_the_training_step_hook_sees_every_step_of_every_shared_loop() -> None:
    """before_step runs once per optimizer step with the epoch and step numbers, in the loops of
    FedAvg and FedProx; an algorithm without one
    trains exactly as before (same weights, bit for bit)."""
    import numpy as np
    import torch

    from edge_agent.algorithms import TrainConfig
    from edge_agent.algorithms.fedavg import FedAvgClient
    from edge_agent.algorithms.fedprox import FedProxClient
    from edge_agent.models import build_model
    from edge_agent.state import state_arrays

    x = torch.from_numpy(np.random.default_rng(0).standard_normal((12, 1, 8, 8)).astype(np.float32))
    y = torch.from_numpy(np.arange(12) % 10)
    cfg = TrainConfig(local_epochs=2, batch_size=5)  # 3 steps per epoch (5, 5, 2)

    def run(algo):
        torch.manual_seed(0)
        m = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
        g = state_arrays(m)
        algo.local_round(m, g, x, y, cfg, round=4, client_id="d", client_index=0, device=torch.device("cpu"),
                         params={"mu": 0.01})
        return state_arrays(m)

    for base in (FedAvgClient, FedProxClient):
        class Counting(base):
            def __init__(self):
                super().__init__()
                self.steps = []

            def before_step(self, model, context):
                assert all(p.grad is not None for p in model.parameters())
                self.steps.append((context.round, context.epoch, context.step))

        counting = Counting()
        with_hook, without = run(counting), run(base())
        assert counting.steps == [(4, e, s) for e, s in [(0, 0), (0, 1), (0, 2), (1, 3), (1, 4), (1, 5)]]
        for a, b in zip(with_hook, without, strict=True):  # a hook that edits nothing changes nothing
            np.testing.assert_array_equal(a, b)
