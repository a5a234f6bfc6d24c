"""Tests of data sets added by a factory (``edge_agent.data.register_dataset``) and of the data
package's public names.

Expected images are worked out here from the documented conversion, ``(v / 255 − 0.5) / 0.5`` in
float64 with HWC → CHW done by explicit indexing, never with the package's own helpers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_agent import data
from edge_agent.errors import DataError

GREY = "test-factory-grey"
RGB = "test-factory-rgb"
BAD = "test-factory-bad"


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No FEDFLEET_DATA, no downloads; every name registered here is removed afterwards."""
    monkeypatch.delenv("FEDFLEET_DATA", raising=False)
    monkeypatch.setenv("FEDFLEET_OFFLINE", "1")
    yield
    for name in (GREY, RGB, BAD):
        if name in data.list_datasets():
            data.unregister_dataset(name)
    data.clear_dataset_cache()


def _grey_raw() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """3 train and 2 test 2×2 grey images with hand-picked pixels, 3 classes."""
    x_tr = np.array([[[0, 255], [51, 102]], [[1, 2], [3, 4]], [[255, 255], [0, 0]]], dtype=np.uint8)
    y_tr = np.array([0, 2, 1], dtype=np.int64)
    x_te = np.array([[[204, 153], [0, 255]], [[10, 20], [30, 40]]], dtype=np.uint8)
    y_te = np.array([2, 2], dtype=np.int64)
    return x_tr, y_tr, x_te, y_te


def test_a_registered_grey_factory_loads_by_name_with_the_common_conversion(tmp_path: Path) -> None:
    calls: list[Path | None] = []

    @data.register_dataset(GREY, num_classes=3, channels=1, image_size=2)
    def grey(data_dir: Path | None) -> tuple[np.ndarray, ...]:
        calls.append(data_dir)
        return _grey_raw()

    assert GREY in data.list_datasets()
    info = data.dataset_info(GREY)
    assert (info.num_classes, info.channels, info.image_size, info.factory) == (3, 1, 2, grey)
    assert info.files == () and info.domains == ()

    ds = data.load_dataset(GREY, data_dir=tmp_path)
    assert calls == [tmp_path]  # the data folder of step 1 reaches the factory as a Path
    assert (ds.name, ds.num_classes, ds.channels, ds.image_size) == (GREY, 3, 1, 2)
    assert ds.source == f"factory:{__name__}.{grey.__qualname__}"
    x_tr, y_tr, x_te, y_te = _grey_raw()
    for split, x, y in ((ds.train, x_tr, y_tr), (ds.test, x_te, y_te)):
        assert split.x.dtype == np.float32 and split.x.shape == (len(y), 1, 2, 2)
        expected = (x.astype(np.float64) / 255.0 - 0.5) / 0.5
        np.testing.assert_allclose(split.x[:, 0], expected, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(split.y, y)
        assert split.y.dtype == np.int64 and not split.x.flags.writeable
    assert ds.train.x[0, 0, 0, 0] == -1.0 and ds.train.x[0, 0, 0, 1] == 1.0  # 0 and 255 exactly
    assert data.class_histogram(ds.train.y, 3) == [1, 1, 1]

    assert data.load_dataset(GREY, data_dir=tmp_path) is ds  # cached: the factory ran once
    assert calls == [tmp_path]
    data.load_dataset(GREY)  # no data folder set, FEDFLEET_DATA unset: the factory gets None
    assert calls == [tmp_path, None]


def test_a_registered_rgb_factory_is_transposed_to_chw() -> None:
    rng = np.random.default_rng(7)
    x_tr = rng.integers(0, 256, size=(4, 3, 3, 3), dtype=np.uint8)  # [N, H, W, C]
    y_tr = np.array([0, 1, 0, 1], dtype=np.int64)
    x_te = np.zeros((0, 3, 3, 3), dtype=np.uint8)  # an empty split is allowed
    y_te = np.zeros(0, dtype=np.int64)
    data.register_dataset(RGB, num_classes=2, channels=3, image_size=3)(lambda _d: (x_tr, y_tr, x_te, y_te))

    ds = data.load_dataset(RGB)
    assert ds.train.x.shape == (4, 3, 3, 3) and len(ds.test) == 0 and ds.test.x.shape == (0, 3, 3, 3)
    for n in range(4):
        for c in range(3):
            for h in range(3):
                for w in range(3):
                    want = (float(x_tr[n, h, w, c]) / 255.0 - 0.5) / 0.5
                    assert abs(float(ds.train.x[n, c, h, w]) - want) < 1e-6


def _ok_grey() -> list[np.ndarray]:
    return list(_grey_raw())


def _with(index: int, value: object) -> list[object]:
    out: list[object] = list(_ok_grey())
    out[index] = value
    return out


BAD_RETURNS = [
    pytest.param(_with(0, _grey_raw()[0].astype(np.float32)), "field 'x' has dtype float32, expected uint8",
                 "x", "train", id="float-images"),
    pytest.param(_with(2, np.zeros((2, 3, 3), np.uint8)), "field 'x' has shape (2, 3, 3), expected N×2×2",
                 "x", "test", id="wrong-image-size"),
    pytest.param(_with(0, np.zeros((3, 2, 2, 3), np.uint8)), "field 'x' has shape (3, 2, 2, 3)",
                 "x", "train", id="rgb-for-grey"),
    pytest.param(_with(1, np.array([0, 2, 1], np.int32)), "field 'y' has dtype int32, expected int64",
                 "y", "train", id="int32-labels"),
    pytest.param(_with(1, np.array([0, 3, 1], np.int64)), "field 'y' has labels in [0, 3], expected [0, 3)",
                 "y", "train", id="label-out-of-range"),
    pytest.param(_with(3, np.array([2], np.int64)), "field 'y' has 1 labels but 'x' has 2 images",
                 "y", "test", id="length-mismatch"),
    pytest.param(_with(0, [[[0, 0], [0, 0]]]), "field 'x' is a list, expected a numpy array",
                 "x", "train", id="list-not-array"),
    pytest.param(_ok_grey()[:3], "must return a tuple (x_train, y_train, x_test, y_test), got a list of 3",
                 None, None, id="three-arrays"),
    pytest.param(None, "must return a tuple (x_train, y_train, x_test, y_test), got NoneType",
                 None, None, id="none"),
]


@pytest.mark.parametrize(("returned", "message", "field", "split"), BAD_RETURNS)
def test_a_factory_breaking_its_contract_gets_a_clear_error(returned: object, message: str,
                                                            field: str | None, split: str | None) -> None:
    data.register_dataset(BAD, num_classes=3, channels=1, image_size=2)(lambda _d: returned)
    with pytest.raises(DataError) as err:
        data.load_dataset(BAD)
    text = str(err.value)
    assert message in text, text
    assert f"data set {BAD!r}: factory " in text  # the set and the factory are named
    assert err.value.dataset == BAD and err.value.field == field
    if split is not None:
        assert f"({split}): field" in text, text


def test_an_exception_in_the_factory_becomes_a_data_error_with_its_cause() -> None:
    def broken(_d: Path | None) -> None:
        raise FileNotFoundError("my_set.npz")

    data.register_dataset(BAD, num_classes=3, channels=1, image_size=2)(broken)
    with pytest.raises(DataError, match=r"factory .*broken failed \(FileNotFoundError: my_set.npz\)") as err:
        data.load_dataset(BAD)
    assert isinstance(err.value.__cause__, FileNotFoundError)

    def refuses(_d: Path | None) -> None:
        raise DataError("put my_set.npz in the data folder", dataset=BAD)

    data.register_dataset(BAD, num_classes=3, channels=1, image_size=2, replace=True)(refuses)
    with pytest.raises(DataError, match=r"^put my_set.npz in the data folder$"):
        data.load_dataset(BAD)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        pytest.param("mnist", {}, "'mnist' is a built-in data set", id="built-in-name"),
        pytest.param("_hidden", {}, "the name must be", id="leading-underscore"),
        pytest.param("two words", {}, "the name must be", id="space"),
        pytest.param(7, {}, "the name must be", id="not-a-str"),
        pytest.param(BAD, {"channels": 2}, "channels must be 1 (grey) or 3 (RGB), got 2", id="channels"),
        pytest.param(BAD, {"num_classes": 0}, "num_classes must be an int >= 1, got 0", id="no-classes"),
        pytest.param(BAD, {"num_classes": True}, "num_classes must be an int >= 1, got True", id="bool-classes"),
        pytest.param(BAD, {"image_size": 2.0}, "image_size must be an int >= 1, got 2.0", id="float-size"),
    ],
)
def test_bad_registrations_are_refused_at_once(name: object, kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"num_classes": 3, "channels": 1, "image_size": 2} | kwargs
    with pytest.raises(DataError) as err:
        data.register_dataset(name, **args)  # type: ignore[arg-type]
    assert message in str(err.value), str(err.value)
    assert BAD not in data.list_datasets()


def test_duplicates_need_replace_and_a_replaced_factory_is_not_served_from_the_cache() -> None:
    first = data.register_dataset(GREY, num_classes=3, channels=1, image_size=2)(lambda _d: _grey_raw())
    assert callable(first)
    with pytest.raises(DataError, match="already registered"):
        data.register_dataset(GREY, num_classes=3, channels=1, image_size=2)
    assert len(data.load_dataset(GREY).train) == 3

    x_tr, y_tr, x_te, y_te = _grey_raw()
    data.register_dataset(GREY, num_classes=3, channels=1, image_size=2, replace=True)(
        lambda _d: (x_tr[:1], y_tr[:1], x_te, y_te))
    assert len(data.load_dataset(GREY).train) == 1  # the new factory, not the cached first set

    with pytest.raises(DataError, match="the factory must be callable, got int"):
        data.register_dataset(RGB, num_classes=3, channels=1, image_size=2)(5)  # type: ignore[arg-type]
    assert RGB not in data.list_datasets()


def test_unregister_removes_only_registered_names() -> None:
    data.register_dataset(GREY, num_classes=3, channels=1, image_size=2)(lambda _d: _grey_raw())
    data.unregister_dataset(GREY)
    assert GREY not in data.list_datasets()
    with pytest.raises(DataError, match=f"unknown data set {GREY!r}"):
        data.load_dataset(GREY)
    with pytest.raises(DataError, match="is not registered"):
        data.unregister_dataset(GREY)
    with pytest.raises(DataError, match="'digits' is a built-in data set"):
        data.unregister_dataset("digits")
    assert "digits" in data.list_datasets()


def test_caps_are_refused_for_a_factory_set_as_for_every_single_domain_set() -> None:
    data.register_dataset(GREY, num_classes=3, channels=1, image_size=2)(lambda _d: _grey_raw())
    with pytest.raises(DataError, match="apply only to the multi-domain sets"):
        data.load_dataset(GREY, domain_train_cap=1)


def test_the_package_exports_exactly_its_all() -> None:
    public = {n for n in vars(data) if not n.startswith("_")} - {"annotations"}
    assert public == set(data.__all__)
    assert list(data.__all__) == sorted(data.__all__)
    for name in data.__all__:
        assert getattr(data, name) is not None
