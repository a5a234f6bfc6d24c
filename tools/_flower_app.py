"""The Flower app of the benchmarks' ``flwr run`` parts (simulation engine and deployment mode):
a ServerApp running Flower's FedAvg (message API) with the server's evaluation after each round,
and a ClientApp training with :class:`tools._flower.Trainer`. Imported only by the Flower venv's
processes (``tools/_flower.py`` writes the app's ``pyproject.toml``, whose components name
``tools._flower_app:server_app`` and ``tools._flower_app:client_app``).

Run config (``flwr run --run-config``): ``job`` (the job file, :func:`tools._flower.write_job`),
``result`` (where the ServerApp writes its marks and the clients' metrics), ``rounds``,
``clients``. The ClientApp's shard is its node config's ``partition-id`` (set by the simulation
engine, or by ``flower-supernode --node-config``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from tools import _flower

server_app = ServerApp()
client_app = ClientApp()

_trainers: dict[tuple[str, int], _flower.Trainer] = {}


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """One local round of client ``partition-id``; the reply carries the new arrays and the
    metrics ``num-examples``, ``train_loss``, ``train_s``, ``wait_s`` (for a training slot),
    ``setup_s`` (making the trainer: data, shard, model; 0 when this process already had it) and
    ``proc_age_s`` (this process's age when the message arrived)."""
    age = _flower.process_age_s()
    job_path = str(context.run_config["job"])
    shard = int(context.node_config["partition-id"])
    key = (job_path, shard)
    setup = 0.0
    if key not in _trainers:
        t0 = time.perf_counter()
        _trainers[key] = _flower.Trainer(_flower.load_job(job_path), shard)
        setup = time.perf_counter() - t0
    trainer = _trainers[key]
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    rnd = int(msg.content["config"]["server-round"])
    r = trainer.fit(arrays, rnd)
    metrics = MetricRecord({"num-examples": r.num_samples, "train_loss": r.train_loss, "train_s": r.train_s,
                            "wait_s": r.wait_s, "setup_s": setup, "proc_age_s": age, "shard": shard,
                            "round": rnd, "pid": os.getpid()})
    return Message(content=RecordDict({"arrays": ArrayRecord(r.tensors), "metrics": metrics}), reply_to=msg)


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """FedAvg over every node for ``rounds`` rounds from fedfleet's initial server model, no
    federated evaluation (fedfleet evaluates on the server only), the server's evaluation after
    each round; writes ``result`` as ``{"flwr", "marks", "clients"}`` (marks: round 0 when the
    first round starts, round r after its evaluation, with its accuracy and loss; clients:
    round → each reply's metrics)."""
    import flwr

    rc = context.run_config
    job = _flower.load_job(str(rc["job"]))
    ev = _flower.Evaluator(job)
    n = int(rc["clients"])
    marks: list[dict] = []
    clients: dict[int, list[dict]] = {}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0:  # the initial model: not evaluated (fedfleet does not either)
            marks.append({"round": 0, "t": time.time()})
            return None
        acc, loss = ev.evaluate(arrays.to_numpy_ndarrays())
        marks.append({"round": server_round, "t": time.time(), "accuracy": acc, "loss": loss})
        return MetricRecord({"accuracy": acc, "loss": loss})

    def train_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
        rows = [{k: v for k, v in rec["metrics"].items()} for rec in records]
        if rows:
            clients[int(rows[0]["round"])] = rows
        total = sum(float(r[weight_key]) for r in rows) or 1.0
        return MetricRecord({"train_loss": sum(float(r["train_loss"]) * float(r[weight_key]) for r in rows) / total})

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n,
                      train_metrics_aggr_fn=train_metrics)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(ev.initial_arrays()), num_rounds=int(rc["rounds"]),
                   evaluate_fn=evaluate_fn)
    Path(str(rc["result"])).write_text(json.dumps({"flwr": flwr.__version__, "marks": marks, "clients": clients}))
