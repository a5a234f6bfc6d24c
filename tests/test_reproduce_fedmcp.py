"""The FedMCP++ reproduction grid: job keys (what a resumed grid reuses) and the report's grouping."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("reproduce_fedmcp", ROOT / "tools" / "reproduce_fedmcp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
