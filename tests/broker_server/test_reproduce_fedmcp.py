"""The FedMCP++ reproduction grid: job keys (what a resumed grid reuses) and the report's grouping."""

from __future__ import annotations

import pytest
from helpers.tools import load_tool


def _tool():
    return load_tool("reproduce_fedmcp")


def test_job_keys_keep_the_default_budget_format_and_name_other_budgets() -> None:
    tool = _tool()
    jobs = tool.make_jobs(["mnist", "usps"], [10, 20], ["Local", "FedMCP++"], [0], rounds=15,
                          train_samples=6000, dirichlet=True, wire=False)
    keys = [j.key for j in jobs]
    # 2 data sets × 2 client counts IID + 2 data sets Dirichlet at the first count, × 2 methods
    assert len(keys) == (2 * 2 + 2) * 2 == len(set(keys))
    # the format of the records already in benchmarks/results/fedmcp.jsonl, so a resume reuses them
    assert "mnist/c10/FedMCPpp/s0" in keys and "mnist/dir0.3/c10/Local/s0" in keys
    assert "usps/dir0.3/c10/FedMCPpp/s0" in keys and not any("dir0.3/c20" in k for k in keys)
    dirichlet = [j for j in jobs if "dir0.3" in j.key]
    assert {j.config["data"]["partition"] for j in dirichlet} == {"dirichlet"}
    assert {j.config["data"]["partition"] for j in jobs if j not in dirichlet} == {"iid"}

    other = tool.make_jobs(["mnist"], [10], ["Local"], [1], rounds=15, train_samples=30000, dirichlet=True,
                           wire=False, iid=False)
    assert [j.key for j in other] == ["mnist/n30000/dir0.3/c10/Local/s1"]
    assert other[0].config["data"]["train_samples"] == 30000 and other[0].tags["train_samples"] == 30000


def _record(key: str, acc: float, *, n: int | None = None, partition: str = "iid") -> dict:
    r = {"key": key, "dataset": "mnist", "clients": 10, "method": key.split("/")[-2].replace("pp", "++"),
         "seed": int(key[-1]), "partition": partition, "ensemble_accuracy": 0.9,
         "up_bytes_per_client_round": 100.0, "down_bytes_per_client_round": 50.0,
         "final": {"client_accuracy_mean": acc, "client_f1_mean": acc, "client_accuracy_worst": acc}}
    if n is not None:
        r["train_samples"] = n
    return r


def test_report_groups_runs_by_training_budget() -> None:
    tool = _tool()
    results = {r["key"]: r for r in [
        _record("mnist/dir0.3/c10/Local/s0", 0.60, partition="dirichlet(0.3)"),  # an old record: no budget tag
        _record("mnist/dir0.3/c10/FedMCPpp/s0", 0.40, n=6000, partition="dirichlet(0.3)"),
        _record("mnist/n30000/dir0.3/c10/Local/s0", 0.80, n=30000, partition="dirichlet(0.3)"),
        _record("mnist/n30000/dir0.3/c10/FedMCPpp/s0", 0.85, n=30000, partition="dirichlet(0.3)"),
        _record("mnist/n30000/dir0.3/c10/FedMCPpp/s1", 0.95, n=30000, partition="dirichlet(0.3)"),
    ]}
    text = tool.report(results, rounds=15, train_samples=6000, seeds=[0], wall_s=None)
    assert "| mnist | dirichlet(0.3) | 6,000 | 10 | Local | 60.00 |" in text
    assert "| mnist | dirichlet(0.3) | 6,000 | 10 | FedMCP++ | 40.00 |" in text
    # two seeds at 30,000: mean 90, population std sqrt(((85-90)² + (95-90)²) / 2) = 5
    assert "| mnist | dirichlet(0.3) | 30,000 | 10 | FedMCP++ | 90.00 ± 5.00 |" in text
    # gains over Local per configuration: 40 − 60 = −20 at 6,000; 90 − 80 = +10 at 30,000
    assert "mnist/dirichlet(0.3)/10: -20.00" in text and "mnist(30,000)/dirichlet(0.3)/10: +10.00" in text
    assert "better in 1 of 2 configurations" in text


def _diag():
    return load_tool("diagnose_fedmcp_skew")


def _trace_record(n: int, variant: str, rnd: int, acc: float, *, top: float = 0.2, after: float | None = None) -> dict:
    return {"dataset": "mnist", "train_samples": n, "variant": variant, "round": rnd, "client_acc_mean": acc,
            "client_acc_min": acc / 2, "teacher_acc": 0.75, "teacher_top_prob": top,
            "after_align_acc_mean": after, "after_align_max_logit": None if after is None else 1.5}


def test_skew_trace_reading_is_computed_from_the_records() -> None:
    diag = _diag()
    records = [_trace_record(600, "none", 1, 0.20), _trace_record(600, "none", 2, 0.40),
               _trace_record(600, "kd", 1, 0.20), _trace_record(600, "kd", 2, 0.15, after=0.12),
               _trace_record(3000, "none", 1, 0.50, top=0.47), _trace_record(3000, "none", 2, 0.60),
               _trace_record(3000, "kd", 1, 0.50, top=0.47), _trace_record(3000, "kd", 2, 0.65, after=0.55)]
    text = diag.report(records, dataset="mnist", clients=10, alpha=0.3, lr=0.05, seed=0, wall_s=None)
    assert "| 600 | kd | 2 | 15.0 | 7.5 | 75.0 | 0.200 | 12.0 | 1.50 |" in text
    # round 2 (the last): 15 − 40 = −25 pp at 600 images, 65 − 60 = +5 pp at 3,000
    assert "`kd` gives 15.0 % after CE against 40.0 % without it (-25.0 pp)" in text
    assert "`kd` gives 65.0 % after CE against 60.0 % without it (+5.0 pp)" in text
    assert "When the round-1 clients are weak" in text  # hurts at the small budget, helps at the large one
    flipped = [dict(r, client_acc_mean=0.9) if r["variant"] == "kd" else r for r in records]
    assert "When the round-1 clients are weak" not in diag.report(flipped, dataset="mnist", clients=10, alpha=0.3,
                                                                  lr=0.05, seed=0, wall_s=None)


def _mnist_available() -> bool:
    from edge_agent.data import load_dataset
    from edge_agent.errors import DataError

    try:
        load_dataset("mnist", allow_download=False)
    except DataError:
        return False
    return True


@pytest.mark.skipif(not _mnist_available(), reason="MNIST files not found (../shared/data or FEDFLEET_DATA)")
def test_skew_trace_round_one_is_the_same_with_and_without_alignment() -> None:
    """Round 1 has no teacher: every variant trains the same clients from the same seeds, so the
    round-1 records agree exactly; in round 2 distillation changes what the clients upload."""
    diag = _diag()
    none = diag.trace("mnist", 3, 600, "none", rounds=2, alpha=0.3, lr=0.05, seed=0)
    kd = diag.trace("mnist", 3, 600, "kd", rounds=2, alpha=0.3, lr=0.05, seed=0)
    assert none[0] == kd[0]
    assert kd[1]["after_align_acc_mean"] is not None and none[1]["after_align_acc_mean"] is None
    assert kd[1]["client_acc_mean"] != none[1]["client_acc_mean"]
    assert 0.0 < kd[0]["teacher_top_prob"] <= 1.0 and kd[0]["teacher_top_prob"] >= 0.1  # ≥ 1/C for C = 10


def test_keys_name_a_round_count_other_than_15_and_the_wire_runs_name_the_budget() -> None:
    tool = _tool()
    jobs = tool.make_jobs(["mnist"], [3], ["Local"], [0], rounds=2, train_samples=600, dirichlet=False, wire=True)
    assert [j.key for j in jobs] == ["mnist/n600/r2/c3/Local/s0", "wire/n600/r2/mnist/c10/fp32",
                                     "wire/n600/r2/mnist/c10/compact"]
    default = tool.make_jobs(["mnist"], [3], ["Local"], [0], rounds=15, train_samples=6000, dirichlet=False, wire=True)
    assert [j.key for j in default][1:] == ["wire/mnist/c10/fp32", "wire/mnist/c10/compact"]  # the records on file


def test_summary_survives_missing_figures_and_shares_ties() -> None:
    tool = _tool()
    skipped = _record("mnist/c10/Local/s0", 0.5)
    del skipped["final"]["client_accuracy_mean"]  # a run whose last round was skipped measured none
    rows = {"FedMCP++": [_record("mnist/c10/FedMCPpp/s0", 0.8)], "EnsKD": [_record("mnist/c10/EnsKD/s0", 0.8)],
            "Local": [skipped], "FedAvg": [], "FedPer": [], "FedRep": []}
    for r in rows["FedMCP++"]:
        r["update_payload_bytes_mean"] = 100.0
    s = tool._config_summary(rows)
    assert (s["rank"], s["methods"], s["gain_over_local"]) == (1, 2, None)  # a tie with EnsKD: both first
    assert s["best_other_worst_method"] == "EnsKD" and s["upload_ratio"] is None
    alone = tool._config_summary({"FedMCP++": rows["FedMCP++"], "Local": []})
    assert alone["best_other_worst"] is None and alone["rank"] == 1


def test_proxy_size_other_than_1000_reaches_the_proxy_methods_and_the_key() -> None:
    tool = _tool()
    jobs = tool.make_jobs(["kmnist"], [3], ["Local", "FedMCP++", "EnsKD"], [0], rounds=15, train_samples=6000,
                          dirichlet=False, wire=False, proxy_size=200)
    assert [j.key for j in jobs] == ["kmnist/p200/c3/Local/s0", "kmnist/p200/c3/FedMCPpp/s0",
                                     "kmnist/p200/c3/EnsKD/s0"]
    assert [j.config["algorithm"].get("proxy_size") for j in jobs] == [None, 200, 200]
