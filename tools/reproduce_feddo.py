"""FedDO against FedAvg, MOON, Oort, FedLC, FedNTD, FedCross, FedAA and a random-ratio control.

The paper's protocol (SPECS.md §4.4–4.5): 100 clients, Dirichlet α ∈ {0.1, 0.5} and IID, a CNN
on Fashion-MNIST and CIFAR-10, 3 seeds; final accuracy and **rounds to a target accuracy**; the
learned behaviour (active devices per round, mean ratio d) against the paper's 20–25 active at
d ≈ 0.8–0.9 under Dir(0.1) and > 50 at d ≈ 0.4–0.5 under IID; agent sizes for 100/500/1,000/2,000
devices with and without low rank (paper Table 3); the pre-training cost in CPU time. What this
script does, and how it is reduced to the machine (every knob is an option):

- the light CNN (``[model] name = "lightcnn"``), a seeded stratified training budget
  (``--train-samples``, default 20,000 images: 200 per client at 100 clients), ``--rounds``
  (default 200; the paper's budget is 1,000), 1 local epoch, SGD lr 0.05, batch 32;
- the baselines ask ``--participation`` (default 0.2, i.e. 20 of 100: the paper does not give
  its participation; 20 matches the active count it reports for FedDO under Dir(0.1)); FedDO
  decides itself who trains;
- FedDO's policy is pre-trained per (data set, partition) with ``fedfleet feddo pretrain``'s
  function (:func:`broker_server.feddo_pretrain.pretrain`), ``--episodes`` (default 20; the paper
  200) of ``--pretrain-rounds`` (default 30) rounds, then loaded (``[algorithm] policy``) and kept
  learning online; its CPU seconds are reported;
- the control ("FedDO-random") replaces the policy by random ratios with the mean ratio and
  active fraction the learned policy showed in the same cell (seed 0), run after FedDO;
- the target of a cell is FedAvg's mean final accuracy there (``--target`` overrides it with one
  fraction for every cell): rounds to target = the first round whose global accuracy reaches it
  (mean over the seeds that reach it, and how many did);
- FedAA (:mod:`broker_server.strategies.fedaa`) asks the same ``--participation`` as the other
  baselines and its DDPG agent learns online within the run (FedAA's own episodes of model
  re-initialisation are not run: one run is one episode);
- a method whose algorithm is not registered in the checkout is skipped with the reason printed
  and written to the report.

Every run is a real federation over an embedded broker (:mod:`broker_server.experiments`);
results go to ``OUT/results.jsonl`` (per-round lines in ``OUT/runs/<key>/metrics.jsonl``) and an
interrupted reproduction resumes; policies go to ``OUT/policies/`` and are reused. The script
exits 1 when a run failed, 2 on a usage error.

Usage::

    python tools/reproduce_feddo.py --out runs/repro-feddo --report benchmarks/feddo.md
    python tools/reproduce_feddo.py --tiny --out /tmp/feddo-tiny --report /tmp/feddo-tiny.md
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker_server.experiments import (  # noqa: E402
    Job,
    code_commit,
    failed_runs_section,
    int_list,
    load_results,
    mean_std,
    pm,
    read_metrics,
    rounds_to_target,
    run_grid,
)

#: method label → (registered algorithm, [algorithm] table)
METHODS: dict[str, tuple[str, dict]] = {
    "FedAvg": ("fedavg", {}),
    "MOON": ("moon", {}),
    "Oort": ("oort", {}),
    "FedLC": ("fedlc", {}),
    "FedNTD": ("fedntd", {}),
    "FedCross": ("fedcross", {}),
    "FedAA": ("fedaa", {}),
    "FedDO": ("feddo", {}),
    "FedDO-random": ("feddo", {"mode": "random"}),
}
#: partition label → ([data] partition, alpha)
PARTITIONS = {"dir0.1": ("dirichlet", 0.1), "dir0.5": ("dirichlet", 0.5), "iid": ("iid", 1.0)}
#: paper Table 3 (FashionMNIST, VGG-11): agent parameters, original / low rank
PAPER_SIZES = {100: (0.93e6, 0.74e6), 500: (2.26e6, 1.28e6), 1000: (3.96e6, 1.95e6), 2000: (7.25e6, 3.47e6)}
#: the paper's learned behaviour (SPECS §4.5)
PAPER_BEHAVIOUR = {"dir0.1": "20–25 active, d ≈ 0.8–0.9", "iid": "> 50 active, d ≈ 0.4–0.5"}
#: the agent's size knobs for FedDO runs (small enough for a shared CPU; the counts table uses 256 × 3)
AGENT = {"hidden": 256, "layers": 3, "rank": 96}
#: the rank of the parameter-count table (FedDO's default)
TABLE_RANK = 96


def job_config(dataset: str, partition: str, clients: int, algorithm: str, params: dict, seed: int, *, rounds: int,
               train_samples: int, participation: float) -> dict:
    """The configuration of one run (as parsed TOML)."""
    scheme, alpha = PARTITIONS[partition]
    extra = dict(AGENT) if algorithm == "feddo" else {}
    if algorithm == "fedcross":
        extra["models"] = max(1, round(participation * clients))
    return {
        "run": {"name": f"feddo-{dataset}", "seed": seed, "rounds": rounds},
        "data": {"dataset": dataset, "partition": scheme, "alpha": alpha, "clients": clients,
                 "train_samples": train_samples, "min_samples": 2},
        "model": {"name": "lightcnn"},
        "train": {"algorithm": algorithm, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "server": {"quorum": 1, "participation_rate": participation, "round_deadline_s": 900.0,
                   "join_timeout_s": 300.0},
        "broker": {"kind": "auto"},
        "agents": {"train_slots": 1, "torch_threads": 1},
        "algorithm": {**extra, **params},
    }


def registered(methods: list[str]) -> tuple[list[str], dict[str, str]]:
    """The methods whose algorithm is registered, and why each other one is skipped."""
    from broker_server.strategies import list_strategies

    have = set(list_strategies())
    keep, skipped = [], {}
    for m in methods:
        algo = METHODS[m][0]
        if algo in have:
            keep.append(m)
        else:
            skipped[m] = f"algorithm {algo!r} is not registered in this checkout (it comes from another branch)"
    return keep, skipped


def policy_path(out: Path, dataset: str, partition: str) -> Path:
    return out / "policies" / f"{dataset}-{partition}.pt"


def pretrain_policies(out: Path, cells: list[tuple[str, str]], *, clients: int, episodes: int, rounds: int,
                      train_samples: int, participation: float, data_dir: str) -> dict[str, dict]:
    """Pre-train (or reuse) one policy per cell; returns ``"ds/part"`` → {path, cpu_seconds, episodes}."""
    from broker_server.config import from_dict
    from broker_server.feddo_pretrain import pretrain, progress_line

    info_path = out / "policies" / "pretrain.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    for ds, part in cells:
        key, path = f"{ds}/{part}", policy_path(out, ds, part)
        if key in info and path.exists():
            continue
        raw = job_config(ds, part, clients, "feddo", {}, 0, rounds=rounds, train_samples=train_samples,
                         participation=participation)
        if data_dir:
            raw["data"]["data_dir"] = data_dir
        print(f"pre-training FedDO for {key}: {episodes} episodes x {rounds} rounds", flush=True)
        res = pretrain(from_dict(raw, f"<pretrain {key}>"), episodes=episodes, rounds=rounds, out=path,
                       on_episode=lambda m: print("  " + progress_line(m, episodes), flush=True))
        info[key] = {"path": str(path), "cpu_seconds": res.cpu_seconds, "episodes": res.episodes,
                     "parameters": res.parameter_counts}
        info_path.parent.mkdir(parents=True, exist_ok=True)
        info_path.write_text(json.dumps(info, indent=1))
    return info


#: the per-round metrics lines of run ``key`` (``[]`` when absent)
read_rounds = read_metrics


def behaviour(lines: list[dict]) -> tuple[float, float]:
    """(mean active devices per round, mean ratio) of a FedDO run."""
    act = [m["feddo_active"] for m in lines if "feddo_active" in m]
    rat = [m["feddo_mean_ratio"] for m in lines if "feddo_mean_ratio" in m]
    return (sum(act) / len(act) if act else 0.0, sum(rat) / len(rat) if rat else 0.0)


#: the first round whose accuracy reaches the target, or ``None``
rounds_to = rounds_to_target


def agent_sizes() -> list[tuple[int, dict, dict]]:
    """(K, dense counts, low-rank counts) of the FedDO agent (hidden 256 × 3, rank 96) for the
    paper's device counts."""
    from broker_server.rl.dsac_t import DSACTAgent, DSACTConfig
    from broker_server.strategies.feddo import GLOBAL_FEATURES

    out = []
    for k in PAPER_SIZES:
        dense = DSACTAgent(k + GLOBAL_FEATURES, k, DSACTConfig(rank=0)).parameter_counts()
        low = DSACTAgent(k + GLOBAL_FEATURES, k, DSACTConfig(rank=TABLE_RANK)).parameter_counts()
        out.append((k, dense, low))
    return out


def make_jobs(datasets, partitions, methods, seeds, *, clients, rounds, train_samples, participation, policies,
              control: dict[str, tuple[float, float]]) -> list[Job]:
    """The grid's jobs (FedDO-random only for cells whose FedDO seed-0 behaviour is known)."""
    jobs = []
    for ds in datasets:
        for part in partitions:
            for label in methods:
                algo, params = METHODS[label]
                params = dict(params)
                if algo == "feddo":
                    params["policy"] = policies[f"{ds}/{part}"]["path"]
                if label == "FedDO-random":
                    if f"{ds}/{part}" not in control:
                        continue
                    act, ratio = control[f"{ds}/{part}"]
                    params.update(random_active=min(1.0, max(1e-3, act / clients)), random_mean=max(1e-3, ratio))
                for seed in seeds:
                    key = f"{ds}/{part}/c{clients}/r{rounds}/n{train_samples}/{label}/s{seed}"
                    jobs.append(Job(key, job_config(ds, part, clients, algo, params, seed, rounds=rounds,
                                                    train_samples=train_samples, participation=participation),
                                    tags={"dataset": ds, "partition": part, "method": label, "seed": seed}))
    return jobs


def report(out: Path, results: dict[str, dict], *, datasets, partitions, methods, skipped, seeds, args,
           policies, target: float | None) -> str:
    """The Markdown report."""
    lines = ["# FedDO reproduction (tools/reproduce_feddo.py)", "",
             f"{args.clients} clients, {args.rounds} rounds, {args.train_samples} training images, "
             f"participation {args.participation} for the baselines, seeds {seeds}, light CNN; "
             f"FedDO pre-trained {args.episodes} episodes x {args.pretrain_rounds} rounds per cell. "
             f"Machine: {platform.machine()}, Python {platform.python_version()}.", ""]
    for m, why in skipped.items():
        lines.append(f"- skipped {m}: {why}")
    lines.append("")
    for ds in datasets:
        for part in partitions:
            rows = {m: [r for r in results.values() if r.get("dataset") == ds and r.get("partition") == part
                        and r.get("method") == m and "error" not in r] for m in methods}
            base = [r["final"]["accuracy"] for r in rows.get("FedAvg", []) if r["final"].get("accuracy") is not None]
            tgt = target if target is not None else (mean_std(base)[0] if base else None)
            lines += [f"## {ds}, {part}" + (f" (target {100 * tgt:.2f} %)" if tgt is not None else ""), "",
                      "| method | final accuracy % | best % | rounds to target (reached/seeds) | active/round "
                      "| mean d |",
                      "|---|---|---|---|---|---|"]
            for m in methods:
                rs = rows[m]
                if not rs:
                    continue
                fin = [100 * r["final"]["accuracy"] for r in rs if r["final"].get("accuracy") is not None]
                best = [100 * r["best_accuracy"] for r in rs if r.get("best_accuracy") is not None]
                per = [read_rounds(out, r["key"]) for r in rs]
                hit = [rounds_to(p, tgt) for p in per] if tgt is not None else []
                got = [h for h in hit if h is not None]
                beh = [behaviour(p) for p in per] if METHODS[m][0] == "feddo" else []
                b_m, _ = mean_std(best) if best else (float("nan"), 0.0)
                r_txt = (f"{sum(got) / len(got):.0f} ({len(got)}/{len(hit)})" if got
                         else f"> {args.rounds} (0/{len(hit)})")
                a_txt = f"{sum(b[0] for b in beh) / len(beh):.1f}" if beh else "—"
                d_txt = f"{sum(b[1] for b in beh) / len(beh):.3f}" if beh else "—"
                lines.append(f"| {m} | {pm(fin, 1.0)} | {b_m:.2f} | {r_txt} | {a_txt} | {d_txt} |")
            if part in PAPER_BEHAVIOUR:
                lines.append(f"\nPaper's learned behaviour here: {PAPER_BEHAVIOUR[part]}.")
            pol = policies.get(f"{ds}/{part}")
            if pol:
                lines.append(f"\nPre-training: {pol['cpu_seconds']:.0f} CPU s for {args.episodes} episodes.")
            lines.append("")
    lines += [f"## Agent parameters (hidden 256 × 3, rank {TABLE_RANK}, 4 global state features)", "",
              "| devices | dense: agent / with targets | low rank: agent / with targets | paper original / low rank |",
              "|---|---|---|---|"]
    for k, dense, low in agent_sizes():
        po, pl = PAPER_SIZES[k]
        lines.append(f"| {k} | {dense['agent']:,} / {dense['with_targets']:,} | {low['agent']:,} / "
                     f"{low['with_targets']:,} | {po / 1e6:.2f}M / {pl / 1e6:.2f}M |")
    lines += ["", "Agent = actor + two critics (what is trained); with targets = twice that (what is stored).",
              "", *failed_runs_section(results)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/repro-feddo")
    p.add_argument("--report", default=None, help="the report (default: benchmarks/feddo.md; a smoke run's "
                   "goes to OUT/report.md, so it never replaces the committed one)")
    p.add_argument("--datasets", default="fashion_mnist,cifar10")
    p.add_argument("--partitions", default="dir0.1,dir0.5,iid", help="of " + ", ".join(PARTITIONS))
    p.add_argument("--methods", default=",".join(METHODS), help="of " + ", ".join(METHODS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--train-samples", type=int, default=20000)
    p.add_argument("--participation", type=float, default=0.2)
    p.add_argument("--episodes", type=int, default=20)
    p.add_argument("--pretrain-rounds", type=int, default=30)
    p.add_argument("--target", type=float, default=None, help="one target accuracy (fraction) for every cell")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--data-dir", default="")
    p.add_argument("--tiny", action="store_true", help="smoke run: digits, dir0.5, 4 clients, 2 rounds, 1 seed, "
                                                       "1 pre-training episode of 2 rounds")
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args(argv)
    if a.report is None:
        a.report = str(Path(a.out) / "report.md") if a.tiny else str(ROOT / "benchmarks" / "feddo.md")
    if a.tiny:
        a.datasets, a.partitions, a.seeds, a.clients, a.rounds = "digits", "dir0.5", "0", 4, 2
        a.train_samples, a.episodes, a.pretrain_rounds, a.participation = 0, 1, 2, 0.5
        AGENT.update(hidden=32, layers=2, rank=4)
    datasets = [d for d in a.datasets.split(",") if d.strip()]
    partitions = [x for x in a.partitions.split(",") if x.strip()]
    if set(partitions) - set(PARTITIONS):
        p.error(f"unknown partitions {sorted(set(partitions) - set(PARTITIONS))}; known: {list(PARTITIONS)}")
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    if set(methods) - set(METHODS):
        p.error(f"unknown methods {sorted(set(methods) - set(METHODS))}; known: {list(METHODS)}")
    seeds = int_list(p, "--seeds", a.seeds)
    if a.clients < 1 or a.rounds < 1 or a.episodes < 1 or a.pretrain_rounds < 1 or not 0 < a.participation <= 1:
        p.error("--clients, --rounds, --episodes, --pretrain-rounds must be >= 1, --participation in (0, 1]")
    methods, skipped = registered(methods)
    for m, why in skipped.items():
        print(f"skipping {m}: {why}", flush=True)
    out = Path(a.out)
    cells = [(ds, part) for ds in datasets for part in partitions]
    if not a.report_only:
        from edge_agent.data import load_dataset
        from edge_agent.errors import DataError

        for ds in datasets:
            try:
                load_dataset(ds, data_dir=a.data_dir or None, allow_download=False)
            except DataError as exc:
                p.error(f"data set {ds!r} is not available: {exc}")
    t0 = time.monotonic()
    policies: dict[str, dict] = {}
    if any(METHODS[m][0] == "feddo" for m in methods):
        policies = (json.loads((out / "policies" / "pretrain.json").read_text())
                    if a.report_only and (out / "policies" / "pretrain.json").exists() else {})
        if not a.report_only:
            policies = pretrain_policies(out, cells, clients=a.clients, episodes=a.episodes, rounds=a.pretrain_rounds,
                                         train_samples=a.train_samples, participation=a.participation,
                                         data_dir=a.data_dir)
    kw = {"clients": a.clients, "rounds": a.rounds, "train_samples": a.train_samples,
          "participation": a.participation, "policies": policies}
    results = load_results(out)
    if not a.report_only:
        def show(r: dict) -> None:
            print(f"{r['key']}: " + (r["error"] if "error" in r else
                                     f"accuracy {r['final'].get('accuracy')} ({r['seconds']:.0f} s)"), flush=True)

        first = [m for m in methods if m != "FedDO-random"]
        jobs = make_jobs(datasets, partitions, first, seeds, control={}, **kw)
        for j in jobs if a.data_dir else ():
            j.config["data"]["data_dir"] = a.data_dir
        stamp = {"commit": code_commit(ROOT)}
        results = run_grid(jobs, out, workers=a.workers, on_result=show, stamp=stamp)
        if "FedDO-random" in methods:  # the control needs FedDO's behaviour (seed 0 of each cell)
            control = {}
            for ds, part in cells:
                key = f"{ds}/{part}/c{a.clients}/r{a.rounds}/n{a.train_samples}/FedDO/s{seeds[0]}"
                lines = read_rounds(out, key)
                if lines:
                    control[f"{ds}/{part}"] = behaviour(lines)
            jobs2 = make_jobs(datasets, partitions, ["FedDO-random"], seeds, control=control, **kw)
            for j in jobs2 if a.data_dir else ():
                j.config["data"]["data_dir"] = a.data_dir
            results.update(run_grid(jobs2, out, workers=a.workers, on_result=show, stamp=stamp))
    text = report(out, results, datasets=datasets, partitions=partitions, methods=methods, skipped=skipped,
                  seeds=seeds, args=a, policies=policies, target=a.target)
    if not a.report_only:
        text += f"\nWall time of this invocation: {time.monotonic() - t0:.0f} s.\n"
    Path(a.report).parent.mkdir(parents=True, exist_ok=True)
    Path(a.report).write_text(text, encoding="utf-8")
    print(f"report written to {a.report}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
