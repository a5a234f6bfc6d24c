"""Seeded partitioners that split a training set among federated clients.

Every partitioner is a pure function: it reads labels (or a sample count) and a seed and returns
``list[np.ndarray]``, one int64 index array per client, indexing the *train* split. The arrays are
disjoint, each sorted in increasing order, and together they cover every index. Randomness comes
only from ``numpy.random.default_rng(seed)`` created inside the call, so the same arguments give
the same partition on every call and every machine (for a given NumPy version).

Schemes (:func:`partition` dispatches on the name):

- ``"iid"``: :func:`iid`, uniform random shards whose sizes differ by at most one.
- ``"dirichlet"``: :func:`dirichlet`, label skew by per-class Dirichlet proportions
  (Hsu, Qi & Brown 2019, "Measuring the effects of non-identical data distribution for
  federated visual classification", arXiv:1909.06335, Sec. 3; the same redraw-until-
  ``min_samples`` loop as PFLlib ``utils/dataset_utils.py::separate_data``).
- ``"classes"``: :func:`classes_per_client`, the pathological label skew: client i holds only
  the s classes (i·s + j) mod C, j < s, and each class's samples are split evenly among the
  clients holding it (the "pat" split of PFLlib ``utils/dataset_utils.py``, with a fixed
  round-robin class assignment; FedPGP's 2-classes-per-client setting, SPECS.md §2.3).
- ``"domain-silo"``: :func:`domain_silo`, each client holds data of one domain only; a domain's
  training split is cut into equal disjoint shards, one per client of that domain (FedPAD,
  Zhang, Wan & Long, Neurocomputing 2026; SPECS.md §1.1). It needs each sample's domain
  (:attr:`edge_agent.data.Dataset.train_domains`) and the clients per domain; the training
  samples of a domain with no client are left out, so the shards then do not cover every index.

Client test sets (:func:`hold_out_local_tests`, :func:`client_splits`): with ``client_test =
"local"`` each client's evaluation split is held out of its own shard, class by class, so that it
has the client's own label distribution (the personalised-FL protocol of PFLlib / HtFLlib,
``utils/dataset_utils.py::split_data``: each client's data split 75/25 into train and test;
FedORGP §5.1 and FedOCP's evaluation, SPECS.md §3.1 and §3.5). With ``"shared"`` every client
trains on its whole shard and is evaluated on the data set's test split.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_agent.errors import LocalTestSplitError, PartitionError

__all__ = [
    "AGENT_SCHEMES",
    "CLIENT_TEST_FRACTION_RANGE",
    "CLIENT_TEST_MODES",
    "ClientSplits",
    "DEFAULT_CLIENT_TEST_FRACTION",
    "DEFAULT_DOMAIN_CLIENTS",
    "DomainSiloPartition",
    "SCHEMES",
    "SIMULATION_ONLY_SCHEMES",
    "STRONG_DOMAIN_CLIENTS",
    "allocate_domain_clients",
    "classes_per_client",
    "client_splits",
    "describe",
    "dirichlet",
    "domain_silo",
    "hold_out_local_tests",
    "iid",
    "parse_domain_clients",
    "partition",
    "split_dataset",
]

SCHEMES: tuple[str, ...] = ("classes", "dirichlet", "domain-silo", "iid")
"""Names accepted by :func:`partition`, sorted."""

SIMULATION_ONLY_SCHEMES: tuple[str, ...] = ("classes",)
"""Schemes of :data:`SCHEMES` only ``fedfleet simulate`` runs: a device's join does not announce
``classes_per_client``, so no server could check that a device split the data as it did."""

AGENT_SCHEMES: tuple[str, ...] = tuple(s for s in SCHEMES if s not in SIMULATION_ONLY_SCHEMES)
"""Schemes a fleet of ``fedfleet-agent`` devices runs (``--partition``; ``fedfleet server``)."""

DEFAULT_DOMAIN_CLIENTS: tuple[int, ...] = (3, 4, 2, 1)
"""Clients per domain, by domain position, when none are configured: FedPAD's main protocol
(SPECS.md §1.1: PACS photo 3 / art 4 / cartoon 2 / sketch 1; Digits mnist 3 / usps 4 / svhn 2 /
mnist-m 1), m = 10."""

CLIENT_TEST_MODES: tuple[str, ...] = ("local", "shared")
"""Values of ``[data] client_test``: ``"shared"`` (every client is evaluated on the data set's
test split) or ``"local"`` (each client on a split held out of its own shard,
:func:`hold_out_local_tests`)."""

DEFAULT_CLIENT_TEST_FRACTION = 0.25
"""Share of each client's samples held out as its local test set: PFLlib / HtFLlib's 75/25 split
(``train_ratio = 0.75`` in ``utils/dataset_utils.py``; FedORGP §5.1, SPECS.md §3.1)."""

CLIENT_TEST_FRACTION_RANGE: tuple[float, float] = (0.01, 0.9)
"""Allowed ``[data] client_test_fraction`` (and ``fedfleet-agent --client-test-fraction``),
inclusive: at least 1 % held out, at least 10 % left to train on."""

STRONG_DOMAIN_CLIENTS: tuple[int, ...] = (6, 2, 1, 1)
"""FedPAD's stronger imbalance (SPECS.md §1.1, Tables 8–9: PACS 6/2/1/1), by domain position;
configure it as e.g. ``domain_clients = "photo=6,art_painting=2,cartoon=1,sketch=1"``."""


def iid(num_samples: int, num_clients: int, *, seed: int) -> list[np.ndarray]:
    """Shuffle ``range(num_samples)`` and cut it into ``num_clients`` near-equal shards.

    Args:
        num_samples: N, number of training samples (>= 1).
        num_clients: K, number of clients, ``1 <= K <= N``.
        seed: seed of ``numpy.random.default_rng`` (int >= 0).

    Returns:
        K int64 arrays, each sorted; sizes are ``N // K`` or ``N // K + 1`` (the first
        ``N % K`` clients get the extra sample); disjoint, covering ``0 .. N-1``.

    Raises:
        PartitionError: N < 1, K < 1, K > N, a non-integer argument, or a negative seed.
    """
    n = _check_int("num_samples", num_samples, minimum=1)
    k = _check_num_clients(num_clients, n)
    rng = _rng(seed)
    order = rng.permutation(n)
    return [np.sort(part).astype(np.int64) for part in np.array_split(order, k)]


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    *,
    alpha: float,
    seed: int,
    min_samples: int = 10,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Label-skewed partition: each class is split among clients by Dirichlet proportions.

    For each class c present in ``labels`` (in increasing order), the class's indices are
    shuffled, proportions ``p ~ Dir(alpha · 1_K)`` are drawn, and the shuffled indices are cut at
    ``floor(cumsum(p)[:-1] · n_c)``: client i gets about ``p_i · n_c`` samples of class c. If any
    client ends with fewer than ``min_samples`` samples the whole draw is repeated (with the same
    generator, so the result stays reproducible), at most ``max_tries`` times. Unlike PFLlib's
    ``separate_data`` no balancing trick (zeroing the proportion of clients already above N/K)
    is applied, so the draw is exactly Hsu et al.'s.

    ``alpha = inf`` is the IID-proportional limit: each class is split as evenly as possible
    (sizes differ by at most one per class) after shuffling, so every client gets nearly the
    global class proportions. Small alpha (0.1) gives each client a few dominant classes.

    Args:
        labels: integer class labels of the train split, shape ``[N]`` (any integer dtype;
            the class ids need not be contiguous).
        num_clients: K, ``1 <= K <= N``.
        alpha: concentration alpha > 0 (float, may be ``math.inf``); not NaN.
        seed: seed of ``numpy.random.default_rng`` (int >= 0).
        min_samples: smallest allowed client size (int >= 0); ``K · min_samples`` must not
            exceed N.
        max_tries: maximum number of draws (int >= 1).

    Returns:
        K int64 arrays, each sorted, disjoint, covering ``0 .. N-1``, each of length
        >= ``min_samples``.

    Raises:
        PartitionError: invalid arguments (as above), or no draw within ``max_tries`` gave every
            client ``min_samples`` samples (the message gives the smallest size reached).
    """
    y = _check_labels(labels)
    n = int(y.shape[0])
    k = _check_num_clients(num_clients, n)
    a = _check_alpha(alpha)
    m = _check_int("min_samples", min_samples, minimum=0)
    tries = _check_int("max_tries", max_tries, minimum=1)
    if k * m > n:
        raise PartitionError(
            f"cannot give each of {k} clients min_samples={m} samples out of {n} "
            f"(needs {k * m}); lower min_samples or num_clients"
        )
    rng = _rng(seed)
    class_members = [np.flatnonzero(y == c) for c in np.unique(y)]

    best = -1
    for _ in range(tries):
        shards: list[list[np.ndarray]] = [[] for _ in range(k)]
        for members in class_members:
            shuffled = rng.permutation(members)
            if math.isinf(a):
                pieces = np.array_split(shuffled, k)
            else:
                proportions = rng.dirichlet(np.full(k, a))
                cuts = (np.cumsum(proportions)[:-1] * shuffled.size).astype(np.int64)
                pieces = np.split(shuffled, cuts)
            for i, piece in enumerate(pieces):
                shards[i].append(piece)
        parts = [np.sort(np.concatenate(s)).astype(np.int64) for s in shards]
        smallest = min(p.size for p in parts)
        if smallest >= m:
            return parts
        best = max(best, smallest)
    raise PartitionError(
        f"dirichlet(alpha={a}) gave no partition of {n} samples over {k} clients with every "
        f"client holding >= {m} samples in {tries} tries (best smallest client: {best}); "
        "raise alpha, lower num_clients or min_samples, or raise max_tries"
    )


def classes_per_client(labels: np.ndarray, num_clients: int, *, classes: int, seed: int,
                       min_samples: int = 1) -> list[np.ndarray]:
    """Pathological label skew: client i holds the ``classes`` classes (i·s + j) mod C, j < s
    (C = the distinct labels in increasing order), and each class's shuffled indices are cut by
    ``numpy.array_split`` into equal shards, one per client holding that class (client order).
    A class no client holds (K·s < C) is left out, so the shards then do not cover every index.

    Args:
        labels: integer class labels ``[N]``. num_clients: K, ``1 <= K <= N``.
        classes: s, classes per client, ``1 <= s <= C``. seed: seed of ``default_rng``.
        min_samples: smallest allowed client size.

    Returns:
        K sorted, disjoint int64 index arrays.

    Raises:
        PartitionError: bad arguments, or a client below ``min_samples``.
    """
    y = _check_labels(labels)
    k = _check_num_clients(num_clients, int(y.shape[0]))
    ids = np.unique(y)
    s = _check_int("classes", classes, minimum=1)
    if s > ids.size:
        raise PartitionError(f"classes={s} per client exceeds the {ids.size} classes of the data")
    m = _check_int("min_samples", min_samples, minimum=0)
    rng = _rng(seed)
    holders: dict[int, list[int]] = {c: [] for c in range(ids.size)}
    for i in range(k):
        for j in range(s):
            holders[(i * s + j) % ids.size].append(i)
    shards: list[list[np.ndarray]] = [[] for _ in range(k)]
    for c in range(ids.size):
        members = rng.permutation(np.flatnonzero(y == ids[c]))
        for owner, piece in zip(holders[c], np.array_split(members, len(holders[c])) if holders[c] else [],
                                strict=True):
            shards[owner].append(piece)
    parts = [np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros(0, np.int64) for p in shards]
    small = min(p.size for p in parts)
    if small < m:
        raise PartitionError(f"classes({s}) partition: a client holds {small} samples, below min_samples={m}; "
                             "use fewer clients")
    return parts


def partition(
    labels: np.ndarray,
    num_clients: int,
    *,
    scheme: str,
    seed: int,
    alpha: float | None = None,
    min_samples: int = 10,
    domains: np.ndarray | None = None,
    domain_names: Sequence[str] = (),
    domain_clients: str | Mapping[str, int] | None = None,
    classes: int = 2,
) -> list[np.ndarray]:
    """Partition a train split among clients by scheme name (``classes``: s of the
    ``"classes"`` scheme, :func:`classes_per_client`; ignored by the others).

    Args:
        labels: integer class labels of the train split, shape ``[N]``.
        num_clients: K, ``1 <= K <= N``.
        scheme: one of :data:`SCHEMES` (``"iid"``, ``"dirichlet"``, ``"domain-silo"``).
        seed: seed of ``numpy.random.default_rng`` (int >= 0).
        alpha: Dirichlet concentration, required for ``"dirichlet"`` and must be None for
            the other schemes (a value there is almost certainly a configuration mistake).
        min_samples: smallest allowed client size. For ``"iid"`` it is checked against
            ``N // K``; for ``"dirichlet"`` it drives the redraw loop of :func:`dirichlet`;
            for ``"domain-silo"`` it bounds every shard (:func:`domain_silo`).
        domains, domain_names, domain_clients: ``"domain-silo"`` only (required there, refused
            elsewhere except ``domain_clients=None``): each sample's domain index ``[N]``, the
            domain names and the clients per domain (see :func:`domain_silo`; None or ``""``
            = 3/4/2/1 by position). The sum of clients per domain must be K.

    Returns:
        K sorted, disjoint int64 index arrays covering ``0 .. N-1`` (see :func:`iid`,
        :func:`dirichlet`; for ``"domain-silo"`` the samples of domains without clients are
        not covered, and :func:`domain_silo` also gives each client's domain).

    Raises:
        PartitionError: unknown scheme (the message lists :data:`SCHEMES`), ``alpha`` missing
            or superfluous, domain arguments missing or superfluous, or any error of the chosen
            partitioner.
    """
    y = _check_labels(labels)
    n = int(y.shape[0])
    k = _check_num_clients(num_clients, n)
    if scheme == "domain-silo":
        if alpha is not None:
            raise PartitionError(f"scheme 'domain-silo' takes no alpha (got alpha={alpha!r})")
        if domains is None:
            raise PartitionError("scheme 'domain-silo' needs each sample's domain (domains=, "
                                 "from a multi-domain data set such as 'pacs' or "
                                 "'digits_domains')")
        _check_domains(domains, domain_names, size=n)
        return domain_silo(domains, domain_names, domain_clients, seed=seed, num_clients=k,
                           min_samples=min_samples).parts
    if domains is not None or domain_clients:
        raise PartitionError(f"scheme {scheme!r} takes no domains / domain_clients "
                             "(those are for 'domain-silo')")
    if scheme == "iid":
        if alpha is not None:
            raise PartitionError(f"scheme 'iid' takes no alpha (got alpha={alpha!r})")
        m = _check_int("min_samples", min_samples, minimum=0)
        if n // k < m:
            raise PartitionError(
                f"iid: {n} samples over {k} clients gives {n // k} per client, "
                f"below min_samples={m}"
            )
        return iid(n, k, seed=seed)
    if scheme == "classes":
        if alpha is not None:
            raise PartitionError(f"scheme 'classes' takes no alpha (got alpha={alpha!r})")
        return classes_per_client(y, k, classes=classes, seed=seed, min_samples=min_samples)
    if scheme == "dirichlet":
        if alpha is None:
            raise PartitionError("scheme 'dirichlet' needs alpha (> 0, or math.inf)")
        return dirichlet(y, k, alpha=alpha, seed=seed, min_samples=min_samples)
    raise PartitionError(f"unknown partition scheme {scheme!r}; valid: {', '.join(SCHEMES)}")


def split_dataset(
    ds,
    num_clients: int,
    *,
    scheme: str,
    seed: int,
    alpha: float | None = None,
    min_samples: int = 10,
    train_samples: int = 0,
    domain_clients: str | Mapping[str, int] | None = "",
    classes: int = 2,
) -> list[np.ndarray]:
    """The configured partition of a loaded data set's training split (``classes``: the
    ``"classes"`` scheme's classes per client, ``[data] classes_per_client``): what a federation's server
    (``[data]`` settings) and each real agent (``fedfleet-agent`` options) must compute alike.

    With ``0 < train_samples < N`` the partition is of a seeded, class-stratified subset of
    ``train_samples`` samples (:func:`edge_agent.data.stratified_subsample` with ``seed``), and
    the returned indices point into the whole split again; otherwise of all N samples. The
    scheme then splits it by :func:`partition` (``"domain-silo"`` with ``ds.train_domains``,
    ``ds.domain_names`` and ``domain_clients``).

    Args:
        ds: a :class:`edge_agent.data.Dataset` (``train.y`` int64 ``[N]``; for ``"domain-silo"``
            also ``train_domains`` int ``[N]`` and ``domain_names``).
        num_clients: K, the shard count (``[data] clients``, ``--shard i/K``).
        scheme, seed, min_samples: as :func:`partition`.
        alpha: Dirichlet α; used only for ``"dirichlet"`` (ignored otherwise).
        train_samples: size of the stratified subset (``[data] train_samples``); 0 = all.
        domain_clients: clients per domain (:func:`allocate_domain_clients`); ``"domain-silo"``
            only (ignored otherwise); ``""``/None = 3/4/2/1 by position.

    Returns:
        K sorted int64 index arrays into ``ds.train``.

    Raises:
        PartitionError: any error of :func:`partition` (too many clients, α too small, an
            unknown domain, clients per domain that do not sum to K, a single-domain set for
            ``"domain-silo"``).
    """
    from edge_agent.data import stratified_subsample

    y_all = np.asarray(ds.train.y)
    subset = None
    if 0 < train_samples < len(y_all):
        subset = stratified_subsample(y_all, train_samples, seed=seed)
    silo: dict[str, Any] = {}  # partition()'s domain keywords, for "domain-silo" only
    if scheme == "domain-silo":
        domains = getattr(ds, "train_domains", None)
        silo = {"domains": domains if domains is None or subset is None else domains[subset],
                "domain_names": tuple(getattr(ds, "domain_names", ()) or ()), "domain_clients": domain_clients}
    parts = partition(y_all if subset is None else y_all[subset], num_clients, scheme=scheme, seed=seed,
                      alpha=alpha if scheme == "dirichlet" else None, min_samples=min_samples, classes=classes,
                      **silo)
    return parts if subset is None else [subset[np.asarray(p, dtype=np.int64)] for p in parts]


def hold_out_local_tests(labels: np.ndarray, parts: Sequence[np.ndarray], *, fraction: float,
                         seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split every client's shard into its training samples and its local test set, per class.

    The protocol of PFLlib / HtFLlib (``utils/dataset_utils.py::split_data``, ``train_ratio =
    0.75``; FedORGP §5.1, SPECS.md §3.1): each client is evaluated on held-out samples of its
    own label distribution. Unlike their ``train_test_split`` (shuffled, not stratified) the hold
    out here is stratified, so a client's test histogram is its training histogram scaled:
    for client i a generator ``numpy.random.default_rng([seed, i])`` is made; for each class c
    of the shard, in increasing label order, the shard's n_ic indices of class c are permuted
    with it and the first

        t_ic = min(floor(fraction · n_ic + 1/2), n_ic − 1)

    go to the test set, the others stay for training. Rounding is half up (0.25 · 2 = 0.5 → 1;
    0.25 · 6 = 1.5 → 2; 0.25 · 5 = 1.25 → 1), and a class keeps at least one training sample
    (a class held once is trained on, never tested: "stratified where possible"). Each client's
    draw depends only on ``(seed, i)`` and its own shard, so a device computes its split alone.

    Args:
        labels: integer class labels ``[N]`` of the split the shards index (``ds.train.y``).
        parts: K integer index arrays into ``labels`` (the partition's shards).
        fraction: share held out, ``0 < fraction < 1`` (:data:`DEFAULT_CLIENT_TEST_FRACTION`).
        seed: the run seed (int >= 0).

    Returns:
        ``(train, test)``: two lists of K sorted int64 arrays into ``labels``; ``train[i]`` and
        ``test[i]`` are disjoint and together exactly ``parts[i]``.

    Raises:
        PartitionError: a fraction outside (0, 1), a bad label or index array, or a client whose
            test set would be empty (every class of its shard held once: the message names the
            client; use a larger fraction, fewer clients or a larger ``min_samples``).
    """
    y = _check_labels(labels, allow_empty=True)
    if isinstance(fraction, bool) or not isinstance(fraction, int | float | np.integer | np.floating) \
            or not 0.0 < float(fraction) < 1.0:
        raise PartitionError(f"the local test fraction must be a number in (0, 1), got {fraction!r}")
    f = float(fraction)
    s = _check_int("seed", seed, minimum=0)
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for i, part in enumerate(parts):
        idx = _check_client_indices(i, part, y.size)
        idx = idx.astype(np.int64, copy=False)
        rng = np.random.default_rng([s, i])
        own = y[idx]
        keep: list[np.ndarray] = []
        held: list[np.ndarray] = []
        for c in np.unique(own):
            members = rng.permutation(idx[own == c])
            t = min(int(np.floor(f * members.size + 0.5)), members.size - 1)
            held.append(members[:t])
            keep.append(members[t:])
        te = np.sort(np.concatenate(held)).astype(np.int64) if held else np.zeros(0, np.int64)
        if te.size == 0:
            classes, sizes = np.unique(own, return_counts=True)
            counts = {int(c): int(n) for c, n in zip(classes, sizes, strict=True)}
            raise LocalTestSplitError(
                f"client {i}: a local test fraction of {f:g} of its {idx.size} samples (per class: {counts}) "
                "leaves no test sample (each class keeps at least one training sample); raise "
                "client_test_fraction or min_samples, or use fewer clients")
        train.append(np.sort(np.concatenate(keep)).astype(np.int64))
        test.append(te)
    return train, test


@dataclass(frozen=True, eq=False)
class ClientSplits:
    """Every client's training and evaluation samples (:func:`client_splits`).

    Attributes:
        train: K sorted int64 arrays into ``ds.train``: what client i trains on.
        test: under ``"local"``, K sorted int64 arrays into ``ds.train``: client i's local test
            set, disjoint from ``train[i]``; ``None`` under ``"shared"`` (the test split).
        client_test: ``"shared"`` or ``"local"`` (:data:`CLIENT_TEST_MODES`).
        fraction: the held-out share under ``"local"``; ``None`` under ``"shared"``.
    """

    train: list[np.ndarray]
    test: list[np.ndarray] | None
    client_test: str
    fraction: float | None


def client_splits(ds, num_clients: int, *, client_test: str = "shared",
                  client_test_fraction: float = DEFAULT_CLIENT_TEST_FRACTION, **partition_args: Any) -> ClientSplits:
    """The configured partition (:func:`split_dataset` with ``partition_args``: ``scheme``,
    ``seed``, ``alpha`` …) and, under ``client_test = "local"``, each client's local test set
    held out of its shard (:func:`hold_out_local_tests` with the same seed): what the server, every
    virtual agent and every ``fedfleet-agent`` compute alike from the announced settings.

    Args:
        ds: a :class:`edge_agent.data.Dataset`.
        num_clients: K.
        client_test: ``"shared"`` (train on the whole shard) or ``"local"``.
        client_test_fraction: the held-out share under ``"local"`` (ignored under ``"shared"``).
        partition_args: the keyword arguments of :func:`split_dataset` (``seed`` required).

    Returns:
        A :class:`ClientSplits`.

    Raises:
        PartitionError: an unknown ``client_test``, or any error of :func:`split_dataset` or
            :func:`hold_out_local_tests`.
    """
    if client_test not in CLIENT_TEST_MODES:
        raise PartitionError(f"client_test must be one of {', '.join(CLIENT_TEST_MODES)}, got {client_test!r}")
    parts = split_dataset(ds, num_clients, **partition_args)
    if client_test == "shared":
        return ClientSplits(train=parts, test=None, client_test="shared", fraction=None)
    train, test = hold_out_local_tests(np.asarray(ds.train.y), parts, fraction=client_test_fraction,
                                       seed=partition_args["seed"])
    return ClientSplits(train=train, test=test, client_test="local", fraction=float(client_test_fraction))


def describe(
    parts: Sequence[np.ndarray],
    labels: np.ndarray,
    num_classes: int,
    *,
    domains: np.ndarray | None = None,
    domain_names: Sequence[str] = (),
) -> list[dict[str, object]]:
    """Summarise a partition for logging.

    Args:
        parts: K integer index arrays into ``labels`` (as returned by :func:`partition`).
        labels: integer class labels ``[N]``, each in ``[0, num_classes)``.
        num_classes: number of classes C >= 1.
        domains: optional domain index of each sample ``[N]`` (into ``domain_names``), e.g.
            :attr:`edge_agent.data.Dataset.train_domains`; None for a single-domain set.
        domain_names: the names ``domains`` indexes.

    Returns:
        K dicts ``{"client": i, "samples": n_i, "histogram": [count of class 0, ..., class
        C-1]}`` with Python ints, in client order; with ``domains``, also ``"domain"``: the
        client's domain name, or the ``"+"``-joined names when its samples span several
        domains (any scheme other than ``"domain-silo"``), ``""`` for an empty client.

    Raises:
        PartitionError: an index is out of range or not an integer, a label is outside
            ``[0, num_classes)``, ``num_classes`` < 1, or ``domains`` does not match.
    """
    y = _check_labels(labels, allow_empty=True)
    c = _check_int("num_classes", num_classes, minimum=1)
    dom = None if domains is None else _check_domains(domains, domain_names, size=y.size)
    if y.size and (y.min() < 0 or y.max() >= c):
        raise PartitionError(f"labels lie in [{y.min()}, {y.max()}], expected [0, {c})")
    out: list[dict[str, object]] = []
    for i, part in enumerate(parts):
        idx = _check_client_indices(i, part, y.size)
        hist = np.bincount(y[idx].astype(np.int64), minlength=c)
        entry: dict[str, object] = {"client": i, "samples": int(idx.size),
                                    "histogram": [int(v) for v in hist]}
        if dom is not None:
            entry["domain"] = "+".join(domain_names[d] for d in np.unique(dom[idx]))
        out.append(entry)
    return out


# --------------------------------------------------------------------------------------------
# Domain silos
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class DomainSiloPartition:
    """The result of :func:`domain_silo`.

    Attributes:
        parts: K int64 index arrays into the train split, one per client, each sorted.
        client_domains: K domain names: ``client_domains[i]`` is the domain of client i.
        clients_per_domain: ``{domain name: number of clients}`` for every domain, in domain
            order (0 for a domain without clients).
    """

    parts: list[np.ndarray]
    client_domains: tuple[str, ...]
    clients_per_domain: dict[str, int]


_DOMAIN_ENTRY = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*=\s*([0-9]+)\s*$")


def parse_domain_clients(text: str) -> dict[str, int]:
    """Parse a clients-per-domain text such as ``"photo=3,art_painting=4,cartoon=2,sketch=1"``.

    Args:
        text: comma-separated ``NAME=COUNT`` entries; NAME of ``[A-Za-z0-9_.-]``, COUNT a
            decimal int >= 0; spaces around names, counts and commas are ignored.

    Returns:
        ``{name: count}`` in the order written (``{}`` for an empty or blank text).

    Raises:
        PartitionError: an entry is not ``NAME=COUNT``, or a name appears twice.
    """
    if not isinstance(text, str):
        raise PartitionError(f"domain clients must be text like 'photo=3,sketch=1', got {text!r}")
    out: dict[str, int] = {}
    if not text.strip():
        return out
    for entry in text.split(","):
        m = _DOMAIN_ENTRY.match(entry)
        if m is None:
            raise PartitionError(
                f"domain clients {text!r}: {entry.strip()!r} is not NAME=COUNT "
                "(e.g. 'photo=3,art_painting=4,cartoon=2,sketch=1')"
            )
        name, count = m.group(1), int(m.group(2))
        if name in out:
            raise PartitionError(f"domain clients {text!r}: domain {name!r} is given twice")
        out[name] = count
    return out


def allocate_domain_clients(
    domain_names: Sequence[str],
    domain_clients: str | Mapping[str, int] | None = None,
    num_clients: int | None = None,
) -> dict[str, int]:
    """Resolve the clients of each domain.

    Args:
        domain_names: the set's domains in their fixed order (:attr:`Dataset.domain_names`).
        domain_clients: ``{name: count}`` or its text form (:func:`parse_domain_clients`);
            domains not named get 0 clients. None or empty: :data:`DEFAULT_DOMAIN_CLIENTS`
            by position (3/4/2/1), which needs exactly 4 domains.
        num_clients: K; when given, the counts must sum to it.

    Returns:
        ``{name: count}`` for every domain, in ``domain_names`` order.

    Raises:
        PartitionError: a name that is not one of ``domain_names`` (the message lists them), a
            count < 0, no client at all, a sum that differs from ``num_clients``, or no counts
            given for a set that does not have 4 domains.
    """
    names = tuple(domain_names)
    if not names:
        raise PartitionError("domain-silo needs a multi-domain data set (no domain names given)")
    if domain_clients is None:
        given: dict[str, int] = {}
    elif isinstance(domain_clients, str):
        given = parse_domain_clients(domain_clients)
    else:
        given = dict(domain_clients)
    if not given:
        if len(names) != len(DEFAULT_DOMAIN_CLIENTS):
            raise PartitionError(
                f"no clients per domain given and the default {DEFAULT_DOMAIN_CLIENTS} needs 4 "
                f"domains; the data set has {len(names)}: {', '.join(names)}")
        given = dict(zip(names, DEFAULT_DOMAIN_CLIENTS))
    unknown = [n for n in given if n not in names]
    if unknown:
        raise PartitionError(
            f"unknown domain(s) {', '.join(map(repr, unknown))}; this data set's domains are: "
            f"{', '.join(names)}")
    for name, count in given.items():
        _check_int(f"clients of domain {name!r}", count, minimum=0)
    alloc = {n: int(given.get(n, 0)) for n in names}
    total = sum(alloc.values())
    if total < 1:
        raise PartitionError(f"no domain has a client: {alloc}")
    if num_clients is not None and total != num_clients:
        raise PartitionError(
            f"the clients per domain ({', '.join(f'{n}={k}' for n, k in alloc.items())}) sum to "
            f"{total}, but num_clients is {num_clients}")
    return alloc


def domain_silo(
    domains: np.ndarray,
    domain_names: Sequence[str],
    domain_clients: str | Mapping[str, int] | None = None,
    *,
    seed: int,
    num_clients: int | None = None,
    min_samples: int = 1,
) -> DomainSiloPartition:
    """Domain-silo partition: every client holds a disjoint shard of one domain's training data.

    FedPAD's protocol (Zhang, Wan & Long, Neurocomputing 2026; SPECS.md §1.1): domains are
    unbalanced by client count, and "a domain's training split is divided uniformly into disjoint
    shards, one per client of that domain" (SPECS.md §1.1). Clients are numbered domain by
    domain in ``domain_names`` order (the default 3/4/2/1 on PACS: clients 0–2 photo, 3–6
    art_painting, 7–8 cartoon, 9 sketch). With one ``numpy.random.default_rng(seed)``, for each
    domain with k_d >= 1 clients in that order, the domain's n_d sample indices are permuted and cut by
    ``numpy.array_split`` into k_d shards of ``n_d // k_d`` or ``n_d // k_d + 1`` samples (the
    first ``n_d mod k_d`` shards get the extra one), each then sorted.

    Args:
        domains: int ``[N]``, the domain index (into ``domain_names``) of each training sample.
        domain_names: the D domain names, in order.
        domain_clients: clients per domain, see :func:`allocate_domain_clients` (default
            3/4/2/1 by position).
        seed: seed of ``numpy.random.default_rng`` (int >= 0).
        num_clients: K; when given, the clients per domain must sum to it.
        min_samples: smallest allowed shard (int >= 0).

    Returns:
        A :class:`DomainSiloPartition`: K sorted, disjoint int64 index arrays, the domain of
        each client, and the clients per domain.

    Raises:
        PartitionError: bad ``domains`` (not a 1-D integer array of indices into
            ``domain_names``), any error of :func:`allocate_domain_clients`, or a domain with
            fewer than ``k_d · min_samples`` samples (the message names the domain).
    """
    names = tuple(domain_names)
    alloc = allocate_domain_clients(names, domain_clients, num_clients)
    dom = _check_domains(domains, names)
    m = _check_int("min_samples", min_samples, minimum=0)
    rng = _rng(seed)
    parts: list[np.ndarray] = []
    owners: list[str] = []
    for d, name in enumerate(names):
        k = alloc[name]
        if k == 0:
            continue
        members = np.flatnonzero(dom == d)
        if members.size < k * max(m, 1):
            raise PartitionError(
                f"domain {name!r} has {members.size} training samples, too few for {k} clients "
                f"of at least {max(m, 1)} samples each; give it fewer clients")
        for shard in np.array_split(rng.permutation(members), k):
            parts.append(np.sort(shard).astype(np.int64))
            owners.append(name)
    return DomainSiloPartition(parts=parts, client_domains=tuple(owners), clients_per_domain=alloc)


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _check_client_indices(client: int, part: object, size: int) -> np.ndarray:
    """Client ``client``'s shard ``part`` as a 1-D integer array of indices in [0, ``size``).

    Raises:
        PartitionError: not 1-D integers, or an index out of range (the client is named).
    """
    idx = np.asarray(part)
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise PartitionError(f"client {client}: indices must be a 1-D integer array")
    if idx.size and (idx.min() < 0 or idx.max() >= size):
        raise PartitionError(f"client {client}: indices must lie in [0, {size})")
    return idx


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise PartitionError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise PartitionError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_num_clients(num_clients: object, num_samples: int) -> int:
    k = _check_int("num_clients", num_clients, minimum=1)
    if k > num_samples:
        raise PartitionError(
            f"num_clients={k} exceeds the number of samples {num_samples}; "
            "every client needs at least one sample"
        )
    return k


def _check_alpha(alpha: object) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float | np.integer | np.floating):
        raise PartitionError(f"alpha must be a number > 0 (or math.inf), got {alpha!r}")
    a = float(alpha)
    if math.isnan(a) or a <= 0:
        raise PartitionError(f"alpha must be > 0 (or math.inf), got {alpha!r}")
    return a


def _check_domains(domains: object, names: Sequence[str], *, size: int | None = None) -> np.ndarray:
    dom = np.asarray(domains)
    if dom.ndim != 1 or (dom.size and not np.issubdtype(dom.dtype, np.integer)):
        raise PartitionError(f"domains must be a 1-D integer array, got shape {dom.shape} "
                             f"dtype {dom.dtype}")
    if size is not None and dom.size != size:
        raise PartitionError(f"domains has {dom.size} entries, labels {size}")
    if dom.size and (dom.min() < 0 or dom.max() >= len(names)):
        raise PartitionError(f"domains must lie in [0, {len(names)}) (indices into "
                             f"{tuple(names)}), got [{dom.min()}, {dom.max()}]")
    return dom


def _check_labels(labels: object, *, allow_empty: bool = False) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise PartitionError(f"labels must be a 1-D array, got shape {y.shape}")
    if y.size == 0:
        if allow_empty:
            return y.astype(np.int64)
        raise PartitionError("labels is empty: there is nothing to partition")
    if not np.issubdtype(y.dtype, np.integer):
        raise PartitionError(f"labels must have an integer dtype, got {y.dtype}")
    return y


def _rng(seed: object) -> np.random.Generator:
    s = _check_int("seed", seed, minimum=0)
    return np.random.default_rng(s)
