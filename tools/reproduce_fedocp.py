"""FedOCP on a model-heterogeneous fleet: FedProto, FedGH, FedTGP, FedOCP's ablations, a sweep of its unfixed keys.

The protocol of SPECS.md §3.1 (FedOCP seed + HtFLlib/FedORGP conventions): 20 clients, all
sampled each round, a model group of ≥ 4 architectures (``[model] group``, default ``htfe4-cpu``:
lightcnn, resnet8, mobilenet_v2_small, inception_small, device i runs member i mod 4), SGD lr 0.01,
batch 32, 1 local epoch; accuracy = the devices' own models on their **local test sets**
(``[data] client_test = "local"``: 25 % of each client's shard held out per class before training,
the 75/25 split of HtFLlib/FedORGP, SPECS §3.1 and §3.5), as Σ correct / Σ test samples over the
devices (``client_accuracy_weighted``, HtFLlib's ``serverbase.evaluate``), best round and last
round. Every method here is prototype-only: no global model exists. Grid (one real federation per
cell, :func:`broker_server.simulate.simulate`, run by :mod:`broker_server.experiments`):

- data: CIFAR-10 (the default), then Fashion-MNIST and MNIST as resumable extensions
  (``--datasets CIFAR-10,Fashion-MNIST,MNIST``), from ``../shared/data`` (CIFAR-100, Flowers102
  and Tiny-ImageNet of the paper are not there; SVHN has 50 images offline: left out); a data set
  after the first runs ``--extension-methods`` (default :data:`EXTENSION_METHODS`: the baselines
  and FedOCP, no ablation and no 100-epoch FedORGP), so a second data set tests the headline and
  the baselines' ranking at half the first one's cells;
- splits: Dirichlet α = 0.1 (the likely "practical" setting, SPECS §3.1) and the pathological
  2 classes per client (``partition = "classes"``);
- methods: FedProto (``fedproto``, λ = 10 as HtFLlib's scripts), FedGH, FedTGP, FedORGP (the
  paper's best weights; at its own 1 server epoch a round and at 100), FedOCP, and the
  ablations of SPECS §3.6, each exactly one ``[algorithm]`` key away from FedOCP: no orthogonal
  init, no server contrastive loss (class means instead), no client orthogonality loss, no client
  contrastive loss;
- a sweep of every FedOCP key the paper does not fix (SPECS §3.2/§3.3 [guess]: the loss weights
  λ_align, λ_orth, λ_con at 0, 10× and 100× the default (λ_align's 100 is also FedORGP's λ_c on
  the same loss: the report sets that cell against FedORGP, FedOCP's additions at equal alignment
  weight), the temperatures τ_client, τ_server at 0.1× and 10×, the server's epochs (1, FedORGP's)
  and lr (10× and 100×): 100× the weights and the server's lr look for where the method
  collapses, which 10× did not reach) on one setting (``--sweep-bench``, default CIFAR-10 /
  Dir(0.1), local test), 3 seeds, cells keyed ``sweep/...``; λ_orth = 0 and λ_con = 0 are the
  ablation cells of the main grid (the same configuration reaches the clients), so they are read
  from there, not run twice.
  ``--sweep-extended`` adds 0.1× the loss weights, 10 server epochs, server lr 0.001, server batch
  10 (HtFLlib's) and orthogonally initialised server embeddings; ``anchor_steps`` is not swept (with
  C = 10 ≤ d = 64 the anchors are the exact QR factor and the steps are unused);
- per method: client accuracy, rounds to a target client accuracy per seed (:data:`TARGETS`), the
  mean inter-class cosine similarity of the global prototypes (metric ``global_prototype_cosine``
  of the last round; FedGH has none: its head rows' cosine, ``head_row_cosine``, marked †),
  upload and download bytes per client per round (device links, MQTT framing included) and the
  update's extras bytes;
- 3 seeds; mean ± std (population); comparisons over the seeds both sides have.

- evaluation protocol (``--client-test``, default ``local``): ``local`` is the paper's; ``shared``
  scores every device on ≤ 2,000 images of the shared test split (all classes) instead, where
  under Dir(0.1) or 2 classes per client a personalised model scores near chance by construction.
  Each record and report column names its protocol, so the two are never mixed; ``--tiny`` runs
  both, for FedOCP and FedProto, to show the difference.

The paper reports +6.8 pp over FedORGP on CIFAR-100 (HtFE8, practical); CIFAR-100 is not in
``../shared/data``, so the report tests that margin on the data sets here against FedORGP
(:mod:`broker_server.strategies.fedorgp`, SPECS §6.5) at its own 1 server epoch a round and at
FedOCP's 100 (a 10-round run gives the 1-epoch server a tenth of the paper's server training),
then against the best baseline here, and gives verdicts on each ablation and the prototypes'
inter-class cosine.

CPU plan for 2 cores (the defaults; :func:`cell_core_seconds`, the report's "CPU plan" section):

- measured: one FedOCP cell, CIFAR-10 Dir(0.1), 20 clients all participating, 10,000 training
  images (7,500 trained on, 2,500 local test), 4 rounds, ``nice -n 5`` on the 2 cores shared
  with four other busy processes (load ≈ 3.6): 229 s wall for the cell, 151 s CPU for the whole
  invocation (132 s user + 19 s system, broker included) → ≈ 36 s of one core per round and
  ≈ 8 s of start-up and close (:data:`MEASURED_ROUND_CPU_S`, :data:`MEASURED_START_CPU_S`);
- server epochs stay the strategies' own (FedOCP, FedTGP 100; FedGH, FedORGP 1; the row "FedORGP
  100 server epochs" 100): 100 epochs of the
  prototype generator on 60–200 uploads took 0.1–0.4 s CPU, ≤ 1 % of a round;
- defaults: 10 rounds (:data:`ROUNDS`), 10,000 training images (:data:`TRAIN_SAMPLES`), CIFAR-10
  only: a cell ≈ 8 + 10 × 36 = 368 s of one core; the main grid (2 splits × 10 methods × 3 seeds
  = 60 cells) ≈ 6.1 core-hours; the sweep (14 values × 3 seeds = 42 cells) ≈ 4.3 core-hours;
  together ≈ 10.4 core-hours ≈ 5.2 h wall on 2 workers when nothing else runs;
- extensions: each further data set 2 splits × 5 methods (:data:`EXTENSION_METHODS`) × 3 seeds
  = 30 cells, ≤ 3.1 core-hours (1×28×28 images: CIFAR-10's cost as the bound; the report's CPU
  plan gives what its records took); the committed grid (``tools/grid_queue.py``) adds
  Fashion-MNIST, and leaves MNIST out (every method near its ceiling there tells little);
  ``--sweep-extended`` 7 values × 3 seeds = 21 cells ≈ 2.1 core-hours. The grid resumes where it
  stopped, so each extension is one more invocation.

Resumable: each finished cell is appended to ``OUT/results.jsonl`` and skipped when present (a
failed one runs again). A grid starts on every worker at once; a fresh one prints a CPU estimate
for the rest when its first cell finishes (``--estimate-only`` runs that cell alone and stops), a
resumed one takes the mean time of its recorded cells. Shrink knobs: ``--rounds``,
``--clients``, ``--train-samples``, ``--epochs``, ``--seeds``, ``--datasets``, ``--splits``,
``--methods``, ``--group``, ``--server-epochs``, ``--sweep-keys``, ``--no-sweep``. ``--verify K``
re-runs K recorded cells and reports whether they reproduce the recorded accuracy.

Usage::

    python tools/reproduce_fedocp.py --out runs/repro-fedocp --report benchmarks/fedocp.md
    python tools/reproduce_fedocp.py --tiny --out /tmp/fedocp-tiny --report /tmp/fedocp-tiny.md
    python tools/reproduce_fedocp.py --out runs/repro-fedocp --report benchmarks/fedocp.md --report-only
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker_server.experiments import (  # noqa: E402
    NOT_RECORDED,
    Job,
    attach_round_series,
    cell_rounds_to_target,
    check_out_dir,
    check_report_records,
    claim_verdict,
    code_commit,
    default_data_dir,
    earlier_verify,
    failed_runs_section,
    has_rounds,
    hits_text,
    int_list,
    load_results,
    mean_std,
    name_list,
    numerics_line,
    pm,
    read_metrics,
    records_cost,
    run_with_estimate,
    script_exit,
    verify_records,
)
from broker_server.strategies.fedocp import (  # noqa: E402
    LAMBDA_ALIGN,
    LAMBDA_CON,
    LAMBDA_ORTH,
    SERVER_BATCH,
    SERVER_EPOCHS,
    SERVER_LR,
    TAU,
)
from broker_server.text import plural  # noqa: E402

#: method label → (registered algorithm, [algorithm] table). Baselines: SPECS §6 defaults.
METHODS: dict[str, tuple[str, dict]] = {
    "FedProto": ("fedproto", {"lambda_proto": 10.0}),
    "FedGH": ("fedgh", {}),
    "FedTGP": ("fedtgp", {}),
    "FedORGP": ("fedorgp", {}),
    "FedORGP 100 server epochs": ("fedorgp", {"server_epochs": 100}),
    "FedOCP": ("fedocp", {}),
    "FedOCP no orthogonal init": ("fedocp", {"orth_init": False}),
    "FedOCP no server contrastive": ("fedocp", {"server_contrastive": False}),
    "FedOCP no client orthogonality": ("fedocp", {"client_orthogonality": False}),
    "FedOCP no client contrastive": ("fedocp", {"client_contrastive": False}),
}
BASELINES = ["FedProto", "FedGH", "FedTGP", "FedORGP", "FedORGP 100 server epochs"]
#: the paper's headline baseline (SPECS §3.6: "+6.8 over FedORGP"), at its own 1 server epoch a
#: round and at FedOCP's 100 (a 10-round run gives a 1-epoch server 10 epochs in all, the paper's
#: 100 rounds 100): the headline verdict takes the stronger of the two per setting
HEADLINE = ["FedORGP", "FedORGP 100 server epochs"]
ABLATIONS = [m for m in METHODS if m.startswith("FedOCP no")]
#: the methods a data set after the first runs (``--extension-methods``): the headline's rival at
#: its own server epochs, the other baselines and FedOCP; the ablations and the 100-epoch FedORGP
#: (weaker than the 1-epoch one on both CIFAR-10 splits) stay with the first data set
EXTENSION_METHODS = ["FedProto", "FedGH", "FedTGP", "FedORGP", "FedOCP"]
#: algorithms whose server trains for ``server_epochs`` (the shrink knob applies to them)
SERVER_TRAINED = ("fedtgp", "fedocp", "fedgh", "fedorgp")

DATASETS = {"CIFAR-10": "cifar10", "Fashion-MNIST": "fashion_mnist", "MNIST": "mnist"}
SPLITS: dict[str, dict] = {
    "Dir(0.1)": {"partition": "dirichlet", "alpha": 0.1},
    "2 classes/client": {"partition": "classes", "classes_per_client": 2},
}
#: The paper's claim (SPECS §3.6), on a data set this machine does not have, against FedORGP.
CLAIM_GAIN_PP = 6.8
#: SPECS §3.6, ablation table T5 (CIFAR-100, HtFE8, practical): the base, + orthogonal init, and
#: the full method (+ server contrastive, + client orthogonality, + client contrastive, added one
#: at a time; the single steps are not in SPECS).
T5_BASE, T5_ORTH_INIT, T5_FULL = 34.37, 42.34, 47.54
#: what removing each mechanism should cost if T5's gain carries over (pp): the orthogonal init's
#: own step; the other three have no single step in SPECS, so only the sign is claimed (None)
ABLATION_CLAIMS_PP: dict[str, float | None] = {
    "FedOCP no orthogonal init": round(T5_ORTH_INIT - T5_BASE, 2),
    "FedOCP no server contrastive": None,
    "FedOCP no client orthogonality": None,
    "FedOCP no client contrastive": None,
}
#: rounds-to-target thresholds (client accuracy on the local test sets), per data set [guess: the
#: paper gives none; CIFAR-10's from the one measured cell, FedOCP Dir(0.1) at 62–65 % in rounds 1–4]
TARGETS = {"CIFAR-10": 0.70, "Fashion-MNIST": 0.90, "MNIST": 0.97}
#: mean inter-class cosine at or below which a prototype set counts as orthogonal or more separated
#: (this report's threshold: 0 is orthogonal on average; 10 unit vectors can reach −1/9 ≈ −0.11,
#: the simplex, the most separated set, since ‖Σ p_c‖² ≥ 0 gives mean cos ≥ −1/(C − 1))
ORTHOGONAL_COS = 0.1
#: a swept value this many pp below the default (same seeds) is called a drop in the verdicts
DROP_PP = 10.0

#: the prototype width d of every member of the group (the paper's 512: a 2-core budget)
FEATURE_DIM = 64
#: The CPU plan's defaults (module docstring).
ROUNDS = 10
TRAIN_SAMPLES = 10_000
#: Measured (module docstring): CPU seconds of one round and of start-up + close, for one CIFAR-10
#: FedOCP cell of 20 clients on :data:`MEASURED_TRAIN_SAMPLES` training images.
MEASURED_ROUND_CPU_S = 36.0
MEASURED_START_CPU_S = 8.0
MEASURED_TRAIN_SAMPLES = 10_000
#: CIFAR-10's training split (``train_samples = 0``: all of it)
CIFAR10_TRAIN = 50_000


def _times(value: float, factor: float) -> float:
    """``value × factor`` rounded to 6 significant digits (0.1 × 0.1 gives 0.01, not 0.010000000000000002)."""
    return float(f"{value * factor:.6g}")


#: FedORGP's client alignment weight λ_c (SPECS §6.5, the paper's best), on the same loss as FedOCP's
#: λ_align: the sweep runs it too, so FedOCP's additions can be compared with FedORGP at equal weight
ORGP_LAMBDA = 100.0
#: FedOCP keys the paper does not fix (SPECS §3.2/§3.3 [guess]): key → (the strategy's default, the
#: values the sweep runs, the values ``--sweep-extended`` adds). Defaults are read from
#: :mod:`broker_server.strategies.fedocp`, whose docstring says why each is what it is.
SWEEPS: dict[str, tuple[object, tuple, tuple]] = {
    "lambda_align": (LAMBDA_ALIGN, (0.0, _times(LAMBDA_ALIGN, 10), ORGP_LAMBDA), (_times(LAMBDA_ALIGN, 0.1),)),
    "lambda_orth": (LAMBDA_ORTH, (0.0, _times(LAMBDA_ORTH, 10), _times(LAMBDA_ORTH, 100)), (_times(LAMBDA_ORTH, 0.1),)),
    "lambda_con": (LAMBDA_CON, (0.0, _times(LAMBDA_CON, 10), _times(LAMBDA_CON, 100)), (_times(LAMBDA_CON, 0.1),)),
    "tau_client": (TAU, (_times(TAU, 0.1), _times(TAU, 10)), ()),
    "tau_server": (TAU, (_times(TAU, 0.1), _times(TAU, 10)), ()),
    "server_epochs": (SERVER_EPOCHS, (1,), (10,)),
    "server_lr": (SERVER_LR, (_times(SERVER_LR, 10), _times(SERVER_LR, 100)), (_times(SERVER_LR, 0.1),)),
    "server_batch": (SERVER_BATCH, (), (10,)),
    "server_orth_init": (False, (), (True,)),
}
#: A swept value whose configuration is a main-grid ablation's (the clients get the same round
#: config, the server the same keys): its row reads that ablation's cells.
SWEEP_AS_ABLATION: dict[tuple[str, object], str] = {
    ("lambda_orth", 0.0): "FedOCP no client orthogonality",
    ("lambda_con", 0.0): "FedOCP no client contrastive",
}
#: FedOCP keys left out of the sweep, and why.
NOT_SWEPT = {
    "anchor_steps": "unused here: with C = 10 classes ≤ d = 64 the anchors are the exact QR factor "
                    "(edge_agent.algorithms.fedocp.orthogonal_anchors); the steps only matter when C > d",
    "server_seed, anchor_seed": "seeds of the generator and of the anchors, not hyperparameters",
}


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in ".-" else "_" for ch in text).strip("_")


#: ``[data] client_test`` values: the paper's local test sets, or the shared test split
CLIENT_TESTS = ("local", "shared")
#: test images per device under ``client_test = "shared"``
SHARED_EVAL_MAX = 2000


def job_config(dataset: str, split: str, algorithm: str, params: dict, seed: int, *, rounds: int, epochs: int,
               clients: int, train_samples: int, lr: float, group: str, server_epochs: int, data_dir: str,
               client_test: str = "local") -> dict:
    """The configuration of one run (as parsed TOML); ``client_test``: ``"local"`` (each device's
    held-out 25 % of its shard, SPECS §3.5) or ``"shared"`` (≤ 2,000 images of the test split).
    ``server_epochs`` > 0 sets that key for FedTGP, FedOCP (every variant, so that an ablation
    stays one key away from FedOCP; unused without the server's contrastive loss), FedGH and
    FedORGP, unless ``params`` sets it (a sweep cell, the row "FedORGP 100 server epochs")."""
    data = {"dataset": DATASETS[dataset], "clients": clients, "train_samples": train_samples, "min_samples": 1,
            "client_test": client_test, **SPLITS[split]}
    if data_dir:
        data["data_dir"] = data_dir
    algo = dict(params)
    if server_epochs and algorithm in SERVER_TRAINED:
        algo.setdefault("server_epochs", server_epochs)
    return {
        "run": {"name": f"fedocp-{_slug(dataset)}", "seed": seed, "rounds": rounds},
        "data": data,
        "train": {"algorithm": algorithm, "local_epochs": epochs, "batch_size": 32, "lr": lr, "momentum": 0.0},
        "server": {"participation_rate": 1.0, "quorum": 1, "round_deadline_s": 3600.0, "join_timeout_s": 600.0,
                   "client_eval": True, "client_eval_max": SHARED_EVAL_MAX if client_test == "shared" else 0},
        "broker": {"kind": "auto"},
        "agents": {"train_slots": 1, "torch_threads": 1},
        "model": {"name": "lightcnn", "feature_dim": FEATURE_DIM, "group": group},
        "algorithm": algo,
    }


def sweep_plan(keys: Sequence[str] | None = None, *, extended: bool = False,
               server_epochs: int = 0) -> dict[str, tuple[object, list]]:
    """The sweep's keys → (the main grid's value, the other values, in order): :data:`SWEEPS`'
    run values, and with ``extended`` its extra ones; a key left with no value is dropped, as is
    a value equal to the main grid's (``server_epochs`` > 0 replaces the strategy's default).

    Raises:
        ValueError: a key not in :data:`SWEEPS`.
    """
    unknown = sorted(set(keys or ()) - set(SWEEPS))
    if unknown:
        raise ValueError(f"unknown sweep keys {unknown}; known: {list(SWEEPS)}")
    plan: dict[str, tuple[object, list]] = {}
    for key in keys if keys is not None else SWEEPS:
        default, run, extra = SWEEPS[key]
        if key == "server_epochs" and server_epochs:
            default = server_epochs
        values = [v for v in (*run, *(extra if extended else ())) if v != default]
        if values:
            plan[key] = (default, values)
    return plan


def _sweep_key(ds: str, sp: str, ct: str, key: str, value: object, seed: int) -> str:
    return f"sweep/{_slug(ds)}/{_slug(sp)}/{ct}/{key}={_slug(str(value))}/s{seed}"


def _main_job(ds: str, sp: str, ct: str, label: str, seed: int, **kw) -> Job:
    return Job(f"main/{_slug(ds)}/{_slug(sp)}/{ct}/{_slug(label)}/s{seed}",
               job_config(ds, sp, METHODS[label][0], METHODS[label][1], seed, client_test=ct, **kw),
               tags={"grid": "main", "dataset": ds, "split": sp, "client_test": ct, "method": label, "seed": seed})


def methods_per_dataset(datasets: list[str], methods: list[str],
                        extension_methods: list[str] | None = None) -> dict[str, list[str]]:
    """Data set → the methods its main grid runs: ``methods`` on the first data set, and on each
    later one the members of ``methods`` that ``extension_methods`` names (``None``: all of
    ``methods``), in ``methods``' order.

    >>> methods_per_dataset(["CIFAR-10", "MNIST"], ["FedProto", "FedOCP", "FedOCP no orthogonal init"],
    ...                     ["FedOCP", "FedProto"])["MNIST"]
    ['FedProto', 'FedOCP']
    """
    keep = set(methods if extension_methods is None else extension_methods)
    return {ds: list(methods) if i == 0 else [m for m in methods if m in keep] for i, ds in enumerate(datasets)}


def make_jobs(datasets: list[str], splits: list[str], methods: list[str] | dict[str, list[str]], seeds: list[int],
              client_tests: tuple[str, ...] | list[str] = ("local",), *, sweep: tuple[str, str, str] | None = None,
              sweep_values: dict[str, tuple[object, list]] | None = None, **kw) -> list[Job]:
    """The grid's cells, in the order they run: per data set (in ``datasets`` order) the main
    grid seed by seed (every split, evaluation protocol and method: ``methods``, or
    ``methods[data set]`` when it maps each data set to its own, :func:`methods_per_dataset`),
    and after the sweep's data
    set the sweep seed by seed: on ``sweep`` = (data set, split, protocol) one FedOCP cell per
    value of ``sweep_values`` (:func:`sweep_plan`; default: the whole plan), keyed
    ``sweep/<data set>/<split>/<protocol>/<key>=<value>/s<seed>``, preceded by the main cells its
    table reads that ``methods`` or ``datasets`` leave out (FedOCP's, the default row, and the
    ablations of :data:`SWEEP_AS_ABLATION`). ``kw``: :func:`job_config`'s keywords."""
    per_ds = methods if isinstance(methods, dict) else {ds: methods for ds in datasets}
    jobs = [_main_job(ds, sp, ct, label, seed, **kw)
            for ds in datasets for seed in seeds for sp in splits for ct in client_tests for label in per_ds[ds]]
    if sweep is None:
        return jobs
    ds, sp, ct = sweep
    plan = sweep_plan(server_epochs=int(kw.get("server_epochs", 0))) if sweep_values is None else sweep_values
    have = {j.key for j in jobs}
    extra: list[Job] = []
    for seed in seeds:
        needed = ["FedOCP"] + [SWEEP_AS_ABLATION[(k, v)] for k, (_, vs) in plan.items() for v in vs
                               if (k, v) in SWEEP_AS_ABLATION]
        for label in needed:
            job = _main_job(ds, sp, ct, label, seed, **kw)
            if job.key not in have:
                have.add(job.key)
                extra.append(job)
        for key, (_, values) in plan.items():
            for v in values:
                if (key, v) in SWEEP_AS_ABLATION:
                    continue
                extra.append(Job(_sweep_key(ds, sp, ct, key, v, seed),
                                 job_config(ds, sp, "fedocp", {key: v}, seed, client_test=ct, **kw),
                                 tags={"grid": "sweep", "dataset": ds, "split": sp, "client_test": ct,
                                       "method": "FedOCP", "sweep_key": key, "value": v, "seed": seed}))
    if ds not in datasets:
        return jobs + extra
    cut = max(i for i, j in enumerate(jobs) if j.tags["dataset"] == ds) + 1
    return jobs[:cut] + extra + jobs[cut:]


def _client_figure(m: dict) -> float | None:
    """A metrics line's client accuracy: Σ correct / Σ test samples over the devices
    (``client_accuracy_weighted``, HtFLlib's), else the unweighted mean (a line without it)."""
    a = m.get("client_accuracy_weighted", m.get("client_accuracy_mean"))
    return None if a is None else float(a)


def client_accuracy(out: Path, r: dict, which: str = "best") -> float | None:
    """The devices' own accuracy (:func:`_client_figure`, a fraction): the best round's
    (``which="best"``, from the cell's rounds, :func:`~broker_server.experiments.read_metrics`;
    ``None`` when they are not on hand) or the last round's (the record's ``final``)."""
    if which == "last":
        return _client_figure(r.get("final", {}))
    accs = [a for m in read_metrics(out, r["key"]) if (a := _client_figure(m)) is not None]
    return max(accs) if accs else None


def rounds_to_client_target(out: Path, r: dict, target: float) -> int | str | None:
    """The first round whose client accuracy (:func:`_client_figure`) reached ``target`` (a
    fraction), ``None`` when none did, :data:`~broker_server.experiments.NOT_RECORDED` when the
    cell's rounds are not on hand (:func:`~broker_server.experiments.cell_rounds_to_target` over
    this report's figure)."""
    return cell_rounds_to_target(out, r["key"], target, _client_figure)


def _protocol(r: dict) -> str:
    """A record's evaluation protocol (records made before the option existed: ``"shared"``)."""
    return str(r.get("client_test", "shared"))


def prototype_cosine(out: Path, r: dict) -> tuple[float | None, bool]:
    """(the last logged mean inter-class cosine of the global prototypes, whether it is FedGH's head
    rows instead)."""
    for m in reversed(read_metrics(out, r["key"])):
        if m.get("global_prototype_cosine") is not None:
            return float(m["global_prototype_cosine"]), False
        if m.get("head_row_cosine") is not None:
            return float(m["head_row_cosine"]), True
    return None, False


def _cells(main: list[dict], ds: str, sp: str, ct: str, label: str) -> list[dict]:
    return [r for r in main if r["dataset"] == ds and r["split"] == sp and r["method"] == label
            and _protocol(r) == ct]


def per_seed(records: Sequence[dict], value: Callable[[dict], float | None]) -> dict[int, float]:
    """seed → ``value(record)`` for the records whose value is known."""
    return {int(r["seed"]): v for r in records if (v := value(r)) is not None}


def paired_differences(a: dict[int, float], b: dict[int, float]) -> list[float]:
    """``a[s] − b[s]`` for every seed s both have, in seed order."""
    return [a[s] - b[s] for s in sorted(set(a) & set(b))]


def seed_matched(by_label: dict[str, dict[int, float]]) -> tuple[dict[str, float], list[int]]:
    """(label → mean over the seeds every label with a value shares, those seeds); labels with no
    value are left out; ``({}, [])`` when they share no seed. A partly run grid so compares like
    with like."""
    have = {k: v for k, v in by_label.items() if v}
    shared = sorted(set.intersection(*(set(v) for v in have.values()))) if have else []
    if not shared:
        return {}, []
    return {k: mean_std([v[s] for s in shared])[0] for k, v in have.items()}, shared


def _verdict(measured: float, claimed: float | None, std: float, pairs: int) -> str:
    """:func:`~broker_server.experiments.claim_verdict`, marked provisional when it rests on one
    paired difference (a grid under way): one pair has no spread to judge it by."""
    verdict = claim_verdict(measured, claimed, std, pairs)
    return verdict if pairs >= 2 else f"{verdict}, provisional: 1 pair, no spread to judge it by"


def _group_text(group: str) -> str:
    """The members of a named model group, or the name when it is not one."""
    from edge_agent.models import MODEL_GROUPS

    members = MODEL_GROUPS.get(group)
    return ", ".join(members) if members else group


def _diff_text(diffs: list[float], scale: float = 100.0, unit: str = " pp", digits: int = 2) -> str:
    """Paired differences as ``"+1.23 ± 0.40 pp (3 seeds)"`` (one seed: no ±)."""
    m, s = mean_std([scale * d for d in diffs])
    n = len(diffs)
    text = f"{m:+.{digits}f}{unit}" if n == 1 else f"{m:+.{digits}f} ± {s:.{digits}f}{unit}"
    return f"{text} ({plural(n, 'seed')})"


def cell_core_seconds(rounds: int, train_samples: int) -> float:
    """The plan's cost of one cell in seconds of one core: start-up + rounds × the measured round,
    scaled linearly by the training images (``0`` = all of CIFAR-10's 50,000) against the
    measured cell's; an estimate for CIFAR-10, a bound for the 28×28 data sets."""
    n = train_samples or CIFAR10_TRAIN
    return MEASURED_START_CPU_S + rounds * MEASURED_ROUND_CPU_S * n / MEASURED_TRAIN_SAMPLES


def cpu_plan_section(parts: list[tuple[str, int, list[dict]]], settings: dict) -> list[str]:
    """The report's "CPU plan" lines: per part (label, planned cells, the records of that part on
    hand) the estimate (:func:`cell_core_seconds`) and what the records cost."""
    per_cell = cell_core_seconds(settings["rounds"], settings["train_samples"])
    lines = ["## CPU plan (2 cores)", "",
             f"Measured: one FedOCP cell, CIFAR-10 Dir(0.1), 20 clients, {MEASURED_TRAIN_SAMPLES:,} training images, "
             f"4 rounds, on the 2 cores shared with four busy processes: 229 s wall, 151 s CPU → ≈ "
             f"{MEASURED_ROUND_CPU_S:.0f} s of one core per round + ≈ {MEASURED_START_CPU_S:.0f} s start-up. Estimate "
             f"per cell at {settings['rounds']} rounds × {settings['train_samples'] or CIFAR10_TRAIN:,} images: "
             f"≈ {per_cell:.0f} s of one core (CIFAR-10; the 28×28 sets cost less, not measured). Records: each "
             "cell's own wall seconds, one torch thread per cell.", "",
             "| part | cells | estimate (core-hours) | on record: cells, cell-hours |", "|---|---|---|---|"]
    total = 0.0
    for label, cells, recs in parts:
        est = cells * per_cell / 3600
        total += est
        secs = [float(r["seconds"]) for r in recs if "seconds" in r]
        lines.append(f"| {label} | {cells} | {est:.1f} | {len(secs)}, {sum(secs) / 3600:.2f} |")
    lines += ["", f"All parts: ≈ {total:.1f} core-hours, ≈ {total / 2:.1f} h wall on 2 workers when nothing else "
              "runs. Each part resumes where it stopped.", ""]
    return lines


def report(results: dict[str, dict], *, out: Path, datasets: list[str], splits: list[str], methods: list[str],
           seeds: list[int], settings: dict, wall_s: float | None, commit: str, verify: list[str],
           client_tests: tuple[str, ...] | list[str] = ("local",), sweep: tuple[str, str, str] | None = None,
           sweep_values: dict[str, tuple[object, list]] | None = None,
           extension_methods: list[str] | None = None) -> str:
    """The markdown report of the records ``results`` (key → record, ``OUT/results.jsonl``),
    their rounds read through :func:`~broker_server.experiments.read_metrics` from ``out``;
    ``methods`` on the first data set, the ones ``extension_methods`` names on each later one
    (:func:`methods_per_dataset`).

    ``sweep`` = (data set, split, protocol) of the sweep and ``sweep_values`` its plan
    (:func:`sweep_plan`); with ``sweep`` None the sweep table appears when sweep records exist,
    on their setting. Accuracies are fractions in the records and percentages in the report;
    means over seeds are population mean ± std; every comparison between two methods is over
    the seeds both have on record.
    """
    ok = [r for r in results.values() if "error" not in r]
    main = [r for r in ok if r.get("grid") == "main"]
    sweep_recs = [r for r in ok if r.get("grid") == "sweep"]
    if sweep is None and sweep_recs:
        r0 = sweep_recs[0]
        sweep = (r0["dataset"], r0["split"], _protocol(r0))
    if sweep is not None and sweep_values is None:
        sweep_values = sweep_plan(server_epochs=int(settings.get("server_epochs") or 0))
    columns = [(sp, ct) for sp in splits for ct in client_tests]
    n_seeds = len(seeds)
    per_ds = methods_per_dataset(datasets, methods, extension_methods)

    def best(r: dict) -> float | None:
        return client_accuracy(out, r)

    def cosine(r: dict) -> float | None:
        return prototype_cosine(out, r)[0]

    def partial(k: int) -> str:
        return f" ({k} of {n_seeds} seeds)" if k < n_seeds else ""

    images = f"{settings['train_samples']:,}" if settings["train_samples"] else "all"
    orgp_epochs = (f"the grid's {settings['server_epochs']}" if settings.get("server_epochs")
                   else "its own 1")
    server_epochs = (f"{settings['server_epochs']} for FedTGP, FedOCP, FedGH and FedORGP (the row 'FedORGP 100 "
                     "server epochs' keeps 100)" if settings.get("server_epochs")
                     else "the strategies' own (FedTGP, FedOCP 100; FedGH, FedORGP 1; the row 'FedORGP 100 "
                     "server epochs' 100)")
    lines = ["# FedOCP on a model-heterogeneous fleet: reproduction with baselines, ablations and a sweep", "",
             f"Generated by `tools/reproduce_fedocp.py` at commit `{commit}`; every number below was measured in "
             "the records this report reads (`results.jsonl`).", "",
             "## Protocol", "",
             f"- {settings['clients']} clients, all sampled each round, {settings['rounds']} rounds × "
             f"{settings['epochs']} local epoch(s), SGD lr {settings['lr']}, batch 32; model group "
             f"`{settings['group']}` ({_group_text(settings['group'])}; device i runs member i mod n), every member "
             f"ending in a {FEATURE_DIM}-wide feature (the paper's 512, SPECS §3.1) and a Linear({FEATURE_DIM}, C) "
             "head; training subset "
             f"{images} samples (stratified, 25 % of each shard held out as the "
             f"device's local test set); server epochs: {server_epochs}; seeds {seeds}; mean ± std (population) "
             "over seeds; "
             f"a cell on fewer seeds says so, \"(k of {n_seeds} seeds)\". The paper runs 100 rounds "
             "(SPECS §3.1); the rounds and images here are what 2 cores allow (see the CPU plan).",
             "- Accuracy: each device's own model (FedProto, FedTGP: nearest global prototype; FedGH, FedORGP, "
             "FedOCP: the own head), Σ correct / Σ test samples over the devices (HtFLlib's), best round (HtFLlib's "
             "convention, the figure every comparison below uses) and last round, under the protocol each "
             "column names: **local** = each device's local test set, 25 % of its shard held out per class "
             "before training (HtFLlib/FedORGP 75/25, SPECS §3.5: the paper's); **shared** = ≤ 2,000 images "
             "of the shared test split (all classes), where a personalised model under label skew scores "
             f"low by construction. *{NOT_RECORDED}*: the cell's rounds are not recorded (a record made before "
             "records carried their rounds, whose run folder is gone), so its best round is unknown.",
             "- Splits: Dirichlet(0.1) per class over clients; '2 classes/client': client i holds classes 2i, "
             "2i+1 mod 10, each class split evenly among its holders.",
             "- Ablations: each is FedOCP with one `[algorithm]` key switched off (`orth_init`, "
             "`server_contrastive`, `client_orthogonality`, `client_contrastive` = false).", ""]
    if wall_s is not None:
        lines += [f"Wall time of this invocation: {wall_s / 60:.1f} min on {platform.machine()} "
                  f"({os.cpu_count()} CPUs).", ""]
    lines += [records_cost(results), "", numerics_line(results), ""]
    stamped = sorted({str(r["commit"]) for r in ok if r.get("commit")})
    if stamped:
        lines += [f"Records made at commit(s) {', '.join(f'`{c}`' for c in stamped)}.", ""]
    have = [d for d in DATASETS if any(r["dataset"] == d for r in main)]
    not_run = [d for d in datasets if d not in have]
    if not_run:
        lines += [f"**Scope: these records hold {', '.join(have) or 'no data set'}; {', '.join(not_run)} not run "
                  "yet (the grid resumes where it stopped).** The verdicts below cover only the settings on record.",
                  ""]
    # CPU plan: the planned cells per part against what the records of each part cost
    parts = [(f"main, {ds}", len(splits) * len(per_ds[ds]) * n_seeds * len(client_tests),
              [r for r in main if r["dataset"] == ds]) for ds in datasets]
    if sweep is not None and sweep_values:
        n_sweep = sum(1 for k, (_, vs) in sweep_values.items() for v in vs if (k, v) not in SWEEP_AS_ABLATION)
        parts.append((f"sweep, {sweep[0]} {sweep[1]}", n_sweep * n_seeds, sweep_recs))
    lines += cpu_plan_section(parts, settings)

    for ds in datasets:
        target = TARGETS[ds]
        lines += [f"## {ds}", "", "| method | " + " | ".join(f"{sp}, {ct} test: best / last (%)" for sp, ct in columns)
                  + f" | rounds to {target:.0%}, per seed (per column) | global prototype cosine (per column) |",
                  "|---|" + "---|" * (len(columns) + 2)]
        for label in per_ds[ds]:
            cells, rtt, cos = [], [], []
            for sp, ct in columns:
                rs = sorted(_cells(main, ds, sp, ct, label), key=lambda r: int(r["seed"]))
                if not rs:
                    cells.append("–")
                    rtt.append("–")
                    cos.append("–")
                    continue
                b = [a for r in rs if (a := best(r)) is not None]
                last = [a for r in rs if (a := client_accuracy(out, r, "last")) is not None]
                cells.append((pm(b, plain_single=True) + partial(len(b)) if b else NOT_RECORDED) + " / "
                             + (pm(last, plain_single=True) + partial(len(last)) if last else "–"))
                hits = hits_text([rounds_to_client_target(out, r, target) for r in rs])
                on = [int(r["seed"]) for r in rs]
                rtt.append(hits + ("" if on == seeds else f" (seeds {', '.join(map(str, on))})"))
                cs = [prototype_cosine(out, r) for r in rs]
                vals = [c for c, _ in cs if c is not None]
                cos.append(pm(vals, 1.0, 3, plain_single=True) + ("†" if any(h for _, h in cs) else "")
                           if vals else NOT_RECORDED)
            lines.append(f"| {label} | " + " | ".join(cells) + " | " + "; ".join(rtt) + " | " + "; ".join(cos) + " |")
        lines += ["", f"Rounds to {target:.0%} [target a guess: the paper gives none]: the first round whose client "
                  f"accuracy reached it, per seed in seed order; *never*: not within {settings['rounds']} rounds; "
                  f"*{NOT_RECORDED}*: the cell's rounds are not recorded.", ""]
    lines += ["† FedGH broadcasts a head, not prototypes: the cosine between its head's class rows.", "",
              "## Bytes per client per round (device links, MQTT framing included)", "",
              "Mean over each method's cells on record (every setting and seed it ran, so rows on other seeds or "
              "splits differ a little: a device uploads one prototype per class it holds, and the split decides "
              "how many; the download carries every class's prototype, and its round config the method's keys).",
              "",
              "| method | up B | down B | update extras B | update model tensors B |", "|---|---|---|---|---|"]
    for label in methods:
        rs = [r for r in main if r["method"] == label]
        if rs:
            fields = [r.get("update_field_bytes_mean", {}) for r in rs]
            extras = mean_std([sum(v for k, v in f.items() if k.startswith("extras.")) for f in fields])[0]
            tensors = mean_std([float(f.get("tensors", 0.0)) for f in fields])[0]
            lines.append(f"| {label} | {mean_std([r['up_bytes_per_client_round'] for r in rs])[0]:,.0f} | "
                         f"{mean_std([r['down_bytes_per_client_round'] for r in rs])[0]:,.0f} | {extras:,.0f} | "
                         f"{tensors:,.0f} |")
    lines += ["", "(An update's model tensors field is an empty list, 1 byte: no parameter leaves a device.)", ""]

    sweep_verdicts: list[str] = []
    if sweep is not None and sweep_values:
        sds, ssp, sct = sweep
        in_bench = [r for r in sweep_recs if r["dataset"] == sds and r["split"] == ssp and _protocol(r) == sct]
        swept = sorted({int(r["seed"]) for r in in_bench})
        default_rs = [r for r in _cells(main, sds, ssp, sct, "FedOCP") if int(r["seed"]) in swept]
        default_acc = per_seed(default_rs, best)
        lines += ["## Sweep of FedOCP's unfixed keys", "",
                  f"{sds}, {ssp}, {sct} test; one key changed at a time from FedOCP's defaults. The default row is "
                  f"the main grid's FedOCP cell on the seeds the sweep has run ({swept or 'none yet'}), and each "
                  "row's difference is against it over the seeds both have. A value marked = ablation is that "
                  "main-grid ablation's cells (the same configuration).", "",
                  "| key | value | best-round accuracy (%) | − default, same seeds | prototype cosine | seeds |",
                  "|---|---|---|---|---|---|"]
        for key, (default, values) in sweep_values.items():
            rows: list[tuple[str, list[dict]]] = [(f"{default!r} (default)", default_rs)]
            for v in values:
                alias = SWEEP_AS_ABLATION.get((key, v))
                if alias:
                    rows.append((f"{v!r} (= ablation '{alias.removeprefix('FedOCP ')}')",
                                 [r for r in _cells(main, sds, ssp, sct, alias) if int(r["seed"]) in swept]))
                else:
                    rows.append((repr(v), [r for r in in_bench if r.get("sweep_key", r.get("key")) == key
                                           and r["value"] == v]))
            gains: list[tuple[float, str, str]] = []
            for i, (text, rs) in enumerate(rows):
                acc = per_seed(rs, best)
                diffs = paired_differences(acc, default_acc) if i else []
                if diffs:
                    gains.append((100 * mean_std(diffs)[0], text, _diff_text(diffs), 100 * mean_std(diffs)[1],
                                  len(diffs)))
                row_cos = [c for r in rs if (c := cosine(r)) is not None]
                # records without their rounds (best round, last cosine unknown): n/r, not "–"
                unknown = NOT_RECORDED if any(not has_rounds(out, r["key"]) for r in rs) else "–"
                lines.append(f"| {key} | {text} | "
                             + (pm(list(acc.values()), plain_single=True) if acc else unknown) + " | "
                             + ("–" if not i else _diff_text(diffs) if diffs else "–") + " | "
                             + (pm(row_cos, 1.0, 3, plain_single=True) if row_cos else unknown)
                             + f" | {len(acc)}{f' of {len(rs)}' if len(acc) < len(rs) else ''} |")
            if gains:
                best_gain = max(gains)
                drops = [f"{t} {d}" for g, t, d, _, _ in gains if g <= -DROP_PP]
                # "beats" only beyond the seeds' spread (one seed: no spread to judge by, said so)
                gain, text, diff, spread, n = best_gain
                best_text = ("the default is the best value on record" if gain <= 0
                             else f"{text} is ahead by {diff}, one seed: no spread to judge by" if n < 2
                             else f"{text} beats the default by {diff}" if gain > spread
                             else f"{text} is ahead by {diff}, within the seeds' spread")
                sweep_verdicts.append(
                    f"- sweep `{key}` ({len(gains)} of {len(values)} values on record): " + best_text
                    + (f"; drops of ≥ {DROP_PP:.0f} pp: {', '.join(drops)}" if drops
                       else f"; no value on record drops ≥ {DROP_PP:.0f} pp") + ".")
        lines += ["", "Not swept: " + "; ".join(f"`{k}`: {why}" for k, why in NOT_SWEPT.items()) + ".", ""]

    lines += ["## Verdicts", "",
              f"- **The paper's headline, +{CLAIM_GAIN_PP} pp over FedORGP**, is measured on CIFAR-100 (HtFE8, "
              "practical), which is not in ../shared/data; here it is tested on the data sets above, against "
              f"FedORGP at {orgp_epochs} server epoch(s) a round and at 100 (the stronger of the two per setting, "
              f"seed-matched), with +{CLAIM_GAIN_PP} pp as the bar: *reproduced* = FedOCP beats it by ≥ "
              f"{CLAIM_GAIN_PP} pp, *direction only* = by less, *not reproduced* = it does not beat it, or by no "
              "more than the std of its paired differences (`broker_server.experiments.claim_verdict`). The same "
              "bar is then put against the best of all baselines here."]
    def margin_lines(rivals: list[str], versus: str, total: str, paper: str, none: str) -> list[str]:
        """Per setting, FedOCP against the strongest of ``rivals`` (seed-matched means; ``versus``
        introduces it: "" names it alone), then the pooled (setting, seed) differences; each
        with its verdict against the paper's margin."""
        out: list[str] = []
        gains: list[float] = []  # per setting: the seed-matched mean gain over its strongest rival (pp)
        pairs: list[float] = []  # per (setting, seed): FedOCP − that rival (pp)
        for ds in datasets:
            for sp, ct in columns:
                by = {label: per_seed(_cells(main, ds, sp, ct, label), best) for label in ["FedOCP", *rivals]}
                means, shared = seed_matched(by)
                base = {k: v for k, v in means.items() if k in rivals}
                if "FedOCP" in means and base:
                    top = max(base, key=lambda k: base[k])
                    gains.append(100 * (means["FedOCP"] - base[top]))
                    diffs = [100 * (by["FedOCP"][s] - by[top][s]) for s in shared]
                    pairs += diffs
                    out.append(f"- {ds} {sp} ({ct} test), seeds {shared}: FedOCP {100 * means['FedOCP']:.2f} vs "
                               f"{versus}{top} {100 * base[top]:.2f} → {_diff_text(diffs, scale=1.0)} → "
                               f"**{_verdict(gains[-1], CLAIM_GAIN_PP, mean_std(diffs)[1], len(diffs))}**.")
        if not gains:
            return [*out, none]
        g, g_std = mean_std(pairs)
        return [*out, f"- FedOCP vs {total} over {plural(len(gains), 'setting')}: {g:+.2f} ± {g_std:.2f} pp over "
                      f"{plural(len(pairs), '(setting, seed) pair')}, ahead in {sum(x > 0 for x in gains)} of "
                      f"{len(gains)} → **{_verdict(g, CLAIM_GAIN_PP, g_std, len(pairs))}**{paper}."]

    lines += margin_lines(HEADLINE, "", "FedORGP", f" (the paper: +{CLAIM_GAIN_PP} pp on CIFAR-100)",
                          "- no FedOCP/FedORGP pair on record yet.")
    if sweep is not None:  # FedOCP at FedORGP's alignment weight against FedORGP: what FedOCP's additions bring
        sds, ssp, sct = sweep
        at_orgp = per_seed([r for r in sweep_recs if r["dataset"] == sds and r["split"] == ssp
                            and _protocol(r) == sct and r.get("sweep_key") == "lambda_align"
                            and float(r.get("value", -1)) == ORGP_LAMBDA], best)
        rivals = {label: per_seed(_cells(main, sds, ssp, sct, label), best) for label in HEADLINE}
        rivals = {k: v for k, v in rivals.items() if set(v) & set(at_orgp)}
        if at_orgp and rivals:
            top = max(rivals, key=lambda k: mean_std([rivals[k][x] for x in sorted(set(rivals[k]) & set(at_orgp))])[0])
            diffs = [100 * d for d in paired_differences(at_orgp, rivals[top])]
            m, sd = mean_std(diffs)
            lines.append(f"- At FedORGP's alignment weight (the sweep's λ_align = {ORGP_LAMBDA:g}; {sds} {ssp}, {sct} "
                         f"test): FedOCP − {top} {_diff_text(diffs, scale=1.0)} → "
                         f"**{_verdict(m, CLAIM_GAIN_PP, sd, len(diffs))}** (FedOCP's orthogonal init, orthogonality "
                         "and contrastive losses and server InfoNCE, against FedORGP's loss at the same λ).")
    lines += ["", "Against the best baseline of each setting (any of FedProto, FedGH, FedTGP, FedORGP):", ""]
    lines += margin_lines(BASELINES, "the best baseline ", "the best baseline", "",
                          "- no FedOCP/baseline pair on record yet.")

    def pairwise(label: str, ref: str, value: Callable[[dict], float | None] = best
                 ) -> list[tuple[str, list[float]]]:
        """(setting, per-seed label − ref) for every setting where both have a shared seed."""
        found = []
        for ds in datasets:
            for sp, ct in columns:
                d = paired_differences(per_seed(_cells(main, ds, sp, ct, label), value),
                                       per_seed(_cells(main, ds, sp, ct, ref), value))
                if d:
                    found.append((f"{ds} {sp} ({ct})", d))
        return found

    for label in BASELINES:
        found = pairwise("FedOCP", label)
        if found:
            avg = sum(mean_std(d)[0] for _, d in found) / len(found)
            lines.append(f"- FedOCP − {label}: " + "; ".join(f"{s} {_diff_text(d)}" for s, d in found)
                         + f"; {100 * avg:+.2f} pp on average.")
    lines += ["", f"Ablations (SPECS §3.6, T5, CIFAR-100 HtFE8 practical): the orthogonal init adds "
              f"{T5_ORTH_INIT - T5_BASE:+.2f} pp to the base ({T5_BASE} → {T5_ORTH_INIT}); server contrastive, client "
              f"orthogonality and client contrastive, added one at a time, bring it to {T5_FULL} "
              f"({T5_FULL - T5_ORTH_INIT:+.2f} pp together; their single steps are not in SPECS). T5 adds each "
              "mechanism to a base; here each is removed from the full method, so the two compare in sign: the "
              "claim holds for a mechanism when removing it costs accuracy. Verdicts pool the paired differences over "
              "(setting, seed) (`broker_server.experiments.claim_verdict`): *reproduced* = the cost reaches T5's step "
              "(the orthogonal init; for the other three, whose single steps SPECS lacks, any cost beyond the spread), "
              "*direction only* = a smaller cost beyond the spread, *not reproduced* = no cost, or a cost no larger "
              "than the std of the pairs.", ""]
    ablated = 0
    worth_of: dict[str, str] = {}  # ablation → its pooled accuracy cost, for the geometry's reading
    for label in ABLATIONS:
        found = pairwise("FedOCP", label)  # what removing it costs, per setting: FedOCP − the ablation
        if not found:
            continue
        ablated += 1
        costs = sum(mean_std(d)[0] > 0 for _, d in found)
        worth, worth_std = mean_std([100 * x for _, d in found for x in d])
        n_pairs = sum(len(d) for _, d in found)
        worth_of[label] = f"{worth:+.2f} ± {worth_std:.2f} pp ({plural(n_pairs, 'pair')})"
        claimed = ABLATION_CLAIMS_PP.get(label)
        bar = (f"T5's {claimed:+.2f} pp" if claimed is not None
               else "the sign: T5 gives no single step for it")
        lines.append(f"- {label}: removing it costs (FedOCP − it) "
                     + "; ".join(f"{s} {_diff_text(d)}" for s, d in found)
                     + f"; over all pairs {worth:+.2f} ± {worth_std:.2f} pp "
                     + f"({plural(n_pairs, '(setting, seed) pair')}), a cost in {costs} of "
                     + f"{plural(len(found), 'setting')}; against {bar} → "
                     + f"**{_verdict(worth, claimed, worth_std, n_pairs)}**.")
    if not ablated:
        lines.append("- no ablation/FedOCP pair on record yet.")
    lines += ["", f"Prototype geometry (FedOCP's claim: orthogonal, well-separated global prototypes): the last "
              f"round's mean inter-class cosine; 0 is orthogonal on average and −1/9 ≈ −0.11 the simplex, the most "
              f"separated 10 unit vectors can be, so a mean at or below {ORTHOGONAL_COS} counts as **orthogonal or "
              "more separated** (this report's threshold), and a lower mean is a more separated set. Against each "
              "baseline over the seeds both have († FedGH: its head's rows).", ""]
    for ds in datasets:
        for sp, ct in columns:
            ocp = per_seed(_cells(main, ds, sp, ct, "FedOCP"), cosine)
            if not ocp:
                continue
            ocp_mean = mean_std(list(ocp.values()))[0]
            parts_cos = []
            lower = 0
            compared = 0
            also: list[str] = []  # baselines the threshold passes too
            for label in BASELINES:
                other = per_seed(_cells(main, ds, sp, ct, label), cosine)
                shared = sorted(set(ocp) & set(other))
                if not shared:
                    continue
                ocp_on = mean_std([ocp[s] for s in shared])[0]
                other_on = mean_std([other[s] for s in shared])[0]
                compared += 1
                lower += ocp_on < other_on
                if other_on <= ORTHOGONAL_COS:
                    also.append(f"{label}{'†' if label == 'FedGH' else ''}")
                parts_cos.append(f"{label}{'†' if label == 'FedGH' else ''} {other_on:+.3f} (FedOCP {ocp_on:+.3f}, "
                                 f"{plural(len(shared), 'seed')})")
            near = ("orthogonal or more separated" if ocp_mean <= ORTHOGONAL_COS
                    else "not orthogonal (mean cosine above the threshold)")
            lines.append(f"- {ds} {sp} ({ct} test): FedOCP {ocp_mean:+.3f} ({len(ocp)} of {n_seeds} seeds) → **{near}**"
                         + (f" (so are {', '.join(also)}: the threshold alone does not set FedOCP apart)"
                            if also else "")
                         + (f"; more separated than {lower} of {compared} baselines: " + "; ".join(parts_cos)
                            if compared else "") + ".")
    moved = []  # which mechanism makes the separation: each ablation's cosine against FedOCP's, same seeds
    for label in ABLATIONS:
        found = pairwise(label, "FedOCP", cosine)
        if found:
            moved.append(f"- {label}: " + "; ".join(f"{s} {_diff_text(d, scale=1.0, unit='', digits=3)}"
                                                    for s, d in found)
                         + (f"; removing it costs {worth_of[label]} of accuracy (above)" if label in worth_of else ""))
    if moved:
        lines += ["", "Which mechanism separates the prototypes: each ablation's last-round mean cosine minus "
                  "FedOCP's, over the seeds both have (a positive difference: the mechanism removed was separating "
                  "them).", ""]
        lines += moved
    if sweep_verdicts:
        lines += ["", "Sweep (one key at a time, against the default on the same seeds):", ""] + sweep_verdicts
    both = []
    for ds in datasets:  # the two protocols side by side, where both were run
        for sp in splits:
            for label in per_ds[ds]:
                by_ct = {ct: [a for r in _cells(main, ds, sp, ct, label) if (a := best(r)) is not None]
                         for ct in CLIENT_TESTS}
                if all(by_ct.values()):
                    both.append(f"- {ds} {sp} {label}: local test {100 * mean_std(by_ct['local'])[0]:.2f} vs "
                                 f"shared test {100 * mean_std(by_ct['shared'])[0]:.2f} (best round, %)")
    if both:
        lines += ["", "Evaluation protocols side by side (not a verdict: the local test is the paper's):", ""] + both
    if verify:
        lines += ["", "## Re-run check", ""] + verify
    lines.append("")
    return "\n".join(lines + failed_runs_section(results))


def _sweep_bench(p: argparse.ArgumentParser, text: str, protocol: str) -> tuple[str, str, str]:
    """``"DATA SET/SPLIT"`` (the split may hold a ``/``) → (data set, split, ``protocol``);
    otherwise ``parser.error`` naming the known ones."""
    ds, _, sp = text.partition("/")
    if ds not in DATASETS or sp not in SPLITS:
        p.error(f"--sweep-bench takes DATASET/SPLIT with a data set of {list(DATASETS)} and a split of "
                f"{list(SPLITS)}; got {text!r}")
    return ds, sp, protocol


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/repro-fedocp", help="grid folder (results.jsonl, runs/)")
    p.add_argument("--report", default=None, help="the report (default: OUT/report.md; the committed "
                   "one, benchmarks/fedocp.md, is replaced only when named here)")
    p.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds per cell (default {ROUNDS}: the CPU plan)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--train-samples", type=int, default=TRAIN_SAMPLES,
                   help=f"stratified training subset (0 = all; default {TRAIN_SAMPLES:,}: the CPU plan)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--group", default="htfe4-cpu", help="[model] group (a named group)")
    p.add_argument("--server-epochs", type=int, default=0,
                   help="server epochs of FedTGP/FedOCP/FedGH/FedORGP (0 = theirs)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--datasets", default="CIFAR-10",
                   help=f"comma-separated, of {list(DATASETS)} (default CIFAR-10; the others extend the records)")
    p.add_argument("--splits", default=",".join(SPLITS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--extension-methods", default=",".join(EXTENSION_METHODS),
                   help="the methods a data set after the first in --datasets runs (default: the baselines and "
                        "FedOCP); the first data set runs --methods")
    p.add_argument("--sweep-bench", default="CIFAR-10/Dir(0.1)",
                   help="DATASET/SPLIT of the sweep, under the first --client-test protocol")
    p.add_argument("--sweep-keys", default=",".join(SWEEPS), help="the keys to sweep (default: all)")
    p.add_argument("--sweep-extended", action="store_true", help="also the extended values of each key")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--data-dir", default="", help="default: $FEDFLEET_DATA, then ../shared/data")
    p.add_argument("--client-test", default="local",
                   help="evaluation protocol(s), comma-separated: local (each device's held-out 25 %%, the paper's), "
                        "shared (the shared test split)")
    p.add_argument("--tiny", action="store_true", help="1 seed, 5 rounds × 5 local epochs, 4 clients, 400 samples, "
                                                       "MNIST Dir(0.1), FedOCP and FedProto, both protocols, 5 server "
                                                       "epochs, a tau_server sweep (a smoke run: 6 cells, a few "
                                                       "minutes)")
    p.add_argument("--estimate-only", action="store_true", help="run the first missing cell, print the estimate")
    p.add_argument("--verify", type=int, default=0, metavar="K", help="re-run K recorded cells and compare")
    p.add_argument("--report-only", action="store_true", help="write the report from OUT/results.jsonl")
    a = p.parse_args(argv)
    if a.report is None:  # the committed report is replaced only when named
        a.report = str(Path(a.out) / "report.md")
    if a.tiny:
        # 5 × 5 epochs: with 2 rounds of 1 epoch (3 SGD steps a round on ~100 samples) no model learns
        # anything, and neither protocol can tell a method from chance
        a.seeds, a.rounds, a.epochs, a.clients, a.train_samples, a.server_epochs = "0", 5, 5, 4, 400, 5
        a.datasets, a.splits, a.methods, a.client_test = "MNIST", "Dir(0.1)", "FedOCP,FedProto", "local,shared"
        a.sweep_bench, a.sweep_keys, a.sweep_extended, a.no_sweep = "MNIST/Dir(0.1)", "tau_server", False, False
    data_dir = default_data_dir(ROOT, a.data_dir)
    seeds = int_list(p, "--seeds", a.seeds)
    datasets = name_list(p, "--datasets", a.datasets, DATASETS)
    splits = name_list(p, "--splits", a.splits, SPLITS)
    methods = name_list(p, "--methods", a.methods, METHODS)
    extension_methods = name_list(p, "--extension-methods", a.extension_methods, METHODS)
    client_tests = name_list(p, "--client-test", a.client_test, CLIENT_TESTS)
    if not client_tests:
        p.error("--client-test needs at least one protocol")
    if (a.rounds < 1 or a.epochs < 1 or a.clients < 1 or a.workers < 1 or a.train_samples < 0 or a.verify < 0
            or a.server_epochs < 0 or not a.lr > 0):
        p.error("--rounds, --epochs, --clients, --workers must be >= 1, --train-samples, --server-epochs and "
                "--verify >= 0, --lr > 0")
    sweep = None if a.no_sweep else _sweep_bench(p, a.sweep_bench, client_tests[0])
    sweep_values = sweep_plan(name_list(p, "--sweep-keys", a.sweep_keys, SWEEPS), extended=a.sweep_extended,
                              server_epochs=a.server_epochs) if sweep else None
    check_out_dir(p, a.out, report_only=a.report_only, report=a.report, estimate_only=a.estimate_only,
                  verify=a.verify)
    out = Path(a.out)
    settings = {"rounds": a.rounds, "epochs": a.epochs, "clients": a.clients, "train_samples": a.train_samples,
                "lr": a.lr, "group": a.group, "server_epochs": a.server_epochs}
    jobs = make_jobs(datasets, splits, methods_per_dataset(datasets, methods, extension_methods), seeds,
                     client_tests, sweep=sweep, sweep_values=sweep_values,
                     data_dir=data_dir, **settings)
    wall, verify_lines = None, []
    commit = code_commit(ROOT)
    if not a.report_only:
        def show(r: dict) -> None:
            print(f"{r['key']}: " + (r["error"] if "error" in r else
                                     f"client acc {_client_figure(r.get('final', {}))} "
                                     f"({r['seconds']:.0f} s)"), flush=True)

        wall = run_with_estimate(jobs, out, workers=a.workers, estimate_only=a.estimate_only, on_result=show,
                                 note="cells differ: CIFAR-10 costs more", stamp={"commit": commit})
        if a.estimate_only:
            return 0  # an estimate leaves the committed report as it is
        if a.verify:
            verify_lines = verify_records(jobs, out, a.verify, workers=a.workers, commit=commit,
                                          headline=lambda r: _client_figure(r.get("final", {})))
    else:
        check_report_records(jobs, out)  # the report describes these options: the records must be theirs
    verify_lines = verify_lines or earlier_verify(out)  # a --report-only keeps the last re-run check
    attached = attach_round_series(out)
    if attached:
        print(f"{attached} records given their rounds from their run folders")
    results = load_results(out)
    text = report(results, out=out, datasets=datasets, splits=splits, methods=methods, seeds=seeds,
                  settings=settings, wall_s=wall, commit=commit, verify=verify_lines, client_tests=client_tests,
                  sweep=sweep, sweep_values=sweep_values, extension_methods=extension_methods)
    cmd = " ".join(shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    text = text.replace("\n## Protocol", f"\nCommand (records and report): `python tools/reproduce_fedocp.py {cmd}`\n\n"
                        "## Protocol", 1)
    Path(a.report).parent.mkdir(parents=True, exist_ok=True)
    Path(a.report).write_text(text, encoding="utf-8")
    print(f"wrote {a.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(script_exit(main))
