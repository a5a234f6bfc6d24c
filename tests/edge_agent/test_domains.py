"""Tests of the multi-domain data sets (``pacs``, ``digits_domains``), the ``domain-silo``
partitioner and its configuration keys (FedPAD's protocol, SPECS.md §1.1).

Expected numbers are worked out by hand or from shared/data/MANIFEST.md (per-class counts), and
images are checked against an independent resize (PIL ``Image.resize(..., BILINEAR)``), never
against the code under test. Nothing here downloads: FEDFLEET_OFFLINE=1 for every test.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from broker_server import config as config_mod
from broker_server.errors import ConfigError
from edge_agent import data
from edge_agent.errors import DataError, PartitionError
from edge_agent.partition import (
    DEFAULT_DOMAIN_CLIENTS,
    STRONG_DOMAIN_CLIENTS,
    allocate_domain_clients,
    describe,
    domain_silo,
    parse_domain_clients,
    partition,
)

# MANIFEST.md per-class counts of the PACS domain files (class 0 first).
PACS_COUNTS = {
    "photo": [189, 202, 182, 186, 199, 280, 432],
    "art_painting": [379, 255, 285, 184, 201, 295, 449],
    "cartoon": [389, 457, 346, 135, 324, 288, 405],
    "sketch": [772, 740, 753, 608, 816, 80, 160],
}
DIGITS_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]  # scikit-learn's 8x8 digits
MNIST_TEST_N, USPS_TEST_N, MNIST_M_TRAIN_N = 10000, 2007, 5000

_ENV_DATA_AT_START = os.environ.get("FEDFLEET_DATA", "")


def _shared_dir() -> Path | None:
    for d in data._npz_search_dirs(data._user_data_dir(None)):
        if (d / "pacs" / "photo_32.npz").is_file() and (d / "mnist" / "test.npz").is_file():
            return d
    return None


SHARED = _shared_dir()
needs_shared = pytest.mark.skipif(SHARED is None, reason="MANIFEST data files not found (set FEDFLEET_DATA)")


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("FEDFLEET_OFFLINE", "1")
    if _ENV_DATA_AT_START:
        monkeypatch.setenv("FEDFLEET_DATA", _ENV_DATA_AT_START)
    yield


@pytest.fixture(scope="module", autouse=True)
def _free_cache() -> Iterator[None]:
    yield
    data.clear_dataset_cache()


def _test_share(n: int) -> int:
    """round(n / 5) with halves up (the documented 20 % test share of a class)."""
    return (2 * n + 5) // 10


def _shard_sizes(n: int, k: int) -> list[int]:
    """n samples cut into k near-equal shards, the first n mod k one larger."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _pil_reference(raw: np.ndarray, size: int = 32) -> np.ndarray:
    """Independent conversion: PIL bilinear resize, grey copied to RGB, (v/255 − .5)/.5, CHW."""
    from PIL import Image

    out = []
    for img in raw:
        im = Image.fromarray(img).resize((size, size), Image.BILINEAR).convert("RGB")
        out.append(np.asarray(im, dtype=np.float64).transpose(2, 0, 1))
    return (np.stack(out) / 255.0 - 0.5) / 0.5


# ---------------------------------------------------------------------------- domain_silo (pure)


def test_domain_silo_by_hand_on_a_tiny_set() -> None:
    """Domains A (5 samples), B (7), C (3), D (2); clients A=2, B=3, C=1, D=0.

    By hand: A's 5 samples in 2 shards -> 3 + 2; B's 7 in 3 -> 3 + 2 + 2; C's 3 in 1 -> 3; D has
    no client, so its 2 samples (indices 15, 16) are in no shard. Clients are numbered domain
    by domain: A, A, B, B, B, C.
    """
    domains = np.array([0] * 5 + [1] * 7 + [2] * 3 + [3] * 2)
    rng = np.random.default_rng(3)
    order = rng.permutation(domains.size)  # samples of a domain need not be contiguous
    domains = domains[order]
    names = ("A", "B", "C", "D")
    res = domain_silo(domains, names, "A=2,B=3,C=1", seed=11)
    assert res.client_domains == ("A", "A", "B", "B", "B", "C")
    assert res.clients_per_domain == {"A": 2, "B": 3, "C": 1, "D": 0}
    assert [len(p) for p in res.parts] == [3, 2, 3, 2, 2, 3]
    allidx = np.concatenate(res.parts)
    assert len(np.unique(allidx)) == allidx.size == 15  # disjoint
    for p, dom in zip(res.parts, res.client_domains):
        assert p.dtype == np.int64 and np.all(np.diff(p) > 0)  # sorted
        assert set(domains[p]) == {names.index(dom)}  # one domain per client
    for d in range(3):  # a domain with clients is covered exactly
        got = np.sort(np.concatenate([p for p, n in zip(res.parts, res.client_domains) if n == names[d]]))
        np.testing.assert_array_equal(got, np.flatnonzero(domains == d))
    assert set(np.flatnonzero(domains == 3)).isdisjoint(allidx)

    # The same seed gives the same shards; another seed other shards of the same sizes.
    again = domain_silo(domains, names, {"A": 2, "B": 3, "C": 1}, seed=11)
    assert all(np.array_equal(a, b) for a, b in zip(res.parts, again.parts))
    other = domain_silo(domains, names, "A=2,B=3,C=1", seed=12)
    assert [len(p) for p in other.parts] == [3, 2, 3, 2, 2, 3]
    assert any(not np.array_equal(a, b) for a, b in zip(res.parts, other.parts))


def test_domain_silo_follows_the_documented_draw() -> None:
    """Second derivation of the shards from the docstring: one generator, domains in order,
    each domain's indices permuted and cut by array_split."""
    domains = np.array([1, 0, 1, 1, 0, 2, 1, 0, 1, 2, 1])
    rng = np.random.default_rng(5)
    expected = []
    for d, k in enumerate((2, 3, 1)):
        expected += [np.sort(s) for s in np.array_split(rng.permutation(np.flatnonzero(domains == d)), k)]
    got = domain_silo(domains, ("x", "y", "z"), "x=2,y=3,z=1", seed=5).parts
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


def test_partition_dispatch_and_describe_name_the_domain() -> None:
    domains = np.repeat(np.arange(4), [8, 9, 6, 5])
    labels = np.arange(domains.size) % 3
    parts = partition(labels, 10, scheme="domain-silo", seed=0, min_samples=1, domains=domains,
                      domain_names=("p", "a", "c", "s"), domain_clients="")  # default 3/4/2/1
    assert [len(p) for p in parts] == [3, 3, 2, 3, 2, 2, 2, 3, 3, 5]
    desc = describe(parts, labels, 3, domains=domains, domain_names=("p", "a", "c", "s"))
    assert [d["domain"] for d in desc] == ["p"] * 3 + ["a"] * 4 + ["c"] * 2 + ["s"]
    assert desc[9]["histogram"] == [int(np.sum(labels[23:] == c)) for c in range(3)]
    # iid over the same set: a client's samples span domains
    mixed = describe(partition(labels, 2, scheme="iid", seed=0, min_samples=1), labels, 3, domains=domains,
                     domain_names=("p", "a", "c", "s"))
    assert all("+" in d["domain"] for d in mixed)
    assert "domain" not in describe(parts, labels, 3)[0]


@pytest.mark.parametrize("kwargs, match", [
    ({"domain_clients": "p=3,a=4,c=2,s=2"}, "sum to 11, but num_clients is 10"),
    ({"domain_clients": "p=3,a=4,c=2,x=1"}, "unknown domain.*'x'.*p, a, c, s"),
    ({"domain_clients": "p=3;a=7"}, "is not NAME=COUNT"),
    ({"domain_clients": "p=3,p=7"}, "given twice"),
    ({"domain_clients": "p=10", "alpha": 0.5}, "takes no alpha"),
    ({"domains": None}, "needs each sample's domain"),
    ({"domain_clients": "p=10", "min_samples": 3}, "domain 'p' has 28 .*too few for 10 clients"),
])
def test_domain_silo_refuses_bad_arguments(kwargs: dict, match: str) -> None:
    labels = np.zeros(40, np.int64)
    base = {"domains": np.repeat(np.arange(4), 10), "domain_names": ("p", "a", "c", "s"), "min_samples": 1}
    if "min_samples" in kwargs:  # 28 samples in p
        base["domains"] = np.array([0] * 28 + [1, 2, 3] * 4)
    with pytest.raises(PartitionError, match=match):
        partition(labels, 10, scheme="domain-silo", seed=0, **{**base, **kwargs})
    with pytest.raises(PartitionError, match="takes no domains"):
        partition(labels, 2, scheme="iid", seed=0, domains=base["domains"], min_samples=1)


def test_domain_client_defaults_and_parsing() -> None:
    assert DEFAULT_DOMAIN_CLIENTS == (3, 4, 2, 1) and STRONG_DOMAIN_CLIENTS == (6, 2, 1, 1)
    assert parse_domain_clients(" photo = 6 , art_painting=2,cartoon=1, sketch=1 ") == {
        "photo": 6, "art_painting": 2, "cartoon": 1, "sketch": 1}
    assert parse_domain_clients("") == {}
    assert allocate_domain_clients(("a", "b", "c", "d")) == {"a": 3, "b": 4, "c": 2, "d": 1}
    assert allocate_domain_clients(("a", "b", "c", "d"), "b=2") == {"a": 0, "b": 2, "c": 0, "d": 0}
    with pytest.raises(PartitionError, match="needs 4 domains"):
        allocate_domain_clients(("a", "b", "c"))
    with pytest.raises(PartitionError, match="no domain has a client"):
        allocate_domain_clients(("a", "b"), "a=0")
    with pytest.raises(PartitionError, match="must be >= 0"):
        allocate_domain_clients(("a", "b"), {"a": -1, "b": 2})


# ---------------------------------------------------------------------------- image helpers


def test_stratified_subsample_quotas_by_hand() -> None:
    """y: class 0 x5, class 1 x3, class 2 x2 (N = 10), cap 5. Quotas 5·n_c/N = 2.5, 1.5, 1.0
    -> floors 2, 1, 1 (sum 4); the one left goes to the largest remainder, a tie between
    classes 0 and 1 broken by the lower id: 3, 1, 1."""
    y = np.array([1, 0, 2, 0, 1, 0, 0, 2, 1, 0])
    keep = data.stratified_subsample(y, 5)
    assert keep.dtype == np.int64 and np.all(np.diff(keep) > 0)
    assert np.bincount(y[keep], minlength=3).tolist() == [3, 1, 1]
    np.testing.assert_array_equal(keep, data.stratified_subsample(y, 5))  # fixed seed
    np.testing.assert_array_equal(data.stratified_subsample(y, 0), np.arange(10))
    np.testing.assert_array_equal(data.stratified_subsample(y, 99), np.arange(10))
    with pytest.raises(DataError):
        data.stratified_subsample(y, -1)


def test_bilinear_weights_by_hand_and_resize_against_pil() -> None:
    # 2 -> 4: output centres 0.25, 0.75, 1.25, 1.75 (input pixel centres 0.5, 1.5).
    np.testing.assert_allclose(data.bilinear_weights(2, 4),
                               [[1, 0], [0.75, 0.25], [0.25, 0.75], [0, 1]])
    # 4 -> 2 (shrinking, radius 2): centre 1.0 -> weights of pixels at 0.5, 1.5, 2.5 are
    # 1 - 0.5/2, 1 - 0.5/2, 1 - 1.5/2 = .75, .75, .25, normalised by 1.75.
    np.testing.assert_allclose(data.bilinear_weights(4, 2)[0], [3 / 7, 3 / 7, 1 / 7, 0])
    from PIL import Image

    rng = np.random.default_rng(0)
    for shape in ((6, 8, 8), (6, 16, 16), (6, 28, 28), (4, 28, 28, 3)):
        x = rng.integers(0, 256, size=shape, dtype=np.uint8)
        got = data.resize_bilinear(x, 32)
        ref = np.stack([np.asarray(Image.fromarray(i).resize((32, 32), Image.BILINEAR)) for i in x])
        assert got.shape == ref.shape and got.dtype == np.uint8
        assert np.abs(got.astype(int) - ref.astype(int)).max() <= 1  # PIL rounds between passes
    x32 = rng.integers(0, 256, size=(2, 32, 32, 3), dtype=np.uint8)
    assert data.resize_bilinear(x32, 32) is x32
    grey = rng.integers(0, 256, size=(2, 5, 5), dtype=np.uint8)
    rgb = data.to_rgb(grey)
    assert rgb.shape == (2, 5, 5, 3) and all(np.array_equal(rgb[..., c], grey) for c in range(3))
    with pytest.raises(DataError):
        data.resize_bilinear(grey.astype(np.float32), 32)


# ---------------------------------------------------------------------------- PACS


@needs_shared
def test_pacs_domains_splits_are_stratified_fixed_and_3x32x32() -> None:
    ds = data.load_dataset("pacs")
    assert ds.domain_names == data.PACS_DOMAINS == ("photo", "art_painting", "cartoon", "sketch")
    assert ds.substitutions == () and ds.num_classes == 7
    assert (ds.channels, ds.image_size) == (3, 32)
    assert ds.train.x.dtype == np.float32 and ds.train.x.shape[1:] == (3, 32, 32)
    for i, name in enumerate(ds.domain_names):
        counts = PACS_COUNTS[name]
        test = ds.test_domains[name]
        assert test.x.shape[1:] == (3, 32, 32) and test.x.dtype == np.float32
        assert data.class_histogram(test.y, 7) == [_test_share(n) for n in counts]
        train_y = ds.train.y[ds.train_domains == i]
        assert data.class_histogram(train_y, 7) == [n - _test_share(n) for n in counts]
        # the domain split is the single-domain set's fixed split, same conversion
        single = data.load_dataset(f"pacs_{name}")
        np.testing.assert_array_equal(test.x, single.test.x)
        np.testing.assert_array_equal(ds.train.x[ds.train_domains == i], single.train.x)
    assert len(ds.test) == sum(len(v) for v in ds.test_domains.values())
    assert ds.domain_summary()["domain_test_samples"] == {"photo": 333, "art_painting": 410, "cartoon": 469,
                                                          "sketch": 786}
    assert not ds.train.x.flags.writeable and not ds.test_domains["photo"].x.flags.writeable

    first = {k: np.array(v.x) for k, v in ds.test_domains.items()}
    data.clear_dataset_cache()
    again = data.load_dataset("pacs")
    assert again is not ds
    for k, v in again.test_domains.items():
        np.testing.assert_array_equal(v.x, first[k])
    np.testing.assert_array_equal(again.train_domains, ds.train_domains)


@needs_shared
@pytest.mark.parametrize("alloc, text, expected", [
    # train sizes from MANIFEST: photo 1670 − 333 = 1337, art 2048 − 410 = 1638,
    # cartoon 2344 − 469 = 1875, sketch 3929 − 786 = 3143
    ((3, 4, 2, 1), "", [446, 446, 445, 410, 410, 409, 409, 938, 937, 3143]),
    ((6, 2, 1, 1), "photo=6,art_painting=2,cartoon=1,sketch=1",
     [223, 223, 223, 223, 223, 222, 819, 819, 1875, 3143]),
])
def test_pacs_allocation_gives_the_shard_sizes_from_the_manifest(alloc: tuple, text: str, expected: list) -> None:
    train_n = {d: sum(c) - sum(_test_share(n) for n in c) for d, c in PACS_COUNTS.items()}
    assert train_n == {"photo": 1337, "art_painting": 1638, "cartoon": 1875, "sketch": 3143}
    assert [s for d, k in zip(data.PACS_DOMAINS, alloc) for s in _shard_sizes(train_n[d], k)] == expected
    ds = data.load_dataset("pacs")
    res = domain_silo(ds.train_domains, ds.domain_names, text or None, seed=0, num_clients=10)
    assert [len(p) for p in res.parts] == expected
    assert res.client_domains == tuple(d for d, k in zip(data.PACS_DOMAINS, alloc) for _ in range(k))
    allidx = np.concatenate(res.parts)
    assert np.array_equal(np.sort(allidx), np.arange(len(ds.train)))  # disjoint, all used
    for p, d in zip(res.parts, res.client_domains):
        assert np.all(ds.train_domains[p] == ds.domain_names.index(d))


# ---------------------------------------------------------------------------- Digits


@pytest.fixture(scope="module")
def digits_ds() -> data.Dataset:
    if SHARED is None:
        pytest.skip(reason="shared/data (MANIFEST.md files) not found beside the repository")
    return data.load_dataset("digits_domains", domain_train_cap=300, domain_test_cap=100)


def test_digits_domains_announce_the_sklearn_stand_in(digits_ds: data.Dataset) -> None:
    ds = digits_ds
    assert ds.domain_names == ("mnist", "usps", "sklearn_digits", "mnist_m")
    text = " ".join(ds.substitutions)
    assert "sklearn_digits" in text and "SVHN" in text and "50 SVHN images" in text
    assert "mnist_m" in text and "regenerated" in text
    assert ds.domain_summary()["substitutions"] == list(ds.substitutions)
    assert "sklearn_digits=sklearn" in ds.source
    sizes = ds.domain_summary()
    # caps: 300 train / 100 test per domain; sklearn digits has 1797 − 359 = 1438 train, 359 test
    assert sizes["domain_train_samples"] == {"mnist": 300, "usps": 300, "sklearn_digits": 300, "mnist_m": 300}
    assert sizes["domain_test_samples"] == {"mnist": 100, "usps": 100, "sklearn_digits": 100, "mnist_m": 100}
    for name, split in ds.test_domains.items():
        assert split.x.shape == (100, 3, 32, 32) and split.x.dtype == np.float32, name
        assert split.x.min() >= -1.0 and split.x.max() <= 1.0
        # stratified: each class within one sample of its share
        assert len(np.unique(split.y)) == 10
    # sklearn digits: the stratified 80/20 split (seed 0) before the cap, shares by hand
    assert sum(_test_share(n) for n in DIGITS_COUNTS) == 359


def test_digits_domain_images_match_an_independent_conversion(digits_ds: data.Dataset) -> None:
    """Every domain's test images equal PIL bilinear 32x32, grey->RGB, (v/255-.5)/.5 of the raw
    file images that the cap keeps (within one grey level: PIL rounds between its passes)."""
    assert SHARED is not None
    raws = {"mnist": np.load(SHARED / "mnist" / "test.npz"), "usps": np.load(SHARED / "usps" / "test.npz"),
            "mnist_m": np.load(SHARED / "mnist_m_regenerated" / "test.npz")}
    from sklearn.datasets import load_digits

    bunch = load_digits()
    dx = np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8)
    _, te = data._stratified_split(bunch.target.astype(np.int64))
    raws["sklearn_digits"] = {"x": dx[te], "y": bunch.target[te].astype(np.int64)}
    for name, raw in raws.items():
        x, y = raw["x"], raw["y"]
        keep = data.stratified_subsample(y, 100)
        got = digits_ds.test_domains[name]
        np.testing.assert_array_equal(got.y, y[keep])
        np.testing.assert_allclose(got.x, _pil_reference(x[keep]), atol=1 / 127.5 + 1e-6, err_msg=name)


@needs_shared
def test_full_svhn_replaces_the_stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An SVHN npz pair in the data folder becomes the svhn domain; no substitution for it."""
    monkeypatch.setattr(data._folders, "_SHARED_DATA_DIRS", (SHARED,))  # the other domains come from there
    rng = np.random.default_rng(1)
    (tmp_path / "svhn").mkdir()
    raw = {}
    for split, n in (("train", 30), ("test", 20)):
        raw[split] = (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), np.arange(n, dtype=np.int64) % 10)
        np.savez_compressed(tmp_path / "svhn" / f"{split}.npz", x=raw[split][0], y=raw[split][1])
    ds = data.load_dataset("digits_domains", data_dir=tmp_path, domain_train_cap=50, domain_test_cap=20)
    assert ds.domain_names == ("mnist", "usps", "svhn", "mnist_m")
    assert not any("sklearn" in s for s in ds.substitutions) and any("mnist_m" in s for s in ds.substitutions)
    np.testing.assert_allclose(ds.test_domains["svhn"].x, (raw["test"][0].transpose(0, 3, 1, 2) / 255 - .5) / .5,
                               atol=1e-6)
    assert int(np.sum(ds.train_domains == 2)) == 30


@needs_shared
def test_svhn_in_torchvision_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchvision's train_32x32.mat/test_32x32.mat (X [32, 32, 3, N], y in 1..10, 10 = digit 0)
    are read through torchvision (md5 check bypassed for the tiny stand-in files)."""
    import scipy.io
    import torchvision.datasets.svhn as tv_svhn

    monkeypatch.setattr(tv_svhn.SVHN, "_check_integrity", lambda self: True)
    monkeypatch.setattr(data._folders, "_SHARED_DATA_DIRS", (SHARED,))
    rng = np.random.default_rng(2)
    x = {}
    for split, n in (("train", 12), ("test", 10)):
        x[split] = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
        scipy.io.savemat(tmp_path / f"{split}_32x32.mat", {"X": x[split], "y": (np.arange(n) % 10 + 1)[:, None]})
    ds = data.load_dataset("digits_domains", data_dir=tmp_path, domain_train_cap=20, domain_test_cap=10)
    assert ds.domain_names[2] == "svhn" and ds.source.count("svhn=torchvision:") == 1
    assert ds.test_domains["svhn"].y.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
    np.testing.assert_allclose(ds.test_domains["svhn"].x, (x["test"].transpose(3, 2, 0, 1) / 255 - .5) / .5,
                               atol=1e-6)

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "scipy" else real(n, *a))
    data.clear_dataset_cache()
    with pytest.raises(DataError, match="needs scipy"):
        data.load_dataset("digits_domains", data_dir=tmp_path, domain_train_cap=20)


def test_missing_domain_and_bad_caps_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data._folders, "_SHARED_DATA_DIRS", ())
    monkeypatch.setattr(data._folders, "_TORCHVISION_CACHE", tmp_path / "tv")
    monkeypatch.delenv("FEDFLEET_DATA", raising=False)
    with pytest.raises(DataError, match="domain 'photo'") as info:
        data.load_dataset("pacs", data_dir=tmp_path)
    assert info.value.dataset == "pacs" and "pacs/photo_32.npz" in str(info.value)
    with pytest.raises(DataError, match="domain 'mnist'"):  # never made up, never a stand-in
        data.load_dataset("digits_domains", data_dir=tmp_path)
    with pytest.raises(DataError, match="only to the multi-domain sets"):
        data.load_dataset("digits", domain_train_cap=10)
    with pytest.raises(DataError, match="int >= 0"):
        data.load_dataset("pacs", domain_test_cap=-1)


def test_dataset_record_checks_domain_fields() -> None:
    x = np.zeros((4, 3, 2, 2), np.float32)
    y = np.zeros(4, np.int64)
    split = data.ArraySplit(x=x, y=y, num_classes=2)
    half = data.ArraySplit(x=x[:2], y=y[:2], num_classes=2)
    ok = dict(name="t", train=split, test=split, num_classes=2, channels=3, image_size=2, source="-",
              domain_names=("a", "b"), train_domains=np.array([0, 0, 1, 1]), test_domains={"a": half, "b": half})
    assert data.Dataset(**ok).is_multi_domain
    for bad in ({"train_domains": np.array([0, 0, 1, 2])}, {"train_domains": np.array([0, 1, 1])},
                {"test_domains": {"b": half, "a": half}}, {"test_domains": {"a": half, "b": split}},
                {"domain_names": ("a", "a")}, {"domain_names": ()}):
        with pytest.raises(DataError):
            data.Dataset(**{**ok, **bad})


# ---------------------------------------------------------------------------- configuration


def _cfg(**data_keys: object) -> config_mod.Config:
    return config_mod.from_dict({"data": {"dataset": "pacs", "partition": "domain-silo", **data_keys}}, "<t>")


def test_config_accepts_domain_silo_and_refuses_bad_values() -> None:
    assert _cfg().data.domain_clients == ""  # default 3/4/2/1 with clients = 10
    assert _cfg(domain_clients="photo=6,art_painting=2,cartoon=1,sketch=1", domain_train_cap=500).data.clients == 10
    cases = [
        ({"domain_clients": "photo=6,art=2,cartoon=1,sketch=1"},
         "unknown domain.*'art'.*photo, art_painting, cartoon, sketch"),
        ({"domain_clients": "photo=6,art_painting=2,cartoon=1,sketch=2"}, "sums to 11 clients.*clients = 10"),
        ({"clients": 9}, "default 3/4/2/1 .*not \\[data\\] clients = 9.*photo=3,art_painting=4"),
        ({"domain_clients": "photo:6"}, "is not NAME=COUNT"),
        ({"dataset": "mnist"}, "needs a multi-domain dataset \\(digits_domains, pacs\\)"),
        ({"partition": "iid", "domain_clients": "photo=10"}, "domain_clients is for partition = 'domain-silo'"),
        ({"dataset": "mnist", "partition": "iid", "domain_train_cap": 5}, "apply to the multi-domain"),
        ({"domain_test_cap": -1}, "domain_test_cap"),
    ]
    for keys, match in cases:
        with pytest.raises(ConfigError, match=match):
            _cfg(**keys)
    digits = _cfg(dataset="digits_domains", domain_clients="mnist=3,usps=4,sklearn_digits=2,mnist_m=1")
    assert digits.data.domain_clients.startswith("mnist=3")
    assert "domain_clients = \"\"" in _cfg().to_toml()


# ---------------------------------------------------------------------------- federation


@needs_shared
def test_domain_silo_federation_reports_per_domain_accuracy(tmp_path: Path) -> None:
    """One round of FedAvg on PACS (capped to 40 train / 25 test images per domain) with the
    3/4/2/1 domain silos over an embedded broker: the run records each client's domain, and the
    per-domain, avg and worst accuracies of metrics.jsonl equal a recomputation of the final
    model's accuracy on each domain's test split."""
    import torch

    from broker_server.runtime import device_model
    from broker_server.simulate import simulate

    torch.set_num_threads(1)
    cfg = config_mod.from_dict({
        "run": {"name": "silo", "seed": 0, "rounds": 1},
        "data": {"dataset": "pacs", "partition": "domain-silo", "clients": 10, "min_samples": 5,
                 "domain_train_cap": 40, "domain_test_cap": 25},
        "train": {"local_epochs": 1, "batch_size": 16, "lr": 0.05},
        "server": {"quorum": 10, "round_deadline_s": 120.0, "join_timeout_s": 60.0},
        "broker": {"kind": "amqtt"},
    }, "<test>")
    result = simulate(cfg, run_dir=tmp_path / "run")
    run = result.run_dir
    part = json.loads((run / "partition.json").read_text())
    assert [c["domain"] for c in part["clients"]] == ["photo"] * 3 + ["art_painting"] * 4 + ["cartoon"] * 2 + ["sketch"]
    assert [c["samples"] for c in part["clients"]] == [14, 13, 13, 10, 10, 10, 10, 20, 20, 40]
    assert part["domains"] == list(data.PACS_DOMAINS) and part["substitutions"] == []
    registry = json.loads((run / "registry.json").read_text())
    assert {d["client_id"]: d["info"]["domain"] for d in registry["devices"]}["client-009"] == "sketch"

    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    ds = data.load_dataset("pacs", domain_train_cap=40, domain_test_cap=25)
    model = device_model(ds, 0)
    model.load_state_dict(torch.load(run / "model_final.pt"))
    model.eval()
    with torch.no_grad():
        acc = {d: float((model(torch.from_numpy(np.array(s.x))).argmax(1).numpy() == s.y).mean())
               for d, s in ds.test_domains.items()}
    assert set(last["domain_accuracy"]) == set(data.PACS_DOMAINS)
    for d in acc:
        assert last["domain_accuracy"][d] == pytest.approx(acc[d], abs=1e-9)
    assert last["accuracy_avg"] == pytest.approx(np.mean(list(acc.values())))
    assert last["accuracy_worst"] == pytest.approx(min(acc.values()))
