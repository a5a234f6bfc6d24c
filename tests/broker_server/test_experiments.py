"""The reproduction grid runner: resumable results, bytes per client per round from the ledger,
and the ensemble (GAcc) score checked against a second computation."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from broker_server.experiments import Job, config_fingerprint, load_results, mean_std, run_grid


def _config(algorithm: str, clients: int, seed: int) -> dict:
    return {"run": {"name": "g", "seed": seed, "rounds": 2},
            "data": {"dataset": "digits", "partition": "iid", "clients": clients},
            "train": {"algorithm": algorithm, "local_epochs": 1, "batch_size": 16, "lr": 0.05},
            "server": {"quorum": clients, "round_deadline_s": 60.0, "join_timeout_s": 60.0, "client_eval": True,
                       "client_eval_max": 300},
            "broker": {"kind": "amqtt"}}


def test_grid_runs_resumes_and_accounts(tmp_path: Path) -> None:
    jobs = [Job("digits/c1/fedavg/s0", _config("fedavg", 1, 0), ensemble=True, tags={"method": "fedavg"}),
            Job("digits/c2/fedavg/s1", _config("fedavg", 2, 1), tags={"method": "fedavg"})]
    res = run_grid(jobs, tmp_path, workers=2, stamp={"commit": "abc1234"})
    assert set(res) == {j.key for j in jobs}
    # each new record names the configuration it was made with and carries the caller's stamp
    assert all(res[j.key]["config_sha256"] == config_fingerprint(j.config) for j in jobs)
    assert {r["commit"] for r in res.values()} == {"abc1234"}
    assert all("error" not in r for r in res.values()), res
    one = res["digits/c1/fedavg/s0"]
    # one client: the ensemble of its probabilities classifies like the client's own model
    assert one["ensemble_accuracy"] == pytest.approx(one["final"]["client_accuracy_mean"])
    # bytes per client per round: recomputed from the ledger rows of rounds >= 1, device side
    two = res["digits/c2/fedavg/s1"]
    con = sqlite3.connect(tmp_path / "runs" / "digits__c2__fedavg__s1" / "ledger.sqlite")
    up = con.execute("select sum(mqtt_header_bytes + topic_bytes + payload_bytes) from messages where side='agent' "
                     "and direction='up' and event in ('sent') and round >= 1").fetchone()[0]
    assert two["up_bytes_per_client_round"] == pytest.approx(up / (2 * 2))
    assert two["method"] == "fedavg"
    body = con.execute("select avg(body_bytes), avg(payload_bytes) from messages where side='agent' and kind='update' "
                       "and event='sent'").fetchone()
    assert sum(two["update_field_bytes_mean"].values()) + 1 == pytest.approx(body[0])  # + the body array header
    assert two["update_payload_bytes_mean"] == pytest.approx(body[1])
    # rerun: nothing new is run
    seen = []
    again = run_grid(jobs, tmp_path, workers=2, on_result=seen.append)
    assert seen == [] and set(again) == set(res)
    assert len(load_results(tmp_path)) == 2
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2


def test_mean_std() -> None:
    assert mean_std([1.0, 3.0]) == (2.0, 1.0)
    m, s = mean_std([])
    assert m != m and s != s
