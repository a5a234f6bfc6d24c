"""Reader of scikit-learn's 8×8 digits (``digits``; the stand-in for SVHN in ``digits_domains``),
which needs no file."""

from __future__ import annotations

import numpy as np

from edge_agent.data._records import RawSplits
from edge_agent.data._sampling import split_whole
from edge_agent.errors import DataError


def read_digits() -> RawSplits:
    """sklearn's 8×8 digits, values 0–16 mapped to uint8 by ``rint(v·255/16)``, split 80/20."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # the optional extra fedfleet[digits]
        raise DataError("data set 'digits' needs scikit-learn: pip install 'fedfleet[digits]' (or scikit-learn)",
                        dataset="digits") from exc
    bunch = load_digits()
    x = np.rint(np.asarray(bunch.images, dtype=np.float64) * (255.0 / 16.0)).astype(np.uint8)
    y = np.asarray(bunch.target, dtype=np.int64)
    return split_whole(x, y)
