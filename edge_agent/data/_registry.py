"""The data-set registry: every name :func:`edge_agent.data.load_dataset` accepts.

Each name maps to a :class:`~edge_agent.data.DatasetInfo` saying what the set is (classes,
channels, image size) and where it is read from: npz files of the ``shared/data`` layout, a
torchvision layout, scikit-learn, the domains of a multi-domain set, or a user's factory added
with :func:`register_dataset`. Nothing here does I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar, cast

from edge_agent.data._records import DatasetFactory, DatasetInfo, DomainSpec
from edge_agent.errors import DataError


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


MULTI_DOMAIN: tuple[DatasetInfo, ...] = (
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
                "which torchvision checks too; the 96×96 images are resized to 32×32 on loading) "
                "or stl10/train.npz and test.npz (x uint8 N×32×32×3) in the data folder."
            ),
        ),
        DatasetInfo("digits", 10, 1, 8, sklearn=True),
        _pacs("photo"),
        _pacs("art_painting"),
        _pacs("cartoon"),
        _pacs("sketch"),
        *MULTI_DOMAIN,
    )
}


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
        pass
    from edge_agent.plugins import is_reference

    if is_reference(name, "dataset"):
        return _user_dataset(name)
    raise DataError(
        f"unknown data set {name!r}; known names: {', '.join(list_datasets())}, or your own factory as "
        "'package.module:function' (decorated with fedfleet.dataset_factory) or an entry point of group "
        "fedfleet.datasets",
        dataset=str(name),
    )


#: the attribute :func:`dataset_factory` sets on a factory: ``(num_classes, channels, image_size)``.
FACTORY_ATTR = "__fedfleet_dataset__"


def dataset_factory(*, num_classes: int, channels: int, image_size: int) -> Callable[[F], F]:
    """Declare a function a data-set factory that the configuration names by import path
    (``[data] dataset = "mypkg.data:shapes"``, ``fedfleet-agent --dataset mypkg.data:shapes``) or
    by entry point (group ``fedfleet.datasets``); use as a decorator::

        @dataset_factory(num_classes=4, channels=1, image_size=12)
        def shapes(data_dir):
            ...
            return x_train, y_train, x_test, y_test

    The factory contract is :func:`register_dataset`'s (called with the data folder or None; four
    arrays: uint8 images ``[N, S, S]`` or ``[N, S, S, 3]``, int64 labels ``[N]`` in ``[0, K)``),
    checked when the set is loaded: a misfit raises :class:`DataError` naming the factory, the
    split and the field. The set's name is the reference it was found by.

    Raises:
        DataError: (at once) ``num_classes`` or ``image_size`` not an int >= 1, ``channels`` not
            1 or 3; from the decorator, a factory that is not callable.
    """
    _check_shape("dataset_factory", num_classes, channels, image_size)

    def decorate(factory: F) -> F:
        if not callable(factory):
            raise DataError(f"dataset_factory: the factory must be callable, got {type(factory).__name__}")
        setattr(factory, FACTORY_ATTR, (num_classes, channels, image_size))
        return factory

    return decorate


def _user_dataset(ref: str) -> DatasetInfo:
    """The registry entry of a user's factory named by import path or entry point (kept under
    ``ref`` once resolved).

    Raises:
        DataError: the reference cannot be resolved, or names something that is not a function
            declared with :func:`dataset_factory`.
    """
    from edge_agent.plugins import resolve_reference

    obj = resolve_reference(ref, kind="dataset", what="data set factory", error=DataError)
    shape = getattr(obj, FACTORY_ATTR, None)
    if not callable(obj) or shape is None:
        raise DataError(f"data set factory {ref!r}: {type(obj).__name__} {getattr(obj, '__qualname__', obj)!r} is not "
                        "declared with @fedfleet.dataset_factory(num_classes=..., channels=..., image_size=...)",
                        dataset=ref)
    num_classes, channels, image_size = shape
    info = DatasetInfo(ref, num_classes, channels, image_size, factory=cast(DatasetFactory, obj))
    _REGISTRY[ref] = info
    return info


def _check_shape(who: str, num_classes: object, channels: object, image_size: object) -> None:
    for what, value, low in (("num_classes", num_classes, 1), ("image_size", image_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise DataError(f"{who}: {what} must be an int >= {low}, got {value!r}")
    if isinstance(channels, bool) or channels not in (1, 3):
        raise DataError(f"{who}: channels must be 1 (grey) or 3 (RGB), got {channels!r}")


_BUILTIN: frozenset[str] = frozenset(_REGISTRY)
"""The names defined above; :func:`register_dataset` never replaces them."""

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")

F = TypeVar("F", bound=Callable[..., object])


def register_dataset(
    name: str, *, num_classes: int, channels: int, image_size: int, replace: bool = False
) -> Callable[[F], F]:
    """Add a data set read by a factory function; use as a decorator.

    Example::

        from edge_agent.data import register_dataset

        @register_dataset("my_digits", num_classes=10, channels=1, image_size=28)
        def my_digits(data_dir):
            with np.load(data_dir / "my_digits.npz") as z:
                return z["x_train"], z["y_train"], z["x_test"], z["y_test"]

    after which ``load_dataset("my_digits")`` returns a :class:`~edge_agent.data.Dataset` like any
    other name (``register_dataset(...)(function)`` does the same without decorator syntax).

    The factory contract:

    - It is called as ``factory(data_dir)``, with ``data_dir`` the data folder of step 1 of the
      resolution order (the ``data_dir`` argument of ``load_dataset``, else env
      ``FEDFLEET_DATA``) as a :class:`pathlib.Path` (which may not exist), or None when neither
      is set. It is called once per data folder: the result is cached in-process like every
      set, until :func:`~edge_agent.data.clear_dataset_cache`.
    - It returns a tuple ``(x_train, y_train, x_test, y_test)`` of numpy arrays, the raw images
      as the npz files of ``shared/data`` hold them:

      * ``x_*``: uint8, values 0–255, ``[N, S, S]`` when ``channels`` is 1 and ``[N, S, S, 3]``
        (height, width, channel) when ``channels`` is 3, with ``S = image_size``;
      * ``y_*``: int64 ``[N]`` (the same N as its ``x``), each label in ``[0, num_classes)``;
      * either split may be empty (N = 0), e.g. a set that only has test images.

      They are converted like every set here (float32 ``[N, C, S, S]``, ``(v / 255 − 0.5) /
      0.5`` in [-1, 1]; see :func:`~edge_agent.data.normalize_images`). Anything else (another
      dtype, a float image, a wrong shape, labels out of range, not four arrays) makes
      ``load_dataset`` raise :class:`DataError` naming the factory, the split and the field.
    - A :class:`DataError` it raises reaches the caller unchanged; any other exception is
      converted into a :class:`DataError` naming the factory (the original is ``__cause__``).

    Args:
        name: the new name: letters, digits, ``_``, ``.``, ``-`` (at most 64, not starting
            with ``_``, ``.`` or ``-``), not one of the built-in names.
        num_classes: K >= 1, the number of classes.
        channels: C, 1 (grey) or 3 (RGB).
        image_size: S >= 1 in pixels (images are S×S).
        replace: True lets a name registered earlier by this function be replaced (a loaded
            set stays cached under the old entry and is not returned for the new one); False
            (default) refuses a name already taken.

    Returns:
        The decorator; it registers the function and returns it unchanged.

    Raises:
        DataError: (at once, not at loading) a name that is not a str of the form above, a
            built-in name, a name already registered when ``replace`` is False, ``num_classes``
            or ``image_size`` not an int >= 1, ``channels`` not 1 or 3; and, from the decorator,
            a factory that is not callable.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise DataError(f"register_dataset: the name must be 1 to 64 letters, digits, '_', '.' or '-' "
                        f"(not starting with '_', '.' or '-'), got {name!r}")
    if name in _BUILTIN:
        raise DataError(f"register_dataset: {name!r} is a built-in data set and cannot be replaced; "
                        "choose another name", dataset=name)
    if name in _REGISTRY and not replace:
        raise DataError(f"register_dataset: {name!r} is already registered (pass replace=True to "
                        "replace it)", dataset=name)
    for what, value, low in (("num_classes", num_classes, 1), ("image_size", image_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise DataError(f"register_dataset({name!r}): {what} must be an int >= {low}, got {value!r}",
                            dataset=name)
    if isinstance(channels, bool) or channels not in (1, 3):
        raise DataError(f"register_dataset({name!r}): channels must be 1 (grey) or 3 (RGB), got "
                        f"{channels!r}", dataset=name)

    def decorate(factory: F) -> F:
        if not callable(factory):
            raise DataError(f"register_dataset({name!r}): the factory must be callable, got "
                            f"{type(factory).__name__}", dataset=name)
        _REGISTRY[name] = DatasetInfo(name, num_classes, channels, image_size,
                                      factory=cast(DatasetFactory, factory))  # checked when called
        return factory

    return decorate


def unregister_dataset(name: str) -> None:
    """Remove a data set added with :func:`register_dataset` (its cached data is no longer found).

    Raises:
        DataError: ``name`` is a built-in set, or not registered.
    """
    if name in _BUILTIN:
        raise DataError(f"unregister_dataset: {name!r} is a built-in data set", dataset=name)
    if name not in _REGISTRY:
        raise DataError(f"unregister_dataset: {name!r} is not registered", dataset=str(name))
    del _REGISTRY[name]

