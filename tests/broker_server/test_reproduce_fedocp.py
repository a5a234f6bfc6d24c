"""The FedOCP reproduction grid: each cell names its evaluation protocol (key, tags, config), its
configuration passes the run checks, and the report never mixes the two protocols."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from broker_server.config import from_dict

ROOT = Path(__file__).resolve().parents[2]
KW = dict(rounds=2, epochs=1, clients=4, train_samples=400, lr=0.01, group="htfe4-cpu", server_epochs=5,
          data_dir="")


def _tool():
    spec = importlib.util.spec_from_file_location("reproduce_fedocp", ROOT / "tools" / "reproduce_fedocp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    assert "| – / 60.00 ± 0.00 | – / 20.00 ± 0.00 |" in row  # no metrics.jsonl here: no best round
    assert "Dir(0.1), local test" in text and "Dir(0.1), shared test" in text
