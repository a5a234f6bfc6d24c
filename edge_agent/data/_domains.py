"""The multi-domain sets (``pacs``, ``digits_domains``): each domain found as a single-domain set
(with its fallback, e.g. scikit-learn's digits for SVHN), capped, brought to 3×S×S and stacked.
See "Multi-domain sets" in the docstring of :mod:`edge_agent.data`."""

from __future__ import annotations

import functools
import importlib.util
import os
import types

import numpy as np

from edge_agent.data._folders import locate
from edge_agent.data._images import NORMALIZE_CHUNK, normalize_images, resize_bilinear, to_rgb
from edge_agent.data._read import read_raw
from edge_agent.data._records import ArraySplit, Dataset, DatasetInfo
from edge_agent.data._registry import dataset_info
from edge_agent.data._sampling import stratified_subsample
from edge_agent.errors import DataError

_DOMAIN_CACHE_SIZE = 2  # multi-domain sets are large (MNIST alone: 737 MB uncapped)


def load_domains(
    info: DatasetInfo,
    data_dir: str | os.PathLike[str] | None,
    allow_download: bool | None,
    caps: tuple[int, int],
) -> Dataset:
    """Find every domain of multi-domain set ``info`` (falling back where allowed), then load
    them through the cache.

    Args:
        info: a registry entry with ``domains``.
        data_dir, allow_download: as :func:`~edge_agent.data.load_dataset` (a domain that has a
            fallback is never downloaded).
        caps: ``(domain_train_cap, domain_test_cap)``, checked ints >= 0 (0 = no cap).

    Returns:
        The stacked :class:`Dataset` (see :func:`~edge_agent.data.load_dataset`).

    Raises:
        DataError: a required domain is missing (the message names it), SVHN's ``.mat`` files
            are found but scipy is not installed, or a domain's reader fails.
    """
    found: list[tuple[str, str, str, str, tuple[str, ...], tuple[tuple[int, int], ...]]] = []
    for spec in info.domains:
        chosen = spec
        try:
            located = locate(dataset_info(spec.dataset), data_dir,
                              allow_download if spec.fallback is None else False)
        except DataError as exc:
            if spec.fallback is None:
                raise DataError(f"data set {info.name!r}, domain {spec.name!r}: {exc}",
                                dataset=info.name, searched=exc.searched, path=exc.path) from exc
            chosen = spec.fallback
            located = locate(dataset_info(chosen.dataset), data_dir, allow_download)
        kind, location, _ = located
        if chosen.dataset == "svhn" and kind == "torchvision":
            if importlib.util.find_spec("scipy") is None:
                raise DataError(
                    f"data set {info.name!r}: SVHN's train_32x32.mat and test_32x32.mat were found "
                    f"under {location[0]}, but reading them needs scipy (pip install scipy); or "
                    "remove them to use the scikit-learn digits stand-in", dataset=info.name,
                    path=location[0])
        found.append((chosen.name, chosen.dataset, chosen.substitution, *located))
    return _load_domains_cached(info.name, tuple(found), caps)


@functools.lru_cache(maxsize=_DOMAIN_CACHE_SIZE)
def _load_domains_cached(
    name: str,
    found: tuple[tuple[str, str, str, str, tuple[str, ...], tuple[tuple[int, int], ...]], ...],
    caps: tuple[int, int],
) -> Dataset:
    """Read, cap, resize and stack the domains in ``found`` (domain name, single-set name,
    substitution note, and the :func:`locate` key of that set)."""
    info = dataset_info(name)
    size = info.image_size
    names: list[str] = []
    train_parts: list[tuple[np.ndarray, np.ndarray]] = []
    test_parts: list[tuple[np.ndarray, np.ndarray]] = []
    sources: list[str] = []
    notes: list[str] = []
    for domain, dataset, note, kind, location, _stamps in found:
        dinfo = dataset_info(dataset)
        if dinfo.num_classes != info.num_classes:  # pragma: no cover - registry misuse
            raise DataError(f"domain {domain!r} has {dinfo.num_classes} classes, {name!r} "
                            f"{info.num_classes}", dataset=name)
        x_tr, y_tr, x_te, y_te, src = read_raw(dinfo, kind, location)
        for (x, y), cap, parts in (((x_tr, y_tr), caps[0], train_parts),
                                   ((x_te, y_te), caps[1], test_parts)):
            keep = stratified_subsample(y, cap)
            parts.append((to_rgb(resize_bilinear(x[keep], size)), np.asarray(y[keep], np.int64)))
        names.append(domain)
        sources.append(f"{domain}={src}")
        if note:
            notes.append(note)

    def stack(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[ArraySplit, list[int]]:
        n = sum(len(y) for _, y in parts)
        x_out = np.empty((n, 3, size, size), dtype=np.float32)
        pos = 0
        for x, _ in parts:
            for a in range(0, len(x), NORMALIZE_CHUNK):
                chunk = x[a:a + NORMALIZE_CHUNK]
                x_out[pos:pos + len(chunk)] = normalize_images(chunk)
                pos += len(chunk)
        y_out = np.concatenate([y for _, y in parts]) if parts else np.zeros(0, np.int64)
        x_out.setflags(write=False)
        y_out.setflags(write=False)
        sizes = [len(y) for _, y in parts]
        return ArraySplit(x=x_out, y=y_out, num_classes=info.num_classes), sizes

    train, train_sizes = stack(train_parts)
    del train_parts
    test, test_sizes = stack(test_parts)
    train_domains = np.repeat(np.arange(len(names), dtype=np.int64), train_sizes)
    train_domains.setflags(write=False)
    bounds = np.concatenate([[0], np.cumsum(test_sizes)]).astype(np.int64)
    test_domains = {
        d: ArraySplit(x=test.x[a:b], y=test.y[a:b], num_classes=info.num_classes)
        for d, a, b in zip(names, bounds[:-1], bounds[1:], strict=True)
    }
    return Dataset(name=name, train=train, test=test, num_classes=info.num_classes, channels=3,
                   image_size=size, source="; ".join(sources), domain_names=tuple(names),
                   train_domains=train_domains, test_domains=types.MappingProxyType(test_domains),
                   substitutions=tuple(notes))


def clear_cache() -> None:
    """Drop every multi-domain set cached here."""
    _load_domains_cached.cache_clear()
