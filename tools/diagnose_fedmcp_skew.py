"""Why FedMCP++'s distillation collapses the clients under label skew: a round-by-round trace.

Runs the FedMCP++ client round (:class:`edge_agent.algorithms.fedmcp.FedMCPClient`, the same
code the agents run) for every client of a partition in one process, with the server's
accuracy-weighted teacher (:func:`broker_server.strategies.fedmcp.teacher_weights`, SPECS §5.3)
between rounds, and records per round:

- the clients' proxy-set accuracy after their local CE epoch (what they upload), mean and min;
- the teacher's proxy accuracy and its mean top probability at T (how flat the targets are);
- the clients' proxy accuracy and largest |logit| right after the alignment stages, measured
  on a copy of each client (the round itself goes on from the original, so the trace does not
  change the run).

No MQTT here: the federation's transport does not change what the clients learn, and the
in-process loop makes the alignment stages observable. The grid's numbers come from real
federations (``tools/reproduce_fedmcp.py``).

Usage::

    python tools/diagnose_fedmcp_skew.py --variants none,kd,kd0.1,full \
        --report benchmarks/fedmcp-skew.md --records benchmarks/results/fedmcp-skew.jsonl
    python tools/diagnose_fedmcp_skew.py --train-samples 6000 --variants kd,none --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker_server.runtime import device_model  # noqa: E402
from broker_server.strategies.fedmcp import proxy_accuracy, teacher_weights  # noqa: E402
from edge_agent.algorithms._base import TrainConfig  # noqa: E402
from edge_agent.algorithms.fedmcp import FedMCPClient, FedMCPParams  # noqa: E402
from edge_agent.data import load_dataset  # noqa: E402
from edge_agent.errors import DataError, PartitionError  # noqa: E402
from edge_agent.partition import split_dataset  # noqa: E402

#: variant name → the client's [algorithm] switches
VARIANTS: dict[str, dict] = {
    "none": {"kd": False, "infonce": False, "proto_align": False},  # = Local
    "kd": {"infonce": False, "proto_align": False},  # EnsKD's stage with the accuracy-weighted teacher
    "kd0.1": {"infonce": False, "proto_align": False, "kd_weight": 0.1},
    "full": {},  # every FedMCP++ stage at its defaults
}


def trace(dataset: str, clients: int, train_samples: int, variant: str, *, rounds: int, alpha: float, lr: float,
          seed: int, data_dir: str | None = None) -> list[dict]:
    """One run's per-round records (see the module docstring); fractions in [0, 1].

    Raises:
        DataError: the data set is not found (``data_dir``, then the usual search order).
        PartitionError: more clients than the budget can give ``min_samples`` = 5 each.
        ValueError: a bad FedMCP++ hyperparameter or proxy size.
    """
    ds = load_dataset(dataset, data_dir=data_dir)
    params = dict(VARIANTS[variant], onnx_soft_predictions=False)
    hp = FedMCPParams.from_mapping(params)
    parts = split_dataset(ds, clients, scheme="dirichlet", seed=seed, alpha=alpha, min_samples=5,
                          train_samples=train_samples)
    kw = FedMCPClient.setup_kwargs(ds, params, seed)
    proxy_x, proxy_y = torch.from_numpy(np.array(kw["proxy_x"])), kw["proxy_y"]
    cfg = TrainConfig(lr=lr, momentum=0.9, batch_size=32, seed=seed)
    fleet = []
    for i, idx in enumerate(parts):
        model = device_model(ds, seed * 1000 + i)  # every client its own initialisation, as in the grid
        fleet.append((model, FedMCPClient(**kw), torch.from_numpy(ds.train.x[idx]), torch.from_numpy(ds.train.y[idx])))

    def on_proxy(model: torch.nn.Module) -> tuple[float, float]:
        model.eval()
        with torch.no_grad():
            logits = model(proxy_x)
        return float((logits.argmax(1).numpy() == proxy_y).mean()), float(logits.abs().max())

    records, extras = [], {}
    for rnd in range(1, rounds + 1):
        after_align, max_logit, softs, protos, accs = [], [], [], [], []
        for i, (model, client, x, y) in enumerate(fleet):
            if extras and (hp.kd or hp.infonce or hp.proto_align):
                m2, c2 = copy.deepcopy(model), copy.deepcopy(client)
                teacher = c2._teacher(m2, extras, torch.device("cpu"))
                c2._align(m2, teacher, cfg, hp, torch.Generator().manual_seed(rnd * 7919 + i), torch.device("cpu"), i)
                a, ml = on_proxy(m2)
                after_align.append(a)
                max_logit.append(ml)
            res = client.local_round(model, (), x, y, cfg, round=rnd, client_index=i, device="cpu", params=params,
                                     global_extras=extras)
            softs.append(res.extras["soft_predictions"])
            protos.append(res.extras["prototypes"])
            accs.append(proxy_accuracy(softs[-1], proxy_y))
        w = teacher_weights(accs)
        t_soft = np.einsum("k,kpc->pc", w, np.stack(softs)).astype(np.float32)
        t_protos = np.einsum("k,kcd->cd", w, np.stack(protos)).astype(np.float32)
        extras = {"teacher_soft_predictions": t_soft, "teacher_prototypes": t_protos}
        records.append({"round": rnd, "client_acc_mean": float(np.mean(accs)), "client_acc_min": float(np.min(accs)),
                        "teacher_acc": proxy_accuracy(t_soft, proxy_y), "teacher_top_prob": float(t_soft.max(1).mean()),
                        "after_align_acc_mean": float(np.mean(after_align)) if after_align else None,
                        "after_align_max_logit": float(np.max(max_logit)) if max_logit else None})
        print(json.dumps({"dataset": dataset, "train_samples": train_samples, "variant": variant, **records[-1]}),
              flush=True)
    return records


def _fmt(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def report(records: list[dict], *, dataset: str, clients: int, alpha: float, lr: float, seed: int,
           wall_s: float | None) -> str:
    """The markdown trace of ``records`` (the JSON lines :func:`trace` prints, with
    ``train_samples`` and ``variant``), plus a reading computed from them: per budget, round 2's
    teacher sharpness and what one alignment pass did to the students against no alignment."""
    lines = ["# FedMCP++ under label skew: a round-by-round trace", "",
             f"Generated by `tools/diagnose_fedmcp_skew.py` ({dataset}, {clients} clients, Dirichlet({alpha}), "
             f"lr {lr}, momentum 0.9, batch 32, 1 local epoch, 1,000-image proxy set, seed {seed}); every number "
             "was measured in that run. Accuracies in % on the proxy set. *after CE*: what the clients upload; "
             "*after alignment*: the same clients right after the alignment stages on the previous round's "
             "teacher (measured on a copy); *teacher top p*: mean largest probability of the teacher at T = 1.5 "
             "(uniform: 1/C). Variants: `none` = no alignment (Local), `kd` = the distillation stage only, `kd0.1` = "
             "the same with weight 0.1, `full` = every FedMCP++ stage.", "",
             "| train images | variant | round | after CE mean | after CE min | teacher acc | teacher top p | "
             "after alignment mean | max \\|logit\\| after alignment |", "|---|---|---|---|---|---|---|---|---|"]
    budgets = sorted({r["train_samples"] for r in records})
    variants = list(dict.fromkeys(r["variant"] for r in records))
    for n in budgets:
        for v in variants:
            for r in (r for r in records if r["train_samples"] == n and r["variant"] == v):
                ml = r["after_align_max_logit"]
                lines.append(f"| {n:,} | {v} | {r['round']} | {_fmt(r['client_acc_mean'])} | "
                             f"{_fmt(r['client_acc_min'])} | {_fmt(r['teacher_acc'])} | {r['teacher_top_prob']:.3f} | "
                             f"{_fmt(r['after_align_acc_mean'])} | {'–' if ml is None else f'{ml:.2f}'} |")
    lines += ["", "## Reading (computed from the table)", ""]
    gains: dict[int, float] = {}
    for n in budgets:
        def at(v: str, rnd: int, n: int = n) -> dict | None:  # called within this iteration only
            return next((r for r in records if r["train_samples"] == n and r["variant"] == v and r["round"] == rnd),
                        None)

        last = max((r["round"] for r in records if r["train_samples"] == n), default=0)
        aligned = next((v for v in ("kd", "full", "kd0.1") if at(v, 2) and at(v, last)), None)
        if aligned is None or not at("none", last) or last < 2:
            continue  # needs 'none' and an alignment variant over at least 2 rounds
        first, kd2, none_last, kd_last = at("none", 1), at(aligned, 2), at("none", last), at(aligned, last)
        gains[n] = kd_last["client_acc_mean"] - none_last["client_acc_mean"]
        lines.append(
            f"- **{n:,} training images**: after round 1 the clients' mean proxy accuracy is "
            f"{_fmt(first['client_acc_mean'])} % and the teacher's top probability {first['teacher_top_prob']:.3f} "
            f"(its argmax is right {_fmt(first['teacher_acc'])} % of the time). One alignment pass (`{aligned}`) on "
            "it leaves "
            f"the students at {_fmt(kd2['after_align_acc_mean'])} % (largest |logit| "
            f"{kd2['after_align_max_logit']:.2f}); "
            f"by round {last} `{aligned}` gives {_fmt(kd_last['client_acc_mean'])} % after CE against "
            f"{_fmt(none_last['client_acc_mean'])} % without it "
            f"({100 * (kd_last['client_acc_mean'] - none_last['client_acc_mean']):+.1f} pp).")
    if len(gains) >= 2 and gains[min(gains)] < 0 <= gains[max(gains)]:  # the pattern this tool was written for
        lines += ["", "When the round-1 clients are weak, the accuracy-weighted teacher is right but nearly flat at T "
                      "= 1.5; "
                  "matching its probabilities pulls the students' logits together until their argmax is noise, the "
                  "next "
                  "teacher is built from those students, and one local epoch per round does not climb out. With more "
                  "data per client the first teacher is sharp enough and distillation helps. See the rows of the "
                  "same budgets in `benchmarks/fedmcp.md` for the full federations."]
    lines.append("")
    if wall_s is not None:
        lines += [f"Wall time: {wall_s / 60:.1f} min.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--alpha", type=float, default=0.3, help="Dirichlet α of the label skew")
    p.add_argument("--train-samples", default="6000,30000", help="training budgets (images), comma-separated")
    p.add_argument("--variants", default="none,kd,kd0.1", help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default="", help="write the markdown report here")
    p.add_argument("--records", default="", help="write the per-round records here (JSON lines)")
    p.add_argument("--report-only", action="store_true", help="rebuild --report from --records, run nothing")
    p.add_argument("--data-dir", default="", help="a data folder of your own (default: $FEDFLEET_DATA, then "
                                                  "shared/data)")
    a = p.parse_args(argv)
    try:
        budgets = [int(v) for v in a.train_samples.split(",") if v.strip()]
    except ValueError:
        p.error(f"--train-samples takes comma-separated integers, got {a.train_samples!r}")
    if not a.report_only and (not budgets or min(budgets) < 0 or a.rounds < 1 or a.clients < 1):
        p.error("--train-samples needs at least one budget >= 0 (0 = the whole split); --rounds, --clients >= 1")
    for target in [a.report] + ([] if a.report_only else [a.records]):  # fail now, not after the training
        if target and not Path(target).resolve().parent.is_dir():
            p.error(f"the folder of {target} does not exist")
    variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if a.report_only:
        if not a.records or not a.report:
            p.error("--report-only needs --records (to read) and --report (to write)")
        try:
            text = Path(a.records).read_text(encoding="utf-8")
        except OSError as exc:
            p.error(f"cannot read --records {a.records}: {exc.strerror or exc}")
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
        wall = None
    else:
        torch.set_num_threads(1)
        t0 = time.monotonic()
        records = []
        for n in budgets:
            for v in variants:
                try:
                    records += [{"dataset": a.dataset, "train_samples": n, "variant": v, **r}
                                for r in trace(a.dataset, a.clients, n, v, rounds=a.rounds, alpha=a.alpha, lr=a.lr,
                                               seed=a.seed, data_dir=a.data_dir or None)]
                except (DataError, PartitionError, ValueError) as exc:
                    p.error(f"{a.dataset}, {n} images, variant {v}: {exc}")
        wall = time.monotonic() - t0
        if a.records:
            Path(a.records).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    text = report(records, dataset=a.dataset, clients=a.clients, alpha=a.alpha, lr=a.lr, seed=a.seed, wall_s=wall)
    if a.report:
        Path(a.report).write_text(text, encoding="utf-8")
        print(f"wrote {a.report}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
