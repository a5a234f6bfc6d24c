"""Loading: :func:`load_dataset` (find, read, convert, cache) and :func:`clear_dataset_cache`."""

from __future__ import annotations

import functools
import os

import numpy as np

from edge_agent.data import _domains, _sampling
from edge_agent.data._domains import load_domains
from edge_agent.data._folders import locate
from edge_agent.data._images import normalize_images
from edge_agent.data._read import read_raw
from edge_agent.data._records import ArraySplit, Dataset, DatasetInfo
from edge_agent.data._registry import MULTI_DOMAIN, dataset_info
from edge_agent.data._sampling import check_cap
from edge_agent.errors import DataError

_CACHE_SIZE = 8  # single-domain sets kept per process


def load_dataset(
    name: str,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    allow_download: bool | None = None,
    domain_train_cap: int = 0,
    domain_test_cap: int = 0,
) -> Dataset:
    """Load data set ``name``, searching the locations in the order of the module docstring.

    Args:
        name: one of :func:`list_datasets`.
        data_dir: a directory laid out like ``shared/data`` (``<dir>/mnist/train.npz``, ...),
            or holding torchvision's layout (``<dir>/MNIST/raw/...``). None: use env
            ``FEDFLEET_DATA`` if set, else only the default locations.
        allow_download: True lets torchvision download MNIST, Fashion-MNIST, USPS, CIFAR-10,
            SVHN, KMNIST or STL-10 when no local copy is found; False forbids it; None (default) allows it unless
            env ``FEDFLEET_OFFLINE`` is ``"1"``. A download lands in ``data_dir`` (when that
            folder exists) only after it has succeeded; see step 3 of the module docstring.
            For a multi-domain set it applies to each required domain (never to SVHN, which is
            used only when already present).
        domain_train_cap: multi-domain sets only: keep at most this many training samples per
            domain (a seeded stratified subsample, see "Multi-domain sets" in the module
            docstring); 0 = keep all. It bounds memory (MNIST's 60,000 training images take
            737 MB as float32 3×32×32) and the imbalance in data size between domains.
        domain_test_cap: the same for each domain's test split; 0 = keep all.

    Returns:
        A :class:`Dataset` whose arrays are read-only and shared with other callers in this
        process (cached): ``train.x``/``test.x`` float32 ``[N, C, S, S]`` in [-1, 1],
        ``train.y``/``test.y`` int64 ``[N]``. A multi-domain set also has ``domain_names``,
        ``train_domains``, ``test_domains`` and ``substitutions`` (see :class:`Dataset`).

    Raises:
        DataError: unknown name; no location holds the set (the message lists every location
            searched, in order, and which files to put where; ``searched`` holds the same list);
            a file is found but unreadable or malformed (``path`` and ``field`` name it); a
            torchvision download fails; a cap that is not an int >= 0, or a non-zero cap for a
            single-domain set.
    """
    info = dataset_info(name)
    caps = (check_cap("domain_train_cap", domain_train_cap),
            check_cap("domain_test_cap", domain_test_cap))
    if info.domains:
        return load_domains(info, data_dir, allow_download, caps)
    if any(caps):
        raise DataError(
            f"domain_train_cap/domain_test_cap apply only to the multi-domain sets "
            f"({', '.join(d.name for d in MULTI_DOMAIN)}), not to {info.name!r}",
            dataset=info.name,
        )
    return _load_cached(info, *locate(info, data_dir, allow_download))


def clear_dataset_cache() -> None:
    """Drop every data set cached by :func:`load_dataset` and every proxy split cached by
    :func:`proxy_split` (frees memory; next load rereads)."""
    _load_cached.cache_clear()
    _domains.clear_cache()
    _sampling.clear_proxy_cache()


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _load_cached(
    info: DatasetInfo, kind: str, location: tuple[str, ...], stamps: tuple[tuple[int, int], ...]
) -> Dataset:
    """Load and convert one data set; ``stamps`` (mtime_ns, size) only key the cache, and so does
    the registry entry ``info`` itself (a set registered again under the same name is read anew)."""
    del stamps
    x_tr, y_tr, x_te, y_te, source = read_raw(info, kind, location)
    return _make_dataset(info, x_tr, y_tr, x_te, y_te, source)


def _make_dataset(
    info: DatasetInfo,
    x_tr: np.ndarray,
    y_tr: np.ndarray,
    x_te: np.ndarray,
    y_te: np.ndarray,
    source: str,
) -> Dataset:
    splits = []
    for x, y in ((x_tr, y_tr), (x_te, y_te)):
        xf = normalize_images(x)
        yc = np.array(y, dtype=np.int64, copy=True)
        xf.setflags(write=False)
        yc.setflags(write=False)
        splits.append(ArraySplit(x=xf, y=yc, num_classes=info.num_classes))
    return Dataset(
        name=info.name,
        train=splits[0],
        test=splits[1],
        num_classes=info.num_classes,
        channels=info.channels,
        image_size=info.image_size,
        source=source,
    )
