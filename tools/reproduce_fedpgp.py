"""FedPGP under label skew, with its baselines and the controls that remove one mechanism at a time.

The protocol of the FedPGP seed (Liu, Fan, Zhang, Neurocomputing 2026; SPECS.md §2.3): 20 clients,
70 % sampled each round, Dirichlet label skew, final accuracy and rounds to a target accuracy.
Grid (one real federation per cell, :func:`broker_server.simulate.simulate`, run by
:mod:`broker_server.experiments`):

- data: MNIST, Fashion-MNIST, CIFAR-10 from ``../shared/data`` (SVHN has 50 images offline:
  left out; the paper's 12 settings become 9 here);
- splits: Dirichlet α = 0.1, α = 0.5, and the pathological 2 classes per client
  (``partition = "classes"``);
- methods: FedAvg, FedProx, FedProto (RethinkFL variant, the model averaged, so its global model
  is tested like the others), MOON, FedLC, FedNTD, FedTGP (prototype-only: accuracy = the
  devices' own models on the test split), FedPGP, and FedPGP's three controls:
  *no projection* (the pool as a loss term, g + g_p), *prototypes unused* (uploaded, pooled,
  broadcast, never applied: FedAvg's training with FedPGP's traffic), *projection every step*
  (onto ⟨g, g_p⟩ = 0 whatever the sign);
- a sweep of every FedPGP key the paper does not fix (mix size, G, layer, g_p per step or per
  round, pool weighting, projection unit) on one setting (``--sweep-bench``), each value a run,
  wide enough to look for collapse;
- 3 seeds; mean ± std (population).

Resumable: each finished cell is appended to ``OUT/results.jsonl`` and skipped when present (a
failed one runs again). A grid starts on every worker at once; a fresh one prints a CPU estimate
for the rest when its first cell finishes (``--estimate-only`` runs that cell alone and stops), a
resumed one takes the mean time of its recorded cells. Shrink knobs: ``--rounds``,
``--clients``, ``--train-samples`` (a class-stratified subset), ``--epochs``, ``--seeds``,
``--datasets``, ``--splits``, ``--methods``, ``--no-sweep``. ``--verify K`` re-runs K recorded cells
into a temporary folder inside ``OUT`` (removed after) and reports whether they reproduce the
recorded final accuracy.

Usage::

    python tools/reproduce_fedpgp.py --out runs/repro-fedpgp --report benchmarks/fedpgp.md
    python tools/reproduce_fedpgp.py --tiny --out /tmp/fedpgp-tiny --report /tmp/fedpgp-tiny.md
    python tools/reproduce_fedpgp.py --out runs/repro-fedpgp --report benchmarks/fedpgp.md --report-only
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
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

#: method label → (registered algorithm, [algorithm] table). Baseline keys: SPECS.md §6 defaults.
METHODS: dict[str, tuple[str, dict]] = {
    "FedAvg": ("fedavg", {}),
    "FedProx": ("fedprox", {"mu": 0.01}),
    "FedProto": ("fedproto-avg", {}),
    "MOON": ("moon", {"mu": 1.0, "tau": 0.5}),
    "FedLC": ("fedlc", {"tau": 1.0}),
    "FedNTD": ("fedntd", {"beta": 1.0, "tau": 1.0}),
    "FedTGP": ("fedtgp", {}),
    "FedPGP": ("fedpgp", {}),
    "FedPGP no projection (g+g_p)": ("fedpgp", {"projection": "add"}),
    "FedPGP prototypes unused": ("fedpgp", {"projection": "unused"}),
    "FedPGP project every step": ("fedpgp", {"projection": "always"}),
}
BASELINES = ["FedAvg", "FedProx", "FedProto", "MOON", "FedLC", "FedNTD", "FedTGP"]
CONTROLS = ["FedPGP no projection (g+g_p)", "FedPGP prototypes unused", "FedPGP project every step"]

#: FedPGP keys the paper does not fix, and the values swept (default first). The light CNN's
#: layers: "" = the 64-d feature, "fc" = the same before its ReLU, "pool2" = the 32×(S/4)² conv map.
SWEEPS: dict[str, list] = {
    "mix_size": [8, 2, 32, 128],
    "pool_groups": [4, 1, 16, 64],
    "proto_layer": ["", "fc", "pool2"],
    "gp_every": ["step", "round"],
    "pool_weighting": ["count", "uniform"],
    "projection_unit": ["module", "tensor"],
}

DATASETS = {"MNIST": "mnist", "Fashion-MNIST": "fashion_mnist", "CIFAR-10": "cifar10"}
SPLITS: dict[str, dict] = {
    "Dir(0.1)": {"partition": "dirichlet", "alpha": 0.1},
    "Dir(0.5)": {"partition": "dirichlet", "alpha": 0.5},
    "2 classes/client": {"partition": "classes", "classes_per_client": 2},
}
#: rounds-to-target thresholds (global accuracy), per data set [guess: the paper's targets are not in the seed]
TARGETS = {"MNIST": 0.90, "Fashion-MNIST": 0.70, "CIFAR-10": 0.35}
#: The paper's claims (SPECS §2.4).
CLAIM_GAIN_PP = 5.64
CLAIM_BEST = (10, 12)


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in ".-" else "_" for ch in text).strip("_")


def job_config(dataset: str, split: str, algorithm: str, params: dict, seed: int, *, rounds: int, epochs: int,
               clients: int, train_samples: int, participation: float, lr: float, data_dir: str) -> dict:
    """The configuration of one run (as parsed TOML)."""
    data = {"dataset": DATASETS[dataset], "clients": clients, "train_samples": train_samples, "min_samples": 1,
            **SPLITS[split]}
    if data_dir:
        data["data_dir"] = data_dir
    return {
        "run": {"name": f"fedpgp-{_slug(dataset)}", "seed": seed, "rounds": rounds},
        "data": data,
        "train": {"algorithm": algorithm, "local_epochs": epochs, "batch_size": 32, "lr": lr, "momentum": 0.9,
                  "weight_decay": 5e-4},
        "server": {"participation_rate": participation, "quorum": 1, "round_deadline_s": 1800.0,
                   "join_timeout_s": 300.0, "client_eval_max": 2000},
        "broker": {"kind": "auto"},
        "agents": {"train_slots": 1, "torch_threads": 1},
        "algorithm": dict(params),
    }


def make_jobs(datasets: list[str], splits: list[str], methods: list[str], seeds: list[int], *, sweep: str | None,
              **kw) -> list[Job]:
    """The grid's cells (main grid, then the sweep on ``sweep`` = ``"dataset/split"``, split at its
    first ``/``)."""
    jobs = []
    for seed in seeds:
        for ds in datasets:
            for sp in splits:
                for label in methods:
                    algo, params = METHODS[label]
                    jobs.append(Job(f"main/{_slug(ds)}/{_slug(sp)}/{_slug(label)}/s{seed}",
                                    job_config(ds, sp, algo, params, seed, **kw),
                                    tags={"grid": "main", "dataset": ds, "split": sp, "method": label, "seed": seed}))
        if sweep:
            ds, _, sp = sweep.partition("/")  # the split may hold a "/" ("2 classes/client")
            for key, values in SWEEPS.items():
                for v in values[1:]:  # the default is the main grid's FedPGP cell
                    jobs.append(Job(f"sweep/{_slug(ds)}/{_slug(sp)}/{key}={_slug(str(v)) or 'features'}/s{seed}",
                                    job_config(ds, sp, "fedpgp", {key: v}, seed, **kw),
                                    tags={"grid": "sweep", "dataset": ds, "split": sp, "method": "FedPGP",
                                          "sweep_key": key, "value": v, "seed": seed}))
    return jobs


def _by_seed(main: list[dict], ds: str, sp: str, label: str) -> dict[int, float]:
    """seed → final accuracy of ``label``'s records in setting (``ds``, ``sp``)."""
    return {int(r["seed"]): a for r in main if r["dataset"] == ds and r["split"] == sp and r["method"] == label
            and (a := _acc(r)) is not None}


def _seed_matched(main: list[dict], ds: str, sp: str, labels: list[str]) -> dict[str, float]:
    """label → mean final accuracy over the seeds that every label of ``labels`` on record in
    setting (``ds``, ``sp``) shares (labels with no record there left out; ``{}`` when they share
    none), so a partly run grid compares like with like."""
    by_seed = {label: v for label in labels if (v := _by_seed(main, ds, sp, label))}
    shared = set.intersection(*(set(v) for v in by_seed.values())) if by_seed else set()
    return {label: mean_std([v[sd] for sd in sorted(shared)])[0] for label, v in by_seed.items()} if shared else {}


def _paired(main: list[dict], datasets: list[str], splits: list[str], a: str, b: str) -> list[list[float]]:
    """Per setting (data set × split, in report order, settings where both have a seed), the
    paired differences ``a`` − ``b`` of final accuracy on each seed both have, in pp."""
    out = []
    for ds in datasets:
        for sp in splits:
            acc_a, acc_b = _by_seed(main, ds, sp, a), _by_seed(main, ds, sp, b)
            shared = sorted(set(acc_a) & set(acc_b))
            if shared:
                out.append([100.0 * (acc_a[sd] - acc_b[sd]) for sd in shared])
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _acc(r: dict) -> float | None:
    a = r.get("final", {}).get("accuracy")
    return None if a is None else float(a)


def report(results: dict[str, dict], *, out: Path, datasets: list[str], splits: list[str], methods: list[str],
           seeds: list[int], settings: dict, wall_s: float | None, commit: str, verify: list[str]) -> str:
    ok = [r for r in results.values() if "error" not in r]
    lines = ["# FedPGP under label skew: reproduction with baselines and controls", "",
             f"Generated by `tools/reproduce_fedpgp.py` at commit `{commit}`; every number below was measured in "
             "the records this report reads (`results.jsonl`).", "",
             "## Protocol", "",
             f"- {settings['clients']} clients, {settings['participation']:.0%} sampled per round, "
             f"{settings['rounds']} rounds × {settings['epochs']} local epochs, SGD lr {settings['lr']}, momentum "
             f"0.9, weight decay 5e-4, batch 32; training subset {settings['train_samples'] or 'all'} samples "
             f"(stratified); seeds {seeds}; mean ± std (population) over seeds.",
             "- Model: the light CNN (two convs, a 64-d feature, a linear head), from scratch. The paper's model, "
             "rounds, local epochs and lr are not in the seed (SPECS §2.3).",
             "- Splits: Dirichlet(α) per class over clients; '2 classes/client': client i holds classes 2i, 2i+1 "
             "mod 10, each class split evenly among its holders. SVHN is left out (50 images offline).",
             "- Accuracy: the global model on the test split after the last round (FedTGP: the mean of the "
             "devices' nearest-prototype accuracy on ≤ 2,000 images of the shared test split: a device "
             "that holds 2 classes is scored on all 10, so its figure is not comparable with the global "
             "models' and is low by construction; `[data] client_test = \"local\"` measures it on the "
             "device's own classes).", ""]
    if wall_s is not None:
        lines += [f"Wall time of this invocation: {wall_s / 60:.1f} min on {platform.machine()} "
                  f"({os.cpu_count()} CPUs).", ""]
    lines += [records_cost(results), "", numerics_line(results), ""]
    main = [r for r in ok if r.get("grid") == "main"]
    have = [d for d in DATASETS if any(r["dataset"] == d for r in main)]
    missing = [d for d in DATASETS if d not in have]
    if missing:
        lines += [f"**Scope: these records hold {', '.join(have) or 'no data set'}; {', '.join(missing)} "
                  "not run yet (the grid resumes where it stopped: run the script again with those "
                  "`--datasets`).** The verdicts below cover only the settings on record.", ""]
    stamped = sorted({str(r["commit"]) for r in ok if r.get("commit")})
    if stamped:
        lines += [f"Records made at commit(s) {', '.join(f'`{c}`' for c in stamped)}.", ""]
    best_count, settings_n = 0, 0
    for ds in datasets:
        target = TARGETS[ds]
        lines += [f"## {ds}", "", "| method | " + " | ".join(splits) + f" | rounds to {target:.0%} (per split) |",
                  "|---|" + "---|" * (len(splits) + 1)]
        for label in methods:
            cells, rtt = [], []
            for sp in splits:
                rs = [r for r in main if r["dataset"] == ds and r["split"] == sp and r["method"] == label]
                accs = [a for r in rs if (a := _acc(r)) is not None]
                partial = f" ({len(accs)} of {len(seeds)} seeds)" if rs and len(accs) < len(seeds) else ""
                cells.append(pm(accs, plain_single=True) + partial if rs else "–")
                hits = [cell_rounds_to_target(out, r["key"], target) for r in sorted(rs, key=lambda r: int(r["seed"]))]
                rtt.append(hits_text(hits) if rs else "–")
            lines.append(f"| {label} | " + " | ".join(cells) + " | " + "; ".join(rtt) + " |")
        for sp in splits:
            # a setting counts once FedPGP and FedAvg both have a seed; every method's mean is then
            # over the seeds that all methods on record there share (a partly run grid compares like
            # with like)
            means = _seed_matched(main, ds, sp, ["FedPGP", *BASELINES])
            if "FedPGP" in means and "FedAvg" in means:
                settings_n += 1
                best_count += int(max(means, key=lambda k: means[k]) == "FedPGP")
        lines += ["", f"Rounds to {target:.0%}: the first round whose global accuracy reached it, per seed "
                  f"in seed order; *never*: not within {settings['rounds']} rounds; "
                  f"*{NOT_RECORDED}*: the cell's rounds "
                  "are not recorded (a record made before records carried their rounds, whose run folder is gone).", ""]
    lines += ["## Bytes per client per round (device links, MQTT framing included)", "",
              "| method | up B | down B | update extras B |", "|---|---|---|---|"]
    for label in methods:
        rs = [r for r in main if r["method"] == label]
        if rs:
            extras = mean_std([sum(v for k, v in r.get("update_field_bytes_mean", {}).items()
                                   if k.startswith("extras.")) for r in rs])[0]
            lines.append(f"| {label} | {mean_std([r['up_bytes_per_client_round'] for r in rs])[0]:,.0f} | "
                         f"{mean_std([r['down_bytes_per_client_round'] for r in rs])[0]:,.0f} | {extras:,.0f} |")
    lines += ["", "## FedPGP's mechanism: how often the projection acts", "",
              "Per setting, mean over the seeds on record: the share of layer-steps whose batch gradient "
              "conflicted with the prototype gradient (⟨g, g_p⟩ < 0) and was projected, over all rounds "
              "and in the last round, and the global prototype pool broadcast in the last round.", "",
              "| setting | seeds | projected share, all rounds | last round | pool prototypes | pool B |",
              "|---|---|---|---|---|---|"]
    for ds in datasets:
        for sp in splits:
            rs = [r for r in main if r["dataset"] == ds and r["split"] == sp and r["method"] == "FedPGP"]
            if not rs:
                continue
            every = [_mean([m["pgp_projected_share"] for m in read_metrics(out, r["key"])
                            if m.get("pgp_projected_share") is not None]) for r in rs]
            every_known = [v for v in every if v is not None]
            last = [float(f["pgp_projected_share"]) for r in rs
                    if (f := r.get("final", {})).get("pgp_projected_share") is not None]
            size = [float(r["final"]["pgp_pool_size"]) for r in rs if r.get("final", {}).get("pgp_pool_size")]
            nbytes = [float(r["final"]["pgp_pool_bytes"]) for r in rs if r.get("final", {}).get("pgp_pool_bytes")]
            lines.append(f"| {ds} {sp} | {len(rs)} | "
                         + (pm(every_known, digits=1, plain_single=True) + " %" if every_known else NOT_RECORDED)
                         + (f" ({len(every_known)} of {len(rs)})" if every_known and len(every_known) < len(rs) else "")
                         + f" | {pm(last, digits=1, plain_single=True)} % | {pm(size, 1.0, 0, plain_single=True)} | "
                         f"{pm(nbytes, 1.0, 0, plain_single=True)} |")
    sweep = [r for r in ok if r.get("grid") == "sweep"]
    if sweep:
        swept_seeds = sorted({int(r["seed"]) for r in sweep})
        lines += ["", "## Sweep of FedPGP's unfixed keys", "",
                  f"On {sweep[0]['dataset']} {sweep[0]['split']}, one key at a time away from FedPGP's defaults. "
                  f"The default row is the main grid's FedPGP cell on the seeds the sweep has run ({swept_seeds}), "
                  "so every row of a key compares the same seeds. *Δ paired*: the value's accuracy minus the "
                  "default's on the same seed, mean ± std over the seeds both have (pp; the seeds' own spread, "
                  "which the accuracy column's std holds, cancels).", "",
                  "| key | value | accuracy | Δ paired (pp) | seeds |", "|---|---|---|---|---|"]
        ds, sp = sweep[0]["dataset"], sweep[0]["split"]
        default = {int(r["seed"]): a for r in main if r["dataset"] == ds and r["split"] == sp
                   and r["method"] == "FedPGP" and int(r["seed"]) in swept_seeds and (a := _acc(r)) is not None}
        for key, values in SWEEPS.items():
            for v in values:
                if v == values[0]:
                    by_seed = default
                else:
                    # records before the tag was renamed hold the swept key in "key"
                    by_seed = {int(r["seed"]): a for r in sweep if r.get("sweep_key", r["key"]) == key
                               and r["value"] == v and (a := _acc(r)) is not None}
                acc = list(by_seed.values())
                deltas = [100.0 * (a - default[seed]) for seed, a in by_seed.items() if seed in default]
                d_mean, d_std = mean_std(deltas)
                delta = ("–" if v == values[0] or not deltas else f"{d_mean:+.2f}" if len(deltas) == 1
                         else f"{d_mean:+.2f} ± {d_std:.2f}")
                lines.append(f"| {key} | {v!r}{' (default)' if v == values[0] else ''} | "
                             f"{pm(acc, plain_single=True)} | {delta} | {len(acc)} |")
    lines += ["", "## Verdicts", "",
              "Differences are paired: per setting and seed, a method's final accuracy minus the other's on the "
              "same seed (pp); mean ± population std over those (setting, seed) pairs (the std holds the "
              "settings' differences as well as the seeds'). *reproduced*: the mean reaches the paper's figure; "
              "*direction only*: positive, smaller; *not reproduced*: zero, negative, or a positive mean no larger "
              "than that std (`broker_server.experiments.claim_verdict`). *Ahead in k of n settings*: settings "
              "whose mean difference over their seeds is positive.", ""]
    if settings.get("tiny"):
        lines += ["**A smoke run (`--tiny`)**: a few clients, rounds and samples; its figures test the "
                  "plumbing, and the verdicts below say nothing about the paper.", ""]
    if settings_n:
        pairs = _paired(main, datasets, splits, "FedPGP", "FedAvg")
        flat = [d for per in pairs for d in per]
        g, g_std = mean_std(flat)
        up = sum(1 for per in pairs if sum(per) > 0)
        verdict = claim_verdict(g, CLAIM_GAIN_PP, g_std, len(flat))
        lines.append(f"- '+{CLAIM_GAIN_PP} pp over FedAvg on average': {g:+.2f} ± {g_std:.2f} pp over {len(flat)} "
                     f"(setting, seed) pairs in {len(pairs)} settings, ahead in {up} of {len(pairs)} settings "
                     f"→ **{verdict}**.")
        frac = best_count / settings_n
        need = CLAIM_BEST[0] / CLAIM_BEST[1]
        verdict = "reproduced" if frac >= need else "direction only" if best_count > 0 else "not reproduced"
        on_record = [b for b in BASELINES if any(r["method"] == b for r in main)]
        lines.append(f"- 'best in {CLAIM_BEST[0]} of {CLAIM_BEST[1]} settings': best in {best_count} of "
                     f"{settings_n} (among FedPGP and the {len(on_record)} of {len(BASELINES)} baselines on record: "
                     f"{', '.join(on_record)}) → **{verdict}**.")
    else:
        lines.append("- no FedPGP/FedAvg pair on record yet.")
    # the mechanism: each control against FedPGP, per setting (mean over the seeds both have), then
    # over settings
    for label in CONTROLS:
        pairs = _paired(main, datasets, splits, label, "FedPGP")
        if pairs:
            per_setting = [sum(per) / len(per) for per in pairs]
            d, d_std = mean_std([x for per in pairs for x in per])
            lines.append(f"- control '{label}' − FedPGP: {', '.join(f'{x:+.2f}' for x in per_setting)} pp per "
                         f"setting (mean over its seeds), {d:+.2f} ± {d_std:.2f} pp over the (setting, seed) pairs, "
                         f"ahead in {sum(1 for x in per_setting if x > 0)} of {len(per_setting)} settings.")
    same = _paired(main, datasets, splits, "FedPGP prototypes unused", "FedAvg")
    if same:
        flat = [x for per in same for x in per]
        lines.append(f"- check: 'FedPGP prototypes unused' computes g_p and never applies it, so it trains as FedAvg: "
                     f"equal final accuracy in {sum(1 for x in flat if x == 0)} of {len(flat)} (setting, seed) pairs.")
    free = _paired(main, datasets, splits, "FedPGP no projection (g+g_p)", "FedPGP")
    if free:
        d = mean_std([x for per in free for x in per])[0]
        lines.append("- reading: " + (
            f"adding g_p to the batch gradient without projecting did better than FedPGP's projection ({d:+.2f} pp "
            "on average): the projection, FedPGP's mechanism, is not what the prototypes contribute here."
            if d > 0 else
            f"the projection did better than adding g_p unprojected ({-d:+.2f} pp on average)."))
    if verify:
        lines += ["", "## Re-run check", ""] + verify
    lines.append("")
    return "\n".join(lines + failed_runs_section(results))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/repro-fedpgp", help="grid folder (results.jsonl, runs/)")
    p.add_argument("--report", default=None, help="the report (default: OUT/report.md; the committed "
                   "one, benchmarks/fedpgp.md, is replaced only when named here)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--participation", type=float, default=0.7)
    p.add_argument("--train-samples", type=int, default=0, help="stratified training subset (0 = all)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument("--splits", default=",".join(SPLITS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--sweep-bench", default="Fashion-MNIST/Dir(0.1)", help="dataset/split of the sweep")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--data-dir", default="", help="default: $FEDFLEET_DATA, then ../shared/data")
    p.add_argument("--tiny", action="store_true", help="1 seed, 2 rounds, 4 clients, 1,000 samples, MNIST "
                                                       "Dir(0.5), FedAvg and FedPGP, no sweep (a smoke run)")
    p.add_argument("--estimate-only", action="store_true", help="run the first missing cell, print the estimate")
    p.add_argument("--verify", type=int, default=0, metavar="K", help="re-run K recorded cells and compare")
    p.add_argument("--report-only", action="store_true", help="write the report from OUT/results.jsonl")
    a = p.parse_args(argv)
    if a.report is None:  # the committed report is replaced only when named
        a.report = str(Path(a.out) / "report.md")
    if a.tiny:
        a.seeds, a.rounds, a.clients, a.train_samples = "0", 2, 4, 1000
        a.datasets, a.splits, a.methods, a.no_sweep = "MNIST", "Dir(0.5)", "FedAvg,FedPGP", True
    data_dir = default_data_dir(ROOT, a.data_dir)
    seeds = int_list(p, "--seeds", a.seeds)
    datasets = name_list(p, "--datasets", a.datasets, DATASETS)
    splits = name_list(p, "--splits", a.splits, SPLITS)
    methods = name_list(p, "--methods", a.methods, METHODS)
    if (a.rounds < 1 or a.epochs < 1 or a.clients < 1 or a.workers < 1 or a.train_samples < 0 or a.verify < 0
            or not 0 < a.participation <= 1 or not a.lr > 0):
        p.error("--rounds, --epochs, --clients, --workers must be >= 1, --train-samples and --verify >= 0, "
                "--participation in (0, 1], --lr > 0")
    bench_ds, _, bench_sp = a.sweep_bench.partition("/")  # a split may hold a "/" ("2 classes/client")
    if not a.no_sweep and (bench_ds not in DATASETS or bench_sp not in SPLITS):
        p.error(f"--sweep-bench takes DATASET/SPLIT with a data set of {list(DATASETS)} and a split of "
                f"{list(SPLITS)}; got {a.sweep_bench!r}")
    check_out_dir(p, a.out, report_only=a.report_only, report=a.report, estimate_only=a.estimate_only,
                  verify=a.verify)
    out = Path(a.out)
    settings = {"rounds": a.rounds, "epochs": a.epochs, "clients": a.clients, "train_samples": a.train_samples,
                "participation": a.participation, "lr": a.lr}
    jobs = make_jobs(datasets, splits, methods, seeds, sweep=None if a.no_sweep else a.sweep_bench,
                     data_dir=data_dir, **settings)
    wall, verify_lines = None, []
    commit = code_commit(ROOT)
    if not a.report_only:
        def show(r: dict) -> None:
            print(f"{r['key']}: " + (r["error"] if "error" in r else f"acc {_acc(r)} ({r['seconds']:.0f} s)"),
                  flush=True)

        wall = run_with_estimate(jobs, out, workers=a.workers, estimate_only=a.estimate_only, on_result=show,
                                 note="cells differ: CIFAR-10 and prototype methods cost more",
                                 stamp={"commit": commit})
        if a.estimate_only:
            return 0  # an estimate leaves the committed report as it is
        if a.verify:
            verify_lines = verify_records(jobs, out, a.verify, workers=a.workers, commit=commit, headline=_acc)
    else:
        check_report_records(jobs, out)  # the report describes these options: the records must be theirs
    verify_lines = verify_lines or earlier_verify(out)  # a --report-only keeps the last re-run check
    attached = attach_round_series(out)
    if attached:
        print(f"{attached} records given their rounds from their run folders")
    results = load_results(out)
    text = report(results, out=out, datasets=datasets, splits=splits, methods=methods, seeds=seeds,
                  settings={**settings, "tiny": a.tiny}, wall_s=wall, commit=commit, verify=verify_lines)
    cmd = " ".join(shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    text = text.replace("\n## Protocol", f"\nCommand (records and report): `python tools/reproduce_fedpgp.py {cmd}`\n\n"
                        "## Protocol", 1)
    Path(a.report).parent.mkdir(parents=True, exist_ok=True)
    Path(a.report).write_text(text, encoding="utf-8")
    print(f"wrote {a.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(script_exit(main))
