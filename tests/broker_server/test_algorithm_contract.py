"""The algorithm contract: every registered algorithm's two halves agree on what they declare,
and every hook resolves to the base class's default or an override."""

from __future__ import annotations

import inspect

from broker_server.strategies import BUFFERS, MODEL_REQUIREMENTS, SHARES, Strategy, get_strategy_class, list_strategies
from edge_agent.algorithms import ClientAlgorithm, get_client_algorithm_class, list_client_algorithms

SERVER_HOOKS = ("setup_kwargs", "bind_model", "configure_round", "global_extras", "validate", "accumulator",
                "aggregate", "skipped_round", "commit", "round_metrics", "state_dict", "load_state_dict")
CLIENT_HOOKS = ("setup_kwargs", "eval_split", "local_round", "before_step", "predict", "on_update_receipt")

#: what the join admission reads: prototype-only methods admit any architecture.
PROTOTYPE_ONLY = {"fedproto", "fedmcp", "enskd", "local"}


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
    class Bare(Strategy):
        pass

    b = Bare()
    assert (Bare.share, Bare.buffers, Bare.model_requirement, Bare.instructions) == ("all", "average", "manifest", ())
    assert b.global_extras() == {} and b.validate(None) is None and b.round_metrics() == {}
    assert b.skipped_round(1, None) is None and b.state_dict() == {}
    plan = b.configure_round(1, ["b", "a"], None)
    assert plan.selected == ("a", "b") and dict(plan.config) == {} and dict(plan.instructions) == {}
    assert ClientAlgorithm.share == "all" and ClientAlgorithm.buffers == "average"
