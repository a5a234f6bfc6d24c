"""Tests of edge_agent.data: offline loading, conversion, validation, resolution order, cache.

Expected numbers come from shared/data/MANIFEST.md and from scikit-learn's digits, not from the
code under test. Nothing here downloads: FEDFLEET_OFFLINE=1 is set for every test.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_agent import data
from edge_agent.errors import DataError, EdgeAgentError

# MANIFEST.md class counts, class 0 first.
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
USPS_TRAIN_COUNTS = [1194, 1005, 731, 658, 652, 556, 664, 645, 542, 644]
USPS_TEST_COUNTS = [359, 264, 198, 166, 200, 160, 170, 147, 166, 177]
PACS_PHOTO_COUNTS = [189, 202, 182, 186, 199, 280, 432]
SVHN50_COUNTS = [6, 4, 7, 4, 5, 6, 4, 4, 4, 6]
DIGITS_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


# FEDFLEET_DATA as the test run was started with (the autouse fixture below removes it).
_ENV_DATA_AT_START = os.environ.get("FEDFLEET_DATA", "")


def _shared_dir() -> Path | None:
    """The folder the loader reads the MANIFEST sets from, by the loader's own resolution:
    FEDFLEET_DATA first, then the shared data folder(s) beside the repository."""
    for d in data._npz_search_dirs(data._user_data_dir(None)):
        if (d / "mnist" / "test.npz").is_file():
            return d
    return None


SHARED = _shared_dir()


@pytest.fixture
def _shared_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the loader see SHARED again: put back the FEDFLEET_DATA the run started with."""
    if _ENV_DATA_AT_START:
        monkeypatch.setenv("FEDFLEET_DATA", _ENV_DATA_AT_START)


def needs_shared(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test that reads the MANIFEST files (from FEDFLEET_DATA or the shared folder)."""
    test = pytest.mark.usefixtures("_shared_data")(test)
    return pytest.mark.skipif(
        SHARED is None,
        reason="MANIFEST data files not found (set FEDFLEET_DATA or provide ../shared/data)",
    )(test)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No downloads, no FEDFLEET_DATA; drop cached sets afterwards to bound test memory."""
    monkeypatch.setenv("FEDFLEET_OFFLINE", "1")
    monkeypatch.delenv("FEDFLEET_DATA", raising=False)
    yield
    data.clear_dataset_cache()


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No shared folder and an empty torchvision cache: only what the test writes exists."""
    monkeypatch.setattr(data._folders, "_SHARED_DATA_DIRS", ())
    monkeypatch.setattr(data._folders, "_TORCHVISION_CACHE", tmp_path / "tv-cache")
    return tmp_path


def _expected_norm(raw: np.ndarray) -> np.ndarray:
    """Independent float64 reference of the documented conversion."""
    return (raw.astype(np.float64) / 255.0 - 0.5) / 0.5


def _round_half_up_fifth(n: int) -> int:
    """round(n / 5) with halves up, in integers (the 20 % test share)."""
    return (2 * n + 5) // 10


def _write_mnist_like(folder: Path, n_train: int = 12, n_test: int = 7, seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    (folder / "mnist").mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        np.savez_compressed(
            folder / "mnist" / f"{split}.npz",
            x=rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8),
            y=rng.integers(0, 10, size=n).astype(np.int64),
        )


# ---------------------------------------------------------------------------- names & records


def test_list_datasets_names() -> None:
    names = data.list_datasets()
    assert names == sorted(names)
    assert set(names) == {
        "mnist", "fashion_mnist", "usps", "cifar10", "mnist_m", "svhn", "svhn_sample50",
        "kmnist", "stl10",  # read only from a user's own copy (not in the offline set)
        "digits", "pacs_photo", "pacs_art_painting", "pacs_cartoon", "pacs_sketch",
        "pacs", "digits_domains",  # the multi-domain sets (tests/test_domains.py)
    }


def test_unknown_name_raises_data_error() -> None:
    with pytest.raises(DataError) as info:
        data.load_dataset("imagenet")
    assert info.value.dataset == "imagenet"
    assert "mnist" in str(info.value) and "digits" in str(info.value)
    assert isinstance(info.value, EdgeAgentError)


def test_array_split_rejects_bad_arrays() -> None:
    x = np.zeros((3, 1, 4, 4), np.float32)
    with pytest.raises(DataError):
        data.ArraySplit(x=x.astype(np.float64), y=np.zeros(3, np.int64), num_classes=2)
    with pytest.raises(DataError):
        data.ArraySplit(x=x, y=np.zeros(3, np.int32), num_classes=2)
    with pytest.raises(DataError):
        data.ArraySplit(x=x, y=np.zeros(2, np.int64), num_classes=2)
    with pytest.raises(DataError):
        data.ArraySplit(x=x, y=np.array([0, 1, 2], np.int64), num_classes=2)
    split = data.ArraySplit(x=x, y=np.array([0, 1, 1], np.int64), num_classes=2)
    assert (len(split), split.channels, split.image_size) == (3, 1, 4)


def test_array_split_subset_copies() -> None:
    x = np.arange(5 * 4, dtype=np.float32).reshape(5, 1, 2, 2)
    y = np.array([0, 1, 2, 1, 0], np.int64)
    split = data.ArraySplit(x=x, y=y, num_classes=3)
    sub = split.subset(np.array([4, 1]))
    np.testing.assert_array_equal(sub.x, x[[4, 1]])
    np.testing.assert_array_equal(sub.y, [0, 1])
    with pytest.raises(DataError):
        split.subset(np.array([5]))


# ---------------------------------------------------------------------------- conversion


def test_normalize_images_known_pixels() -> None:
    gray = np.array([[[0, 255], [128, 1]]], dtype=np.uint8)  # [1, 2, 2]
    out = data.normalize_images(gray)
    assert out.shape == (1, 1, 2, 2) and out.dtype == np.float32
    assert out[0, 0, 0, 0] == -1.0 and out[0, 0, 0, 1] == 1.0
    np.testing.assert_allclose(out[0, 0], _expected_norm(gray[0]), rtol=0, atol=1e-6)

    rgb = np.zeros((2, 3, 5, 3), np.uint8)  # N, H, W, C
    rgb[1, 2, 4, 0], rgb[1, 2, 4, 2] = 255, 51
    out = data.normalize_images(rgb)
    assert out.shape == (2, 3, 3, 5)
    assert out[1, 0, 2, 4] == 1.0 and out[1, 1, 2, 4] == -1.0
    assert out[1, 2, 2, 4] == pytest.approx((51 / 255 - 0.5) / 0.5, abs=1e-6)

    with pytest.raises(DataError):
        data.normalize_images(gray.astype(np.float32))
    with pytest.raises(DataError):
        data.normalize_images(np.zeros((2, 4, 4, 4), np.uint8))


# ---------------------------------------------------------------------------- the offline sets


@needs_shared
def test_mnist_sizes_counts_and_normalisation() -> None:
    ds = data.load_dataset("mnist")
    assert (len(ds.train), len(ds.test)) == (60000, 10000)
    assert (ds.num_classes, ds.channels, ds.image_size) == (10, 1, 28)
    assert ds.train.x.shape == (60000, 1, 28, 28) and ds.train.x.dtype == np.float32
    assert ds.test.y.dtype == np.int64
    assert data.class_histogram(ds.test.y, 10) == MNIST_TEST_COUNTS
    assert data.class_histogram(ds.train.y, 10) == MNIST_TRAIN_COUNTS
    assert Path(ds.source) == (SHARED / "mnist").resolve()

    with np.load(SHARED / "mnist" / "test.npz") as z:
        raw_x, raw_y = z["x"], z["y"]
    np.testing.assert_array_equal(ds.test.y, raw_y)
    np.testing.assert_allclose(ds.test.x[:, 0], _expected_norm(raw_x), rtol=0, atol=1e-6)
    assert np.all(ds.test.x[:, 0][raw_x == 0] == -1.0)
    assert np.all(ds.test.x[:, 0][raw_x == 255] == 1.0)
    assert (raw_x == 255).any()


@needs_shared
def test_arrays_are_read_only_and_cached() -> None:
    a = data.load_dataset("mnist")
    b = data.load_dataset("mnist")
    assert a is b
    for arr in (a.train.x, a.train.y, a.test.x, a.test.y):
        assert not arr.flags.writeable
    with pytest.raises(ValueError):
        a.test.x[0, 0, 0, 0] = 3.0


@needs_shared
def test_cifar10_hwc_to_chw() -> None:
    ds = data.load_dataset("cifar10")
    assert (len(ds.train), len(ds.test)) == (10000, 10000)
    assert ds.train.x.shape[1:] == (3, 32, 32)
    assert data.class_histogram(ds.train.y, 10) == [1000] * 10
    with np.load(SHARED / "cifar10" / "test.npz") as z:
        raw = z["x"][:50]
    np.testing.assert_allclose(
        ds.test.x[:50], _expected_norm(raw).transpose(0, 3, 1, 2), rtol=0, atol=1e-6
    )


@needs_shared
@pytest.mark.parametrize(
    ("name", "n_train", "n_test", "shape"),
    [
        ("fashion_mnist", 60000, 10000, (1, 28, 28)),
        ("usps", 7291, 2007, (1, 16, 16)),
        ("mnist_m", 5000, 10000, (3, 28, 28)),
    ],
)
def test_other_pair_sets(name: str, n_train: int, n_test: int, shape: tuple[int, ...]) -> None:
    ds = data.load_dataset(name)
    assert (len(ds.train), len(ds.test)) == (n_train, n_test)
    assert ds.train.x.shape[1:] == shape and ds.test.x.shape[1:] == shape
    assert float(ds.test.x.min()) >= -1.0 and float(ds.test.x.max()) <= 1.0
    if name == "usps":
        assert data.class_histogram(ds.train.y, 10) == USPS_TRAIN_COUNTS
        assert data.class_histogram(ds.test.y, 10) == USPS_TEST_COUNTS
    if name == "mnist_m":
        assert data.class_histogram(ds.test.y, 10) == MNIST_TEST_COUNTS


@needs_shared
def test_pacs_photo_stratified_split() -> None:
    ds = data.load_dataset("pacs_photo")
    assert (ds.num_classes, ds.channels, ds.image_size) == (7, 3, 32)
    assert len(ds.train) + len(ds.test) == 1670
    expected_test = [_round_half_up_fifth(n) for n in PACS_PHOTO_COUNTS]
    assert data.class_histogram(ds.test.y, 7) == expected_test
    assert data.class_histogram(ds.train.y, 7) == [
        n - t for n, t in zip(PACS_PHOTO_COUNTS, expected_test, strict=True)
    ]
    # Every image of the file lands in exactly one split (compare as multisets of rows).
    with np.load(SHARED / "pacs" / "photo_32.npz") as z:
        raw = _expected_norm(z["x"]).transpose(0, 3, 1, 2).reshape(1670, -1)
    both = np.concatenate([ds.train.x, ds.test.x]).reshape(1670, -1).astype(np.float64)
    np.testing.assert_allclose(
        both[np.lexsort(both.T[::-1])], raw[np.lexsort(raw.T[::-1])], rtol=0, atol=1e-6
    )


@needs_shared
def test_svhn_sample50_and_svhn_message() -> None:
    ds = data.load_dataset("svhn_sample50")
    assert ds.train.x.shape == (0, 3, 32, 32) and ds.train.y.shape == (0,)
    assert ds.test.x.shape == (50, 3, 32, 32)
    assert data.class_histogram(ds.test.y, 10) == SVHN50_COUNTS
    with pytest.raises(DataError) as info:
        data.load_dataset("svhn")
    msg = str(info.value)
    assert "50" in msg and "svhn_sample50" in msg and "not attempted" in msg


def test_digits_split_is_stratified_disjoint_and_fixed() -> None:
    from sklearn.datasets import load_digits

    ds = data.load_dataset("digits")
    assert ds.source == "sklearn"
    assert (ds.channels, ds.image_size, ds.num_classes) == (1, 8, 10)
    assert len(ds.train) + len(ds.test) == 1797
    expected_test = [_round_half_up_fifth(n) for n in DIGITS_COUNTS]
    assert sum(expected_test) == 359
    assert data.class_histogram(ds.test.y, 10) == expected_test
    assert data.class_histogram(ds.train.y, 10) == [
        n - t for n, t in zip(DIGITS_COUNTS, expected_test, strict=True)
    ]

    # Independent conversion: 0..16 -> 0..255 -> [-1, 1]; the two splits together hold every
    # (image, label) row of sklearn's data exactly once.
    bunch = load_digits()
    ref = (bunch.images * (255.0 / 16.0)).round() / 255.0 * 2.0 - 1.0
    ref_rows = np.column_stack([ref.reshape(1797, -1), bunch.target])
    got_rows = np.column_stack(
        [
            np.concatenate([ds.train.x, ds.test.x]).reshape(1797, -1).astype(np.float64),
            np.concatenate([ds.train.y, ds.test.y]),
        ]
    )
    np.testing.assert_allclose(
        got_rows[np.lexsort(got_rows.T[::-1])],
        ref_rows[np.lexsort(ref_rows.T[::-1])],
        rtol=0,
        atol=1e-6,
    )

    data.clear_dataset_cache()
    again = data.load_dataset("digits")
    assert again is not ds
    np.testing.assert_array_equal(again.test.x, ds.test.x)
    np.testing.assert_array_equal(again.train.y, ds.train.y)


def test_stratified_split_indices() -> None:
    y = np.repeat(np.arange(4), [10, 3, 1, 7])
    train, test = data._stratified_split(y)
    assert np.intersect1d(train, test).size == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), np.arange(y.size))
    assert np.all(np.diff(train) > 0) and np.all(np.diff(test) > 0)
    assert np.bincount(y[test], minlength=4).tolist() == [2, 1, 0, 1]


# ---------------------------------------------------------------------------- resolution order


def test_missing_everywhere_offline(isolated: Path) -> None:
    missing = isolated / "nowhere"
    with pytest.raises(DataError) as info:
        data.load_dataset("mnist", data_dir=missing)
    err = info.value
    msg = str(err)
    assert f"{missing}  [the data folder you set, does not exist]" in msg
    assert "mnist/train.npz and mnist/test.npz" in msg
    assert "x uint8 N×28×28" in msg and "FEDFLEET_DATA" in msg
    assert "not attempted (downloads are off: FEDFLEET_OFFLINE=1)" in msg
    assert err.dataset == "mnist"
    assert err.searched[0] == str(missing)
    assert f"torchvision:{isolated / 'tv-cache'}" in err.searched
    assert not missing.exists()  # a lookup never creates the data folder


def test_message_names_every_way_to_set_the_data_folder(isolated: Path) -> None:
    """The advice reads right for CLI, config and Python users alike (not only Python names)."""
    with pytest.raises(DataError) as info:
        data.load_dataset("mnist", data_dir=isolated / "nowhere")
    msg = str(info.value)
    for way in (
        "`--data-dir DIR` on the command line",
        "`[data] data_dir` in the config",
        "`data_dir=` in Python",
        "the FEDFLEET_DATA environment variable",
    ):
        assert way in msg
    assert "pass data_dir=" not in msg and "(allow_download=True," not in msg
    # Where to put what is still spelled out.
    assert f"e.g. {isolated / 'nowhere' / 'mnist' / 'train.npz'}" in msg
    assert "torchvision's MNIST folder layout (MNIST/raw/train-images-idx3-ubyte" in msg
    with pytest.raises(DataError) as info:
        data.load_dataset("mnist_m")
    assert "(nothing: no data folder set, FEDFLEET_DATA not set" in str(info.value)


def test_missing_with_env_dir_and_allow_download_false(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FEDFLEET_OFFLINE")
    env_dir = isolated / "env-data"
    monkeypatch.setenv("FEDFLEET_DATA", str(env_dir))
    with pytest.raises(DataError) as info:
        data.load_dataset("mnist_m", allow_download=False)
    assert info.value.searched == [str(env_dir)]  # mnist_m has no torchvision fallback
    assert "env FEDFLEET_DATA" in str(info.value)
    assert "mnist_m_regenerated/train_subset5k.npz" in str(info.value)
    with pytest.raises(DataError) as info:
        data.load_dataset("usps", allow_download=False)
    assert "not attempted (downloads are off: allow_download=False)" in str(info.value)


def test_data_dir_before_shared_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_mnist_like(tmp_path / "arg", n_train=12, n_test=7, seed=1)
    _write_mnist_like(tmp_path / "env", n_train=5, n_test=3, seed=2)
    monkeypatch.setenv("FEDFLEET_DATA", str(tmp_path / "env"))
    ds = data.load_dataset("mnist", data_dir=tmp_path / "arg")
    assert (len(ds.train), len(ds.test)) == (12, 7)
    assert Path(ds.source) == (tmp_path / "arg" / "mnist").resolve()
    ds_env = data.load_dataset("mnist")
    assert (len(ds_env.train), len(ds_env.test)) == (5, 3)
    with np.load(tmp_path / "env" / "mnist" / "test.npz") as z:
        np.testing.assert_allclose(ds_env.test.x[:, 0], _expected_norm(z["x"]), atol=1e-6)
        np.testing.assert_array_equal(ds_env.test.y, z["y"])


def test_cache_reloads_rewritten_file(tmp_path: Path) -> None:
    _write_mnist_like(tmp_path, n_train=4, n_test=2, seed=3)
    first = data.load_dataset("mnist", data_dir=tmp_path)
    _write_mnist_like(tmp_path, n_train=6, n_test=2, seed=4)
    second = data.load_dataset("mnist", data_dir=tmp_path)
    assert len(first.train) == 4 and len(second.train) == 6


def _bad_cases() -> list[object]:
    good_x = np.zeros((4, 28, 28), np.uint8)
    good_y = np.array([0, 1, 2, 3], np.int64)
    return [
        pytest.param({"x": good_x.astype(np.float32), "y": good_y}, "x", id="x_float"),
        pytest.param({"x": np.zeros((4, 32, 32), np.uint8), "y": good_y}, "x", id="x_shape"),
        pytest.param({"x": good_x, "y": good_y.astype(np.int32)}, "y", id="y_int32"),
        pytest.param({"x": good_x}, "y", id="y_missing"),
        pytest.param({"y": good_y}, "x", id="x_missing"),
        pytest.param({"x": good_x, "y": good_y[:3]}, "y", id="y_length"),
        pytest.param({"x": good_x, "y": np.array([0, 1, 2, 10], np.int64)}, "y", id="y_range"),
        pytest.param({"x": good_x, "y": np.array([0, -1, 2, 3], np.int64)}, "y", id="y_negative"),
        pytest.param({"x": good_x, "y": good_y.reshape(4, 1)}, "y", id="y_2d"),
        pytest.param({"x": np.array([None] * 4, dtype=object), "y": good_y}, "x", id="x_object"),
        pytest.param(b"this is not an npz archive", None, id="not_a_zip"),
        pytest.param(b"PK\x03\x04garbage", None, id="truncated"),
    ]


@pytest.mark.parametrize(("content", "field"), _bad_cases())
def test_malformed_npz_names_file_and_field(
    tmp_path: Path, content: dict[str, np.ndarray] | bytes, field: str | None
) -> None:
    _write_mnist_like(tmp_path)
    bad = tmp_path / "mnist" / "test.npz"
    if isinstance(content, bytes):
        bad.write_bytes(content)
    else:
        np.savez_compressed(bad, **content)
    with pytest.raises(DataError) as info:
        data.load_dataset("mnist", data_dir=tmp_path)
    err = info.value
    assert str(bad) in str(err) or str(bad.resolve()) in str(err)
    assert err.field == field
    assert err.path is not None and Path(err.path).name == "test.npz"
    if field is not None:
        assert f"'{field}'" in str(err)


def _write_idx_layout(raw: Path, sizes: dict[str, int], *, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Write torchvision's MNIST-family raw files (``{split}-images-idx3-ubyte`` and
    ``{split}-labels-idx1-ubyte``, big-endian idx headers) of random 28×28 images into ``raw``;
    return split → (x uint8 [n, 28, 28], y uint8 [n])."""
    rng = np.random.default_rng(seed)
    raw.mkdir(parents=True)
    arrays = {}
    for split, n in sizes.items():
        x = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        y = rng.integers(0, 10, size=n).astype(np.uint8)
        arrays[split] = (x, y)
        (raw / f"{split}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, n, 28, 28) + x.tobytes())
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, n) + y.tobytes())
    return arrays


def test_torchvision_layout_found_without_download(isolated: Path) -> None:
    """A torchvision MNIST folder (raw idx files) under data_dir is used, download=False."""
    arrays = _write_idx_layout(isolated / "MNIST" / "raw", {"train": 9, "t10k": 4}, seed=5)
    ds = data.load_dataset("mnist", data_dir=isolated, allow_download=False)
    assert ds.source == f"torchvision:{isolated.resolve()}"
    assert (len(ds.train), len(ds.test)) == (9, 4)
    np.testing.assert_allclose(ds.test.x[:, 0], _expected_norm(arrays["t10k"][0]), atol=1e-6)
    np.testing.assert_array_equal(ds.train.y, arrays["train"][1].astype(np.int64))


# ---------------------------------------------------------------------------- class_histogram


def test_class_histogram_against_loop() -> None:
    y = np.random.default_rng(0).integers(0, 7, size=500)
    expected = [sum(1 for v in y if v == k) for k in range(9)]
    assert data.class_histogram(y, 9) == expected
    assert data.class_histogram(np.zeros(0, np.int64), 3) == [0, 0, 0]
    with pytest.raises(DataError):
        data.class_histogram(np.array([0, 3]), 3)
    with pytest.raises(DataError):
        data.class_histogram(np.array([0.0, 1.0]), 3)
    with pytest.raises(DataError):
        data.class_histogram(np.array([0, 1]), 0)


def test_corrupt_torchvision_layout_raises(isolated: Path) -> None:
    raw = isolated / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split in ("train", "t10k"):
        for kind in ("images-idx3", "labels-idx1"):
            (raw / f"{split}-{kind}-ubyte").write_bytes(b"\x00\x00")
    with pytest.raises(DataError) as info:
        data.load_dataset("mnist", data_dir=isolated, allow_download=False)
    assert str(isolated) in str(info.value) and info.value.dataset == "mnist"


def test_download_attempted_only_when_allowed(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in torchvision class records the call and fails like an offline download."""
    import torchvision.datasets as tvd

    calls: list[tuple[str, bool]] = []

    class FakeUSPS:
        def __init__(self, root: str, train: bool = True, download: bool = False) -> None:
            calls.append((root, download))
            raise OSError("network unreachable (fake)")

    monkeypatch.setattr(tvd, "USPS", FakeUSPS)
    with pytest.raises(DataError):  # FEDFLEET_OFFLINE=1 and allow_download=None: no call
        data.load_dataset("usps")
    assert calls == []

    monkeypatch.delenv("FEDFLEET_OFFLINE")
    with pytest.raises(DataError) as info:
        data.load_dataset("usps", data_dir=isolated / "dl")
    # One attempt, with download=True, into a fresh temporary folder under the cache root.
    assert len(calls) == 1 and calls[0][1] is True
    tmp_root = Path(calls[0][0])
    assert tmp_root.parent == isolated / "tv-cache" and tmp_root.name.startswith(".download-")
    assert not tmp_root.exists()  # removed again
    assert not (isolated / "dl").exists()
    msg = str(info.value)
    assert "(download failed: " in msg and "network unreachable (fake)" in msg
    assert str(tmp_root) not in msg  # no pointer to a folder that is gone
    assert info.value.searched[0] == str(isolated / "dl")
    assert isinstance(info.value.__cause__, DataError)


# ---------------------------------------------------------------------------- downloads


def _tree_listing(root: Path) -> list[tuple[object, ...]]:
    """Every entry under ``root`` (and root itself) with its type, mode, mtime, size and
    content hash: equal listings mean the tree is byte-for-byte unchanged, and a folder in
    which something was created and removed again shows up through its mtime."""
    if not root.exists():
        return []
    out: list[tuple[object, ...]] = []
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        rel = path.relative_to(root).as_posix()
        if path.is_dir() and not path.is_symlink():
            out.append((rel, "dir", st.st_mode, st.st_mtime_ns))
        else:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            out.append((rel, "file", st.st_mode, st.st_mtime_ns, st.st_size, digest))
    return out


def _offline_mnist_download(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    """Make torchvision's real MNIST download fail the way it does offline.

    ``MNIST.download`` creates ``<root>/MNIST/raw`` and then calls
    ``download_and_extract_archive`` once per mirror; offline each call raises ``URLError`` and
    MNIST finally raises ``RuntimeError("Error downloading ...")``. Only the network call is
    replaced here; torchvision's own folder creation and error handling run unchanged.
    """
    import urllib.error

    import torchvision.datasets.mnist as tv_mnist

    def no_network(url: str, download_root: str, **kwargs: object) -> None:
        calls.append(download_root)
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution (fake)")

    monkeypatch.setattr(tv_mnist, "download_and_extract_archive", no_network)


def _partial_usps_download(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    """USPS: ``download_url`` creates the root, leaves a partial file and raises URLError."""
    import urllib.error

    import torchvision.datasets.usps as tv_usps

    def broken(url: str, root: str, filename: str, md5: str | None = None) -> None:
        calls.append(root)
        os.makedirs(root, exist_ok=True)
        Path(root, filename).write_bytes(b"BZh91AY&SY partial")
        raise urllib.error.URLError("connection reset (fake)")

    monkeypatch.setattr(tv_usps, "download_url", broken)


@pytest.mark.parametrize(
    ("name", "break_download"),
    [("mnist", _offline_mnist_download), ("usps", _partial_usps_download)],
)
def test_failed_download_leaves_data_dir_untouched(
    isolated: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    break_download: Callable[[pytest.MonkeyPatch, list[str]], None],
) -> None:
    """A lookup that fails changes nothing under the data folder and creates no missing one."""
    calls: list[str] = []
    break_download(monkeypatch, calls)
    # The reported mistake: the data folder is the set's own folder (…/mnist holding the npz).
    own_folder = isolated / "user" / name
    own_folder.mkdir(parents=True)
    (own_folder / "train.npz").write_bytes(b"train bytes")
    (own_folder / "test.npz").write_bytes(b"test bytes")
    (own_folder / "notes").mkdir()
    (own_folder / "notes" / "README").write_text("mine")
    missing = isolated / "user" / "not-there"
    before = _tree_listing(isolated / "user")

    for data_dir in (own_folder, missing):
        calls.clear()
        with pytest.raises(DataError) as info:
            data.load_dataset(name, data_dir=data_dir, allow_download=True)
        assert calls, "the download was attempted"
        assert all(Path(c).is_relative_to(isolated / "tv-cache") for c in calls)
        assert "(download failed: " in str(info.value)
        assert "URLError" in str(info.value) or "Error downloading" in str(info.value)
        assert _tree_listing(isolated / "user") == before
        assert not missing.exists()
        # The temporary download folder is gone too; the cache root holds nothing.
        assert list((isolated / "tv-cache").iterdir()) == []


def _fake_mnist_mirror(
    monkeypatch: pytest.MonkeyPatch, n_train: int = 6, n_test: int = 3
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A successful MNIST download: writes the (uncompressed) idx files torchvision expects."""
    import torchvision.datasets.mnist as tv_mnist

    rng = np.random.default_rng(11)
    arrays = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        arrays[split] = (
            rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8),
            rng.integers(0, 10, size=n).astype(np.uint8),
        )

    def fetch(url: str, download_root: str, filename: str, **kwargs: object) -> None:
        split, kind = filename.split("-")[0], filename.split("-")[1]
        x, y = arrays[split]
        body = (
            struct.pack(">IIII", 0x803, len(x), 28, 28) + x.tobytes()
            if kind == "images"
            else struct.pack(">II", 0x801, len(y)) + y.tobytes()
        )
        Path(download_root, filename.removesuffix(".gz")).write_bytes(body)

    monkeypatch.setattr(tv_mnist, "download_and_extract_archive", fetch)
    return arrays


@pytest.mark.parametrize("leftover", [False, True], ids=["empty_dir", "old_empty_MNIST_raw"])
def test_successful_download_is_moved_into_data_dir(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, leftover: bool
) -> None:
    arrays = _fake_mnist_mirror(monkeypatch)
    target = isolated / "user"
    target.mkdir()
    if leftover:  # what the old code left behind after a failed download
        (target / "MNIST" / "raw").mkdir(parents=True)
    ds = data.load_dataset("mnist", data_dir=target, allow_download=True)
    assert ds.source == f"torchvision:{target.resolve()}"
    assert (len(ds.train), len(ds.test)) == (6, 3)
    np.testing.assert_allclose(ds.test.x[:, 0], _expected_norm(arrays["t10k"][0]), atol=1e-6)
    assert sorted(p.name for p in (target / "MNIST" / "raw").iterdir()) == sorted(
        f"{s}-{k}-ubyte" for s in ("train", "t10k") for k in ("images-idx3", "labels-idx1")
    )
    assert sorted(p.name for p in target.iterdir()) == ["MNIST"]
    assert list((isolated / "tv-cache").iterdir()) == []  # temporary folder removed
    data.clear_dataset_cache()  # found again without a download
    monkeypatch.setattr(
        "torchvision.datasets.mnist.download_and_extract_archive", None, raising=True
    )
    again = data.load_dataset("mnist", data_dir=target, allow_download=False)
    np.testing.assert_array_equal(again.train.y, arrays["train"][1].astype(np.int64))


def test_missing_data_dir_is_warned_about_before_the_fallback(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A data folder that does not exist (a typo) used to fall back to the shared folder without a
    word. The fallback stays (the documented order), but the missing folder is named in a warning;
    an existing folder gives none."""
    import logging

    shared = isolated / "shared"
    _write_mnist_like(shared, n_train=6, n_test=4)
    monkeypatch.setattr(data._folders, "_SHARED_DATA_DIRS", (shared,))
    typo = isolated / "dtaa"
    with caplog.at_level(logging.WARNING, logger="edge_agent.data"):
        ds = data.load_dataset("mnist", data_dir=typo, allow_download=False)
    assert Path(ds.source) == (shared / "mnist").resolve()  # the fallback still works
    msgs = [r.getMessage() for r in caplog.records]
    assert any(f"the data folder you set, {typo}, is not an existing folder" in m for m in msgs), msgs
    caplog.clear()
    monkeypatch.setenv("FEDFLEET_DATA", str(typo))
    with caplog.at_level(logging.WARNING, logger="edge_agent.data"):
        data.load_dataset("mnist", allow_download=False)
    assert any(f"env FEDFLEET_DATA, {typo}, is not an existing folder" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edge_agent.data"):
        data.load_dataset("mnist", data_dir=shared, allow_download=False)
    assert not [r for r in caplog.records if "not an existing folder" in r.getMessage()]


def test_a_data_dir_without_the_set_names_the_folder_used_instead(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An existing --data-dir that does not hold the set: the fallback to the shared folder says
    which folder it used."""
    import logging

    shared = isolated / "shared"
    _write_mnist_like(shared, n_train=6, n_test=4)
    monkeypatch.setattr(data._folders, "_SHARED_DATA_DIRS", (shared,))
    other = isolated / "my-data"
    other.mkdir()
    with caplog.at_level(logging.WARNING, logger="edge_agent.data"):
        ds = data.load_dataset("mnist", data_dir=other, allow_download=False)
    assert Path(ds.source) == (shared / "mnist").resolve()
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [f"the data folder you set, {other}, does not hold mnist (mnist/train.npz, mnist/test.npz): "
                    f"using {shared}"], msgs


def test_successful_download_never_creates_missing_data_dir(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_mnist_mirror(monkeypatch)
    missing = isolated / "user" / "not-there"
    ds = data.load_dataset("mnist", data_dir=missing, allow_download=True)
    cache = isolated / "tv-cache"
    assert ds.source == f"torchvision:{cache.resolve()}"
    assert not missing.exists() and not missing.parent.exists()
    assert sorted(p.name for p in cache.iterdir()) == ["MNIST"]
    assert len(list((cache / "MNIST" / "raw").iterdir())) == 4


# ---------------------------------------------------------------------------- misplaced folder


@pytest.mark.parametrize(
    ("name", "folder", "files"),
    [
        ("mnist", "mnist", ("train.npz", "test.npz")),
        ("cifar10", "cifar10", ("train_subset10k.npz", "test.npz")),
        ("pacs_photo", "pacs", ("photo_32.npz",)),
    ],
)
def test_hint_when_data_dir_is_the_sets_own_folder(
    isolated: Path, name: str, folder: str, files: tuple[str, ...]
) -> None:
    own = isolated / "x" / folder
    own.mkdir(parents=True)
    for f in files:
        (own / f).write_bytes(b"")
    with pytest.raises(DataError) as info:
        data.load_dataset(name, data_dir=own)
    found = "/".join(files)
    expected = (
        f"found {found} directly in {own}: pass its parent folder ({isolated / 'x'}) as the "
        "data folder"
    )
    assert expected in str(info.value)
    assert f"e.g. {isolated / 'x' / folder / files[0]}" in str(info.value)


def test_hint_for_env_dir_wrongly_named_folder_and_torchvision_layout(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = isolated / "x" / "mnist"
    own.mkdir(parents=True)
    (own / "train.npz").write_bytes(b"")
    (own / "test.npz").write_bytes(b"")
    monkeypatch.setenv("FEDFLEET_DATA", str(own))  # the same mistake through the environment
    with pytest.raises(DataError) as info:
        data.load_dataset("mnist")
    assert f"pass its parent folder ({isolated / 'x'}) as the data folder" in str(info.value)

    odd = isolated / "y" / "my_mnist_copy"  # own folder, but not named as the loader expects
    odd.mkdir(parents=True)
    (odd / "train.npz").write_bytes(b"")
    (odd / "test.npz").write_bytes(b"")
    with pytest.raises(DataError) as info:
        data.load_dataset("mnist", data_dir=odd)
    msg = str(info.value)
    assert f"found train.npz/test.npz directly in {odd}" in msg
    assert f"rename {odd} to {isolated / 'y' / 'mnist'}" in msg

    raw = isolated / "z" / "MNIST" / "raw"  # torchvision's layout, one level too deep
    raw.mkdir(parents=True)
    for s in ("train", "t10k"):
        for k in ("images-idx3", "labels-idx1"):
            (raw / f"{s}-{k}-ubyte").write_bytes(b"")
    with pytest.raises(DataError) as info:
        data.load_dataset("mnist", data_dir=raw.parent)
    assert f"pass its parent folder ({isolated / 'z'}) as the data folder" in str(info.value)

    with pytest.raises(DataError) as info:  # no hint when nothing is misplaced
        data.load_dataset("mnist", data_dir=isolated / "z")
    assert "directly in" not in str(info.value)


# ---------------------------------------------------------------------------- KMNIST and STL-10 (user-supplied)


def test_kmnist_from_a_torchvision_layout(isolated: Path) -> None:
    """KMNIST is not in the offline set: a user's torchvision KMNIST/raw folder is read as is."""
    arrays = _write_idx_layout(isolated / "KMNIST" / "raw", {"train": 8, "t10k": 5}, seed=11)
    ds = data.load_dataset("kmnist", data_dir=isolated, allow_download=False)
    assert (ds.channels, ds.image_size, len(ds.train), len(ds.test)) == (1, 28, 8, 5)
    np.testing.assert_allclose(ds.train.x[:, 0], _expected_norm(arrays["train"][0]), atol=1e-6)
    np.testing.assert_array_equal(ds.test.y, arrays["t10k"][1].astype(np.int64))


def test_stl10_from_a_torchvision_layout_is_resized_to_32(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """STL-10's binary files (column-major 3×96×96 images, labels 1–10) come back as 32×32 RGB
    with labels 0–9, each image within one grey level of PIL's bilinear resize."""
    import torchvision.datasets as tvd
    from PIL import Image

    # the real files are checked against their published MD5s; these are made here
    monkeypatch.setattr(tvd.STL10, "_check_integrity", lambda self: True)
    rng = np.random.default_rng(12)
    folder = isolated / "stl10_binary"
    folder.mkdir()
    images = {}
    for split, n in (("train", 4), ("test", 3)):
        # smooth images (a gradient plus noise) so bilinear rounding differences stay small
        base = np.linspace(0, 200, 96, dtype=np.float64)
        img = (base[None, :, None, None] + base[None, None, :, None] * 0.2
               + rng.integers(0, 40, size=(n, 96, 96, 3))).clip(0, 255).astype(np.uint8)  # NHWC
        labels = rng.integers(1, 11, size=n).astype(np.uint8)
        images[split] = (img, labels)
        # the file stores each image channel by channel, each channel column-major
        (folder / f"{split}_X.bin").write_bytes(img.transpose(0, 3, 2, 1).tobytes())
        (folder / f"{split}_y.bin").write_bytes(labels.tobytes())
    (folder / "unlabeled_X.bin").write_bytes(b"")
    ds = data.load_dataset("stl10", data_dir=isolated, allow_download=False)
    assert (ds.channels, ds.image_size, len(ds.train), len(ds.test)) == (3, 32, 4, 3)
    assert ds.train.x.shape == (4, 3, 32, 32)
    for split, got in (("train", ds.train), ("test", ds.test)):
        img, labels = images[split]
        np.testing.assert_array_equal(got.y, labels.astype(np.int64) - 1)
        pil = np.stack([np.asarray(Image.fromarray(im).resize((32, 32), Image.BILINEAR)) for im in img])
        np.testing.assert_allclose(got.x.transpose(0, 2, 3, 1), _expected_norm(pil), atol=2 / 127.5 + 1e-6)


def test_kmnist_and_stl10_missing_say_what_to_supply(isolated: Path) -> None:
    for name, needle in (("kmnist", "KMNIST/raw"), ("stl10", "stl10_binary")):
        with pytest.raises(DataError) as info:
            data.load_dataset(name, data_dir=isolated, allow_download=False)
        assert needle in str(info.value) and "not in the offline data set" in str(info.value)
