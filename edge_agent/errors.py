"""Exceptions of the edge agent.

Every exception that :mod:`edge_agent` raises on purpose derives from :class:`EdgeAgentError`,
so a caller that only wants "the agent failed" catches that one class. The branches are grouped
by what the caller can do about them::

    EdgeAgentError                 base of everything raised on purpose in ``edge_agent``
    ├── DataError                  a data set is missing, malformed, or has an unknown name:
    │                              put the files where the message says, or fix the name
    │                              (``dataset``, ``searched``, ``path``, ``field``)
    ├── PartitionError             bad arguments to a partitioner, or no partition meets the
    │                              constraints (e.g. ``min_samples``): change the arguments
    └── ModelError                 unknown model name, bad architecture arguments, or an input
                                   tensor whose shape the model cannot take

(``AgentError`` and ``ConfigError`` are reserved for the agent runtime and its configuration
loader; they will sit beside the classes above, directly under :class:`EdgeAgentError`.)

Foreign exceptions (``OSError`` and ``zipfile.BadZipFile`` from ``numpy.load``, ``RuntimeError``
from torchvision, ``TypeError`` from a model constructor) are converted once, where they
happen, with ``raise ... from exc``, so the original traceback is kept as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DataError", "EdgeAgentError", "ModelError", "PartitionError"]


class EdgeAgentError(Exception):
    """Base class of every exception raised on purpose by :mod:`edge_agent`."""


class DataError(EdgeAgentError):
    """A data set could not be found, could not be read, or its contents are malformed.

    Also raised for an unknown data-set name and for labels out of range.

    Attributes:
        dataset: the data-set name that was asked for (``"mnist"``), or ``None`` when the
            error is not about a named data set (e.g. a bad label array).
        searched: the locations tried, in the order they were tried, as strings (directories,
            files, or ``"torchvision:<root>"``); empty when nothing was searched.
        path: the file that was found but is unreadable or malformed, or ``None``.
        field: the npz field (``"x"``, ``"y"``) that is missing or malformed, or ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        dataset: str | None = None,
        searched: Sequence[str] = (),
        path: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.dataset = dataset
        self.searched: list[str] = [str(s) for s in searched]
        self.path = path
        self.field = field


class PartitionError(EdgeAgentError):
    """The arguments to a partitioner are invalid, or no partition satisfies them.

    Examples: ``num_clients`` < 1 or larger than the number of samples, ``alpha`` <= 0, an
    unknown scheme name, or a Dirichlet draw that never gives every client ``min_samples``
    samples within ``max_tries`` attempts.
    """


class LocalTestSplitError(PartitionError):
    """A shard too small for its local test set (``[data] client_test = "local"``): the
    fraction, rounded per class with each class keeping one training sample, holds out nothing.
    The message says which client and its per-class counts, and what to change."""


class ModelError(EdgeAgentError):
    """Unknown model name, invalid architecture arguments, or an input of the wrong shape."""
