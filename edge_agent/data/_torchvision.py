"""Reader of torchvision's folder layouts (MNIST-family idx files, USPS bz2, CIFAR-10 batches,
SVHN ``.mat``, STL-10 binaries), opened through ``torchvision.datasets``, which may also
download them (see ``_download.py`` for where a download goes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge_agent.data._images import resize_bilinear
from edge_agent.data._records import DatasetInfo, RawSplits, validate_raw
from edge_agent.errors import DataError

TORCHVISION_MARKERS: dict[str, tuple[str, ...]] = {
    "MNIST": tuple(
        f"MNIST/raw/{s}-{k}-ubyte"
        for s in ("train", "t10k")
        for k in ("images-idx3", "labels-idx1")
    ),
    "FashionMNIST": tuple(
        f"FashionMNIST/raw/{s}-{k}-ubyte"
        for s in ("train", "t10k")
        for k in ("images-idx3", "labels-idx1")
    ),
    "USPS": ("usps.bz2", "usps.t.bz2"),
    "CIFAR10": ("cifar-10-batches-py/data_batch_1", "cifar-10-batches-py/test_batch"),
    "SVHN": ("train_32x32.mat", "test_32x32.mat"),
    "KMNIST": tuple(
        f"KMNIST/raw/{s}-{k}-ubyte"
        for s in ("train", "t10k")
        for k in ("images-idx3", "labels-idx1")
    ),
    # torchvision's STL10 checks the MD5 of all five files (unlabeled_X.bin too) before opening
    "STL10": tuple(f"stl10_binary/{s}_{k}.bin" for s in ("train", "test") for k in ("X", "y"))
    + ("stl10_binary/unlabeled_X.bin",),
}
"""Files (relative to a torchvision root) whose presence means "this layout is here", per
``torchvision.datasets`` class name."""


def layout_present(tv_name: str, root: Path) -> bool:
    """True when every marker file of torchvision class ``tv_name`` is a file under ``root``."""
    return all((root / rel).is_file() for rel in TORCHVISION_MARKERS[tv_name])


def read_torchvision(
    info: DatasetInfo, root: Path, *, download: bool
) -> RawSplits:
    """Open (or download) ``info.torchvision`` under ``root``, both splits.

    SVHN and STL-10 come as NCHW and are transposed to NHWC; STL-10's 96×96 images are resized
    to ``info.image_size`` (:func:`~edge_agent.data.resize_bilinear`).

    Returns:
        ``(x_train, y_train, x_test, y_test)``: uint8 ``[N, S, S]`` or ``[N, S, S, 3]``, int64
        ``[N]`` (validated against ``info``).

    Raises:
        DataError: torchvision is missing or fails (not found, corrupt, no network; the original
            exception is ``__cause__``), or the arrays do not match ``info``.
    """
    what = "download into" if download else "open the layout under"
    try:
        import torchvision.datasets as tvd

        cls = getattr(tvd, str(info.torchvision))
        out: list[np.ndarray] = []
        for train in (True, False):
            if info.torchvision in ("SVHN", "STL10"):
                ds = cls(str(root), split="train" if train else "test", download=download)
                x = np.asarray(ds.data, dtype=np.uint8).transpose(0, 2, 3, 1)  # NCHW -> NHWC
                y = np.asarray(ds.labels)
                # STL-10 is 96×96: resized to the table's 32×32 (SPECS §5.1: the light CNN's
                # RGB figures assume 32×32 input)
                x = resize_bilinear(np.ascontiguousarray(x), info.image_size)
            else:
                ds = cls(str(root), train=train, download=download)
                data = ds.data.numpy() if hasattr(ds.data, "numpy") else ds.data
                x = np.asarray(data, dtype=np.uint8)
                targets = ds.targets
                y = np.asarray(targets.numpy() if hasattr(targets, "numpy") else targets)
            out.extend((np.ascontiguousarray(x), y.astype(np.int64)))
    except DataError:
        raise
    except Exception as exc:  # torchvision raises RuntimeError, OSError, URLError, ...
        raise DataError(
            f"data set {info.name!r}: torchvision could not {what} {root} "
            f"({type(exc).__name__}: {exc})",
            dataset=info.name,
            searched=[f"torchvision:{root}"],
            path=str(root),
        ) from exc
    x_tr, y_tr, x_te, y_te = out
    for x, y, split in ((x_tr, y_tr, "train"), (x_te, y_te, "test")):
        validate_raw(x, y, info, f"torchvision:{root} ({split})")
    return x_tr, y_tr, x_te, y_te
