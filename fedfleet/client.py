"""The client half of the public API: what runs on a device. Imports ``edge_agent`` only (never
``broker_server``), so a device's copy of a user's client module stays free of server code.

A client algorithm subclasses :class:`ClientAlgorithm` and implements ``local_round`` (see its
docstring and the hook table of the README); the shared SGD loop :func:`sgd_epochs` takes a
``loss_fn`` and the ``before_step`` hook. A data set is a factory declared with
:func:`dataset_factory`; a model is a factory ``(num_classes, in_channels, image_size,
feature_dim) -> torch.nn.Module`` with ``features``/``head``/``classifier`` (checked by
:func:`check_model`).
"""

from __future__ import annotations

from edge_agent.algorithms import BUFFERS, SHARES, ClientAlgorithm, LocalResult, StepContext, TrainConfig
from edge_agent.algorithms._base import FeatureModel, StateOnReceipt, step_hook
from edge_agent.algorithms.fedavg import FedAvgClient, LossFn, cross_entropy_loss, sgd_epochs, shuffle_generator
from edge_agent.data import ArraySplit, Dataset, dataset_factory, load_dataset
from edge_agent.models import LightCNN, check_model, make_model
from edge_agent.plugins import Algorithm

__all__ = [
    "Algorithm", "ArraySplit", "BUFFERS", "ClientAlgorithm", "Dataset", "FeatureModel", "FedAvgClient", "LightCNN",
    "LocalResult", "LossFn", "SHARES", "StateOnReceipt", "StepContext", "TrainConfig", "check_model",
    "cross_entropy_loss", "dataset_factory", "load_dataset", "make_model", "sgd_epochs", "shuffle_generator",
    "step_hook",
]
