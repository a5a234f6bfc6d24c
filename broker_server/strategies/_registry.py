"""Name → server-strategy class registry (a duplicate name is an error)."""

from __future__ import annotations

from edge_agent.registry import Registry

from ..errors import ConfigError

_REGISTRY = Registry("strategy", ConfigError)

register_strategy = _REGISTRY.register
list_strategies = _REGISTRY.names
get_strategy = _REGISTRY.get
get_strategy_class = _REGISTRY.get_class
