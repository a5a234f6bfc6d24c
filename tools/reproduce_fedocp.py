"""FedOCP on a model-heterogeneous fleet, with FedProto, FedGH, FedTGP and FedOCP's ablations.

The protocol of SPECS.md §3.1 (FedOCP seed + HtFLlib/FedORGP conventions): 20 clients, all
sampled each round, a model group of ≥ 4 architectures (``[model] group``, default ``htfe4-cpu``:
lightcnn, resnet8, mobilenet_v2_small, inception_small, device i runs member i mod 4), SGD lr 0.01,
batch 32, 1 local epoch; accuracy = the devices' own models on their **local test sets**
(``[data] client_test = "local"``: 25 % of each client's shard held out per class before training,
the 75/25 split of HtFLlib/FedORGP, SPECS §3.1 and §3.5), as Σ correct / Σ test samples over the
devices (``client_accuracy_weighted``, HtFLlib's ``serverbase.evaluate``), best round and last
round. Every method here is prototype-only: no global model exists. Grid (one real federation per
cell, :func:`broker_server.simulate.simulate`, run by :mod:`broker_server.experiments`):

- data: CIFAR-10, Fashion-MNIST, MNIST from ``../shared/data`` (CIFAR-100, Flowers102 and
  Tiny-ImageNet of the paper are not there; SVHN has 50 images offline: left out);
- splits: Dirichlet α = 0.1 (the likely "practical" setting, SPECS §3.1) and the pathological
  2 classes per client (``partition = "classes"``);
- methods: FedProto (``fedproto``, λ = 10 as HtFLlib's scripts), FedGH, FedTGP, FedOCP, and the
  ablations of SPECS §3.6, one mechanism removed at a time: no orthogonal init, no server
  contrastive loss (class means instead), no client orthogonality loss, no client contrastive loss;
- per method: client accuracy, the mean inter-class cosine similarity of the global prototypes
  (metric ``global_prototype_cosine`` of the last round; FedGH has none: its head rows' cosine,
  ``head_row_cosine``, marked †), upload and download bytes per client per round (device links,
  MQTT framing included) and the update's extras bytes;
- 3 seeds; mean ± std (population).

- evaluation protocol (``--client-test``, default ``local``): ``local`` is the paper's; ``shared``
  scores every device on ≤ 2,000 images of the shared test split (all classes) instead, where
  under Dir(0.1) or 2 classes per client a personalised model scores near chance by construction.
  Each record and report column names its protocol, so the two are never mixed; ``--tiny`` runs
  both, for FedOCP and FedProto, to show the difference.

The paper reports +6.8 pp over FedORGP on CIFAR-100 (HtFE8, practical); CIFAR-100 is not in
``../shared/data`` and FedORGP is not built here, so the report states what it measured on the
sets it has, and no verdict on that number.

Resumable: each finished cell is appended to ``OUT/results.jsonl`` and skipped when present (a
failed one runs again). Before the grid the first missing cell runs alone and its time gives a
CPU estimate for the rest (``--estimate-only`` stops there). Shrink knobs: ``--rounds``,
``--clients``, ``--train-samples``, ``--epochs``, ``--seeds``, ``--datasets``, ``--splits``,
``--methods``, ``--group``, ``--server-epochs``. ``--verify K`` re-runs K recorded cells and reports
whether they reproduce the recorded accuracy.

Usage::

    python tools/reproduce_fedocp.py --out runs/repro-fedocp --report benchmarks/fedocp.md
    python tools/reproduce_fedocp.py --tiny --out /tmp/fedocp-tiny --report /tmp/fedocp-tiny.md
    python tools/reproduce_fedocp.py --out runs/repro-fedocp --report benchmarks/fedocp.md --report-only
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker_server.experiments import (  # noqa: E402
    Job,
    code_commit,
    default_data_dir,
    failed_runs_section,
    int_list,
    load_results,
    mean_std,
    name_list,
    pm,
    read_metrics,
    records_cost,
    run_with_estimate,
    verify_records,
)

#: method label → (registered algorithm, [algorithm] table). Baselines: SPECS §6 defaults.
METHODS: dict[str, tuple[str, dict]] = {
    "FedProto": ("fedproto", {"lambda_proto": 10.0}),
    "FedGH": ("fedgh", {}),
    "FedTGP": ("fedtgp", {}),
    "FedOCP": ("fedocp", {}),
    "FedOCP no orthogonal init": ("fedocp", {"orth_init": False}),
    "FedOCP no server contrastive": ("fedocp", {"server_contrastive": False}),
    "FedOCP no client orthogonality": ("fedocp", {"client_orthogonality": False}),
    "FedOCP no client contrastive": ("fedocp", {"client_contrastive": False}),
}
ABLATIONS = [m for m in METHODS if m.startswith("FedOCP no")]
#: algorithms whose server trains for ``server_epochs`` (the shrink knob applies to them)
SERVER_TRAINED = ("fedtgp", "fedocp", "fedgh")

DATASETS = {"CIFAR-10": "cifar10", "Fashion-MNIST": "fashion_mnist", "MNIST": "mnist"}
SPLITS: dict[str, dict] = {
    "Dir(0.1)": {"partition": "dirichlet", "alpha": 0.1},
    "2 classes/client": {"partition": "classes", "classes_per_client": 2},
}
#: The paper's claim (SPECS §3.6), on a data set this machine does not have.
CLAIM_GAIN_PP = 6.8


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
    held-out 25 % of its shard, SPECS §3.5) or ``"shared"`` (≤ 2,000 images of the test split)."""
    data = {"dataset": DATASETS[dataset], "clients": clients, "train_samples": train_samples, "min_samples": 1,
            "client_test": client_test, **SPLITS[split]}
    if data_dir:
        data["data_dir"] = data_dir
    algo = dict(params)
    if server_epochs and algorithm in SERVER_TRAINED and not (algorithm == "fedocp"
                                                             and params.get("server_contrastive") is False):
        algo.setdefault("server_epochs", server_epochs)
    return {
        "run": {"name": f"fedocp-{_slug(dataset)}", "seed": seed, "rounds": rounds},
        "data": data,
        "train": {"algorithm": algorithm, "local_epochs": epochs, "batch_size": 32, "lr": lr, "momentum": 0.0},
        "server": {"participation_rate": 1.0, "quorum": 1, "round_deadline_s": 3600.0, "join_timeout_s": 600.0,
                   "client_eval": True, "client_eval_max": SHARED_EVAL_MAX if client_test == "shared" else 0},
        "broker": {"kind": "auto"},
        "agents": {"train_slots": 1, "torch_threads": 1},
        "model": {"name": "lightcnn", "feature_dim": 64, "group": group},
        "algorithm": algo,
    }


def make_jobs(datasets: list[str], splits: list[str], methods: list[str], seeds: list[int],
              client_tests: tuple[str, ...] | list[str] = ("local",), **kw) -> list[Job]:
    """The grid's cells (one per seed, data set, split, evaluation protocol and method)."""
    return [Job(f"main/{_slug(ds)}/{_slug(sp)}/{ct}/{_slug(label)}/s{seed}",
                job_config(ds, sp, METHODS[label][0], METHODS[label][1], seed, client_test=ct, **kw),
                tags={"grid": "main", "dataset": ds, "split": sp, "client_test": ct, "method": label, "seed": seed})
            for seed in seeds for ds in datasets for sp in splits for ct in client_tests for label in methods]


def _client_figure(m: dict) -> float | None:
    """A metrics line's client accuracy: Σ correct / Σ test samples over the devices
    (``client_accuracy_weighted``, HtFLlib's), else the unweighted mean (a line without it)."""
    a = m.get("client_accuracy_weighted", m.get("client_accuracy_mean"))
    return None if a is None else float(a)


def client_accuracy(out: Path, r: dict, which: str = "best") -> float | None:
    """The devices' own accuracy (:func:`_client_figure`): the best round's (``which="best"``) or
    the last round's."""
    if which == "last":
        return _client_figure(r.get("final", {}))
    accs = [a for m in read_metrics(out, r["key"]) if (a := _client_figure(m)) is not None]
    return max(accs) if accs else None


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


def report(results: dict[str, dict], *, out: Path, datasets: list[str], splits: list[str], methods: list[str],
           seeds: list[int], settings: dict, wall_s: float | None, commit: str, verify: list[str],
           client_tests: tuple[str, ...] | list[str] = ("local",)) -> str:
    ok = [r for r in results.values() if "error" not in r and r.get("grid") == "main"]
    columns = [(sp, ct) for sp in splits for ct in client_tests]
    lines = ["# FedOCP on a model-heterogeneous fleet: reproduction with baselines and ablations", "",
             f"Generated by `tools/reproduce_fedocp.py` at commit `{commit}`; every number below was measured in "
             "the records this report reads (`results.jsonl`).", "",
             "## Protocol", "",
             f"- {settings['clients']} clients, all sampled each round, {settings['rounds']} rounds × "
             f"{settings['epochs']} local epoch(s), SGD lr {settings['lr']}, batch 32; model group "
             f"`{settings['group']}` (device i runs member i mod n); training subset "
             f"{settings['train_samples'] or 'all'} samples; server epochs {settings['server_epochs'] or 'default'} "
             f"(FedTGP, FedOCP, FedGH); seeds {seeds}; mean ± std (population) over seeds.",
             "- Accuracy: each device's own model (FedProto, FedTGP: nearest global prototype; FedGH, FedOCP: "
             "the own head), Σ correct / Σ test samples over the devices (HtFLlib's), best round (HtFLlib's "
             "convention) and last round, under the protocol each column names: **local** = each device's "
             "local test set, 25 % of its shard held out per class before training (HtFLlib/FedORGP 75/25, "
             "SPECS §3.5: the paper's); **shared** = ≤ 2,000 images of the shared test split (all classes), "
             "where a personalised model under label skew scores low by construction.",
             "- Splits: Dirichlet(0.1) per class over clients; '2 classes/client': client i holds classes 2i, "
             "2i+1 mod 10, each class split evenly among its holders.", ""]
    if wall_s is not None:
        lines += [f"Wall time of this invocation: {wall_s / 60:.1f} min on {platform.machine()} "
                  f"({os.cpu_count()} CPUs).", ""]
    lines += [records_cost(results), ""]
    for ds in datasets:
        lines += [f"## {ds}", "", "| method | " + " | ".join(f"{sp}, {ct} test: best / last (%)" for sp, ct in columns)
                  + " | global prototype cosine (per column) |", "|---|" + "---|" * (len(columns) + 1)]
        for label in methods:
            cells, cos = [], []
            for sp, ct in columns:
                rs = [r for r in ok if r["dataset"] == ds and r["split"] == sp and r["method"] == label
                      and _protocol(r) == ct]
                best = [a for r in rs if (a := client_accuracy(out, r)) is not None]
                last = [a for r in rs if (a := client_accuracy(out, r, "last")) is not None]
                cells.append(f"{pm(best)} / {pm(last)}" if rs else "–")
                cs = [prototype_cosine(out, r) for r in rs]
                vals = [c for c, _ in cs if c is not None]
                cos.append(pm(vals, 1.0, 3) + ("†" if any(h for _, h in cs) else "") if vals else "–")
            lines.append(f"| {label} | " + " | ".join(cells) + " | " + "; ".join(cos) + " |")
        lines.append("")
    lines += ["† FedGH broadcasts a head, not prototypes: the cosine between its head's class rows.", "",
              "## Bytes per client per round (device links, MQTT framing included)", "",
              "| method | up B | down B | update extras B | update model tensors B |", "|---|---|---|---|---|"]
    for label in methods:
        rs = [r for r in ok if r["method"] == label]
        if rs:
            fields = [r.get("update_field_bytes_mean", {}) for r in rs]
            extras = mean_std([sum(v for k, v in f.items() if k.startswith("extras.")) for f in fields])[0]
            tensors = mean_std([float(f.get("tensors", 0.0)) for f in fields])[0]
            lines.append(f"| {label} | {mean_std([r['up_bytes_per_client_round'] for r in rs])[0]:,.0f} | "
                         f"{mean_std([r['down_bytes_per_client_round'] for r in rs])[0]:,.0f} | {extras:,.0f} | "
                         f"{tensors:,.0f} |")
    lines += ["", "(An update's model tensors field is an empty list, 1 byte: no parameter leaves a device.)", "",
              "## What the reproduction shows", ""]
    gains = []
    for ds in datasets:
        for sp, ct in columns:
            means = {}
            for label in methods:
                acc = [a for r in ok if r["dataset"] == ds and r["split"] == sp and r["method"] == label
                       and _protocol(r) == ct and (a := client_accuracy(out, r)) is not None]
                if acc:
                    means[label] = mean_std(acc)[0]
            base = {k: v for k, v in means.items() if k in ("FedProto", "FedGH", "FedTGP")}
            if "FedOCP" in means and base:
                best_base = max(base, key=lambda k: base[k])
                gains.append(100 * (means["FedOCP"] - base[best_base]))
                lines.append(f"- {ds} {sp} ({ct} test): FedOCP {100 * means['FedOCP']:.2f} vs the best baseline "
                             f"{best_base} "
                             f"{100 * base[best_base]:.2f} ({gains[-1]:+.2f} pp); ablations: "
                             + ", ".join(f"{k.removeprefix('FedOCP ')} {100 * (v - means['FedOCP']):+.2f} pp"
                                         for k, v in means.items() if k in ABLATIONS))
    if not gains:
        lines.append("- no FedOCP/baseline pair on record yet.")
    for ds in datasets:  # the two protocols side by side, where both were run
        for sp in splits:
            for label in methods:
                by = {ct: [a for r in ok if r["dataset"] == ds and r["split"] == sp and r["method"] == label
                           and _protocol(r) == ct and (a := client_accuracy(out, r)) is not None]
                      for ct in CLIENT_TESTS}
                if all(by.values()):
                    lines.append(f"- {ds} {sp} {label}: local test {100 * mean_std(by['local'])[0]:.2f} vs shared "
                                 f"test {100 * mean_std(by['shared'])[0]:.2f} (best round, %)")
    lines.append(f"- The paper's +{CLAIM_GAIN_PP} pp over FedORGP is on CIFAR-100 (HtFE8), which is not in "
                 "../shared/data, against FedORGP, which is not built here: not checked.")
    if verify:
        lines += ["", "## Re-run check", ""] + verify
    lines.append("")
    return "\n".join(lines + failed_runs_section(results))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/repro-fedocp", help="grid folder (results.jsonl, runs/)")
    p.add_argument("--report", default=None, help="the report (default: benchmarks/fedocp.md; a smoke run's "
                   "goes to OUT/report.md, so it never replaces the committed one)")
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--train-samples", type=int, default=0, help="stratified training subset (0 = all)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--group", default="htfe4-cpu", help="[model] group (a named group)")
    p.add_argument("--server-epochs", type=int, default=0, help="server epochs of FedTGP/FedOCP/FedGH (0 = theirs)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument("--splits", default=",".join(SPLITS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--data-dir", default="", help="default: $FEDFLEET_DATA, then ../shared/data")
    p.add_argument("--client-test", default="local",
                   help="evaluation protocol(s), comma-separated: local (each device's held-out 25 %%, the paper's), "
                        "shared (the shared test split)")
    p.add_argument("--tiny", action="store_true", help="1 seed, 5 rounds × 5 local epochs, 4 clients, 400 samples, "
                                                       "MNIST Dir(0.1), FedOCP and FedProto, both protocols, 5 server "
                                                       "epochs (a smoke run: 4 cells, a few minutes)")
    p.add_argument("--estimate-only", action="store_true", help="run the first missing cell, print the estimate")
    p.add_argument("--verify", type=int, default=0, metavar="K", help="re-run K recorded cells and compare")
    p.add_argument("--report-only", action="store_true", help="write the report from OUT/results.jsonl")
    a = p.parse_args(argv)
    if a.report is None:
        a.report = str(Path(a.out) / "report.md") if a.tiny else str(ROOT / "benchmarks" / "fedocp.md")
    if a.tiny:
        # 5 × 5 epochs: with 2 rounds of 1 epoch (3 SGD steps a round on ~100 samples) no model learns
        # anything, and neither protocol can tell a method from chance
        a.seeds, a.rounds, a.epochs, a.clients, a.train_samples, a.server_epochs = "0", 5, 5, 4, 400, 5
        a.datasets, a.splits, a.methods, a.client_test = "MNIST", "Dir(0.1)", "FedOCP,FedProto", "local,shared"
    data_dir = default_data_dir(ROOT, a.data_dir)
    seeds = int_list(p, "--seeds", a.seeds)
    datasets = name_list(p, "--datasets", a.datasets, DATASETS)
    splits = name_list(p, "--splits", a.splits, SPLITS)
    methods = name_list(p, "--methods", a.methods, METHODS)
    client_tests = name_list(p, "--client-test", a.client_test, CLIENT_TESTS)
    out = Path(a.out)
    settings = {"rounds": a.rounds, "epochs": a.epochs, "clients": a.clients, "train_samples": a.train_samples,
                "lr": a.lr, "group": a.group, "server_epochs": a.server_epochs}
    jobs = make_jobs(datasets, splits, methods, seeds, client_tests, data_dir=data_dir, **settings)
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
    results = load_results(out)
    text = report(results, out=out, datasets=datasets, splits=splits, methods=methods, seeds=seeds,
                  settings=settings, wall_s=wall, commit=commit, verify=verify_lines, client_tests=client_tests)
    Path(a.report).parent.mkdir(parents=True, exist_ok=True)
    Path(a.report).write_text(text, encoding="utf-8")
    print(f"wrote {a.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
