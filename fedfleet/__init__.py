"""fedfleet's public Python API: bring your own algorithm, data set and model, and run a
simulation, a server or an agent from Python.

Everything public is in ``__all__`` and documented in the README ("Bring your own code"); the
names come from three modules, loaded on first use so that a device importing only the client
half never imports the server's code:

* :mod:`fedfleet.client` — the client half (:class:`ClientAlgorithm`, :func:`sgd_epochs`,
  :func:`dataset_factory`, :func:`make_model` …), ``edge_agent`` only;
* :mod:`fedfleet.server` — the server half (:class:`Strategy`, :class:`FedAvg`,
  :class:`GlobalUpdate` …);
* :mod:`fedfleet.api` — :func:`run_simulation`, :func:`run_server`, :func:`run_agent`,
  :class:`History`, :func:`load_config`.

:data:`API_VERSION` is the version of this API: it goes up when a name in ``__all__`` changes in
a way that breaks code written against it (a hook's arguments, a record's fields). It is not the
wire protocol's version (``protocol.PROTOCOL_VERSION``, 1), nor the package's (``__version__``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: The package version (the ``version`` of pyproject.toml).
__version__ = "0.1.0"

#: The public API's version: 1 = the contract of this release (see the module docstring).
API_VERSION = 1

_CLIENT = ("Algorithm", "ArraySplit", "BUFFERS", "ClientAlgorithm", "Dataset", "FeatureModel", "FedAvgClient",
           "LightCNN", "LocalResult", "LossFn", "SHARES", "StateOnReceipt", "StepContext", "TrainConfig",
           "check_model", "cross_entropy_loss", "dataset_factory", "load_dataset", "make_model", "sgd_epochs",
           "shuffle_generator", "step_hook")
_SERVER = ("Accumulator", "BufferedAccumulator", "ClientReport", "ClientResult", "FedAvg", "GlobalUpdate",
           "RoundPlan", "RunningWeightedSum", "Scalar", "Strategy", "classifier_shape", "parameter_count",
           "select_clients", "weighted_average")
_API = ("AgentHistory", "History", "load_config", "run_agent", "run_server", "run_simulation")
_CONFIG = ("Config", "ConfigError")

_WHERE = {**{n: "fedfleet.client" for n in _CLIENT}, **{n: "fedfleet.server" for n in _SERVER},
          **{n: "fedfleet.api" for n in _API}, "Config": "broker_server.config", "ConfigError": "broker_server.errors"}

__all__ = [
    "API_VERSION", "Accumulator", "AgentHistory", "Algorithm", "ArraySplit", "BUFFERS", "BufferedAccumulator",
    "ClientAlgorithm", "ClientReport", "ClientResult", "Config", "ConfigError", "Dataset", "FeatureModel", "FedAvg",
    "FedAvgClient", "GlobalUpdate", "History", "LightCNN", "LocalResult", "LossFn", "RoundPlan",
    "RunningWeightedSum", "SHARES", "Scalar", "StateOnReceipt", "StepContext", "Strategy", "TrainConfig",
    "__version__", "check_model", "classifier_shape", "cross_entropy_loss", "dataset_factory", "load_config",
    "load_dataset", "make_model", "parameter_count", "run_agent", "run_server", "run_simulation", "select_clients",
    "sgd_epochs", "shuffle_generator", "step_hook", "weighted_average",
]


def __getattr__(name: str) -> Any:
    """The public name ``name``, imported from its module on first use (PEP 562)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'fedfleet' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)


if TYPE_CHECKING:  # the names for type checkers and editors
    from broker_server.config import Config
    from broker_server.errors import ConfigError

    from .api import AgentHistory, History, load_config, run_agent, run_server, run_simulation
    from .client import (
        BUFFERS,
        SHARES,
        Algorithm,
        ArraySplit,
        ClientAlgorithm,
        Dataset,
        FeatureModel,
        FedAvgClient,
        LightCNN,
        LocalResult,
        LossFn,
        StateOnReceipt,
        StepContext,
        TrainConfig,
        check_model,
        cross_entropy_loss,
        dataset_factory,
        load_dataset,
        make_model,
        sgd_epochs,
        shuffle_generator,
        step_hook,
    )
    from .server import (
        Accumulator,
        BufferedAccumulator,
        ClientReport,
        ClientResult,
        FedAvg,
        GlobalUpdate,
        RoundPlan,
        RunningWeightedSum,
        Scalar,
        Strategy,
        classifier_shape,
        parameter_count,
        select_clients,
        weighted_average,
    )
