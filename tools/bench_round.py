"""Round benchmark of fedfleet: a round of the main job against its compute floor, per phase;
encode/decode against a plain copy, with peak memory; peak RSS per virtual agent; the main job
side by side under Flower 1.42 (simulation engine, deployment mode, legacy gRPC). Writes a
Markdown report (``benchmarks/round.md``) from JSON results kept per part, so a long run can be
resumed and parts re-run on their own.

Usage (from the repository root, on a quiet machine: nothing else busy, every figure is a time)::

    python tools/bench_round.py --out benchmarks/round.md                  # every part, full sizes
    python tools/bench_round.py --parts codec --redo --out benchmarks/round.md   # one part again
    python tools/bench_round.py --tiny --work /tmp/bench-round-tiny --out /tmp/round-tiny.md  # smoke
    python tools/bench_round.py --parts round,flower-sim,flower-deploy,flower-legacy --work /tmp/bench-round \\
        --out benchmarks/round.md                                     # fedfleet against Flower only

Parts (``--parts``; each one's results go to ``WORK/<part>.json`` and are reused unless ``--redo``):

1. ``round`` — the main job (``examples/mnist-fedavg.toml``: MNIST, light CNN, 10 clients,
   Dirichlet 0.5, 1 local epoch, ``--rounds`` rounds, seed 0) with :func:`broker_server.simulate.simulate`
   over the embedded broker, its thread plan as chosen (:func:`edge_agent.device.plan_threads`).
   Per round: wall seconds, the server's ``phase_s`` from ``metrics.jsonl`` (selection, publish,
   collect, receive/decode, accumulate, aggregate, evaluate, the previous round's checkpoint and
   registry, ledger writes) and the devices' own ``train_seconds``; every agent's own phases
   (waiting for a training slot, train, prepare/send the update, receive). Then, in the same
   process, the **compute floor**: the same epochs over the same shards (the same partition),
   with the same thread plan (``train_slots`` trainings at once, each with ``torch_threads``
   intra-op threads), in a plain torch loop (SGD with the job's lr/momentum/weight decay, batch
   size, a seeded ``randperm`` order), no MQTT, no encoding, starting each round from the
   previous round's plain average; plus the same evaluation of the global model. Ratio = steady
   fedfleet round (rounds 2..R) / steady floor round. A fedfleet round's steady time is the
   interval between its ``ended_s`` and the previous round's (under evaluation overlap a
   round's ``seconds`` run into the next round, so consecutive ``seconds`` overlap);
   ``--overlap-evaluation`` sets ``[server] overlap_evaluation`` for the run.
2. ``codec`` — :func:`protocol.messages.encode` / :func:`~protocol.messages.decode` of one
   float32 update of 10,000 values (40 KB) and of 11.2 M values (44.8 MB) against ``np.copyto``
   into a preallocated array and ``arr.copy()`` (which allocates, as an encode must), median of
   ``--reps``; peak traced memory (``tracemalloc``, numpy reports to it) of the encode, of a whole
   chunked :meth:`protocol.channel.Channel.send` (1 MiB chunks, a transport that keeps nothing)
   and of the decode, as multiples of the payload.
3. ``fleet`` — peak RSS (VmHWM) of a simulating process with 1, 100 and 500 virtual MNIST agents
   (IID, 2 rounds, one fresh child process per case), per agent beyond the 1-agent case (the data
   set and the process's fixed cost), and rounds per minute.

4. ``flower-sim``, ``flower-deploy``, ``flower-legacy`` — the job of part 1 (same configuration
   file and overrides, so the same data, Dirichlet partition, seeds, light CNN, initial model,
   local training code — ``FedAvgClient.local_round`` with the agents' ``TrainConfig`` — and the
   same server evaluation after each round) under Flower, from its own venv
   (``--flower-venv``, default ``WORK/flwr-venv``; created and ``--flower-spec`` installed when
   missing, reused otherwise; :mod:`tools._flower`):

   - ``flower-sim``: Flower's simulation engine, ``flower-superlink --insecure --simulation``
     and ``flwr run`` of the app (``tools/_flower_app.py``), Ray backend with
     ``init-args-num-cpus`` = train slots × torch threads and ``client-resources-num-cpus`` =
     torch threads, so Ray runs as many client actors as fedfleet trains at once;
   - ``flower-deploy``: deployment mode, a SuperLink and one ``flower-supernode --insecure``
     per client (``--node-config "partition-id=i num-partitions=N"``) as separate processes on
     127.0.0.1, then ``flwr run`` against them;
   - ``flower-legacy``: the deprecated gRPC ``start_server`` / ``start_client`` processes (as
     ``tools/bench_protocol.py`` part 4, without its byte-counting relay);
   - ``flower-sim-defaults``, ``flower-legacy-defaults``: the same two as Flower's users get
     them, with Flower's and torch's own resource defaults instead of fedfleet's thread plan:
     torch's intra-op default (one thread per core) in every process, the simulation engine's
     default client resources (2 CPUs per client actor: cores ÷ 2 actors), every legacy client
     process training at once. They show what the thread plan itself is worth; the goals are
     checked against both settings.

   Fairness: every process of every system runs with ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` and
   ``torch.set_num_threads`` at fedfleet's thread plan's torch threads (1 on 2 cores) and
   one inter-op thread, and no more trainings run at once than the plan's ``train_slots``
   (fedfleet: a semaphore; Flower: Ray's CPUs in simulation, :class:`tools._flower.TrainSlots`
   file locks across the client processes otherwise). Per round: wall seconds from the server's
   marks (round r ends after its evaluation, as fedfleet's ``seconds``), accuracy, the clients'
   training, slot waits and set-up (data, shard and model made in the client process); start-up:
   launch → first round and total wall − Σ rounds. The report compares steady rounds (2..R)
   with part 1's and checks the goals (fedfleet ≥ 3× faster per round than deployment mode,
   ≥ 1.5× than legacy gRPC, faster than the simulation engine, final accuracy within 0.3 pp).

``--tiny`` shrinks every part (digits, 3 clients, 2 rounds; 40 KB and 2 MB updates; 2 and 4
agents) to check that the tool works; its figures mean nothing. ``--clients N`` sets the job's
client count (and quorum) for parts 1 and 4.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools import _flower  # noqa: E402  (ROOT first on sys.path: run as a script)

PARTS = ("round", "codec", "fleet", "flower-sim", "flower-deploy", "flower-legacy", "flower-sim-defaults",
         "flower-legacy-defaults")
FLOWER_PARTS = PARTS[3:]
#: parts that run Flower as shipped (its own resource defaults), not at fedfleet's thread plan
DEFAULTS_PARTS = ("flower-sim-defaults", "flower-legacy-defaults")


# --------------------------------------------------------------------------------------------
# helpers


def code_commit() -> str:
    """The checkout's short commit, with " (uncommitted changes)" when the tree is dirty."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True,
                                text=True).stdout.strip())
    return commit + (" (uncommitted changes)" * dirty)


def machine() -> dict[str, Any]:
    import numpy as np
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "torch": torch.__version__, "numpy": np.__version__, "commit": code_commit(),
            "loadavg": os.getloadavg(), "when": time.strftime("%Y-%m-%d %H:%M")}


def vmhwm_mib() -> float:
    """Peak resident memory of this process (``VmHWM``), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def median_time(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def job_overrides(args: argparse.Namespace, over: dict[tuple[str, str], Any] | None = None) -> dict:
    """The ``{(section, key): value}`` overrides of the job's configuration file."""
    # every round evaluated, as the Flower runs it is compared with (their rounds end after it)
    o: dict[tuple[str, str], Any] = {("run", "rounds"): args.rounds, ("server", "eval_every"): 1}
    if getattr(args, "overlap_evaluation", ""):
        o[("server", "overlap_evaluation")] = args.overlap_evaluation
    if args.tiny:
        o.update({("data", "dataset"): "digits", ("data", "clients"): 3, ("server", "quorum"): 3,
                  ("run", "rounds"): 2})
    if args.clients:
        o.update({("data", "clients"): args.clients, ("server", "quorum"): args.clients})
    o.update(over or {})
    return o


def job_config(args: argparse.Namespace, over: dict[tuple[str, str], Any] | None = None):
    from broker_server import config as C

    return C.load(args.config, job_overrides(args, over))


# --------------------------------------------------------------------------------------------
# part 1: a round against its compute floor


def part_round(args: argparse.Namespace) -> dict[str, Any]:
    from broker_server.simulate import simulate

    cfg = job_config(args)
    plans: list[Any] = []
    agents: list[Any] = []
    run_dir = Path(args.work) / f"run-{int(time.time())}"
    t0 = time.perf_counter()
    res = simulate(cfg, run_dir=run_dir, on_plan=plans.append, agent_hook=lambda i, a: agents.append(a))
    wall = time.perf_counter() - t0
    plan = plans[0]
    rounds = [{"round": m["round"], "seconds": m["seconds"], "accuracy": m.get("accuracy"),
               "phase_s": m.get("phase_s", {}), "clients_train_s": m.get("clients_train_s", {}),
               **({"ended_s": m["ended_s"]} if "ended_s" in m else {})}
              for m in res.metrics]
    agent_phases: dict[str, float] = {}
    for a in agents:
        for k, v in a.phases.snapshot().items():
            agent_phases[k] = agent_phases.get(k, 0.0) + v
    floor = compute_floor(cfg, plan, len(rounds))
    return {"config": str(args.config), "dataset": cfg.data.dataset, "clients": cfg.data.clients,
            "thread_plan": plan.as_dict(), "rounds": rounds, "wall_s": wall, "final_accuracy": res.final_accuracy,
            "agent_phases_s": agent_phases, "floor": floor, "broker": res.broker}


def compute_floor(cfg: Any, plan: Any, rounds: int) -> dict[str, Any]:
    """The same local epochs over the same shards in a plain torch loop (module docstring)."""
    import torch
    import torch.nn.functional as F

    from broker_server.runtime import device_model
    from broker_server.server import evaluate
    from broker_server.simulate import split_clients
    from edge_agent.data import load_dataset

    ds = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir or None)
    parts = split_clients(ds, cfg)
    shards = [(torch.from_numpy(ds.train.x[idx]), torch.from_numpy(ds.train.y[idx])) for idx in parts]
    torch.set_num_threads(plan.torch_threads)
    name = cfg.model.architectures()[0]
    global_model = device_model(ds, cfg.run.seed, name, cfg.model.feature_dim)
    t = cfg.train

    def local(i: int, state: dict[str, torch.Tensor], rnd: int) -> tuple[dict[str, torch.Tensor], int]:
        model = device_model(ds, cfg.run.seed, name, cfg.model.feature_dim)
        model.load_state_dict(state)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
        x, y = shards[i]
        g = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + rnd * 1009 + i)
        for _ in range(t.local_epochs):
            perm = torch.randperm(len(y), generator=g)
            for s in range(0, len(y), t.batch_size):
                idx = perm[s:s + t.batch_size]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, len(y)

    out = []
    with ThreadPoolExecutor(max_workers=plan.train_slots) as pool:
        for rnd in range(1, rounds + 1):
            state = {k: v.detach().clone() for k, v in global_model.state_dict().items()}
            t0 = time.perf_counter()
            results = list(pool.map(lambda i, s=state, r=rnd: local(i, s, r), range(len(shards))))
            t1 = time.perf_counter()
            n = sum(w for _, w in results)
            avg = {k: sum(s[k].double() * (w / n) for s, w in results).to(v.dtype)
                   for k, v in global_model.state_dict().items()}
            global_model.load_state_dict(avg)
            t2 = time.perf_counter()
            acc, _ = evaluate(global_model, ds.test, batch_size=cfg.server.eval_batch_size)
            t3 = time.perf_counter()
            out.append({"round": rnd, "train_s": t1 - t0, "average_s": t2 - t1, "evaluate_s": t3 - t2,
                        "accuracy": float(acc)})
    return {"rounds": out, "train_slots": plan.train_slots, "torch_threads": plan.torch_threads}


# --------------------------------------------------------------------------------------------
# part 2: encode / decode against a copy, with peak memory


class _NullTransport:
    client_id = "client-007"

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                wait_s: float | None = None) -> None:
        pass

    def subscribe(self, filters: list[str], qos: int = 1) -> None:
        pass

    def get(self, timeout_s: float | None) -> None:
        return None

    def close(self) -> None:
        pass


def _peak(fn: Any) -> tuple[int, Any]:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        out = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - before, out


def _codec_row(n: int, reps: int) -> dict[str, Any]:
    """Times and peaks of one float32 update of ``n`` values."""
    import numpy as np

    from protocol import topics
    from protocol.channel import Channel
    from protocol.messages import Envelope, Kind, Update, decode, encode

    arr = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    dst = np.empty_like(arr)
    body = Update(tensors=(arr,), num_samples=10, train_loss=0.5)
    env = Envelope(round=1, sender="client-007", seq=1, body=body, timestamp_ms=1)
    payload = encode(env).payload
    t_copyto = median_time(lambda: np.copyto(dst, arr), reps)
    t_copy = median_time(lambda: arr.copy(), reps)
    t_enc = median_time(lambda: encode(env), reps)
    t_dec = median_time(lambda: decode(payload), reps)
    enc_peak, _ = _peak(lambda: encode(env))
    dec_peak, _ = _peak(lambda: decode(payload))
    ch = Channel(_NullTransport(), node_id="client-007", side="agent", federation="bench", ledger=None)
    send_peak, _ = _peak(lambda: ch.send(topics.up("bench", "client-007", Kind.UPDATE), body, round=1))
    return {"values": n, "tensor_bytes": arr.nbytes, "payload_bytes": len(payload), "reps": reps,
            "copyto_s": t_copyto, "copy_s": t_copy, "encode_s": t_enc, "decode_s": t_dec,
            "encode_peak_bytes": enc_peak, "send_peak_bytes": send_peak, "decode_peak_bytes": dec_peak}


def part_codec(args: argparse.Namespace) -> dict[str, Any]:
    sizes = (10_000, 500_000) if args.tiny else (10_000, 11_200_000)
    reps = 3 if args.tiny else args.reps
    rows = [_codec_row(n, reps) for n in sizes]
    return {"rows": rows}


# --------------------------------------------------------------------------------------------
# part 3: peak RSS per virtual agent


def fleet_child(args: argparse.Namespace) -> None:
    """One fleet case in this (fresh) process; prints one JSON line."""
    from broker_server.simulate import simulate
    from edge_agent.data import load_dataset

    n = args.child_fleet
    over: dict[tuple[str, str], Any] = {
        ("data", "clients"): n, ("data", "partition"): "iid", ("data", "min_samples"): 5, ("server", "quorum"): n,
        ("server", "join_timeout_s"): 600.0, ("server", "round_deadline_s"): 1800.0, ("run", "rounds"): 2}
    if args.tiny:
        over[("data", "dataset")] = "digits"
    cfg = job_config(args, over)
    ds = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir or None)
    data_mib = (ds.train.x.nbytes + ds.train.y.nbytes) / 2**20
    loaded = vmhwm_mib()
    res = simulate(cfg, run_dir=Path(args.work) / f"fleet-{n}-{int(time.time())}")
    secs = [m["seconds"] for m in res.metrics]
    print(json.dumps({"agents": n, "vmhwm_mib": vmhwm_mib(), "after_load_mib": loaded, "data_mib": data_mib,
                      "round_s": secs, "rounds_completed": res.rounds_completed,
                      "reported": [m["clients_reported"] for m in res.metrics]}))


def part_fleet(args: argparse.Namespace) -> dict[str, Any]:
    sizes = (1, 2, 4) if args.tiny else tuple(int(s) for s in args.fleet_sizes.split(","))
    cases = []
    for n in sizes:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child-fleet", str(n), "--work", str(args.work),
               "--config", str(args.config)] + (["--tiny"] if args.tiny else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            cases.append({"agents": n, "error": (proc.stderr or proc.stdout)[-2000:]})
            continue
        cases.append(json.loads(lines[-1]))
    return {"cases": cases}


# --------------------------------------------------------------------------------------------
# part 4: the same job under Flower


def fedfleet_plan(cfg: Any) -> Any:
    """The thread plan :func:`broker_server.simulate.simulate` chooses for ``cfg`` on this
    machine with an embedded broker (part 1's setting)."""
    from edge_agent.device import detect, plan_threads, usable_cores

    return plan_threads(usable_cores(detect()), role="simulation", clients=cfg.data.clients, embedded_broker=True,
                        torch_threads=cfg.agents.torch_threads, train_slots=cfg.agents.train_slots)


def part_flower(args: argparse.Namespace, part: str) -> dict[str, Any]:
    cfg = job_config(args)
    plan = fedfleet_plan(cfg)
    folder = Path(args.work) / part
    venv_dir = Path(args.flower_venv) if args.flower_venv else Path(args.work) / "flwr-venv"
    try:
        venv = _flower.ensure_venv(venv_dir, spec=args.flower_spec, log=lambda m: print("  " + m, flush=True))
    except RuntimeError as exc:
        return {"ok": False, "why": str(exc)}
    slots, threads, slots_dir = plan.train_slots, plan.torch_threads, folder / "slots"
    used_plan = plan.as_dict()
    if part in DEFAULTS_PARTS:
        # Flower as its users get it: torch's own intra-op default (one thread per core); the
        # simulation engine's default client resources (2 CPUs per client actor); the legacy
        # path's clients all training at once
        threads = max(1, plan.cores)
        slots = max(1, plan.cores // 2) if part == "flower-sim-defaults" else 0
        slots_dir = folder / "slots" if slots and part != "flower-sim-defaults" else None
        used_plan = {**used_plan, "train_slots": slots, "torch_threads": threads}
    job = _flower.write_job(folder / "job.json", config=args.config, overrides=job_overrides(args),
                            train_slots=slots if slots_dir else 0, torch_threads=threads, slots_dir=slots_dir,
                            batch_size=_flower.agent_batch_size(cfg))
    n, rounds = cfg.data.clients, cfg.run.rounds
    if part.startswith("flower-sim"):
        res = _flower.run_simulation(venv, job, folder, rounds=rounds, clients=n, train_slots=slots,
                                     torch_threads=threads)
    elif part == "flower-deploy":
        res = _flower.run_deployment(venv, job, folder, rounds=rounds, clients=n, torch_threads=threads)
    else:
        res = _flower.run_legacy(venv, job, folder, rounds=rounds, clients=n, torch_threads=threads)
    res.update(flwr_version=venv.version, venv=str(venv.root), venv_installed=venv.installed, spec=args.flower_spec,
               dataset=cfg.data.dataset, clients=n, rounds_asked=rounds, thread_plan=used_plan, work=str(folder),
               flower_defaults=part in DEFAULTS_PARTS)
    if res["ok"]:
        print(f"  {part}: steady round {_mean([r['seconds'] for r in res['rounds'][1:] or res['rounds']]):.2f} s, "
              f"wall {res['wall_s']:.1f} s, accuracy {res['final_accuracy']:.4f}", flush=True)
    else:
        print(f"  {part} failed: {res['why'][:2000]}", flush=True)
    return res


# --------------------------------------------------------------------------------------------
# report


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def report(results: dict[str, dict], args: argparse.Namespace) -> str:
    m = machine()
    out = ["# fedfleet round benchmark", "",
           f"Produced by `python tools/bench_round.py {' '.join(sys.argv[1:])}` on {m['when']}; code {m['commit']}. "
           f"{m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}. Load "
           f"average at the end {m['loadavg'][0]:.2f}/{m['loadavg'][1]:.2f}/{m['loadavg'][2]:.2f}: times are "
           "only meaningful on a quiet machine. Each part's own start time and load are in its JSON "
           f"(`{args.work}`).", ""]
    ran_at = {p: r.get("commit", "not recorded") for p, r in results.items()}
    if any(c != m["commit"] for c in ran_at.values()):
        out += ["Parts run at other code than the report's: " + "; ".join(
            f"{p} at {c}" for p, c in ran_at.items() if c != m["commit"]) + ".", ""]
    if args.tiny:
        out += ["**--tiny: a smoke run of the tool at toy sizes; no figure here means anything.**", ""]
    r = results.get("round")
    if r:
        plan = r["thread_plan"]
        rounds = r["rounds"]
        steady = rounds[1:] or rounds
        fl = r["floor"]["rounds"]
        fl_steady = fl[1:] or fl
        mean_round = _steady(rounds)
        mean_floor = _mean([x["train_s"] for x in fl_steady])
        mean_floor_eval = _mean([x["train_s"] + x["average_s"] + x["evaluate_s"] for x in fl_steady])
        out += ["## 1. A round against its compute floor", "",
                f"`{r['config']}` ({r['dataset']}, {r['clients']} clients), {len(rounds)} rounds over {r['broker']}; "
                f"thread plan: {plan['train_slots']} trainings at once x {plan['torch_threads']} torch threads on "
                f"{plan['cores']} cores ({'; '.join(plan['reasons'])}); evaluation overlapped in "
                f"{sum('evaluate_overlapped' in x['phase_s'] for x in rounds)} of {len(rounds)} rounds. Final "
                f"accuracy {r['final_accuracy']:.4f}; floor's plain FedAvg {fl[-1]['accuracy']:.4f}.", "",
                "| | steady round s (rounds 2..R) | × floor |", "| --- | ---: | ---: |",
                f"| fedfleet round | {mean_round:.2f} | {mean_round / mean_floor:.2f} |",
                f"| floor: training only | {mean_floor:.2f} | 1.00 |",
                f"| floor: training + average + evaluation | {mean_floor_eval:.2f} | "
                f"{mean_floor_eval / mean_floor:.2f} |",
                ""]
        order = ["select", "publish", "evaluate_prev", "collect", "receive", "accumulate", "aggregate", "evaluate",
                 "checkpoint", "registry", "open_next", "slot_wait", "evaluate_overlapped", "checkpoint_prev",
                 "registry_prev", "ledger"]
        seen = {k for x in rounds for k in x["phase_s"]}
        keys = [k for k in order if k in seen] + sorted(seen - set(order))
        out += ["Server phases per round (s; `metrics.jsonl` `phase_s`; `receive` and `accumulate` lie inside "
                "`collect`; `*_prev` are the previous round's; `open_next`, `slot_wait` and "
                "`evaluate_overlapped` happen while the next round trains; `ledger` counts every writer; "
                "*since previous end*: from the previous round's `ended_s` to this one's):", "",
                "| round | seconds | since previous end | " + " | ".join(keys) + " | devices' train s (sum / max) |",
                "| ---: | ---: | ---: | " + " | ".join("---:" for _ in keys) + " | ---: |"]
        for i, x in enumerate(rounds):
            ct = x["clients_train_s"]
            gap = (f"{x['ended_s'] - rounds[i - 1]['ended_s']:.2f}"
                   if i and "ended_s" in x and "ended_s" in rounds[i - 1] else "—")
            out.append(f"| {x['round']} | {x['seconds']:.2f} | {gap} | "
                       + " | ".join(f"{x['phase_s'].get(k, 0.0):.3f}" for k in keys)
                       + f" | {ct.get('sum', 0):.2f} / {ct.get('max', 0):.2f} |")
        out += ["", "Floor per round (s):", "", "| round | train | average | evaluate | accuracy |",
                "| ---: | ---: | ---: | ---: | ---: |"]
        out += [f"| {x['round']} | {x['train_s']:.2f} | {x['average_s']:.3f} | {x['evaluate_s']:.2f} | "
                f"{x['accuracy']:.4f} |" for x in fl]
        ap = r["agent_phases_s"]
        out += ["", "Agents' own phases, summed over every agent and round (s): "
                + ", ".join(f"{k} {v:.2f}" for k, v in sorted(ap.items())), ""]
    c = results.get("codec")
    if c:
        out += ["## 2. Encode and decode against a copy", "",
                "| values | payload MB | np.copyto ms | arr.copy() ms | encode ms | encode × copyto | encode × copy() "
                "| decode ms | decode × copyto | encode peak × payload | chunked send peak × payload | decode peak "
                "× payload |", "| ---: |" + " ---: |" * 11]
        for x in c["rows"]:
            p = x["payload_bytes"]
            enc, dec = x["encode_s"], x["decode_s"]
            out.append(
                f"| {x['values']:,} | {p / 1e6:.2f} | {x['copyto_s'] * 1e3:.3f} | {x['copy_s'] * 1e3:.3f} | "
                f"{enc * 1e3:.3f} | {x['copyto_s'] / enc:.2f} | {x['copy_s'] / enc:.2f} | "
                f"{dec * 1e3:.3f} | {x['copyto_s'] / dec:.2f} | {x['encode_peak_bytes'] / p:.2f} | "
                f"{x['send_peak_bytes'] / p:.2f} | {x['decode_peak_bytes'] / p:.2f} |")
        out += ["", "Speeds are ratios of times (1.0 = as fast as the copy); goals: encode ≥ 0.3×, "
                "decode ≥ 0.5× copy speed at 45 MB, peak ≤ 1.2× payload.", ""]
    f = results.get("fleet")
    if f:
        cases = f["cases"]
        base = next((x for x in cases if x.get("agents") == 1 and "vmhwm_mib" in x), None)
        out += ["## 3. Peak RSS per virtual agent", "",
                "| agents | VmHWM MiB | data set MiB | Δ vs 1 agent MiB | MiB per agent | steady round s "
                "| rounds/min |",
                "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for x in cases:
            if "error" in x:
                out.append(f"| {x['agents']} | failed: {x['error'][-200:]!r} | | | | | |")
                continue
            d = x["vmhwm_mib"] - base["vmhwm_mib"] if base and x["agents"] > 1 else None
            delta = "—" if d is None else f"{d:,.1f}"
            per = "—" if d is None else f"{d / (x['agents'] - 1):.2f}"
            steady = _mean(x["round_s"][1:] or x["round_s"])
            out.append(f"| {x['agents']} | {x['vmhwm_mib']:,.1f} | {x['data_mib']:.1f} | {delta} | {per} | "
                       f"{steady:.2f} | {60 / steady:.2f} |")
        out += ["", "Goal: ≤ 2 MiB per agent beyond the data set.", ""]
    if any(p in results for p in FLOWER_PARTS):
        out += flower_section(results)
    return "\n".join(out) + "\n"


FLOWER_NAMES = {"flower-sim": "Flower simulation engine", "flower-deploy": "Flower deployment mode",
                "flower-legacy": "Flower legacy gRPC",
                "flower-sim-defaults": "Flower simulation engine, Flower's defaults",
                "flower-legacy-defaults": "Flower legacy gRPC, Flower's defaults"}
#: fedfleet's steady round at least this many times faster than each Flower mode (the goals)
FLOWER_GOALS = {"flower-deploy": 3.0, "flower-legacy": 1.5, "flower-sim": 1.0, "flower-sim-defaults": 1.0,
                "flower-legacy-defaults": 1.5}
ACCURACY_GOAL_PP = 0.3


def _steady(rounds: list[dict]) -> float:
    """Mean seconds a steady round (2..R; the only one when there is one) takes: the interval
    between consecutive rounds' ``ended_s`` when every round has one (fedfleet: a round
    evaluated while the next one trains has ``seconds`` that overlap the next round's, which a
    mean of ``seconds`` would count twice), else each round's ``seconds``."""
    if len(rounds) >= 2 and all("ended_s" in x for x in rounds):
        ends = [x["ended_s"] for x in rounds]
        return _mean([b - a for a, b in zip(ends, ends[1:], strict=False)])
    return _mean([x["seconds"] for x in (rounds[1:] or rounds)])


def _rounds_span(rounds: list[dict]) -> float:
    """Seconds from the first round's opening to the last round's end: from ``ended_s`` when every
    round has one (overlapping rounds counted once), else Σ ``seconds``."""
    if rounds and all("ended_s" in x for x in rounds):
        return rounds[-1]["ended_s"] - rounds[0]["ended_s"] + rounds[0]["seconds"]
    return sum(x["seconds"] for x in rounds)


def _agg(rounds: list[dict], key: str, stat: str) -> float:
    """Mean over rounds 2..R (all rounds when there is one) of a clients' figure's ``stat``."""
    vals = [x[key][stat] for x in (rounds[1:] or rounds) if key in x]
    return _mean(vals)


def flower_section(results: dict[str, dict]) -> list[str]:
    """Section 4 of the report: part 1's fedfleet run against the Flower parts."""
    out = ["## 4. The same job under Flower", ""]
    ff = results.get("round")
    fl = {p: results[p] for p in FLOWER_PARTS if p in results}
    ok = {p: r for p, r in fl.items() if r.get("ok")}
    for p, r in fl.items():
        if not r.get("ok"):
            out += [f"**{FLOWER_NAMES[p]}: not measured** — " + str(r.get("why", "")).replace("\n", " ")[:1500], ""]
    if not ok:
        return out
    any_r = next((r for p, r in ok.items() if p not in DEFAULTS_PARTS), next(iter(ok.values())))
    plan = any_r["thread_plan"]
    out += [f"Flower {any_r['flwr_version']} (`pip install \"{any_r['spec']}\"` in its own venv, `{any_r['venv']}`; "
            "torch and fedfleet imported from the project's interpreter by path). The job of part 1 "
            f"({any_r['dataset']}, {any_r['clients']} clients, {any_r['rounds_asked']} rounds, the same configuration "
            "file and overrides): the same Dirichlet partition (each Flower client prepares its shard, model and "
            "client algorithm as a fedfleet agent does, `edge_agent.assembly.prepare_agent`), the same initial "
            "server model, `FedAvgClient.local_round` with the agents' `TrainConfig` and shuffling seeds, FedAvg "
            "weighted by samples, no federated evaluation, the server's evaluation on the test split after each "
            "round (initial model not evaluated, as in fedfleet).", "",
            f"Threads and processes: every process runs with `OMP_NUM_THREADS` = `MKL_NUM_THREADS` = "
            f"{plan['torch_threads']}, `torch.set_num_threads({plan['torch_threads']})` and one inter-op thread; at "
            f"most {plan['train_slots']} trainings at once (fedfleet's thread plan on {plan['cores']} cores: "
            f"{plan['train_slots']} slots × {plan['torch_threads']} torch threads). fedfleet: one process (server, "
            "agents as threads, a semaphore of train slots) and the embedded broker. "
            + " ".join(f"{FLOWER_NAMES[p]}: {r['processes']}"
                       + (f" (`--federation-config \"{r['federation_config']}\"`)"
                          if r.get("federation_config") else "")
                       + ("; trainings limited by file-lock slots" if p in ("flower-deploy", "flower-legacy") else "")
                       + "."
                       for p, r in ok.items() if p not in DEFAULTS_PARTS), ""]
    shipped = {p: r for p, r in ok.items() if p in DEFAULTS_PARTS}
    if shipped:
        out += ["*Flower's defaults* rows run Flower as its users get it, the rest of the job unchanged: torch's own "
                f"intra-op default ({next(iter(shipped.values()))['thread_plan']['torch_threads']} threads, one per "
                "core) in every process; the simulation engine with its default client resources (2 CPUs per "
                "client actor, so cores ÷ 2 actors); the legacy path with every client process training at once. "
                + " ".join(f"{FLOWER_NAMES[p]}: {r['processes']}"
                           + (f" (`--federation-config \"{r['federation_config']}\"`)"
                              if r.get("federation_config") else "") + "."
                           for p, r in shipped.items()), ""]
    if ff is None:
        out += ["Part 1 (`round`) has not been run: no fedfleet figures to compare with.", ""]
    elif any((ff["thread_plan"]["train_slots"], ff["thread_plan"]["torch_threads"])
             != (r["thread_plan"]["train_slots"], r["thread_plan"]["torch_threads"])
             for p, r in ok.items() if p not in DEFAULTS_PARTS):
        out += ["**Part 1 ran with another thread plan than the Flower parts** (run them on the same machine): "
                f"part 1 {ff['thread_plan']['train_slots']} × {ff['thread_plan']['torch_threads']}, Flower "
                + ", ".join(f"{FLOWER_NAMES[p]} {r['thread_plan']['train_slots']} × {r['thread_plan']['torch_threads']}"
                            for p, r in ok.items() if p not in DEFAULTS_PARTS) + ".", ""]
    f_steady = _steady(ff["rounds"]) if ff else float("nan")
    f_acc = ff["final_accuracy"] if ff else float("nan")
    rows = []
    if ff:
        f_sum = _rounds_span(ff["rounds"])
        rows.append(("fedfleet `simulate` (thread plan)", ff["rounds"], ff["wall_s"], ff["wall_s"] - f_sum, f_acc))
    for p, r in ok.items():
        rows.append((FLOWER_NAMES[p], r["rounds"], r["wall_s"], r["overhead_s"], r["final_accuracy"]))
    out += ["| system | round 1 s | steady round s (2..R) | total wall s | start-up + teardown s (wall − Σ rounds) "
            "| final accuracy | steady round × fedfleet | accuracy − fedfleet (pp) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, rounds, wall, over, acc in rows:
        st = _steady(rounds)
        out.append(f"| {name} | {rounds[0]['seconds']:.2f} | {st:.2f} | {wall:.1f} | {over:.1f} | {acc:.4f} | "
                   f"{st / f_steady:.2f} | {(acc - f_acc) * 100:+.2f} |")
    out += ["", "Goals (fedfleet's steady round against each; accuracy within "
            f"{ACCURACY_GOAL_PP} pp of fedfleet's):", ""]
    for p, r in ok.items():
        need = FLOWER_GOALS[p]
        ratio = _steady(r["rounds"]) / f_steady
        dpp = (r["final_accuracy"] - f_acc) * 100
        speed_ok = ratio >= need if need > 1 else ratio > need
        acc_ok = abs(dpp) <= ACCURACY_GOAL_PP
        want = f"≥ {need:g}×" if need > 1 else "faster (> 1×)"
        out.append(f"- **{FLOWER_NAMES[p]}: fedfleet {want} per round** — {'met' if speed_ok else 'not met'} "
                   f"({ratio:.2f}×); accuracy {dpp:+.2f} pp ({'met' if acc_ok else 'not met'}).")
    out += ["", "Round by round (s; accuracy after the round):", "",
            "| round | " + " | ".join(n for n, *_ in rows) + " |", "| ---: |" + " ---: |" * len(rows)]
    for i in range(max(len(r[1]) for r in rows)):
        cells = [f"{r[1][i]['seconds']:.2f} ({r[1][i]['accuracy']:.4f})" if i < len(r[1]) else "" for r in rows]
        out.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    out += ["", "Start-up and the clients' own time (Flower; means over rounds 2..R of each round's sum over "
            "clients, except where said):", "",
            "| system | server up s | nodes registered s | launch → round 1 starts s | set-up s/round "
            "| process age at message s (mean) | training s/round | slot wait s/round |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p, r in ok.items():
        up = r.get("superlink_up_s", r.get("server_up_s"))
        nodes = r.get("supernodes_up_s")
        age = _agg(r["rounds"], "proc_age_s", "mean")
        out.append(f"| {FLOWER_NAMES[p]} | {up:.1f} | {'—' if nodes is None else f'{nodes:.1f}'} | "
                   f"{r['launch_to_round0_s']:.1f} | {_agg(r['rounds'], 'setup_s', 'sum'):.2f} | "
                   f"{'—' if age != age else f'{age:.2f}'} | {_agg(r['rounds'], 'train_s', 'sum'):.2f} | "
                   f"{_agg(r['rounds'], 'wait_s', 'sum'):.2f} |")
    if ff:
        ap = ff.get("agent_phases_s", {})
        n_r = len(ff["rounds"])
        out += ["", f"fedfleet's agents for comparison (per round, summed over agents, all {n_r} rounds): "
                + ", ".join(f"{k} {v / n_r:.2f} s" for k, v in sorted(ap.items())) + "."]
    out += ["", "*Set-up* is the client process making its data, shard and model (deployment mode starts one "
            "`flwr-clientapp` process per SuperNode and message, so it pays it, and the imports counted in "
            "*process age*, every round; the simulation engine's Ray actors keep what they made, but a shard that "
            "lands on the other actor is made again there); SuperNodes poll the SuperLink every 3 s when idle "
            "(flwr's `start_client_internal`). Wall times are from each system's launch to the end of its run.", ""]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/round.md", help="the Markdown report")
    ap.add_argument("--work", default="/tmp/bench-round", help="folder for per-part JSON results and run folders")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--redo", action="store_true", help="run the parts again even when their JSON exists")
    ap.add_argument("--tiny", action="store_true", help="toy sizes, to check the tool works")
    ap.add_argument("--config", default=str(ROOT / "examples" / "mnist-fedavg.toml"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--overlap-evaluation", choices=("auto", "off"), default="",
                    help="[server] overlap_evaluation of the job in parts 1 and 4 (default: the configuration's)")
    ap.add_argument("--reps", type=int, default=7, help="repetitions of each codec timing (median)")
    ap.add_argument("--fleet-sizes", default="1,100,500")
    ap.add_argument("--clients", type=int, default=0, help="the job's clients (and quorum) in parts 1 and 4; 0: as "
                                                           "configured (10; --tiny 3)")
    ap.add_argument("--flower-venv", default="", help="Flower's venv, created when missing (default WORK/flwr-venv)")
    ap.add_argument("--flower-spec", default=_flower.FLWR_SPEC, help="what pip installs there (default %(default)s)")
    ap.add_argument("--child-fleet", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.work = str(Path(args.work).resolve())  # the Flower processes read their job files from other folders
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.child_fleet:
        fleet_child(args)
        return 0
    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in wanted if p not in PARTS]
    if bad:
        ap.error(f"unknown part(s) {bad}; known: {', '.join(PARTS)}")
    runners = {"round": part_round, "codec": part_codec, "fleet": part_fleet,
               **{p: (lambda a, p=p: part_flower(a, p)) for p in FLOWER_PARTS}}
    results: dict[str, dict] = {}
    for part in PARTS:
        path = Path(args.work) / f"{part}.json"
        failed = path.exists() and json.loads(path.read_text(encoding="utf-8")).get("ok") is False
        if part in wanted and (args.redo or not path.exists() or failed):
            print(f"bench_round: part {part} …", flush=True)
            started = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_before": os.getloadavg(),
                       "commit": code_commit()}
            res = runners[part](args)
            res.update(started, loadavg_after=os.getloadavg())
            path.write_text(json.dumps(res, indent=1), encoding="utf-8")
        if path.exists():
            results[part] = json.loads(path.read_text(encoding="utf-8"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report(results, args), encoding="utf-8")
    print(f"bench_round: wrote {args.out}")
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench_round"
    sys.exit(main())
