"""Name → client-algorithm class registry (a duplicate name is an error)."""

from __future__ import annotations

from ..errors import EdgeAgentError
from ..registry import Registry

_REGISTRY = Registry("client algorithm", EdgeAgentError)

register_client_algorithm = _REGISTRY.register
list_client_algorithms = _REGISTRY.names
get_client_algorithm = _REGISTRY.get
get_client_algorithm_class = _REGISTRY.get_class
