"""The FedOCP reproduction grid: each cell names its evaluation protocol (key, tags, config), its
configuration passes the run checks, each ablation is one key away from FedOCP, the sweep's cells
and keys, and the report's figures on hand-made records (seed-matched differences, n/r where a
record has no rounds, the sweep table, the verdicts) never mixing the two protocols; options that
cannot make a grid are usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers.tools import load_tool

from broker_server.config import from_dict
from broker_server.experiments import NOISY_VERDICT
from broker_server.strategies.fedocp import FedOCP

KW = dict(rounds=2, epochs=1, clients=4, train_samples=400, lr=0.01, group="htfe4-cpu", server_epochs=5,
          data_dir="")


def _tool():
    return load_tool("reproduce_fedocp")


def test_cells_are_keyed_and_configured_by_their_protocol() -> None:
    tool = _tool()
    jobs = tool.make_jobs(["MNIST"], ["Dir(0.1)"], ["FedOCP", "FedProto"], [0], ["local", "shared"], **KW)
    keys = {j.key: j for j in jobs}
    assert set(keys) == {"main/MNIST/Dir_0.1/local/FedOCP/s0", "main/MNIST/Dir_0.1/local/FedProto/s0",
                         "main/MNIST/Dir_0.1/shared/FedOCP/s0", "main/MNIST/Dir_0.1/shared/FedProto/s0"}
    local, shared = keys["main/MNIST/Dir_0.1/local/FedOCP/s0"], keys["main/MNIST/Dir_0.1/shared/FedOCP/s0"]
    assert local.tags["client_test"] == "local" and shared.tags["client_test"] == "shared"
    assert (local.config["data"]["client_test"], local.config["server"]["client_eval_max"]) == ("local", 0)
    assert (shared.config["data"]["client_test"], shared.config["server"]["client_eval_max"]) == ("shared", 2000)
    for job in jobs:  # what the grid would run passes the configuration checks
        assert from_dict(job.config, job.key).data.client_test == job.tags["client_test"]
    assert tool.make_jobs(["MNIST"], ["Dir(0.1)"], ["FedOCP"], [0], **KW)[0].tags["client_test"] == "local"


@pytest.mark.parametrize("server_epochs", [0, 5])
def test_each_ablation_is_one_key_from_fedocp(server_epochs: int) -> None:
    tool = _tool()
    kw = {**KW, "server_epochs": server_epochs}
    jobs = {j.tags["method"]: j for j in tool.make_jobs(["CIFAR-10"], ["Dir(0.1)"], list(tool.METHODS), [0], **kw)}
    full = jobs["FedOCP"].config
    switched = {"FedOCP no orthogonal init": "orth_init", "FedOCP no server contrastive": "server_contrastive",
                "FedOCP no client orthogonality": "client_orthogonality",
                "FedOCP no client contrastive": "client_contrastive"}
    assert sorted(tool.ABLATIONS) == sorted(switched)
    for label, key in switched.items():
        cfg = jobs[label].config
        # the whole configuration is FedOCP's but for one [algorithm] key, set to false
        assert {k: v for k, v in cfg.items() if k != "algorithm"} == {k: v for k, v in full.items() if k != "algorithm"}
        diff = set(cfg["algorithm"].items()) ^ set(full["algorithm"].items())
        assert diff == {(key, False)}, label


@pytest.mark.parametrize(("server_epochs", "own", "hundred"), [(0, {}, {"server_epochs": 100}),
                                                               (5, {"server_epochs": 5}, {"server_epochs": 100})])
def test_fedorgp_runs_at_its_own_server_epochs_and_at_fedocps(server_epochs: int, own: dict, hundred: dict) -> None:
    """The headline baseline twice: FedORGP's own 1 epoch a round (its strategy default, or the
    grid's shrink knob) and FedOCP's 100 (kept under the knob: it is what the row is named by)."""
    tool = _tool()
    jobs = {j.tags["method"]: j for j in tool.make_jobs(["CIFAR-10"], ["Dir(0.1)"], list(tool.METHODS), [0],
                                                          **{**KW, "server_epochs": server_epochs})}
    assert jobs["FedORGP"].config["train"]["algorithm"] == "fedorgp" and jobs["FedORGP"].config["algorithm"] == own
    assert jobs["FedORGP 100 server epochs"].config["algorithm"] == hundred
    assert from_dict(jobs["FedORGP"].config, "x").train.algorithm == "fedorgp"
    assert set(tool.HEADLINE) <= set(tool.BASELINES)


def test_a_sweep_value_read_from_an_ablation_sends_the_same_round_config() -> None:
    # lambda_orth = 0 and client_orthogonality = false, lambda_con = 0 and client_contrastive = false:
    # the clients get the same round config, and the server the same training keys
    tool = _tool()
    rng = np.random.default_rng(0)
    for (key, value), label in tool.SWEEP_AS_ABLATION.items():
        swept = FedOCP(**{key: value})
        ablation = FedOCP(**tool.METHODS[label][1])
        a = swept.configure_round(1, ["c0", "c1"], np.random.default_rng(0)).config
        b = ablation.configure_round(1, ["c0", "c1"], rng).config
        assert a == b and a[key] == 0.0
        server = ("server_contrastive", "server_epochs", "server_lr", "server_batch", "tau_server", "server_orth_init")
        assert [getattr(swept, k) for k in server] == [getattr(ablation, k) for k in server]


def test_sweep_cells_keys_and_order() -> None:
    tool = _tool()
    jobs = tool.make_jobs(["CIFAR-10", "MNIST"], ["Dir(0.1)"], list(tool.METHODS), [0, 1], ["local"],
                          sweep=("CIFAR-10", "Dir(0.1)", "local"), **KW)
    sweep = [j for j in jobs if j.tags["grid"] == "sweep"]
    # per seed: λ_align 0, 10, 100 (FedORGP's λ_c); λ_orth 10, 100; λ_con 10, 100 (their 0 is an ablation
    # cell); τ_client and τ_server 0.01, 1; server_epochs 1 (the main grid's is 5 here); server_lr 0.1, 1
    # → 14 cells, × 2 seeds
    expect = ["lambda_align=0.0", "lambda_align=10.0", "lambda_align=100.0", "lambda_orth=10.0",
              "lambda_orth=100.0", "lambda_con=10.0", "lambda_con=100.0", "tau_client=0.01", "tau_client=1.0",
              "tau_server=0.01", "tau_server=1.0", "server_epochs=1", "server_lr=0.1", "server_lr=1.0"]
    assert [j.key for j in sweep] == [f"sweep/CIFAR-10/Dir_0.1/local/{v}/s{s}" for s in (0, 1) for v in expect]
    assert all(not j.key.startswith("main/") for j in sweep) and len({j.key for j in jobs}) == len(jobs)
    for j in sweep:  # one key changed from FedOCP (server_epochs 5 from the grid, unless it is the key)
        key = j.tags["sweep_key"]
        assert j.config["algorithm"] == {"server_epochs": 5, key: j.tags["value"]}
        assert j.config["train"]["algorithm"] == "fedocp" and j.tags["method"] == "FedOCP"
        assert from_dict(j.config, j.key).data.client_test == "local"
    # CIFAR-10's main cells (10 methods × 2 seeds), its sweep (28), then MNIST's main cells (20)
    grids = [(j.tags["grid"], j.tags["dataset"]) for j in jobs]
    assert grids == [("main", "CIFAR-10")] * 20 + [("sweep", "CIFAR-10")] * 28 + [("main", "MNIST")] * 20
    # a grid that leaves FedOCP and the two ablations out still runs the cells the sweep's table reads
    only = tool.make_jobs(["CIFAR-10"], ["Dir(0.1)"], ["FedProto"], [0], sweep=("CIFAR-10", "Dir(0.1)", "local"),
                          sweep_values=tool.sweep_plan(["lambda_con", "tau_server"], server_epochs=5), **KW)
    assert [j.key for j in only] == ["main/CIFAR-10/Dir_0.1/local/FedProto/s0", "main/CIFAR-10/Dir_0.1/local/FedOCP/s0",
                                     "main/CIFAR-10/Dir_0.1/local/FedOCP_no_client_contrastive/s0",
                                     "sweep/CIFAR-10/Dir_0.1/local/lambda_con=10.0/s0",
                                     "sweep/CIFAR-10/Dir_0.1/local/lambda_con=100.0/s0",
                                     "sweep/CIFAR-10/Dir_0.1/local/tau_server=0.01/s0",
                                     "sweep/CIFAR-10/Dir_0.1/local/tau_server=1.0/s0"]
    # extended: + λ × 0.1 (3), server_epochs 10, server_lr 0.001, server_batch 10, server_orth_init → 14 + 7 = 21
    wide = tool.sweep_plan(extended=True)
    assert sum(len(v) for _, v in wide.values()) - len(tool.SWEEP_AS_ABLATION) == 21
    assert wide["server_orth_init"] == (False, [True]) and wide["server_epochs"] == (100, [1, 10])
    with pytest.raises(ValueError, match="anchor_steps"):
        tool.sweep_plan(["anchor_steps"])
    with pytest.raises(SystemExit) as bad:
        tool.main(["--sweep-bench", "CIFAR-100/Dir(0.1)", "--report-only"])
    assert bad.value.code == 2


def test_a_later_data_set_runs_the_extension_methods() -> None:
    tool = _tool()
    per_ds = tool.methods_per_dataset(["CIFAR-10", "Fashion-MNIST"], list(tool.METHODS), tool.EXTENSION_METHODS)
    assert per_ds["CIFAR-10"] == list(tool.METHODS)
    assert per_ds["Fashion-MNIST"] == ["FedProto", "FedGH", "FedTGP", "FedORGP", "FedOCP"]
    jobs = tool.make_jobs(["CIFAR-10", "Fashion-MNIST"], ["Dir(0.1)", "2 classes/client"], per_ds, [0, 1], **KW)
    # CIFAR-10: 10 methods × 2 splits × 2 seeds; Fashion-MNIST: 5 × 2 × 2, after it, the same cells as
    # the 5-method grid of Fashion-MNIST alone (so its records keep their keys)
    assert [j.tags["dataset"] for j in jobs] == ["CIFAR-10"] * 40 + ["Fashion-MNIST"] * 20
    alone = tool.make_jobs(["Fashion-MNIST"], ["Dir(0.1)", "2 classes/client"], per_ds["Fashion-MNIST"], [0, 1], **KW)
    assert [(j.key, j.config) for j in jobs[40:]] == [(j.key, j.config) for j in alone]
    # the first data set keeps every method; an extension list names only methods the grid runs
    assert tool.methods_per_dataset(["MNIST"], ["FedOCP"], ["FedProto"]) == {"MNIST": ["FedOCP"]}
    assert tool.methods_per_dataset(["MNIST", "CIFAR-10"], ["FedOCP"], ["FedProto"])["CIFAR-10"] == []
    assert tool.methods_per_dataset(["MNIST", "CIFAR-10"], ["FedOCP"])["CIFAR-10"] == ["FedOCP"]


def test_the_report_keeps_the_protocols_apart(tmp_path: Path) -> None:
    tool = _tool()

    def rec(ct: str | None, weighted: float | None, mean: float) -> dict:
        final = {"client_accuracy_mean": mean} | ({} if weighted is None else {"client_accuracy_weighted": weighted})
        r = {"key": f"main/MNIST/Dir_0.1/{ct}/FedOCP/s0", "grid": "main", "dataset": "MNIST", "split": "Dir(0.1)",
             "method": "FedOCP", "seed": 0, "final": final, "up_bytes_per_client_round": 1.0,
             "down_bytes_per_client_round": 1.0}
        if ct is not None:
            r["client_test"] = ct
        return r

    # the weighted figure when the line has it; an old record without client_test reads as "shared"
    results = {"a": rec("local", 0.6, 0.5), "b": rec(None, None, 0.2)}
    text = tool.report(results, out=tmp_path, datasets=["MNIST"], splits=["Dir(0.1)"], methods=["FedOCP"],
                       seeds=[0], settings={**KW}, wall_s=None, commit="x", verify=[],
                       client_tests=["local", "shared"])
    row = next(line for line in text.splitlines() if line.startswith("| FedOCP |"))
    # no rounds on hand (no run folder, no per_round): the best round is n/r, the last is the record's
    assert "| n/r / 60.00 | n/r / 20.00 |" in row
    assert "Dir(0.1), local test" in text and "Dir(0.1), shared test" in text


SETTINGS = {"rounds": 3, "epochs": 1, "clients": 4, "train_samples": 10_000, "lr": 0.01, "group": "htfe4-cpu",
            "server_epochs": 0}


def _rec(method: str, seed: int, curve: list[float] | None, cos: list[float] | None = None, *,
         last: float | None = None, sweep: tuple[str, float] | None = None) -> dict:
    """A finished record on CIFAR-10 Dir(0.1), local test; ``curve`` the per-round client accuracy
    (``None``: a record made before records carried their rounds)."""
    key = (f"sweep/CIFAR-10/Dir_0.1/local/{sweep[0]}={sweep[1]}/s{seed}" if sweep
           else f"main/CIFAR-10/Dir_0.1/local/{method}/s{seed}")
    final = {"client_accuracy_weighted": curve[-1] if curve else last}
    rec: dict[str, object] = {
           "key": key, "grid": "sweep" if sweep else "main", "dataset": "CIFAR-10", "split": "Dir(0.1)",
           "client_test": "local", "method": method, "seed": seed, "rounds": 3, "seconds": 36.0, "final": final,
           "up_bytes_per_client_round": 100.0, "down_bytes_per_client_round": 200.0, "commit": "abc1234"}
    if sweep:
        rec.update(sweep_key=sweep[0], value=sweep[1])
    if curve is not None:
        rec["per_round"] = {"round": list(range(1, len(curve) + 1)), "client_accuracy_weighted": curve,
                            **({"global_prototype_cosine": cos} if cos else {})}
    return rec


def test_report_figures_from_records(tmp_path: Path) -> None:
    tool = _tool()
    recs = [
        # FedOCP, 3 seeds: best 72, 74, 68; last 70, 74, 68; last cosine −0.05, −0.07, −0.03
        _rec("FedOCP", 0, [0.60, 0.72, 0.70], [0.2, 0.0, -0.05]),
        _rec("FedOCP", 1, [0.62, 0.66, 0.74], [0.1, -0.07, -0.07]),
        _rec("FedOCP", 2, [0.58, 0.64, 0.68], [0.1, 0.0, -0.03]),
        # FedTGP on seeds 0 and 1 only: best 66, 72; cosine 0.30, 0.20
        _rec("FedTGP", 0, [0.50, 0.60, 0.66], [0.4, 0.3, 0.30]),
        _rec("FedTGP", 1, [0.55, 0.72, 0.70], [0.4, 0.3, 0.20]),
        # FedProto: seed 1's record has no rounds (last 80 %, best and cosine n/r)
        _rec("FedProto", 0, [0.65, 0.69, 0.69], [0.5, 0.5, 0.5]),
        _rec("FedProto", 1, None, last=0.80),
        _rec("FedProto", 2, [0.50, 0.60, 0.62], [0.6, 0.6, 0.6]),
        # FedORGP on seeds 0, 1 (best 70, 66); at 100 server epochs on seed 0 (best 71)
        _rec("FedORGP", 0, [0.60, 0.70, 0.68]),
        _rec("FedORGP", 1, [0.60, 0.66, 0.66]),
        _rec("FedORGP 100 server epochs", 0, [0.65, 0.71, 0.70]),
        # ablations: no orthogonal init on seeds 0, 1 (best 66, 71); no client contrastive on seed 0 (best 75)
        _rec("FedOCP no orthogonal init", 0, [0.60, 0.65, 0.66]),
        _rec("FedOCP no orthogonal init", 1, [0.60, 0.70, 0.71]),
        _rec("FedOCP no client contrastive", 0, [0.70, 0.75, 0.74]),
        # no client orthogonality on seeds 0, 1 (best 70, 75): −2 and +1, a cost within the spread
        _rec("FedOCP no client orthogonality", 0, [0.60, 0.70, 0.69], [0.1, 0.2, 0.30]),
        _rec("FedOCP no client orthogonality", 1, [0.60, 0.75, 0.74], [0.1, 0.2, 0.50]),
        # the sweep: λ_align = 100 (FedORGP's λ_c) on seed 0 (best 73); τ_server = 1 on seeds 0, 1 (best 55, 60)
        _rec("FedOCP", 0, [0.50, 0.73, 0.72], sweep=("lambda_align", 100.0)),
        _rec("FedOCP", 0, [0.50, 0.55, 0.52], [0.9, 0.9, 0.9], sweep=("tau_server", 1.0)),
        _rec("FedOCP", 1, [0.50, 0.60, 0.58], [0.8, 0.8, 0.8], sweep=("tau_server", 1.0)),
    ]
    # as in --report-only on a fresh checkout: the records in OUT/results.jsonl, no run folders
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    results = tool.load_results(tmp_path)
    assert len(results) == len(recs)
    text = tool.report(results, out=tmp_path, datasets=["CIFAR-10"], splits=["Dir(0.1)"], methods=list(tool.METHODS),
                       seeds=[0, 1, 2], settings=SETTINGS, wall_s=None, commit="def5678", verify=[],
                       sweep=("CIFAR-10", "Dir(0.1)", "local"))
    lines = text.splitlines()

    def row(prefix: str) -> str:
        return next(line for line in lines if line.startswith(prefix))

    # FedOCP: best (72 + 74 + 68) / 3 = 71.33, population std √((0.67² + 2.67² + 3.33²) / 3) = 2.49; last
    # (70, 74, 68) → 70.67 ± 2.49; first round ≥ 70 %: 2, 3, never; cosine −0.050 ± √(0.0008 / 3) = 0.016
    assert row("| FedOCP |") == "| FedOCP | 71.33 ± 2.49 / 70.67 ± 2.49 | 2 · 3 · never | -0.050 ± 0.016 |"
    # FedTGP on 2 of 3 seeds: best (66, 72) → 69 ± 3, last (66, 70) → 68 ± 2; rounds: never, 2
    assert row("| FedTGP |") == ("| FedTGP | 69.00 ± 3.00 (2 of 3 seeds) / 68.00 ± 2.00 (2 of 3 seeds) | "
                                 "never · 2 (seeds 0, 1) | 0.250 ± 0.050 |")
    # FedProto: best of the two seeds with rounds (69, 62) → 65.5 ± 3.5; last of all three (69, 80, 62)
    # → 70.33 ± 7.41; rounds: never (69 < 70), n/r, never
    assert row("| FedProto |") == ("| FedProto | 65.50 ± 3.50 (2 of 3 seeds) / 70.33 ± 7.41 | never · n/r · never | "
                                   "0.550 ± 0.050 |")
    assert row("| FedGH |") == "| FedGH | – | – | – |"
    # the headline: FedORGP's two rows on the seed they share with FedOCP (0): 70 and 71 → the stronger,
    # 100 server epochs, 72 − 71 = +1 pp, under the +6.8 pp bar → direction only
    assert ("- CIFAR-10 Dir(0.1) (local test), seeds [0]: FedOCP 72.00 vs FedORGP 100 server epochs 71.00 → "
            "+1.00 pp (1 seed) → **direction only, provisional: 1 pair, no spread to judge it by**.") in lines
    assert ("- FedOCP vs FedORGP over 1 setting: +1.00 ± 0.00 pp over 1 (setting, seed) pair, ahead in 1 of 1 → "
            "**direction only, provisional: 1 pair, no spread to judge it by** (the paper: +6.8 pp on "
            "CIFAR-100).") in lines
    # the best baseline over the seeds FedOCP and every baseline on record share (seed 0): FedProto 69,
    # FedTGP 66, FedORGP 70, FedORGP 100 server epochs 71 → the last, +1 pp → direction only
    assert ("- CIFAR-10 Dir(0.1) (local test), seeds [0]: FedOCP 72.00 vs the best baseline FedORGP 100 server "
            "epochs 71.00 → +1.00 pp (1 seed) → **direction only, provisional: 1 pair, no spread to judge it "
            "by**.") in lines
    assert ("- FedOCP vs the best baseline over 1 setting: +1.00 ± 0.00 pp over 1 (setting, seed) pair, ahead in 1 "
            "of 1 → **direction only, provisional: 1 pair, no spread to judge it by**.") in lines
    # FedOCP at λ_align = 100 on seed 0 (73) against the stronger FedORGP there (100 server epochs, 71): +2 pp
    assert ("- At FedORGP's alignment weight (the sweep's λ_align = 100; CIFAR-10 Dir(0.1), local test): FedOCP − "
            "FedORGP 100 server epochs +2.00 pp (1 seed) → **direction only, provisional: 1 pair, no spread to judge "
            "it by** (FedOCP's orthogonal init, orthogonality and contrastive losses and server InfoNCE, against "
            "FedORGP's loss at the same λ).") in lines
    # FedOCP − FedORGP on seeds 0, 1: 72 − 70 = 2, 74 − 66 = 8 → 5 ± 3
    assert "- FedOCP − FedORGP: CIFAR-10 Dir(0.1) (local) +5.00 ± 3.00 pp (2 seeds); +5.00 pp on average." in lines
    # FedOCP − FedProto on seeds 0, 2: 72 − 69 = 3, 68 − 62 = 6 → 4.5 ± 1.5; − FedTGP on 0, 1: 6, 2 → 4 ± 2
    assert "- FedOCP − FedProto: CIFAR-10 Dir(0.1) (local) +4.50 ± 1.50 pp (2 seeds); +4.50 pp on average." in lines
    assert "- FedOCP − FedTGP: CIFAR-10 Dir(0.1) (local) +4.00 ± 2.00 pp (2 seeds); +4.00 pp on average." in lines
    # removing the orthogonal init costs FedOCP − it on seeds 0, 1: 72 − 66 = 6, 74 − 71 = 3 → +4.5 ± 1.5 pp,
    # beyond the spread but short of T5's 42.34 − 34.37 = +7.97 pp → direction only
    assert row("- FedOCP no orthogonal init:") == (
        "- FedOCP no orthogonal init: removing it costs (FedOCP − it) CIFAR-10 Dir(0.1) (local) +4.50 ± 1.50 pp "
        "(2 seeds); over all pairs +4.50 ± 1.50 pp (2 (setting, seed) pairs), a cost in 1 of 1 setting; against "
        "T5's +7.97 pp → **direction only**.")
    # no client contrastive on seed 0: 72 − 75 = −3 → no cost → not reproduced (one pair: provisional)
    assert row("- FedOCP no client contrastive:").endswith(
        "(local) -3.00 pp (1 seed); over all pairs -3.00 ± 0.00 pp (1 (setting, seed) pair), a cost in 0 of 1 "
        "setting; against the sign: T5 gives no single step for it → **not reproduced, provisional: 1 pair, no "
        "spread to judge it by**.")
    # no client orthogonality on seeds 0, 1: 72 − 70 = 2, 74 − 75 = −1 → a cost of +0.5 ± 1.5: a positive
    # mean no larger than its spread → not reproduced, with that said
    assert row("- FedOCP no client orthogonality:").endswith(
        "over all pairs +0.50 ± 1.50 pp (2 (setting, seed) pairs), a cost in 1 of 1 setting; against the sign: T5 "
        f"gives no single step for it → **{NOISY_VERDICT}**.")
    assert not any(line.startswith("- FedOCP no server contrastive: removing") for line in lines)  # none on record
    # cosine: FedOCP −0.05 over 3 seeds, |−0.05| ≤ 0.1; vs FedProto on seeds 0, 2: FedOCP (−0.05 − 0.03) / 2
    # = −0.04, FedProto (0.5 + 0.6) / 2 = 0.55; vs FedTGP on 0, 1: −0.06 against 0.25
    assert ("- CIFAR-10 Dir(0.1) (local test): FedOCP -0.050 (3 of 3 seeds) → **orthogonal or more separated**; "
            "more separated than 2 of 2 baselines: FedProto +0.550 (FedOCP -0.040, 2 seeds); FedTGP +0.250 "
            "(FedOCP -0.060, 2 seeds).") in lines
    # the mechanisms' cosines: no client orthogonality 0.30 − (−0.05) = 0.35, 0.50 − (−0.07) = 0.57 →
    # +0.460 ± 0.110; no orthogonal init has no cosine series, so no line
    assert ("- FedOCP no client orthogonality: CIFAR-10 Dir(0.1) (local) +0.460 ± 0.110 (2 seeds); removing it costs "
            "+0.50 ± 1.50 pp (2 pairs) of accuracy (above)") in lines
    assert not any(line.startswith("- FedOCP no orthogonal init: CIFAR") for line in lines)
    # the sweep: the default row is main FedOCP on the swept seeds 0, 1 (72, 74 → 73 ± 1; cosine −0.05,
    # −0.07 → −0.060 ± 0.010); τ_server = 1: (55, 60) → 57.5 ± 2.5, per seed 55 − 72 = −17, 60 − 74 = −14
    assert "| tau_server | 0.1 (default) | 73.00 ± 1.00 | – | -0.060 ± 0.010 | 2 |" in lines
    assert "| tau_server | 1.0 | 57.50 ± 2.50 | -15.50 ± 1.50 pp (2 seeds) | 0.850 ± 0.050 | 2 |" in lines
    assert "| tau_server | 0.01 | – | – | – | 0 |" in lines  # planned, not run
    # λ_con = 0 is the ablation's cell on the swept seed 0: 75, 75 − 72 = +3
    assert ("| lambda_con | 0.0 (= ablation 'no client contrastive') | 75.00 | +3.00 pp (1 seed) | – | 1 |") in lines
    assert ("- sweep `tau_server` (1 of 2 values on record): the default is the best value on record; drops of "
            "≥ 10 pp: 1.0 -15.50 ± 1.50 pp (2 seeds).") in lines
    assert ("- sweep `lambda_con` (1 of 3 values on record): 0.0 (= ablation 'no client contrastive') is ahead by "
            "+3.00 pp (1 seed), one seed: no spread to judge by; no value on record drops ≥ 10 pp.") in lines
    assert "`anchor_steps`: unused here" in text
    # the CPU plan at 3 rounds × 10,000 images: 8 + 3 × 36 = 116 s a cell; main 1 split × 10 methods × 3
    # seeds = 30 cells → 0.97 core-hours, sweep 14 values × 3 seeds = 42 → 1.35; on record 16 main cells
    # and 3 sweep cells of 36 s each: 0.16 and 0.03 cell-hours; 2.32 core-hours in all
    assert "| main, CIFAR-10 | 30 | 1.0 | 16, 0.16 |" in lines
    assert "| sweep, CIFAR-10 Dir(0.1) | 42 | 1.4 | 3, 0.03 |" in lines
    assert "All parts: ≈ 2.3 core-hours, ≈ 1.2 h wall on 2 workers when nothing else runs. Each part resumes " \
           "where it stopped." in lines
    assert "Records made at commit(s) `abc1234`." in text and "commit `def5678`" in text


@pytest.mark.parametrize(("cos", "verdict"), [(-0.109, "orthogonal or more separated"),
                                            (0.1, "orthogonal or more separated"),
                                            (0.2, "not orthogonal (mean cosine above the threshold)")])
def test_prototype_geometry_verdict_counts_the_simplex_as_separated(cos: float, verdict: str, tmp_path: Path) -> None:
    """A mean inter-class cosine of −0.109 is near −1/9, the simplex, the most separated 10 unit
    vectors can be (‖Σ p_c‖² = 10 + 90·mean ≥ 0): it counts as separated, not as "not orthogonal";
    a lower mean than a baseline's is the more separated set, even when the baseline is nearer 0."""
    tool = _tool()
    recs = [_rec("FedOCP", 0, [0.60, 0.70], [0.0, cos]), _rec("FedGH", 0, [0.60, 0.65], [0.0, 0.005])]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    lines = tool.report(tool.load_results(tmp_path), out=tmp_path, datasets=["CIFAR-10"], splits=["Dir(0.1)"],
                        methods=["FedOCP", "FedGH"], seeds=[0], settings=SETTINGS, wall_s=None, commit="def5678",
                        verify=[], sweep=("CIFAR-10", "Dir(0.1)", "local")).splitlines()
    line = next(x for x in lines if x.startswith("- CIFAR-10 Dir(0.1) (local test): FedOCP"))
    assert f"FedOCP {cos:+.3f} (1 of 1 seeds) → **{verdict}** (so are FedGH†: the threshold alone" in line
    assert f"more separated than {int(cos < 0.005)} of 1 baselines" in line


def test_a_sweep_record_without_rounds_prints_not_recorded(tmp_path: Path) -> None:
    """A sweep cell on record whose rounds are not (no ``per_round``, no run folder): its best
    round and cosine are unknown, n/r, not "–" (which says the cell was not run)."""
    tool = _tool()
    recs = [_rec("FedOCP", 0, [0.60, 0.72, 0.70], [0.2, 0.0, -0.05]),
            _rec("FedOCP", 0, None, last=0.5, sweep=("tau_server", 1.0))]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    text = tool.report(tool.load_results(tmp_path), out=tmp_path, datasets=["CIFAR-10"], splits=["Dir(0.1)"],
                       methods=["FedOCP"], seeds=[0], settings=SETTINGS, wall_s=None, commit="def5678", verify=[],
                       sweep=("CIFAR-10", "Dir(0.1)", "local"), sweep_values=tool.sweep_plan(["tau_server"]))
    lines = text.splitlines()
    # the default row: main FedOCP seed 0, best round 72 %, last cosine −0.05
    assert "| tau_server | 0.1 (default) | 72.00 | – | -0.050 | 1 |" in lines
    assert "| tau_server | 1.0 | n/r | – | n/r | 0 of 1 |" in lines  # on record, rounds not
    assert "| tau_server | 0.01 | – | – | – | 0 |" in lines  # not run


@pytest.mark.parametrize("argv", [["--rounds", "-1"], ["--rounds", "0"], ["--clients", "0"], ["--epochs", "0"],
                                  ["--workers", "0"], ["--verify", "-1"], ["--train-samples", "-5"],
                                  ["--server-epochs", "-1"], ["--lr", "0"], ["--seeds", "x"], ["--methods", "Nope"]])
def test_bad_options_are_usage_errors(argv: list[str], tmp_path: Path) -> None:
    """Each used to reach the grid: every cell recorded as a ConfigError, exit 0."""
    with pytest.raises(SystemExit) as exc:
        _tool().main([*argv, "--out", str(tmp_path / "grid"), "--report", str(tmp_path / "r.md")])
    assert exc.value.code == 2
    assert not (tmp_path / "grid").exists()  # refused before any folder or cell was made
