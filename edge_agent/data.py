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
digits              sklearn.datasets.load_digits (no file)      10       1×8×8   —
pacs_photo          pacs/photo_32.npz (whole domain)            7        3×32×32 —
pacs_art_painting   pacs/art_painting_32.npz (whole domain)     7        3×32×32 —
pacs_cartoon        pacs/cartoon_32.npz (whole domain)          7        3×32×32 —
pacs_sketch         pacs/sketch_32.npz (whole domain)           7        3×32×32 —
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

Loaded data sets are cached in-process (keyed on the name, the resolved file paths and their
modification times), because several virtual agents in one process load the same set; the
arrays returned are read-only (``flags.writeable == False``) so the sharing is safe. Take a
writable copy with ``np.array(split.x)`` if one is needed.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_agent.errors import DataError

__all__ = [
    "ArraySplit",
    "Dataset",
    "DatasetInfo",
    "ENV_DATA_DIR",
    "ENV_OFFLINE",
    "SPLIT_SEED",
    "TEST_FRACTION",
    "class_histogram",
    "clear_dataset_cache",
    "dataset_info",
    "list_datasets",
    "load_dataset",
    "normalize_images",
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
            file for one-file sets, ``"sklearn"`` for ``digits``, or ``"torchvision:<root>"``.

    Raises:
        DataError: on construction, if a split's class count, channels or image size disagree
            with the fields above.
    """

    name: str
    train: ArraySplit
    test: ArraySplit
    num_classes: int
    channels: int
    image_size: int
    source: str

    def __post_init__(self) -> None:
        for split_name in ("train", "test"):
            split: ArraySplit = getattr(self, split_name)
            expected = (self.channels, self.image_size, self.image_size)
            if split.num_classes != self.num_classes or split.x.shape[1:] != expected:
                raise DataError(
                    f"data set {self.name!r}: {split_name} split has images "
                    f"{tuple(split.x.shape[1:])} and {split.num_classes} classes, expected "
                    f"{expected} and {self.num_classes}",
                    dataset=self.name,
                )


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


def _pacs(domain: str) -> DatasetInfo:
    return DatasetInfo(f"pacs_{domain}", 7, 3, 32, whole_file=f"pacs/{domain}_32.npz")


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
        DatasetInfo("digits", 10, 1, 8, sklearn=True),
        _pacs("photo"),
        _pacs("art_painting"),
        _pacs("cartoon"),
        _pacs("sketch"),
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
) -> Dataset:
    """Load data set ``name``, searching the locations in the order of the module docstring.

    Args:
        name: one of :func:`list_datasets`.
        data_dir: a directory laid out like ``shared/data`` (``<dir>/mnist/train.npz``, ...),
            or holding torchvision's layout (``<dir>/MNIST/raw/...``). None: use env
            ``FEDFLEET_DATA`` if set, else only the default locations.
        allow_download: True lets torchvision download MNIST, Fashion-MNIST, USPS, CIFAR-10 or
            SVHN when no local copy is found; False forbids it; None (default) allows it unless
            env ``FEDFLEET_OFFLINE`` is ``"1"``. A download lands in ``data_dir`` (when that
            folder exists) only after it has succeeded; see step 3 of the module docstring.

    Returns:
        A :class:`Dataset` whose arrays are read-only and shared with other callers in this
        process (cached): ``train.x``/``test.x`` float32 ``[N, C, S, S]`` in [-1, 1],
        ``train.y``/``test.y`` int64 ``[N]``.

    Raises:
        DataError: unknown name; no location holds the set (the message lists every location
            searched, in order, and which files to put where; ``searched`` holds the same list);
            a file is found but unreadable or malformed (``path`` and ``field`` name it); a
            torchvision download fails.
    """
    info = dataset_info(name)
    if info.sklearn:
        return _load_cached(info.name, "sklearn", (), ())

    user_dir = _user_data_dir(data_dir)
    npz_dirs = _npz_search_dirs(user_dir)
    searched: list[str] = []
    for folder in npz_dirs:
        searched.append(str(folder))
        paths = [folder / rel for rel in info.files]
        if all(p.is_file() for p in paths):
            resolved = tuple(str(p.resolve()) for p in paths)
            stamps = tuple(_file_stamp(p) for p in paths)
            return _load_cached(info.name, "npz", resolved, stamps)

    if info.torchvision is not None:
        tv_roots = _unique_paths(
            ([user_dir] if user_dir is not None else []) + [_TORCHVISION_CACHE.expanduser()]
        )
        for root in tv_roots:
            searched.append(f"torchvision:{root}")
            if _torchvision_layout_present(info.torchvision, root):
                return _load_cached(info.name, "torchvision", (str(root.resolve()),), ())
        if _downloads_allowed(allow_download):
            try:
                return _download_torchvision(info, user_dir)
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
    """Drop every data set cached by :func:`load_dataset` (frees memory; next load rereads)."""
    _load_cached.cache_clear()


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


# --------------------------------------------------------------------------------------------
# Resolution helpers
# --------------------------------------------------------------------------------------------


def _user_data_dir(data_dir: str | os.PathLike[str] | None) -> Path | None:
    """Step 1: the ``data_dir`` argument, else env ``FEDFLEET_DATA``, else None."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    env = os.environ.get(ENV_DATA_DIR, "")
    return Path(env).expanduser() if env else None


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
            if info.torchvision == "SVHN":
                ds = cls(str(root), split="train" if train else "test", download=download)
                x = np.asarray(ds.data, dtype=np.uint8).transpose(0, 2, 3, 1)  # NCHW -> NHWC
                y = np.asarray(ds.labels)
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


def _download_torchvision(info: DatasetInfo, user_dir: Path | None) -> Dataset:
    """Download ``info.torchvision`` into a fresh temporary folder, then move it into place.

    The temporary folder lies under the torchvision cache (falling back to the system temporary
    folder when the cache cannot be created) and is removed whatever happens, so a failed
    download leaves nothing behind and never touches the user's data folder. Only after
    torchvision has downloaded and both splits have been read and validated are the files moved
    into :func:`_download_root` (one ``os.replace`` per entry, merging into folders that already
    exist there).

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
    return _load_cached(info.name, "torchvision", (str(final_root.resolve()),), ())


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
