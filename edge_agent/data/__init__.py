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

Adding a data set: :func:`register_dataset` registers a factory function under a new name
(``@register_dataset("my_set", num_classes=10, channels=1, image_size=28)``); the factory gets
the data folder of step 1 and returns the raw splits, uint8 images and int64 labels as the npz
files hold them (its docstring gives the exact contract); :func:`load_dataset` then validates,
converts and caches them like any other set (``Dataset.source`` is ``"factory:<function>"``).

The package, one job per module (only the names below are public; the modules are private):

====================  =========================================================================
``_registry.py``      the names: built-in table, multi-domain specs, :func:`register_dataset`
``_folders.py``       the resolution order and download policy (steps 1–4), the not-found text
``_download.py``      torchvision downloads into a temporary folder, moved in atomically
``_npz.py``           reader: npz files of the ``shared/data`` layout
``_torchvision.py``   reader: torchvision layouts (idx, bz2, CIFAR batches, ``.mat``, STL-10)
``_sklearn.py``       reader: scikit-learn's 8×8 digits
``_factory.py``       reader: a registered factory (calls it, checks its contract)
``_read.py``          from what was found to the reader of that kind
``_domains.py``       the multi-domain sets (``pacs``, ``digits_domains``)
``_load.py``          :func:`load_dataset` and the in-process cache
``_records.py``       :class:`ArraySplit`, :class:`Dataset`, :class:`DatasetInfo`,
                      :class:`DomainSpec`, the raw-array checks
``_images.py``        :func:`normalize_images`, :func:`resize_bilinear`, :func:`to_rgb`
``_sampling.py``      :func:`class_histogram`, :func:`stratified_subsample`, the 80/20 split,
                      :func:`proxy_split`
====================  =========================================================================
"""

from __future__ import annotations

from edge_agent.data import _folders, _sampling
from edge_agent.data._folders import ENV_DATA_DIR, ENV_OFFLINE
from edge_agent.data._images import bilinear_weights, normalize_images, resize_bilinear, to_rgb
from edge_agent.data._load import clear_dataset_cache, load_dataset
from edge_agent.data._records import ArraySplit, Dataset, DatasetInfo, DomainSpec
from edge_agent.data._registry import (
    DOMAIN_IMAGE_SIZE,
    PACS_DOMAINS,
    dataset_factory,
    dataset_info,
    list_datasets,
    register_dataset,
    unregister_dataset,
)
from edge_agent.data._sampling import (
    PROXY_SIZE,
    SPLIT_SEED,
    TEST_FRACTION,
    class_histogram,
    proxy_split,
    stratified_subsample,
)

# Private names the data tests reach through the package (the lookup order, the 80/20 split).
_npz_search_dirs = _folders.npz_search_dirs
_user_data_dir = _folders.user_data_dir
_stratified_split = _sampling.stratified_split

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
    "dataset_factory",
    "dataset_info",
    "list_datasets",
    "load_dataset",
    "normalize_images",
    "proxy_split",
    "register_dataset",
    "resize_bilinear",
    "stratified_subsample",
    "to_rgb",
    "unregister_dataset",
]
