"""Image-classification data sets for the edge agent, loaded offline first.

Every data set comes back as a :class:`Dataset` holding a train and a test :class:`ArraySplit`
with ``x`` float32 ``[N, C, H, W]`` normalised to [-1, 1] and ``y`` int64 ``[N]``.

Names (see :func:`list_datasets`) and the files they are read from, relative to a data
directory laid out as in ``shared/data/MANIFEST.md``:

==================  ==========================================  =======  ======  =========
name                files (train; test)                         classes  C×S×S   torchvision
==================  ==========================================  =======  ======  =========
mnist               mnist/train.npz; mnist/test.npz             10       1×28×28 MNIST
fashion_mnist       fashion_mnist/train.npz; .../test.npz       10       1×28×28 FashionMNIST
usps                usps/train.npz; usps/test.npz               10       1×16×16 USPS
cifar10             cifar10/train_subset10k.npz; .../test.npz   10       3×32×32 CIFAR10
mnist_m             mnist_m_regenerated/train_subset5k.npz;     10       3×28×28 —
                    mnist_m_regenerated/test.npz
svhn                svhn/train.npz; svhn/test.npz (not in the   10       3×32×32 SVHN
                    offline set: only 50 images exist offline)
svhn_sample50       (no train: empty); svhn/sample50.npz        10       3×32×32 —
kmnist              kmnist/train.npz; kmnist/test.npz (not in   10       1×28×28 KMNIST
                    the offline set: a user's own copy)
stl10               stl10/train.npz; stl10/test.npz (not in     10       3×32×32 STL10
                    the offline set; 96×96 resized to 32×32)
digits              sklearn.datasets.load_digits (no file)      10       1×8×8   —
pacs_photo          pacs/photo_32.npz (whole domain)            7        3×32×32 —
pacs_art_painting   pacs/art_painting_32.npz (whole domain)     7        3×32×32 —
pacs_cartoon        pacs/cartoon_32.npz (whole domain)          7        3×32×32 —
pacs_sketch         pacs/sketch_32.npz (whole domain)           7        3×32×32 —
pacs                4 domains: photo, art_painting, cartoon,    7        3×32×32 —
                    sketch (the four pacs_* sets above)
digits_domains      4 domains: mnist, usps, svhn (only when     10       3×32×32 —
                    present; else sklearn_digits, from
                    ``digits``), mnist_m
==================  ==========================================  =======  ======  =========

Resolution order (:func:`load_dataset`; the same list is printed in the :class:`DataError`):

1. the ``data_dir`` argument if given, else the directory in env ``FEDFLEET_DATA`` if set;
2. the shared data folder beside the repository, ``<repo>/../shared/data``, then
   ``<repo>/shared/data`` (``<repo>`` is the folder holding the ``edge_agent`` package);
3. torchvision (only for names with a torchvision class in the table above): first a torchvision
   folder layout already present under the directory of step 1 or under
   ``~/.cache/fedfleet/torchvision`` (opened with ``download=False``); then torchvision's own
   download — only when ``allow_download`` is True, or when it is None and env
   ``FEDFLEET_OFFLINE`` is not ``"1"``. The download goes into a fresh temporary folder under
   ``~/.cache/fedfleet/torchvision`` that is always removed afterwards; only when it succeeds
   (and both splits read back valid) are its files moved, one atomic rename each, into the
   directory of step 1 if that is an existing writable folder, else into
   ``~/.cache/fedfleet/torchvision``. A failed lookup or download therefore never creates or
   changes anything under the user's data folder, and a missing data folder is never created;
4. otherwise :class:`DataError`, naming every location searched and which files to put where
   (and, when the data folder given is the set's own folder, e.g. ``/x/mnist`` holding
   ``train.npz`` and ``test.npz``, saying to pass its parent ``/x`` instead).

Sets stored as one file (``digits`` and the PACS domains) are split here into train and test with
a stratified 80/20 split: for each class (in increasing label order) the class's indices are
permuted with ``numpy.random.default_rng(0)`` (one generator for the whole split) and the first
``round_half_up(0.2 · n_class)`` go to test; both index lists are then sorted, so the samples keep
their file order. The split is therefore fixed (seed 0) and the same on every machine.

``digits`` pixel values 0–16 are mapped to uint8 with ``rint(v · 255 / 16)`` before the common
normalisation below, so that every set goes through the same conversion.

Conversion (all sets): uint8 → float32 ``v / 255`` in [0, 1], then ``(v − 0.5) / 0.5`` (the same
as torchvision ``ToTensor()`` followed by ``Normalize(0.5, 0.5)``), so 0 → −1.0 and 255 → 1.0;
grayscale images get a channel axis of size 1, RGB HWC images are transposed to CHW.

Multi-domain sets (``pacs``, ``digits_domains``; FedPAD's domain-silo protocol, SPECS.md §1.1)
are built from the single-domain sets above, each keeping its own train/test split: the official
splits of mnist, usps and mnist_m (``train_subset5k`` / ``test``), the stratified 80/20 split
above (seed 0) for the PACS domains and for ``digits`` — PACS has no official split, so each
PACS domain's test split is that fixed, seeded 20 %. Every domain is brought to 3×32×32:
:func:`resize_bilinear` (PIL's bilinear rule; USPS 16→32, MNIST 28→32, 8×8 digits 8→32; the PACS
files and SVHN are already 32×32), grey copied to three channels (:func:`to_rgb`), then the
common conversion below. The fourth digits domain is SVHN when the full set is found (its npz
pair, or torchvision's ``train_32x32.mat`` / ``test_32x32.mat`` in the data folder, read through
torchvision, which needs scipy; never downloaded for this); otherwise scikit-learn's 8×8 digits
stand in for it under the name ``sklearn_digits``, and :attr:`Dataset.substitutions` says so
(as it says that mnist_m is regenerated). No domain is ever made up: a missing required domain
raises :class:`DataError`. ``domain_train_cap`` / ``domain_test_cap`` keep at most that many
samples per domain and split (:func:`stratified_subsample`, seed 0, largest-remainder class
quotas), e.g. 5,000 to keep MNIST's 60,000 training images out of memory. The train and test
splits are the domains' splits concatenated in domain order; ``train_domains`` gives each
training sample's domain and ``test_domains`` each domain's test split (views into ``test``).

Loaded data sets are cached in-process (keyed on the name, the resolved file paths and their
modification times), because several virtual agents in one process load the same set; the
arrays returned are read-only (``flags.writeable == False``) so the sharing is safe. Take a
writable copy with ``np.array(split.x)`` if one is needed.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import tempfile
import types
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge_agent.errors import DataError

log = logging.getLogger(__name__)

__all__ = [
    "ArraySplit",
    "DOMAIN_IMAGE_SIZE",
    "Dataset",
    "DatasetInfo",
    "DomainSpec",
    "ENV_DATA_DIR",
    "ENV_OFFLINE",
    "PACS_DOMAINS",
    "PROXY_SIZE",
    "SPLIT_SEED",
    "TEST_FRACTION",
    "bilinear_weights",
    "class_histogram",
    "clear_dataset_cache",
    "dataset_info",
    "list_datasets",
    "load_dataset",
    "normalize_images",
    "proxy_split",
    "resize_bilinear",
    "stratified_subsample",
    "to_rgb",
]

ENV_DATA_DIR = "FEDFLEET_DATA"
"""Environment variable naming a data directory, used when ``data_dir`` is not given."""

ENV_OFFLINE = "FEDFLEET_OFFLINE"
"""Environment variable; ``"1"`` forbids torchvision downloads when ``allow_download`` is None."""

TEST_FRACTION = 0.2
"""Share of each class put in the test split for sets stored as one file (digits, PACS)."""

SPLIT_SEED = 0
"""Seed of ``numpy.random.default_rng`` for the stratified split of one-file sets."""

_REPO_DIR = Path(__file__).resolve().parents[1]
# Step 2 of the resolution order; a module attribute so tests can point it elsewhere.
_SHARED_DATA_DIRS: tuple[Path, ...] = (
    (_REPO_DIR / ".." / "shared" / "data").resolve(),
    _REPO_DIR / "shared" / "data",
)
_TORCHVISION_CACHE = Path("~/.cache/fedfleet/torchvision")
_CACHE_SIZE = 8


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


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
                f"{_describe_array(self.x)}",
                field="x",
            )
        if not isinstance(self.y, np.ndarray) or self.y.dtype != np.int64 or self.y.ndim != 1:
            raise DataError(
                f"ArraySplit.y must be an int64 array [N], got {_describe_array(self.y)}",
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
        _check_label_range(self.y, int(self.num_classes), where="ArraySplit.y")

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
                f"subset indices must be a 1-D integer array, got {_describe_array(idx)}"
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
            file for one-file sets, ``"sklearn"`` for ``digits``, or ``"torchvision:<root>"``;
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
            "domain_train_samples": {n: int(c) for n, c in zip(self.domain_names, counts)},
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
                f"[0, {len(names)}), got {_describe_array(ids)}", dataset=self.name)
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


def _pacs(domain: str) -> DatasetInfo:
    return DatasetInfo(f"pacs_{domain}", 7, 3, 32, whole_file=f"pacs/{domain}_32.npz")


PACS_DOMAINS: tuple[str, ...] = ("photo", "art_painting", "cartoon", "sketch")
"""The PACS domains in the order of FedPAD's allocation table (SPECS.md §1.1)."""

DOMAIN_IMAGE_SIZE = 32
"""S of every multi-domain set: each domain is resized to S×S and given 3 channels."""

_SKLEARN_FOR_SVHN = (
    "svhn -> sklearn_digits: the full SVHN was not found (only 50 SVHN images exist offline), so "
    "scikit-learn's 8x8 digits (1797 images, bilinearly upsampled to 32x32, grey copied to 3 "
    "channels, seeded stratified 80/20 split) stand in for SVHN; results on this domain are not "
    "comparable with published SVHN numbers"
)
_MNIST_M_REGENERATED = (
    "mnist_m is MNIST-M regenerated with the Ganin & Lempitsky (2015) recipe (shared/data "
    "MANIFEST.md note 6; train is a 5,000-image subset), not the published MNIST-M release"
)

_MULTI_DOMAIN: tuple[DatasetInfo, ...] = (
    DatasetInfo("pacs", 7, 3, DOMAIN_IMAGE_SIZE,
                domains=tuple(DomainSpec(d, f"pacs_{d}") for d in PACS_DOMAINS)),
    DatasetInfo(
        "digits_domains", 10, 3, DOMAIN_IMAGE_SIZE,
        domains=(
            DomainSpec("mnist", "mnist"),
            DomainSpec("usps", "usps"),
            DomainSpec("svhn", "svhn",
                       fallback=DomainSpec("sklearn_digits", "digits", _SKLEARN_FOR_SVHN)),
            DomainSpec("mnist_m", "mnist_m", _MNIST_M_REGENERATED),
        ),
    ),
)


_REGISTRY: dict[str, DatasetInfo] = {
    info.name: info
    for info in (
        DatasetInfo("mnist", 10, 1, 28, "mnist/train.npz", "mnist/test.npz", torchvision="MNIST"),
        DatasetInfo(
            "fashion_mnist",
            10,
            1,
            28,
            "fashion_mnist/train.npz",
            "fashion_mnist/test.npz",
            torchvision="FashionMNIST",
        ),
        DatasetInfo("usps", 10, 1, 16, "usps/train.npz", "usps/test.npz", torchvision="USPS"),
        DatasetInfo(
            "cifar10",
            10,
            3,
            32,
            "cifar10/train_subset10k.npz",
            "cifar10/test.npz",
            torchvision="CIFAR10",
        ),
        DatasetInfo(
            "mnist_m",
            10,
            3,
            28,
            "mnist_m_regenerated/train_subset5k.npz",
            "mnist_m_regenerated/test.npz",
        ),
        DatasetInfo(
            "svhn",
            10,
            3,
            32,
            "svhn/train.npz",
            "svhn/test.npz",
            torchvision="SVHN",
            hint=(
                "Only 50 SVHN images exist offline (svhn/sample50.npz); load 'svhn_sample50' "
                "for smoke tests (test split only), or put torchvision's train_32x32.mat and "
                "test_32x32.mat in the data folder."
            ),
        ),
        DatasetInfo("svhn_sample50", 10, 3, 32, None, "svhn/sample50.npz"),
        DatasetInfo(
            "kmnist",
            10,
            1,
            28,
            "kmnist/train.npz",
            "kmnist/test.npz",
            torchvision="KMNIST",
            hint=(
                "KMNIST is not in the offline data set: put torchvision's KMNIST/raw/*-ubyte files "
                "(or kmnist/train.npz and test.npz, x uint8 N×28×28, y int64) in the data folder."
            ),
        ),
        DatasetInfo(
            "stl10",
            10,
            3,
            32,
            "stl10/train.npz",
            "stl10/test.npz",
            torchvision="STL10",
            hint=(
                "STL-10 is not in the offline data set: put torchvision's whole stl10_binary/ "
                "folder (train_X.bin, train_y.bin, test_X.bin, test_y.bin and unlabeled_X.bin, "
                "which torchvision checks too; the 96×96 images are resized to 32×32 on loading) or stl10/train.npz and test.npz (x uint8 N×32×32×3) in the "
                "data folder."
            ),
        ),
        DatasetInfo("digits", 10, 1, 8, sklearn=True),
        _pacs("photo"),
        _pacs("art_painting"),
        _pacs("cartoon"),
        _pacs("sketch"),
        *_MULTI_DOMAIN,
    )
}


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def list_datasets() -> list[str]:
    """Return the names :func:`load_dataset` accepts, sorted alphabetically."""
    return sorted(_REGISTRY)


def dataset_info(name: str) -> DatasetInfo:
    """Return the static description of data set ``name`` (shape, classes, files), without I/O.

    Raises:
        DataError: ``name`` is not one of :func:`list_datasets` (``dataset`` is set).
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise DataError(
            f"unknown data set {name!r}; known names: {', '.join(list_datasets())}",
            dataset=str(name),
        ) from None


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
    caps = (_check_cap("domain_train_cap", domain_train_cap),
            _check_cap("domain_test_cap", domain_test_cap))
    if info.domains:
        return _load_domains(info, data_dir, allow_download, caps)
    if any(caps):
        raise DataError(
            f"domain_train_cap/domain_test_cap apply only to the multi-domain sets "
            f"({', '.join(d.name for d in _MULTI_DOMAIN)}), not to {info.name!r}",
            dataset=info.name,
        )
    return _load_cached(info.name, *_locate(info, data_dir, allow_download))


def _locate(
    info: DatasetInfo, data_dir: str | os.PathLike[str] | None, allow_download: bool | None
) -> tuple[str, tuple[str, ...], tuple[tuple[int, int], ...]]:
    """Find single-domain set ``info`` by the resolution order (downloading if allowed).

    Returns:
        ``(kind, location, stamps)``, the key of :func:`_load_cached`: kind ``"sklearn"``,
        ``"npz"`` (location: the resolved files) or ``"torchvision"`` (location: the root).

    Raises:
        DataError: as :func:`load_dataset`.
    """
    if info.sklearn:
        return "sklearn", (), ()

    user_dir = _user_data_dir(data_dir)
    npz_dirs = _npz_search_dirs(user_dir)
    searched: list[str] = []
    for folder in npz_dirs:
        searched.append(str(folder))
        paths = [folder / rel for rel in info.files]
        if all(p.is_file() for p in paths):
            resolved = tuple(str(p.resolve()) for p in paths)
            stamps = tuple(_file_stamp(p) for p in paths)
            return "npz", resolved, stamps

    if info.torchvision is not None:
        tv_roots = _unique_paths(
            ([user_dir] if user_dir is not None else []) + [_TORCHVISION_CACHE.expanduser()]
        )
        for root in tv_roots:
            searched.append(f"torchvision:{root}")
            if _torchvision_layout_present(info.torchvision, root):
                return "torchvision", (str(root.resolve()),), ()
        if _downloads_allowed(allow_download):
            try:
                return "torchvision", (_download_torchvision(info, user_dir),), ()
            except DataError as exc:
                raise DataError(
                    _not_found_message(
                        info, npz_dirs, user_dir, data_dir, allow_download, download_error=str(exc)
                    ),
                    dataset=info.name,
                    searched=searched,
                    path=exc.path,
                ) from exc

    raise DataError(
        _not_found_message(info, npz_dirs, user_dir, data_dir, allow_download),
        dataset=info.name,
        searched=searched,
    )


def clear_dataset_cache() -> None:
    """Drop every data set cached by :func:`load_dataset` and every proxy split cached by
    :func:`proxy_split` (frees memory; next load rereads)."""
    _load_cached.cache_clear()
    _load_domains_cached.cache_clear()
    _proxy_split_cached.cache_clear()


def normalize_images(x: np.ndarray) -> np.ndarray:
    """Convert raw images to model input, the conversion every data set here goes through.

    Args:
        x: uint8 ``[N, H, W]`` (grayscale) or ``[N, H, W, 3]`` (RGB, HWC), values 0–255.

    Returns:
        float32 ``[N, 1, H, W]`` or ``[N, 3, H, W]`` (C-contiguous, writable, a new array) with
        values ``(x / 255 − 0.5) / 0.5`` in [-1, 1]; 0 → −1.0 and 255 → 1.0 exactly.

    Raises:
        DataError: ``x`` is not uint8, or not of one of the two shapes above (``field="x"``).
    """
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8:
        raise DataError(f"images must be uint8, got {_describe_array(x)}", field="x")
    if x.ndim == 3:
        chw = x[:, None, :, :]
    elif x.ndim == 4 and x.shape[3] == 3:
        chw = x.transpose(0, 3, 1, 2)
    else:
        raise DataError(
            f"images must be [N, H, W] or [N, H, W, 3], got shape {x.shape}", field="x"
        )
    out = np.ascontiguousarray(chw).astype(np.float32)
    out /= np.float32(255.0)
    out -= np.float32(0.5)
    out /= np.float32(0.5)
    return out


def class_histogram(y: np.ndarray, num_classes: int) -> list[int]:
    """Count the samples of each class.

    Args:
        y: integer labels ``[N]`` (any integer dtype), each in ``[0, num_classes)``.
        num_classes: number of classes K >= 1.

    Returns:
        ``K`` Python ints: entry k is the number of samples with label k (0 for an absent class).

    Raises:
        DataError: ``y`` is not a 1-D integer array, ``num_classes`` < 1, or a label is out of
            range.
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, int | np.integer):
        raise DataError(f"num_classes must be an int, got {num_classes!r}")
    if num_classes < 1:
        raise DataError(f"num_classes must be >= 1, got {num_classes}")
    labels = np.asarray(y)
    if labels.ndim != 1 or (labels.size and not np.issubdtype(labels.dtype, np.integer)):
        raise DataError(f"labels must be a 1-D integer array, got {_describe_array(labels)}")
    _check_label_range(labels, int(num_classes), where="labels")
    counts = np.bincount(labels.astype(np.int64, copy=False), minlength=int(num_classes))
    return [int(c) for c in counts]


PROXY_SIZE = 1000
"""Default size of the public proxy set (FedMCP++, SPECS.md §5.2: 1000 test samples)."""


def proxy_split(test: ArraySplit, size: int = PROXY_SIZE, seed: int = 0) -> tuple[ArraySplit, ArraySplit]:
    """Split a test split into a public proxy set and the rest (the samples left to evaluate on).

    The proxy set of knowledge-exchange methods (FedMCP++, EnsKD; SPECS.md §5.2: "1000 random
    samples from the dataset's test split, shared and labelled; evaluation should exclude them")
    is drawn here so that the server and every agent derive the same one from the same seed.

    Draw: ``numpy.random.default_rng(seed).permutation(N)``; its first ``size`` entries, sorted,
    are the proxy indices, the other ``N − size``, sorted, the rest. The draw is uniform, **not
    stratified** (the seed says "random samples"): a class may be under-represented or, for a
    tiny ``size``, absent from the proxy set. Both parts keep the split's file order. The two
    index sets are disjoint and together cover the split exactly once.

    Results are cached per ``(test, size, seed)`` (by the identity of ``test``: loaded data
    sets are themselves cached), so the many virtual agents of one process share one copy; the
    arrays returned are read-only, like those of :func:`load_dataset` (take ``np.array(...)``
    for a writable copy).

    Args:
        test: the split to draw from (normally ``Dataset.test``), N samples.
        size: samples in the proxy set P, ``1 <= size < N`` (something must be left to
            evaluate on).
        seed: seed of the draw (the run seed unless the configuration names another).

    Returns:
        ``(proxy, rest)``: :class:`ArraySplit` s with ``x`` float32 ``[P, C, H, W]`` and
        ``[N − P, C, H, W]``, ``y`` int64 ``[P]`` and ``[N − P]``, the same ``num_classes``.

    Raises:
        DataError: ``test`` is not an :class:`ArraySplit`; ``size`` or ``seed`` is not an int;
            ``size`` is outside ``[1, N)``; ``seed`` is negative.
    """
    if not isinstance(test, ArraySplit):
        raise DataError(f"proxy_split needs an ArraySplit, got {type(test).__name__}")
    for name, value in (("size", size), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise DataError(f"proxy_split: {name} must be an int, got {value!r}")
    if not 1 <= size < len(test):
        raise DataError(
            f"proxy_split: size must be in [1, {len(test)}) for a split of {len(test)} samples "
            f"(the rest is the evaluation set), got {size}"
        )
    if seed < 0:
        raise DataError(f"proxy_split: seed must be >= 0, got {seed}")
    return _proxy_split_cached(test, int(size), int(seed))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _proxy_split_cached(test: ArraySplit, size: int, seed: int) -> tuple[ArraySplit, ArraySplit]:
    perm = np.random.default_rng(seed).permutation(len(test))
    parts = []
    for idx in (np.sort(perm[:size]), np.sort(perm[size:])):
        part = test.subset(idx)
        part.x.flags.writeable = False
        part.y.flags.writeable = False
        parts.append(part)
    return parts[0], parts[1]


# --------------------------------------------------------------------------------------------
# Resolution helpers
# --------------------------------------------------------------------------------------------


def _user_data_dir(data_dir: str | os.PathLike[str] | None) -> Path | None:
    """Step 1: the ``data_dir`` argument, else env ``FEDFLEET_DATA``, else None.

    A folder that does not exist is still returned (a download may go elsewhere, see step 3),
    but logged as a warning: a typo there would otherwise fall back to the shared data
    folder without a word."""
    if data_dir is not None:
        folder, origin = Path(data_dir).expanduser(), "the data folder you set"
    else:
        env = os.environ.get(ENV_DATA_DIR, "")
        if not env:
            return None
        folder, origin = Path(env).expanduser(), f"env {ENV_DATA_DIR}"
    if not folder.is_dir():
        log.warning("%s, %s, is not an existing folder: looking in the shared data folder and the "
                    "torchvision cache instead", origin, folder)
    return folder


def _npz_search_dirs(user_dir: Path | None) -> list[Path]:
    """Steps 1 and 2: the directories searched for the npz layout, in order, without repeats."""
    return _unique_paths(([user_dir] if user_dir is not None else []) + list(_SHARED_DATA_DIRS))


def _unique_paths(paths: Sequence[Path]) -> list[Path]:
    seen: set[Path] = set()
    out: list[Path] = []
    for p in paths:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _file_stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return (st.st_mtime_ns, st.st_size)


def _downloads_allowed(allow_download: bool | None) -> bool:
    if allow_download is None:
        return os.environ.get(ENV_OFFLINE, "") != "1"
    return bool(allow_download)


# Files (relative to a torchvision root) whose presence means "this layout is here".
_TORCHVISION_MARKERS: dict[str, tuple[str, ...]] = {
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


def _torchvision_layout_present(tv_name: str, root: Path) -> bool:
    return all((root / rel).is_file() for rel in _TORCHVISION_MARKERS[tv_name])


_HOW_TO_SET_DATA_DIR = (
    "`--data-dir DIR` on the command line (fedfleet and fedfleet-agent), "
    f"`[data] data_dir` in the config, `data_dir=` in Python, or the {ENV_DATA_DIR} environment "
    "variable"
)
"""How a user sets the data folder, in every front end's own words (used in DataError texts)."""


def _shown(path: Path) -> Path:
    """``path`` made absolute for messages (symlinks kept as the user wrote them)."""
    return Path(os.path.abspath(path))


def _misplaced_hint(info: DatasetInfo, user_dir: Path | None) -> tuple[str, Path] | None:
    """Detect the common mistake of giving the set's own folder instead of the data folder.

    Returns:
        ``(hint, folder to use instead)`` when ``user_dir`` directly holds every file of the set
        (``<user_dir>/train.npz`` and ``test.npz`` for mnist) or torchvision's layout one level
        too deep (``<user_dir>/raw/...`` with ``user_dir`` named ``MNIST``); else None.
    """
    if user_dir is None or not user_dir.is_dir():
        return None
    shown = _shown(user_dir)
    names = [Path(rel).name for rel in info.files]
    if names and all((user_dir / n).is_file() for n in names):
        found = "/".join(names)
        subdirs = sorted({Path(rel).parent.as_posix() for rel in info.files})
        if len(subdirs) == 1 and shown.name == subdirs[0]:
            return (
                f"found {found} directly in {shown}: pass its parent folder ({shown.parent}) as "
                "the data folder.",
                shown.parent,
            )
        wanted = " and ".join(info.files)
        return (
            f"found {found} directly in {shown}, but the data folder must hold them as {wanted}: "
            f"put them in a sub-folder {subdirs[0]}/ of the data folder (e.g. rename {shown} to "
            f"{shown.parent / subdirs[0]} and pass {shown.parent} as the data folder).",
            shown.parent,
        )
    if info.torchvision is not None:
        markers = _TORCHVISION_MARKERS[info.torchvision]
        heads = {m.split("/", 1)[0] for m in markers}
        if len(heads) == 1 and all("/" in m for m in markers) and shown.name in heads:
            inner = [m.split("/", 1)[1] for m in markers]
            if all((user_dir / rel).is_file() for rel in inner):
                return (
                    f"found torchvision's {shown.name} layout ({inner[0]}, ...) directly in "
                    f"{shown}: pass its parent folder ({shown.parent}) as the data folder.",
                    shown.parent,
                )
    return None


def _not_found_message(
    info: DatasetInfo,
    npz_dirs: Sequence[Path],
    user_dir: Path | None,
    data_dir: str | os.PathLike[str] | None,
    allow_download: bool | None,
    *,
    download_error: str | None = None,
) -> str:
    lines = [f"data set {info.name!r} not found. Searched, in order:"]
    step = 1
    for folder in npz_dirs:
        if user_dir is not None and folder == user_dir:
            origin = "the data folder you set" if data_dir is not None else f"env {ENV_DATA_DIR}"
        else:
            origin = "shared data folder"
        if not folder.exists():
            state = ", does not exist"
        elif not folder.is_dir():
            state = ", is not a folder"
        else:
            state = ""
        lines.append(f"  ({step}) {folder}  [{origin}{state}]")
        step += 1
    if info.torchvision is not None:
        roots = _unique_paths(
            ([user_dir] if user_dir is not None else []) + [_TORCHVISION_CACHE.expanduser()]
        )
        for root in roots:
            lines.append(f"  ({step}) torchvision:{root}  [torchvision {info.torchvision} layout]")
            step += 1
        if download_error is not None:
            reason = download_error.strip().replace("\n", "\n      ")
            lines.append(f"  torchvision download: tried (download failed: {reason})")
        else:
            why = "allow_download=False" if allow_download is False else f"{ENV_OFFLINE}=1"
            lines.append(f"  torchvision download: not attempted (downloads are off: {why}).")
    if len(lines) == 1:
        lines.append(
            f"  (nothing: no data folder set, {ENV_DATA_DIR} not set, no shared data folder)"
        )
    misplaced = _misplaced_hint(info, user_dir)
    if misplaced is not None:
        lines.append(f"Hint: {misplaced[0]}")
    files = " and ".join(info.files)
    label_range = f"y int64 in [0, {info.num_classes})"
    what = f"{files} (x uint8 {info.x_shape_text}, {label_range})"
    if misplaced is not None:
        example = misplaced[1] / info.files[0]
        lines.append(
            f"The data folder must hold {what}, e.g. {example}; set the data folder with "
            f"{_HOW_TO_SET_DATA_DIR}."
        )
    elif npz_dirs:
        lines.append(
            f"Put {what} under one of the folders above (e.g. {npz_dirs[0] / info.files[0]}), or "
            f"under another folder and set that as the data folder: {_HOW_TO_SET_DATA_DIR}."
        )
    else:
        lines.append(
            f"Put {what} under a folder and set it as the data folder: {_HOW_TO_SET_DATA_DIR}."
        )
    if info.torchvision is not None:
        layout = f"torchvision's {info.torchvision} folder layout " + (
            f"({_TORCHVISION_MARKERS[info.torchvision][0]}, ...)"
        )
        if download_error is not None:
            lines.append(f"Or put {layout} in the data folder, or retry the download when online.")
        elif allow_download is False:
            lines.append(
                f"Or let torchvision download it (allow_download=True in Python), or put {layout} "
                "in the data folder."
            )
        else:
            lines.append(
                f"Or let torchvision download it (unset {ENV_OFFLINE}, or allow_download=True in "
                f"Python), or put {layout} in the data folder."
            )
    if info.hint:
        lines.append(info.hint)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Loading (cached)
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _load_cached(
    name: str, kind: str, location: tuple[str, ...], stamps: tuple[tuple[int, int], ...]
) -> Dataset:
    """Load and convert one data set; ``stamps`` (mtime_ns, size) only key the cache."""
    del stamps
    info = _REGISTRY[name]
    x_tr, y_tr, x_te, y_te, source = _read_raw(info, kind, location)
    return _make_dataset(info, x_tr, y_tr, x_te, y_te, source)


def _read_raw(
    info: DatasetInfo, kind: str, location: tuple[str, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    """Read one single-domain set found by :func:`_locate`, before any conversion.

    Returns:
        ``(x_train, y_train, x_test, y_test, source)``: uint8 images ``[N, S, S]`` or
        ``[N, S, S, 3]`` (validated), int64 labels ``[N]``, and the text for
        :attr:`Dataset.source`.
    """
    name = info.name
    if kind == "sklearn":
        x_tr, y_tr, x_te, y_te = _read_digits()
        source = "sklearn"
    elif kind == "npz":
        if info.whole_file is not None:
            x, y = _read_npz(Path(location[0]), info)
            source = location[0]
            x_tr, y_tr, x_te, y_te = _split_whole(x, y)
        else:
            arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
            paths = iter(location)
            for split, rel in (("train", info.train_file), ("test", info.test_file)):
                if rel is None:
                    arrays[split] = _empty_raw(info)
                else:
                    arrays[split] = _read_npz(Path(next(paths)), info)
            (x_tr, y_tr), (x_te, y_te) = arrays["train"], arrays["test"]
            source = str(Path(location[-1]).parent)
    elif kind == "torchvision":
        root = Path(location[0])
        x_tr, y_tr, x_te, y_te = _read_torchvision(info, root, download=False)
        source = f"torchvision:{root}"
    else:  # pragma: no cover - internal misuse
        raise DataError(f"internal error: unknown loader kind {kind!r}", dataset=name)
    return x_tr, y_tr, x_te, y_te, source


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


def _empty_raw(info: DatasetInfo) -> tuple[np.ndarray, np.ndarray]:
    s = info.image_size
    shape = (0, s, s) if info.channels == 1 else (0, s, s, info.channels)
    return np.zeros(shape, dtype=np.uint8), np.zeros(0, dtype=np.int64)


def _read_npz(path: Path, info: DatasetInfo) -> tuple[np.ndarray, np.ndarray]:
    """Read and validate ``x`` and ``y`` of one MANIFEST-style npz file."""
    where = str(path)
    arrays: dict[str, np.ndarray] = {}
    # Open the file here (not by path in np.load) so it is closed even when the archive is
    # corrupt: np.load leaks its own handle when zipfile rejects the bytes.
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed by the with-block below
    except OSError as exc:
        raise DataError(
            f"{where}: cannot be opened ({exc})", dataset=info.name, path=where
        ) from exc
    with handle:
        try:
            archive = np.load(handle, allow_pickle=False)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise DataError(
                f"{where}: cannot be read as an npz archive ({type(exc).__name__}: {exc})",
                dataset=info.name,
                path=where,
            ) from exc
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise DataError(
                f"{where}: is a single .npy array, expected an npz archive with fields 'x' "
                "and 'y'",
                dataset=info.name,
                path=where,
            )
        with archive:
            for field in ("x", "y"):
                if field not in archive.files:
                    raise DataError(
                        f"{where}: field {field!r} is missing (fields present: "
                        f"{sorted(archive.files)})",
                        dataset=info.name,
                        path=where,
                        field=field,
                    )
                try:
                    arrays[field] = archive[field]
                except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
                    raise DataError(
                        f"{where}: field {field!r} cannot be read ({type(exc).__name__}: {exc})",
                        dataset=info.name,
                        path=where,
                        field=field,
                    ) from exc
    _validate_raw(arrays["x"], arrays["y"], info, where)
    return arrays["x"], arrays["y"]


def _validate_raw(x: np.ndarray, y: np.ndarray, info: DatasetInfo, where: str) -> None:
    """Check uint8 images of the set's shape and int64 labels in range, same N."""
    s, c = info.image_size, info.channels
    expected = (s, s) if c == 1 else (s, s, c)

    def fail(field: str, what: str) -> DataError:
        return DataError(f"{where}: field {field!r} {what}", dataset=info.name, path=where,
                         field=field)

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


def _stratified_split(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split of ``y`` (see module docstring); returns sorted int64 indices."""
    rng = np.random.default_rng(SPLIT_SEED)
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for label in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == label))
        n_test = int(np.floor(TEST_FRACTION * members.size + 0.5))
        test.append(members[:n_test])
        train.append(members[n_test:])
    tr = np.sort(np.concatenate(train)).astype(np.int64) if train else np.zeros(0, np.int64)
    te = np.sort(np.concatenate(test)).astype(np.int64) if test else np.zeros(0, np.int64)
    return tr, te


def _split_whole(
    x: np.ndarray, y: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    tr, te = _stratified_split(y)
    return x[tr], y[tr], x[te], y[te]


def _read_digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """sklearn's 8×8 digits, values 0–16 mapped to uint8 by ``rint(v·255/16)``, split 80/20."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - scikit-learn is a dependency
        raise DataError("data set 'digits' needs scikit-learn", dataset="digits") from exc
    bunch = load_digits()
    x = np.rint(np.asarray(bunch.images, dtype=np.float64) * (255.0 / 16.0)).astype(np.uint8)
    y = np.asarray(bunch.target, dtype=np.int64)
    return _split_whole(x, y)


def _read_torchvision(
    info: DatasetInfo, root: Path, *, download: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Open (or download) ``info.torchvision`` under ``root``; return uint8 HWC x, int64 y."""
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
        _validate_raw(x, y, info, f"torchvision:{root} ({split})")
    return x_tr, y_tr, x_te, y_te


def _download_root(user_dir: Path | None) -> Path:
    """Where a successful download is placed: the user's data folder if it is an existing,
    writable folder, else the torchvision cache (a missing data folder is never created)."""
    if user_dir is not None and user_dir.is_dir() and os.access(user_dir, os.W_OK | os.X_OK):
        return user_dir
    return _TORCHVISION_CACHE.expanduser()


def _download_torchvision(info: DatasetInfo, user_dir: Path | None) -> str:
    """Download ``info.torchvision`` into a fresh temporary folder, then move it into place.

    The temporary folder lies under the torchvision cache (falling back to the system temporary
    folder when the cache cannot be created) and is removed whatever happens, so a failed
    download leaves nothing behind and never touches the user's data folder. Only after
    torchvision has downloaded and both splits have been read and validated are the files moved
    into :func:`_download_root` (one ``os.replace`` per entry, merging into folders that already
    exist there).

    Returns:
        The resolved folder the files were moved into (a torchvision root for :func:`_locate`).

    Raises:
        DataError: the download or its validation failed (the message is the reason, without
            the temporary folder's path); or the downloaded files could not be moved into place.
    """
    final_root = _download_root(user_dir)
    cache = _TORCHVISION_CACHE.expanduser()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp_parent: str | None = str(cache)
    except OSError:
        tmp_parent = None  # e.g. read-only home: use the system temporary folder
    tmp = Path(tempfile.mkdtemp(prefix=f".download-{info.name}-", dir=tmp_parent))
    try:
        try:
            _read_torchvision(info, tmp, download=True)
        except DataError as exc:
            cause = exc.__cause__
            reason = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
            raise DataError(
                f"torchvision {info.torchvision}: {reason.strip()}", dataset=info.name
            ) from exc
        try:
            _install_tree(tmp, final_root)
        except OSError as exc:
            raise DataError(
                f"torchvision {info.torchvision} was downloaded but could not be moved into "
                f"{final_root} ({type(exc).__name__}: {exc})",
                dataset=info.name,
                path=str(final_root),
            ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final_root.resolve())


def _install_tree(src: Path, dst_dir: Path) -> None:
    """Move every entry of folder ``src`` into ``dst_dir``, which must exist (never created).

    A folder that already exists at the destination is merged into (entry by entry); anything
    else is moved with one atomic ``os.replace`` (across file systems: copied to a hidden staging
    folder beside the destination first, then renamed), so no half-written file ever appears
    under ``dst_dir``.
    """
    for entry in sorted(src.iterdir()):
        target = dst_dir / entry.name
        if entry.is_dir() and not entry.is_symlink() and target.is_dir():
            _install_tree(entry, target)
        else:
            _atomic_move(entry, target)


def _atomic_move(src: Path, dst: Path) -> None:
    try:
        os.replace(src, dst)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    staging = Path(tempfile.mkdtemp(prefix=".fedfleet-partial-", dir=dst.parent))
    try:
        staged = staging / src.name
        if src.is_dir():
            shutil.copytree(src, staged, symlinks=True)
        else:
            shutil.copy2(src, staged)
        os.replace(staged, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Multi-domain sets
# --------------------------------------------------------------------------------------------

_DOMAIN_CACHE_SIZE = 2  # multi-domain sets are large (MNIST alone: 737 MB uncapped)
_NORMALIZE_CHUNK = 4096  # images converted to float32 at a time (bounds the peak memory)


def _check_cap(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise DataError(f"{name} must be an int >= 0 (0 = no cap), got {value!r}")
    return int(value)


def _load_domains(
    info: DatasetInfo,
    data_dir: str | os.PathLike[str] | None,
    allow_download: bool | None,
    caps: tuple[int, int],
) -> Dataset:
    """Find every domain of multi-domain set ``info`` (falling back where allowed), then load
    them through the cache. Raises DataError naming the domain that is missing."""
    found: list[tuple[str, str, str, str, tuple[str, ...], tuple[tuple[int, int], ...]]] = []
    for spec in info.domains:
        chosen = spec
        try:
            located = _locate(dataset_info(spec.dataset), data_dir,
                              allow_download if spec.fallback is None else False)
        except DataError as exc:
            if spec.fallback is None:
                raise DataError(f"data set {info.name!r}, domain {spec.name!r}: {exc}",
                                dataset=info.name, searched=exc.searched, path=exc.path) from exc
            chosen = spec.fallback
            located = _locate(dataset_info(chosen.dataset), data_dir, allow_download)
        kind, location, _ = located
        if chosen.dataset == "svhn" and kind == "torchvision":
            import importlib.util

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
    substitution note, and the :func:`_locate` key of that set)."""
    info = _REGISTRY[name]
    size = info.image_size
    names: list[str] = []
    train_parts: list[tuple[np.ndarray, np.ndarray]] = []
    test_parts: list[tuple[np.ndarray, np.ndarray]] = []
    sources: list[str] = []
    notes: list[str] = []
    for domain, dataset, note, kind, location, _stamps in found:
        dinfo = _REGISTRY[dataset]
        if dinfo.num_classes != info.num_classes:  # pragma: no cover - registry misuse
            raise DataError(f"domain {domain!r} has {dinfo.num_classes} classes, {name!r} "
                            f"{info.num_classes}", dataset=name)
        x_tr, y_tr, x_te, y_te, src = _read_raw(dinfo, kind, location)
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
            for a in range(0, len(x), _NORMALIZE_CHUNK):
                chunk = x[a:a + _NORMALIZE_CHUNK]
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
        for d, a, b in zip(names, bounds[:-1], bounds[1:])
    }
    return Dataset(name=name, train=train, test=test, num_classes=info.num_classes, channels=3,
                   image_size=size, source="; ".join(sources), domain_names=tuple(names),
                   train_domains=train_domains, test_domains=types.MappingProxyType(test_domains),
                   substitutions=tuple(notes))


def stratified_subsample(y: np.ndarray, cap: int, seed: int = SPLIT_SEED) -> np.ndarray:
    """Indices of a seeded, class-stratified subsample of at most ``cap`` samples.

    Class c (of the ``n_c`` samples among N) gets the quota ``floor(cap · n_c / N)``; the
    ``cap − Σ quotas`` samples left over go one each to the classes with the largest remainders
    ``cap · n_c mod N`` (ties: lower class id first), i.e. the largest-remainder (Hamilton)
    apportionment, so every class keeps its share to within one sample. Then, for each class in
    increasing label order, its indices are permuted with one ``numpy.random.default_rng(seed)``
    and the first quota are kept.

    Args:
        y: integer labels ``[N]``.
        cap: at most this many samples are kept (int >= 0); 0, or ``cap >= N``, keeps all.
        seed: seed of the generator (default :data:`SPLIT_SEED`, so a capped set is fixed).

    Returns:
        int64 ``[min(cap, N)]`` (``[N]`` when ``cap`` is 0) sorted indices into ``y`` (the
        samples keep their file order).

    Raises:
        DataError: ``cap`` is not an int >= 0, or ``y`` is not a 1-D integer array.
    """
    labels = np.asarray(y)
    if labels.ndim != 1 or (labels.size and not np.issubdtype(labels.dtype, np.integer)):
        raise DataError(f"labels must be a 1-D integer array, got {_describe_array(labels)}")
    cap = _check_cap("cap", cap)
    n = int(labels.size)
    if cap == 0 or cap >= n:
        return np.arange(n, dtype=np.int64)
    classes, counts = np.unique(labels, return_counts=True)
    quota = cap * counts // n
    remainder = cap * counts % n
    left = cap - int(quota.sum())
    quota[np.argsort(-remainder, kind="stable")[:left]] += 1
    rng = np.random.default_rng(seed)
    keep = [rng.permutation(np.flatnonzero(labels == c))[:q] for c, q in zip(classes, quota)]
    return np.sort(np.concatenate(keep)).astype(np.int64)


def bilinear_weights(src: int, dst: int) -> np.ndarray:
    """The ``[dst, src]`` float64 matrix of 1-D bilinear (triangle-filter) resampling.

    Row i holds the weights of output pixel i: its centre maps to ``c = (i + 0.5) · src / dst``
    in input coordinates (pixel centres at ``j + 0.5``, as PIL and ``align_corners=False``);
    input pixel j gets ``max(0, 1 − |j + 0.5 − c| / r)`` with radius ``r = max(1, src / dst)``
    (widened when shrinking, as an antialiasing filter), for ``int(c − r + 0.5) <= j <
    int(c + r + 0.5)`` clipped to ``[0, src)``; the row is then divided by its sum. This is
    PIL's ``Image.resize(..., BILINEAR)`` coefficient rule
    (``ImagingResample``, ``precompute_coeffs``), without PIL's fixed-point rounding.

    Raises:
        DataError: ``src`` or ``dst`` < 1.
    """
    if src < 1 or dst < 1:
        raise DataError(f"bilinear_weights: sizes must be >= 1, got {src} -> {dst}")
    scale = src / dst
    radius = max(scale, 1.0)
    w = np.zeros((dst, src), dtype=np.float64)
    for i in range(dst):
        centre = (i + 0.5) * scale
        lo = max(int(centre - radius + 0.5), 0)
        hi = min(int(centre + radius + 0.5), src)
        j = np.arange(lo, hi)
        row = np.maximum(0.0, 1.0 - np.abs((j + 0.5 - centre) / radius))
        w[i, lo:hi] = row / row.sum()
    return w


def resize_bilinear(x: np.ndarray, size: int) -> np.ndarray:
    """Resize uint8 images to ``size``×``size`` by separable bilinear resampling.

    Args:
        x: uint8 ``[N, H, W]`` or ``[N, H, W, 3]`` (HWC).
        size: S, the output side in pixels (>= 1).

    Returns:
        uint8 ``[N, S, S]`` or ``[N, S, S, 3]``: ``rint(Wh · x · Wwᵀ)`` clipped to 0–255, with
        ``Wh = bilinear_weights(H, S)`` and ``Ww = bilinear_weights(W, S)`` (float32
        arithmetic); within one grey level of PIL ``Image.resize((S, S), BILINEAR)``, which
        rounds between its two passes. ``x`` itself (not a copy) when already S×S.

    Raises:
        DataError: ``x`` is not uint8 of one of the two shapes.
    """
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or not (
        x.ndim == 3 or (x.ndim == 4 and x.shape[3] == 3)
    ):
        raise DataError(f"resize_bilinear needs uint8 [N, H, W] or [N, H, W, 3], got "
                        f"{_describe_array(x)}", field="x")
    h, w = x.shape[1], x.shape[2]
    if (h, w) == (size, size):
        return x
    wh = bilinear_weights(h, size).astype(np.float32)
    ww_t = bilinear_weights(w, size).T.astype(np.float32)
    planes = x if x.ndim == 3 else x.transpose(0, 3, 1, 2)  # [N, H, W] or [N, 3, H, W]
    out = np.empty(planes.shape[:-2] + (size, size), dtype=np.uint8)
    for a in range(0, len(planes), _NORMALIZE_CHUNK):
        v = np.matmul(np.matmul(wh, planes[a:a + _NORMALIZE_CHUNK].astype(np.float32)), ww_t)
        out[a:a + _NORMALIZE_CHUNK] = np.clip(np.rint(v), 0, 255).astype(np.uint8)
    return out if x.ndim == 3 else np.ascontiguousarray(out.transpose(0, 2, 3, 1))


def to_rgb(x: np.ndarray) -> np.ndarray:
    """Give uint8 images 3 channels: grey ``[N, H, W]`` is copied into R, G and B
    (``[N, H, W, 3]``, as torchvision ``Grayscale(num_output_channels=3)``); RGB
    ``[N, H, W, 3]`` is returned as is.

    Raises:
        DataError: ``x`` is not uint8 of one of the two shapes.
    """
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8:
        raise DataError(f"to_rgb needs uint8 images, got {_describe_array(x)}", field="x")
    if x.ndim == 4 and x.shape[3] == 3:
        return x
    if x.ndim == 3:
        return np.repeat(x[..., None], 3, axis=3)
    raise DataError(f"to_rgb needs [N, H, W] or [N, H, W, 3], got shape {x.shape}", field="x")


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _check_label_range(y: np.ndarray, num_classes: int, *, where: str) -> None:
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise DataError(
            f"{where}: labels lie in [{y.min()}, {y.max()}], expected [0, {num_classes})",
            field="y",
        )


def _describe_array(a: object) -> str:
    if isinstance(a, np.ndarray):
        return f"ndarray dtype={a.dtype} shape={a.shape}"
    return type(a).__name__
