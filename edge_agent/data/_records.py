"""The records of the data package: what a loaded set is, and what is known about a name.

:class:`ArraySplit` (one split, model-ready), :class:`Dataset` (train + test and the domains of a
multi-domain set), :class:`DatasetInfo` (a registry entry: shape, classes, where it is read from)
and :class:`DomainSpec` (one domain of a multi-domain set); plus the checks every reader applies to
the raw arrays it returns (:func:`validate_raw`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge_agent.errors import DataError

RawSplits = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""``(x_train, y_train, x_test, y_test)`` as a reader returns them, before conversion: uint8 images
``[N, S, S]`` (grey) or ``[N, S, S, 3]`` (RGB, HWC) and int64 labels ``[N]``."""

DatasetFactory = Callable[[Path | None], RawSplits]
"""A user's data-set factory (see :func:`edge_agent.data.register_dataset`): called with the data
folder (a :class:`pathlib.Path`, or None when none is set), returns :data:`RawSplits`."""


@dataclass(frozen=True, eq=False)
class ArraySplit:
    """One split (train or test) of a data set, ready for the model.

    Attributes:
        x: images, float32 ``[N, C, H, W]``, normalised to [-1, 1] (see module docstring).
        y: labels, int64 ``[N]``, each in ``[0, num_classes)``.
        num_classes: number of classes of the data set (not of this split: a class may be
            absent from a small split).

    Raises:
        DataError: on construction, if ``x`` is not a 4-D float32 array, ``y`` not a 1-D int64
            array, their lengths differ, ``num_classes`` < 1, or a label is out of range.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        if not isinstance(self.x, np.ndarray) or self.x.dtype != np.float32 or self.x.ndim != 4:
            raise DataError(
                "ArraySplit.x must be a float32 array [N, C, H, W], got "
                f"{describe_array(self.x)}",
                field="x",
            )
        if not isinstance(self.y, np.ndarray) or self.y.dtype != np.int64 or self.y.ndim != 1:
            raise DataError(
                f"ArraySplit.y must be an int64 array [N], got {describe_array(self.y)}",
                field="y",
            )
        if self.x.shape[0] != self.y.shape[0]:
            raise DataError(
                f"ArraySplit: x has {self.x.shape[0]} samples but y has {self.y.shape[0]}",
                field="y",
            )
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int | np.integer):
            raise DataError(f"ArraySplit.num_classes must be an int, got {self.num_classes!r}")
        if self.num_classes < 1:
            raise DataError(f"ArraySplit.num_classes must be >= 1, got {self.num_classes}")
        check_label_range(self.y, int(self.num_classes), where="ArraySplit.y")

    def __len__(self) -> int:
        """Number of samples N."""
        return int(self.y.shape[0])

    @property
    def channels(self) -> int:
        """C, the number of image channels (1 grayscale, 3 RGB)."""
        return int(self.x.shape[1])

    @property
    def image_size(self) -> int:
        """H (= W for every set here), in pixels."""
        return int(self.x.shape[2])

    def subset(self, indices: np.ndarray) -> ArraySplit:
        """Return the samples at ``indices`` (e.g. one client's shard) as a new split.

        Args:
            indices: int array ``[M]`` of positions into this split (e.g. one entry of
                :func:`edge_agent.partition.partition`).

        Returns:
            A new :class:`ArraySplit` with copies ``x[indices]`` float32 ``[M, C, H, W]`` and
            ``y[indices]`` int64 ``[M]`` (writable; this split is not modified).

        Raises:
            DataError: ``indices`` is not a 1-D integer array or holds an out-of-range index.
        """
        idx = np.asarray(indices)
        if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
            raise DataError(
                f"subset indices must be a 1-D integer array, got {describe_array(idx)}"
            )
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise DataError(
                f"subset indices must lie in [0, {len(self)}), got [{idx.min()}, {idx.max()}]"
            )
        idx = idx.astype(np.int64, copy=False)
        return ArraySplit(x=self.x[idx], y=self.y[idx], num_classes=self.num_classes)


@dataclass(frozen=True, eq=False)
class Dataset:
    """A loaded data set: train and test splits plus what a model needs to know.

    Attributes:
        name: the name it was loaded under (``"mnist"``).
        train: the training split (may be empty, N = 0, for ``svhn_sample50``).
        test: the test split.
        num_classes: number of classes (10, or 7 for PACS).
        channels: C, 1 for grayscale, 3 for RGB.
        image_size: S, the images are S×S pixels.
        source: where it was loaded from: the folder holding the two npz files, the single npz
            file for one-file sets, ``"sklearn"`` for ``digits``, ``"torchvision:<root>"``, or
            ``"factory:<module>.<function>"`` for a set added with ``register_dataset``;
            for a multi-domain set, ``"<domain>=<source>"`` per domain joined by ``"; "``.
        domain_names: the domains of a multi-domain set (``pacs``, ``digits_domains``) in their
            fixed order, e.g. ``("photo", "art_painting", "cartoon", "sketch")``; ``()`` for a
            single-domain set.
        train_domains: int64 ``[N_train]``, the domain of each training sample as an index into
            ``domain_names`` (read-only); None for a single-domain set. The training samples of
            one domain are contiguous, in ``domain_names`` order.
        test_domains: ``{domain name: ArraySplit}``, each domain's own test split, in
            ``domain_names`` order (read-only views into ``test``, which is their
            concatenation); empty for a single-domain set.
        substitutions: human-readable notes, one per domain that stands in for another or is
            not the published data (e.g. scikit-learn's 8×8 digits for SVHN, the regenerated
            MNIST-M); every output that reports results on this set should state them.

    Raises:
        DataError: on construction, if a split's class count, channels or image size disagree
            with the fields above; or, for a multi-domain set, if ``train_domains`` is not an
            int64 ``[N_train]`` array of indices into ``domain_names``, or ``test_domains``
            does not hold one split per domain (in order) whose sizes sum to ``len(test)``.
    """

    name: str
    train: ArraySplit
    test: ArraySplit
    num_classes: int
    channels: int
    image_size: int
    source: str
    domain_names: tuple[str, ...] = ()
    train_domains: np.ndarray | None = None
    test_domains: Mapping[str, ArraySplit] = field(default_factory=dict)
    substitutions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        named = [("train", self.train), ("test", self.test)]
        named += [(f"test_domains[{k!r}]", v) for k, v in self.test_domains.items()]
        for split_name, split in named:
            expected = (self.channels, self.image_size, self.image_size)
            if split.num_classes != self.num_classes or split.x.shape[1:] != expected:
                raise DataError(
                    f"data set {self.name!r}: {split_name} split has images "
                    f"{tuple(split.x.shape[1:])} and {split.num_classes} classes, expected "
                    f"{expected} and {self.num_classes}",
                    dataset=self.name,
                )
        self._check_domains()

    @property
    def is_multi_domain(self) -> bool:
        """True when the set has named domains (``domain_names`` is not empty)."""
        return bool(self.domain_names)

    def domain_summary(self) -> dict[str, object]:
        """What a run record should say about the domains (JSON-able; ``{}`` for a
        single-domain set): ``{"domains": [names], "domain_train_samples": {name: n},
        "domain_test_samples": {name: n}, "substitutions": [notes]}``."""
        if not self.domain_names:
            return {}
        ids = self.train_domains if self.train_domains is not None else np.zeros(0, np.int64)
        counts = np.bincount(ids, minlength=len(self.domain_names))
        return {
            "domains": list(self.domain_names),
            "domain_train_samples": {n: int(c) for n, c in zip(self.domain_names, counts, strict=True)},
            "domain_test_samples": {n: len(v) for n, v in self.test_domains.items()},
            "substitutions": list(self.substitutions),
        }

    def _check_domains(self) -> None:
        names, ids = self.domain_names, self.train_domains
        if not names:
            if ids is not None or self.test_domains:
                raise DataError(f"data set {self.name!r}: train_domains/test_domains given without "
                                "domain_names", dataset=self.name)
            return
        if len(set(names)) != len(names):
            raise DataError(f"data set {self.name!r}: repeated domain names {names}",
                            dataset=self.name)
        n = len(self.train)
        if (not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.shape != (n,)
                or (ids.size and (ids.min() < 0 or ids.max() >= len(names)))):
            raise DataError(
                f"data set {self.name!r}: train_domains must be int64 [{n}] with values in "
                f"[0, {len(names)}), got {describe_array(ids)}", dataset=self.name)
        if tuple(self.test_domains) != names:
            raise DataError(f"data set {self.name!r}: test_domains has domains "
                            f"{tuple(self.test_domains)}, expected {names}", dataset=self.name)
        total = sum(len(v) for v in self.test_domains.values())
        if total != len(self.test):
            raise DataError(f"data set {self.name!r}: the domain test splits hold {total} samples, "
                            f"the test split {len(self.test)}", dataset=self.name)


@dataclass(frozen=True)
class DatasetInfo:
    """What is known about a data-set name without loading it.

    Attributes:
        name: the data-set name.
        num_classes: number of classes.
        channels: C (1 or 3).
        image_size: S in pixels (images are S×S).
        train_file: npz path of the train split relative to a data directory, or None (no file:
            split here from ``whole_file``, loaded from sklearn, or empty for ``svhn_sample50``).
        test_file: npz path of the test split relative to a data directory, or None.
        whole_file: npz path of a one-file set split here 80/20, or None.
        torchvision: class name in ``torchvision.datasets`` (``"MNIST"``), or None when
            torchvision has no such set.
        sklearn: True when the set comes from scikit-learn (``digits``) and needs no file.
        hint: extra advice printed in the :class:`DataError` when the files are missing.
        domains: for a multi-domain set (``pacs``, ``digits_domains``), its domains in their
            fixed order, each read from a single-domain set of this table; ``()`` otherwise.
        factory: for a set added with :func:`edge_agent.data.register_dataset`, the function
            that returns its raw splits (:data:`DatasetFactory`); None for the built-in sets,
            which are read from the files, torchvision or scikit-learn as the fields above say.
    """

    name: str
    num_classes: int
    channels: int
    image_size: int
    train_file: str | None = None
    test_file: str | None = None
    whole_file: str | None = None
    torchvision: str | None = None
    sklearn: bool = False
    hint: str = ""
    domains: tuple[DomainSpec, ...] = ()
    factory: DatasetFactory | None = None

    @property
    def known_domain_names(self) -> tuple[str, ...]:
        """Every domain name a multi-domain set may have, stand-ins included, in order
        (``digits_domains``: mnist, usps, svhn, sklearn_digits, mnist_m); ``()`` otherwise."""
        out: list[str] = []
        for spec in self.domains:
            out.append(spec.name)
            if spec.fallback is not None:
                out.append(spec.fallback.name)
        return tuple(out)

    @property
    def files(self) -> tuple[str, ...]:
        """The npz files (relative paths) that must all exist in one data directory."""
        if self.whole_file is not None:
            return (self.whole_file,)
        return tuple(f for f in (self.train_file, self.test_file) if f is not None)

    @property
    def x_shape_text(self) -> str:
        """The per-file ``x`` shape as written in the MANIFEST, e.g. ``"N×28×28"``."""
        s = self.image_size
        return f"N×{s}×{s}" if self.channels == 1 else f"N×{s}×{s}×{self.channels}"


@dataclass(frozen=True)
class DomainSpec:
    """One domain of a multi-domain set.

    Attributes:
        name: the domain name used in configurations and metrics (``"photo"``, ``"mnist_m"``).
        dataset: the single-domain set of :func:`list_datasets` it is read from
            (``"pacs_photo"``, ``"mnist_m"``); its train/test split is kept.
        substitution: a note stated in :attr:`Dataset.substitutions` whenever this domain is
            loaded (the domain is not the published data), or ``""``.
        fallback: the domain loaded instead when ``dataset`` is not found anywhere (no
            download is attempted for a domain that has a fallback); None: the domain is
            required and a missing ``dataset`` raises :class:`DataError`.
    """

    name: str
    dataset: str
    substitution: str = ""
    fallback: DomainSpec | None = None


def validate_raw(x: np.ndarray, y: np.ndarray, info: DatasetInfo, where: str) -> None:
    """Check the raw arrays of one split before conversion, as every reader returns them.

    Args:
        x: images, must be uint8 ``[N, S, S]`` when ``info.channels`` is 1, ``[N, S, S, C]``
            (HWC) otherwise, with ``S = info.image_size``.
        y: labels, must be int64 ``[N]`` (the same N) with values in ``[0, info.num_classes)``.
        info: the registry entry the arrays are checked against.
        where: the source named in the message (a file path, ``"torchvision:<root> (train)"``).

    Raises:
        DataError: the first check that fails, as ``"<where>: field 'x' has dtype float32,
            expected uint8"``; ``field`` is ``"x"`` or ``"y"``, ``path`` is ``where``.
    """
    s, c = info.image_size, info.channels
    expected = (s, s) if c == 1 else (s, s, c)

    def fail(field: str, what: str) -> DataError:
        return DataError(f"{where}: field {field!r} {what}", dataset=info.name, path=where,
                         field=field)

    for name, a in (("x", x), ("y", y)):
        if not isinstance(a, np.ndarray):
            raise fail(name, f"is a {type(a).__name__}, expected a numpy array")
    if x.dtype != np.uint8:
        raise fail("x", f"has dtype {x.dtype}, expected uint8")
    if x.ndim != len(expected) + 1 or x.shape[1:] != expected:
        raise fail(
            "x", f"has shape {x.shape}, expected {info.x_shape_text} ({expected} per sample)"
        )
    if y.dtype != np.int64:
        raise fail("y", f"has dtype {y.dtype}, expected int64")
    if y.ndim != 1:
        raise fail("y", f"has shape {y.shape}, expected [N]")
    if y.shape[0] != x.shape[0]:
        raise fail("y", f"has {y.shape[0]} labels but 'x' has {x.shape[0]} images")
    if y.size and (y.min() < 0 or y.max() >= info.num_classes):
        raise fail(
            "y",
            f"has labels in [{y.min()}, {y.max()}], expected [0, {info.num_classes})",
        )


def empty_raw(info: DatasetInfo) -> tuple[np.ndarray, np.ndarray]:
    """An empty split of ``info``'s shape: uint8 ``[0, S, S]`` (or ``[0, S, S, C]``), int64 ``[0]``."""
    s = info.image_size
    shape = (0, s, s) if info.channels == 1 else (0, s, s, info.channels)
    return np.zeros(shape, dtype=np.uint8), np.zeros(0, dtype=np.int64)


def check_label_range(y: np.ndarray, num_classes: int, *, where: str) -> None:
    """Raise :class:`DataError` (``field="y"``, message starting ``where``) unless every label of
    the integer array ``y`` lies in ``[0, num_classes)``."""
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise DataError(
            f"{where}: labels lie in [{y.min()}, {y.max()}], expected [0, {num_classes})",
            field="y",
        )


def describe_array(a: object) -> str:
    """``"ndarray dtype=float32 shape=(2, 3)"`` for an array, else the type name (for messages)."""
    if isinstance(a, np.ndarray):
        return f"ndarray dtype={a.dtype} shape={a.shape}"
    return type(a).__name__
