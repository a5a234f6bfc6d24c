"""Dispatch from what :func:`~edge_agent.data._folders.locate` found to the reader of that kind
(npz, torchvision, scikit-learn, a registered factory), before any conversion."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge_agent.data._factory import factory_name, read_factory
from edge_agent.data._npz import read_npz
from edge_agent.data._records import DatasetInfo, empty_raw
from edge_agent.data._sampling import split_whole
from edge_agent.data._sklearn import read_digits
from edge_agent.data._torchvision import read_torchvision
from edge_agent.errors import DataError


def read_raw(
    info: DatasetInfo, kind: str, location: tuple[str, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    """Read one single-domain set found by ``_folders.locate``, before any conversion.

    Args:
        info: the set's registry entry.
        kind, location: as ``_folders.locate`` returned them.

    Returns:
        ``(x_train, y_train, x_test, y_test, source)``: uint8 images ``[N, S, S]`` or
        ``[N, S, S, 3]`` (validated), int64 labels ``[N]``, and the text for
        :attr:`~edge_agent.data.Dataset.source`.

    Raises:
        DataError: the reader's (a file unreadable or malformed, torchvision failing, a factory
            breaking its contract).
    """
    name = info.name
    if kind == "sklearn":
        x_tr, y_tr, x_te, y_te = read_digits()
        source = "sklearn"
    elif kind == "npz":
        if info.whole_file is not None:
            x, y = read_npz(Path(location[0]), info)
            source = location[0]
            x_tr, y_tr, x_te, y_te = split_whole(x, y)
        else:
            arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
            paths = iter(location)
            for split, rel in (("train", info.train_file), ("test", info.test_file)):
                if rel is None:
                    arrays[split] = empty_raw(info)
                else:
                    arrays[split] = read_npz(Path(next(paths)), info)
            (x_tr, y_tr), (x_te, y_te) = arrays["train"], arrays["test"]
            source = str(Path(location[-1]).parent)
    elif kind == "torchvision":
        root = Path(location[0])
        x_tr, y_tr, x_te, y_te = read_torchvision(info, root, download=False)
        source = f"torchvision:{root}"
    elif kind == "factory":
        x_tr, y_tr, x_te, y_te = read_factory(info, Path(location[0]) if location else None)
        source = f"factory:{factory_name(info)}"
    else:  # pragma: no cover - internal misuse
        raise DataError(f"internal error: unknown loader kind {kind!r}", dataset=name)
    return x_tr, y_tr, x_te, y_te, source
