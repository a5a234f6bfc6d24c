"""Flower side of the fedfleet benchmarks (``tools/bench_round.py`` part ``flower-*``,
``tools/bench_protocol.py`` part 4): one place for what both need.

- :func:`ensure_venv`: Flower's own virtual environment (``python3.11 -m venv`` + ``pip install
  "flwr[simulation]==1.42.*"``), reused when it already holds that version; a ``.pth`` file in it
  appends this repository and this interpreter's site-packages to its ``sys.path``, so torch and
  fedfleet are imported from here by path while Flower's own packages (numpy, grpcio, protobuf …)
  win. Every process the Flower venv starts (SuperLink, SuperNodes, ServerApp, ClientApp, Ray
  workers, legacy server and clients) sees them.
- the job (:func:`write_job`, :func:`load_job`): the fedfleet configuration file and its
  overrides, read in every Flower process by :func:`broker_server.config.load`, so the data set,
  partition, model, seeds and training settings are fedfleet's own.
- :class:`Trainer`: one Flower client's local round, made the way a fedfleet agent makes its own
  (:func:`edge_agent.assembly.prepare_agent` of :func:`broker_server.runtime.agent_spec`: the
  agent's shard from its own split, its model, the client algorithm), trained with the same
  ``local_round`` and the same :class:`~edge_agent.algorithms.TrainConfig`;
  :class:`Evaluator`: the server's model and its evaluation of each round's global model.
- :class:`TrainSlots`: at most ``n`` trainings at once across processes (``flock`` on ``n``
  files), the thread plan's ``train_slots`` of a fedfleet simulation.
- the three ways Flower runs the job, each in its own processes on 127.0.0.1:
  :func:`run_simulation` (``flower-superlink --simulation`` + ``flwr run``, Ray backend),
  :func:`run_deployment` (a SuperLink, N SuperNodes, ``flwr run``), :func:`run_legacy` (the
  deprecated gRPC ``start_server`` / ``start_client``).

The ServerApp and ClientApp used by ``flwr run`` are in ``tools/_flower_app.py`` (committed: it is
code, linted with the rest of ``tools/``); the only per-run file, the Flower app's
``pyproject.toml`` (its components and this run's paths), is written into the work folder by
:func:`write_app`, together with the Flower configuration (``FLWR_HOME/config.toml``) naming the
SuperLink to submit to.

This module imports no Flower at import time: the benchmarks import it in the fedfleet
interpreter. Run as ``python -m tools._flower legacy-server|legacy-client …`` by the Flower venv's
interpreter, it is the legacy server or one legacy client.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FLWR_SPEC = "flwr[simulation]==1.42.*"
PTH_NAME = "fedfleet_bench.pth"


# --------------------------------------------------------------------------------------------
# Flower's virtual environment


@dataclass(frozen=True)
class FlowerVenv:
    """A virtual environment with Flower installed.

    Attributes:
        root: the venv folder.
        version: ``flwr.__version__`` there.
        installed: True when this call created it or installed Flower into it.
    """

    root: Path
    version: str
    installed: bool = False

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def exe(self, name: str) -> str:
        """Path of one of the venv's console scripts (``flwr``, ``flower-superlink`` …)."""
        return str(self.root / "bin" / name)

    def env(self, *, threads: int = 1, flwr_home: Path | None = None) -> dict[str, str]:
        """Environment for a process of this venv: its ``bin`` first on ``PATH`` (SuperLink and
        SuperNode start ``flwr-serverapp`` / ``flwr-clientapp`` by name), no ``PYTHONPATH``
        (the ``.pth`` file brings fedfleet and torch), ``threads`` intra-op threads for
        OpenMP/MKL, Flower's telemetry and update check off, no data download."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.update(PATH=f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(self.root),
                   OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), FLWR_TELEMETRY_ENABLED="0",
                   FLWR_DISABLE_UPDATE_CHECK="1", GRPC_VERBOSITY="ERROR", PYTHONUNBUFFERED="1",
                   FEDFLEET_OFFLINE="1", RAY_DEDUP_LOGS="0", RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0")
        if flwr_home is not None:
            env["FLWR_HOME"] = str(flwr_home)
        return env


def spec_version(spec: str) -> str:
    """The version prefix a requirement pins: ``"flwr[simulation]==1.42.*"`` → ``"1.42."``,
    ``"flwr==1.42.0"`` → ``"1.42.0"``, no ``==`` → ``""`` (any version).

    >>> spec_version("flwr[simulation]==1.42.*")
    '1.42.'
    """
    if "==" not in spec:
        return ""
    v = spec.split("==", 1)[1].strip()
    return v[:-1] if v.endswith("*") else v


def _venv_flwr(python: Path, env: dict[str, str]) -> str | None:
    if not python.exists():
        return None
    r = subprocess.run([str(python), "-c", "import flwr; print(flwr.__version__)"], capture_output=True, text=True,
                       env=env, timeout=300)
    return r.stdout.strip() if r.returncode == 0 else None


def ensure_venv(venv: Path, *, spec: str = FLWR_SPEC, base_python: str = "python3.11",
                log: Callable[[str], None] = print) -> FlowerVenv:
    """The Flower venv at ``venv``: created (``base_python -m venv``) and Flower installed
    (``pip install spec``) unless it already has a version matching ``spec``; then the ``.pth``
    file (this repository, this interpreter's site-packages) written again, so the venv imports
    this checkout's fedfleet.

    Raises:
        RuntimeError: the venv cannot be created or Flower cannot be installed (the pip log's
            tail and the log file are named).
    """
    venv = Path(venv).resolve()
    probe_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    python = venv / "bin" / "python"
    want = spec_version(spec)
    installed = False
    version = _venv_flwr(python, probe_env)
    if version is None or not version.startswith(want):
        venv.parent.mkdir(parents=True, exist_ok=True)
        logfile = venv.parent / f"{venv.name}-install.log"
        if not python.exists():
            log(f"creating the Flower venv {venv} ({base_python} -m venv)")
            r = subprocess.run([base_python, "-m", "venv", str(venv)], capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{base_python} -m venv {venv} failed: {(r.stderr or r.stdout)[-1500:]}")
        log(f"installing {spec} into {venv} (log {logfile})")
        with open(logfile, "w") as out:
            r = subprocess.run([str(python), "-m", "pip", "install", spec], stdout=out, stderr=subprocess.STDOUT,
                               env=probe_env, timeout=3600)
        if r.returncode != 0:
            tail = logfile.read_text(errors="replace")[-1500:]
            raise RuntimeError(f"pip install {spec} into {venv} failed (exit {r.returncode}; {logfile}):\n{tail}")
        version = _venv_flwr(python, probe_env)
        if version is None or not version.startswith(want):
            raise RuntimeError(f"{venv} has flwr {version!r} after installing {spec}")
        installed = True
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, env=probe_env, check=True).stdout.strip()
    here = sysconfig.get_paths()
    lines = [str(ROOT)] + list(dict.fromkeys([here["purelib"], here["platlib"]]))
    (Path(purelib) / PTH_NAME).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return FlowerVenv(venv, version, installed)


# --------------------------------------------------------------------------------------------
# The job: fedfleet's configuration, read in every Flower process


def agent_batch_size(cfg: Any) -> int:
    """The batch size a simulated fedfleet agent of ``cfg`` trains with: ``[train] batch_size``
    capped by its firmware profile's plan (:func:`edge_agent.runtime.agent_runtime` on this
    machine), the smallest over the fleet's profiles. Worked out once, in the benchmark's own
    process, so that no Flower process pays for the device detection."""
    from broker_server.simulate import assign_profiles
    from edge_agent.device import detect
    from edge_agent.runtime import agent_runtime

    info = detect()
    profiles = set(assign_profiles(cfg.agents.profile_mix(), cfg.data.clients, cfg.run.seed))
    return min([cfg.train.batch_size] + [agent_runtime(p, info=info).plan.batch_size for p in profiles])


def write_job(path: Path, *, config: str | Path, overrides: dict[tuple[str, str], Any], train_slots: int,
              torch_threads: int, slots_dir: Path | None, batch_size: int) -> Path:
    """Write the job file every Flower process reads (:func:`load_job`).

    Args:
        config: the fedfleet TOML configuration file.
        overrides: ``{(section, key): value}`` as for :func:`broker_server.config.load`.
        train_slots: trainings at once across the clients (0 = no limit).
        torch_threads: intra-op threads of each training and of the server's evaluation.
        slots_dir: folder of the :class:`TrainSlots` lock files (``None`` when unlimited).
        batch_size: the clients' SGD batch size (:func:`agent_batch_size`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if train_slots and slots_dir is None:
        raise ValueError("train_slots > 0 needs a slots_dir")
    body = {"config": str(Path(config).resolve()), "overrides": [[s, k, v] for (s, k), v in overrides.items()],
            "train_slots": int(train_slots), "torch_threads": int(torch_threads),
            "slots_dir": str(slots_dir) if slots_dir else "", "batch_size": int(batch_size)}
    path.write_text(json.dumps(body, indent=1), encoding="utf-8")
    return path


@dataclass(frozen=True)
class Job:
    """A loaded job: ``cfg`` (:class:`broker_server.config.Config`), ``dataset``, ``train_slots``,
    ``torch_threads``, ``slots_dir``, ``batch_size``."""

    cfg: Any
    dataset: Any
    train_slots: int
    torch_threads: int
    slots_dir: Path | None
    batch_size: int


@lru_cache(maxsize=4)
def load_job(path: str) -> Job:
    """Read a job file and load its data set (cached per process: a Ray worker serves several
    clients). Pins torch to the job's intra-op threads and one inter-op thread.

    Raises:
        ConfigError: the configuration is invalid; DataError: the data set is not found.
    """
    import torch

    from broker_server import config as config_mod
    from edge_agent.data import load_dataset

    body = json.loads(Path(path).read_text(encoding="utf-8"))
    torch.set_num_threads(int(body["torch_threads"]))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # the inter-op pool already started in this process: it keeps its size
        pass
    cfg = config_mod.load(body["config"], {(s, k): v for s, k, v in body["overrides"]})
    ds = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir or None)
    return Job(cfg, ds, int(body["train_slots"]), int(body["torch_threads"]),
               Path(body["slots_dir"]) if body["slots_dir"] else None, int(body["batch_size"]))


def prepare_client(cfg: Any, ds: Any, shard: int) -> Any:
    """Client ``shard`` of ``cfg``'s fleet as a fedfleet agent prepares itself
    (:func:`edge_agent.assembly.prepare_agent`): its shard of the training split (from the
    agent's own :meth:`~edge_agent.assembly.AgentSpec.split`, not the server's), its model
    (seed + 1 + shard) and client algorithm, with the firmware profile
    :func:`broker_server.simulate.assign_profiles` gives it.

    Returns:
        A :class:`~edge_agent.assembly.PreparedAgent`; ``.indices`` is the shard (sorted int64
        indices into ``ds.train``).

    Raises:
        ValueError: ``shard`` outside ``0 .. clients-1``.
    """
    from broker_server.runtime import agent_spec
    from broker_server.simulate import assign_profiles
    from edge_agent.assembly import prepare_agent

    n = cfg.data.clients
    if not 0 <= int(shard) < n:
        raise ValueError(f"client {shard} is not one of the job's {n} clients (0..{n - 1})")
    profile = assign_profiles(cfg.agents.profile_mix(), n, cfg.run.seed)[int(shard)]
    spec = agent_spec(cfg, client_id=f"client-{int(shard):03d}", shard=int(shard), profile=profile)
    return prepare_agent(spec, ds, eval_split=None)


# --------------------------------------------------------------------------------------------
# Training slots across processes


class TrainSlots:
    """At most ``n`` holders at once across processes: an exclusive ``flock`` on one of ``n``
    files in ``folder`` (polled every 10 ms while all are held). The lock goes with the process,
    so a crashed holder frees its slot.

    Raises:
        ValueError: ``n`` < 1.
    """

    def __init__(self, folder: Path, n: int) -> None:
        if n < 1:
            raise ValueError(f"train slots must be >= 1, got {n}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.paths = [self.folder / f"slot-{i}" for i in range(n)]

    @contextmanager
    def hold(self) -> Iterator[int]:
        """Wait for a free slot and hold it for the ``with`` block; yields the slot number."""
        while True:
            for i, p in enumerate(self.paths):
                fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                try:
                    yield i
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
                return
            time.sleep(0.01)


# --------------------------------------------------------------------------------------------
# One client's training, the server's evaluation


@dataclass
class FitResult:
    """One local round: ``tensors`` (float32 arrays, model order), ``num_samples``,
    ``train_loss``, ``train_s`` (the local round), ``wait_s`` (waiting for a training slot)."""

    tensors: list
    num_samples: int
    train_loss: float
    train_s: float
    wait_s: float


class Trainer:
    """Client ``shard`` of the job: :func:`prepare_client`, then each round the fedfleet client
    algorithm's ``local_round`` (same shuffling seeds: ``config.seed``, round, shard) with the
    :class:`~edge_agent.algorithms.TrainConfig` a simulated fedfleet agent gets (``[train]``
    settings, ``[run] seed``, the job's batch size: :func:`agent_batch_size`)."""

    def __init__(self, job: Job, shard: int) -> None:
        import numpy as np
        import torch

        from edge_agent.algorithms import TrainConfig

        cfg, ds = job.cfg, job.dataset
        t0 = time.perf_counter()
        self.prepared = prepare_client(cfg, ds, shard)
        self.shard = int(shard)
        idx = self.prepared.indices
        self.x = torch.from_numpy(np.ascontiguousarray(ds.train.x[idx], dtype=np.float32))
        self.y = torch.from_numpy(np.ascontiguousarray(ds.train.y[idx], dtype=np.int64))
        t = cfg.train
        self.config = TrainConfig(local_epochs=t.local_epochs, batch_size=job.batch_size, lr=t.lr,
                                  momentum=t.momentum, weight_decay=t.weight_decay, seed=cfg.run.seed)
        self.slots = TrainSlots(job.slots_dir, job.train_slots) if job.train_slots and job.slots_dir else None
        self.setup_s = time.perf_counter() - t0

    def fit(self, arrays: list, round: int) -> FitResult:
        """Train one local round from the global ``arrays`` (float32, model order).

        Raises:
            ModelError: ``arrays`` do not match the model.
        """
        import torch

        t0 = time.perf_counter()
        with self.slots.hold() if self.slots is not None else nullcontext():
            t1 = time.perf_counter()
            r = self.prepared.algorithm.local_round(self.prepared.model, tuple(arrays), self.x, self.y, self.config,
                                                    round=int(round), client_index=self.shard,
                                                    client_id=self.prepared.spec.client_id, device=torch.device("cpu"))
            t2 = time.perf_counter()
        return FitResult(list(r.tensors), int(r.num_samples), float(r.train_loss), t2 - t1, t1 - t0)


class Evaluator:
    """The server side: fedfleet's server model (:func:`broker_server.runtime.server_model`,
    ``[run] seed``) as the initial global model, and the server's evaluation of a global model
    on the test split (:func:`broker_server.server.evaluate`, ``[server] eval_batch_size``)."""

    def __init__(self, job: Job) -> None:
        from broker_server.runtime import server_model

        self.job = job
        self.model = server_model(job.cfg, job.dataset)

    def initial_arrays(self) -> list:
        """The initial global model's float32 arrays (model order)."""
        from edge_agent.state import state_arrays

        return list(state_arrays(self.model))

    def evaluate(self, arrays: list) -> tuple[float, float]:
        """``(accuracy, loss)`` of the global model ``arrays`` on the test split (accuracy a
        fraction 0–1, loss the mean cross-entropy)."""
        from broker_server.server import evaluate
        from edge_agent.state import load_arrays

        load_arrays(self.model, arrays)
        acc, loss = evaluate(self.model, self.job.dataset.test, batch_size=self.job.cfg.server.eval_batch_size)
        return float(acc), float(loss)


def process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc/self/stat`` start time and
    ``/proc/stat`` boot time); NaN elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5), counted after "pid (comm)"
        btime = next(int(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                     if ln.startswith("btime"))
        return time.time() - (btime + start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, StopIteration, IndexError):
        return float("nan")


def round_seconds(marks: list[tuple[int, float]]) -> list[dict[str, float]]:
    """Per-round wall seconds from the server's marks: ``(round, time)`` when round 0 (before the
    first round) and each round r (after its evaluation) ended; round r lasted
    ``time[r] - time[r-1]`` (training, aggregation and the evaluation of r).

    Returns:
        ``[{"round": r, "seconds": s}, …]`` for r = 1 .. R, in round order.

    Raises:
        ValueError: the marks are not rounds 0..R each once.

    >>> round_seconds([(0, 10.0), (2, 14.5), (1, 12.0)])
    [{'round': 1, 'seconds': 2.0}, {'round': 2, 'seconds': 2.5}]
    """
    ms = sorted(marks)
    if [r for r, _ in ms] != list(range(len(ms))):
        raise ValueError(f"marks must be rounds 0..R once each, got rounds {[r for r, _ in ms]}")
    return [{"round": ms[i][0], "seconds": ms[i][1] - ms[i - 1][1]} for i in range(1, len(ms))]


# --------------------------------------------------------------------------------------------
# Processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks since boot, ``/proc/PID/stat``), None when gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def descendants(pids: list[int]) -> dict[int, int]:
    """Every living descendant of ``pids`` (from ``/proc/*/stat`` parent ids) → its start time
    (:func:`_start_ticks`); ``pids`` themselves excluded. Empty where there is no ``/proc``."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out: dict[int, int] = {}
    todo = list(pids)
    while todo:
        p = todo.pop()
        for child, pp in parent.items():
            if pp == p and child not in out:
                started = _start_ticks(child)
                if started is not None:
                    out[child] = started
                    todo.append(child)
    return out


@dataclass
class Procs:
    """Child processes, each the leader of its own session (so its own children are ended with
    it); :meth:`stop` sends SIGTERM to each group, then SIGKILL to what is left after
    ``grace_s``."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Any] = field(default_factory=list)

    def start(self, cmd: list[str], log: Path, env: dict[str, str], cwd: Path = ROOT) -> subprocess.Popen:
        f = open(log, "w")
        self.logs.append(f)
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to every group and to every descendant (some Flower processes start theirs
        in new sessions), up to ``grace_s`` for them to end, then SIGKILL to what is left."""
        tree = descendants([p.pid for p in self.procs])
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                try:
                    os.killpg(p.pid, sig)  # the group outlives its leader while a member is left
                except (ProcessLookupError, PermissionError):
                    pass
            for pid, started in tree.items():
                if _start_ticks(pid) == started:  # still that process, not a reused pid
                    try:
                        os.kill(pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
            deadline = time.monotonic() + grace_s
            for p in self.procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for f in self.logs:
            f.close()


def _wait(what: str, ok: Callable[[], bool], procs: list[subprocess.Popen], timeout_s: float, log: Path) -> float:
    """Poll ``ok()`` every 0.1 s; seconds waited. Raises RuntimeError when a process of
    ``procs`` exits first or ``timeout_s`` passes (naming ``log``)."""
    t0 = time.perf_counter()
    while not ok():
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{what}: a process exited with {dead[0].returncode}; see {log}")
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(f"{what}: not within {timeout_s:.0f} s; see {log}")
        time.sleep(0.1)
    return time.perf_counter() - t0


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:
            return 200 <= r.status < 300
    except OSError:
        return False


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------
# flwr run: the app, the SuperLink connection


APP_NAME = "fedfleetbench"


def write_app(folder: Path) -> Path:
    """Write the Flower app ``flwr run`` bundles: a ``pyproject.toml`` whose components are
    ``tools._flower_app:server_app`` / ``client_app`` (importable in the Flower venv through the
    ``.pth`` file) and whose run config has the keys ``flwr run --run-config`` sets."""
    app = Path(folder) / APP_NAME
    app.mkdir(parents=True, exist_ok=True)
    (app / "pyproject.toml").write_text(f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{APP_NAME}"
version = "1.0.0"
description = "fedfleet's benchmark job (FedAvg) as a Flower app"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "fedfleet"

[tool.flwr.app.components]
serverapp = "tools._flower_app:server_app"
clientapp = "tools._flower_app:client_app"

[tool.flwr.app.config]
job = ""
result = ""
rounds = 1
clients = 1
""", encoding="utf-8")
    return app


def write_connection(flwr_home: Path, name: str, port: int) -> None:
    """The Flower configuration (``FLWR_HOME/config.toml``): one insecure SuperLink connection
    ``name`` at 127.0.0.1:``port``, the default."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n',
        encoding="utf-8")


def _toml_str(s: str) -> str:
    return json.dumps(str(s))  # a JSON string is a TOML basic string for paths


def _flwr_run(venv: FlowerVenv, app: Path, conn: str, env: dict[str, str], log: Path, *, job: Path, result: Path,
              rounds: int, clients: int, federation_config: str | None, timeout_s: float) -> None:
    cmd = [venv.exe("flwr"), "run", str(app), conn, "--stream", "--run-config",
           f"job={_toml_str(str(job))} result={_toml_str(str(result))} rounds={rounds} clients={clients}"]
    if federation_config:
        cmd += ["--federation-config", federation_config]
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=app, timeout=timeout_s)
    if r.returncode != 0 or not result.exists():
        raise RuntimeError(f"flwr run exited with {r.returncode} and {'a' if result.exists() else 'no'} result; "
                           f"log tail ({log}):\n{_tail(log)}")


def _outcome(result: Path, t_launch: float, t_end: float, extra: dict[str, Any]) -> dict[str, Any]:
    """The JSON result of a Flower run from the ServerApp's (or legacy server's) result file."""
    res = json.loads(result.read_text(encoding="utf-8"))
    marks = [(int(m["round"]), float(m["t"])) for m in res["marks"]]
    rounds = round_seconds(marks)
    by_round = {int(m["round"]): m for m in res["marks"]}
    clients = {int(k): v for k, v in res.get("clients", {}).items()}
    for r in rounds:
        m = by_round[r["round"]]
        r["accuracy"], r["loss"] = m.get("accuracy"), m.get("loss")
        cl = clients.get(r["round"], [])
        if cl:
            r["clients"] = len(cl)
            for key in ("train_s", "wait_s", "setup_s", "proc_age_s"):
                vals = [float(c[key]) for c in cl if key in c]
                if vals:
                    r[key] = {"sum": sum(vals), "max": max(vals), "mean": sum(vals) / len(vals)}
    first = min(marks)[1]
    return {"ok": True, "rounds": rounds, "final_accuracy": rounds[-1]["accuracy"] if rounds else None,
            "wall_s": t_end - t_launch, "launch_to_round0_s": first - t_launch,
            "overhead_s": (t_end - t_launch) - sum(r["seconds"] for r in rounds), **extra}


def run_simulation(venv: FlowerVenv, job: Path, work: Path, *, rounds: int, clients: int, train_slots: int,
                   torch_threads: int, timeout_s: float = 3600.0) -> dict[str, Any]:
    """Flower's simulation engine: ``flower-superlink --insecure --simulation`` (a child process
    on a free port, the way ``flwr run`` starts its managed local SuperLink), then ``flwr run APP
    sim --stream`` with ``--federation-config`` ``num-supernodes=clients``,
    ``client-resources-num-cpus=torch_threads``, ``init-args-num-cpus=train_slots ×
    torch_threads`` (Ray then keeps ``train_slots`` client actors: no more trainings at once).

    Returns:
        ``ok`` True with ``rounds`` (``round``, ``seconds``, ``accuracy``, the clients'
        ``train_s``/``wait_s``/``setup_s`` sum/max/mean), ``final_accuracy``, ``wall_s`` (launch
        of the SuperLink → ``flwr run`` returned), ``superlink_up_s``, ``launch_to_round0_s``,
        ``overhead_s`` (wall − Σ rounds), ``processes``; ``ok`` False with ``why`` on failure.
    """
    work.mkdir(parents=True, exist_ok=True)
    home, port = work / "flwr-home", free_port()
    write_connection(home, "sim", port)
    app = write_app(work)
    env = venv.env(threads=torch_threads, flwr_home=home)
    result = work / "result.json"
    result.unlink(missing_ok=True)
    procs = Procs()
    fed = (f"num-supernodes={clients} client-resources-num-cpus={torch_threads} "
           f"init-args-num-cpus={train_slots * torch_threads} init-args-num-gpus=0")
    try:
        t0 = time.time()
        sl = procs.start([venv.exe("flower-superlink"), "--insecure", "--simulation",
                          "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(port)],
                         work / "superlink.log", env)
        up = _wait("the SuperLink's /health", lambda: _http_ok(f"http://127.0.0.1:{port}/health"), [sl], 120,
                   work / "superlink.log")
        _flwr_run(venv, app, "sim", env, work / "flwr-run.log", job=job, result=result, rounds=rounds,
                  clients=clients, federation_config=fed, timeout_s=timeout_s)
        t1 = time.time()
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"ok": False, "why": f"{exc}\nSuperLink log tail:\n{_tail(work / 'superlink.log')}"}
    finally:
        procs.stop()
    return _outcome(result, t0, t1, {
        "superlink_up_s": up, "federation_config": fed,
        "processes": "SuperLink; its SuperExec; flwr-simulation (ServerApp + Ray driver); Ray's own processes; "
                     f"{train_slots} Ray client actors ({torch_threads} CPU each), each running ClientApps one "
                     "after another"})


def run_deployment(venv: FlowerVenv, job: Path, work: Path, *, rounds: int, clients: int, torch_threads: int,
                   timeout_s: float = 3600.0) -> dict[str, Any]:
    """Flower's deployment mode: ``flower-superlink --insecure`` and ``clients`` ×
    ``flower-supernode --insecure --superlink 127.0.0.1:PORT --node-config "partition-id=i
    num-partitions=N"`` as separate processes (subprocess isolation: each SuperNode starts a
    ``flwr-clientapp`` process per message), then ``flwr run APP deploy --stream``. The job's
    :class:`TrainSlots` keep trainings at once to its ``train_slots``.

    Returns:
        As :func:`run_simulation`, plus ``supernodes_up_s`` (launch of the SuperNodes → every one
        logged its node id, i.e. registered with the SuperLink).
    """
    work.mkdir(parents=True, exist_ok=True)
    home, port = work / "flwr-home", free_port()
    write_connection(home, "deploy", port)
    app = write_app(work)
    env = venv.env(threads=torch_threads, flwr_home=home)
    result = work / "result.json"
    result.unlink(missing_ok=True)
    procs = Procs()
    try:
        t0 = time.time()
        sl = procs.start([venv.exe("flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
                          "--host", "127.0.0.1", "--port", str(port)], work / "superlink.log", env)
        up = _wait("the SuperLink's /health", lambda: _http_ok(f"http://127.0.0.1:{port}/health"), [sl], 120,
                   work / "superlink.log")
        t_nodes = time.perf_counter()
        nodes, logs = [], []
        for i in range(clients):
            log = work / f"supernode-{i:03d}.log"
            logs.append(log)
            nodes.append(procs.start([venv.exe("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
                                      "--port", str(free_port()),
                                      "--node-config", f"partition-id={i} num-partitions={clients}"], log, env))
        _wait("every SuperNode registered", lambda: all("SuperNode ID" in _tail(lg, 100_000) for lg in logs),
              [sl, *nodes], 300, work)
        nodes_up = time.perf_counter() - t_nodes
        _flwr_run(venv, app, "deploy", env, work / "flwr-run.log", job=job, result=result, rounds=rounds,
                  clients=clients, federation_config=None, timeout_s=timeout_s)
        t1 = time.time()
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"ok": False, "why": f"{exc}\nSuperLink log tail:\n{_tail(work / 'superlink.log')}"}
    finally:
        procs.stop()
    return _outcome(result, t0, t1, {
        "superlink_up_s": up, "supernodes_up_s": nodes_up,
        "processes": f"SuperLink; its SuperExec; a ServerApp process; {clients} SuperNodes, each with its SuperExec; "
                     "each round one flwr-clientapp process per SuperNode"})


def run_legacy(venv: FlowerVenv, job: Path, work: Path, *, rounds: int, clients: int, torch_threads: int,
               client_port: Callable[[int], int] | None = None, timeout_s: float = 3600.0) -> dict[str, Any]:
    """Flower's legacy gRPC path: ``flwr.server.start_server`` (FedAvg, deprecated, in
    ``flwr.compat``) in one process and ``clients`` ``flwr.client.start_client`` processes
    (``python -m tools._flower legacy-server|legacy-client``) on 127.0.0.1.

    Args:
        client_port: maps the server's port to the one the clients dial (a counting relay in
            front of it); ``None``: the server's port.

    Returns:
        As :func:`run_simulation` (``server_up_s``: launch → the server's port accepts), plus
        ``client_exit_codes``.
    """
    work.mkdir(parents=True, exist_ok=True)
    env = venv.env(threads=torch_threads)
    port = free_port()
    result = work / "result.json"
    result.unlink(missing_ok=True)
    base = [str(venv.python), "-m", "tools._flower"]
    procs = Procs()
    try:
        t0 = time.time()
        server = procs.start([*base, "legacy-server", "--job", str(job), "--port", str(port), "--rounds", str(rounds),
                              "--clients", str(clients), "--result", str(result)], work / "server.log", env)
        up = _wait("the legacy server's port", lambda: _port_open(port), [server], 300, work / "server.log")
        dial = client_port(port) if client_port else port
        cl = [procs.start([*base, "legacy-client", "--job", str(job), "--port", str(dial), "--client", str(i)],
                          work / f"client-{i:03d}.log", env) for i in range(clients)]
        server.wait(timeout=timeout_s)
        for p in cl:
            p.wait(timeout=120)
        t1 = time.time()
        if server.returncode != 0 or not result.exists():
            raise RuntimeError(f"the legacy server exited with {server.returncode}; log tail:\n"
                               f"{_tail(work / 'server.log')}")
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"ok": False, "why": str(exc)}
    finally:
        procs.stop()
    return _outcome(result, t0, t1, {
        "server_up_s": up, "client_exit_codes": [p.returncode for p in cl],
        "processes": f"one start_server process; {clients} start_client processes"})


# --------------------------------------------------------------------------------------------
# The legacy server and client processes (run by the Flower venv's interpreter)


def legacy_server(ns: argparse.Namespace) -> int:
    """Flower's legacy gRPC server: FedAvg over all clients, no federated evaluation (fedfleet
    evaluates on the server only), the server's evaluation after each round; writes the marks
    (:func:`round_seconds`), accuracies and the clients' fit metrics to ``ns.result``."""
    import flwr
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import ServerConfig, start_server
    from flwr.server.strategy import FedAvg

    job = load_job(str(ns.job))
    ev = Evaluator(job)
    marks: list[dict[str, Any]] = []
    fit_metrics: dict[int, list[dict[str, Any]]] = {}
    rnd = {"r": 0}

    def evaluate_fn(server_round: int, parameters: Any, config: Any) -> Any:
        arrays = parameters if isinstance(parameters, list) else parameters_to_ndarrays(parameters)
        if server_round == 0:  # the initial model: not evaluated (fedfleet does not either)
            marks.append({"round": 0, "t": time.time()})
            return None
        acc, loss = ev.evaluate(arrays)
        marks.append({"round": server_round, "t": time.time(), "accuracy": acc, "loss": loss})
        return loss, {"accuracy": acc}

    def on_fit_config(server_round: int) -> dict[str, Any]:
        rnd["r"] = server_round
        return {"round": server_round}

    def fit_aggr(results: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        fit_metrics[rnd["r"]] = [dict(m) for _, m in results]
        return {}

    n = ns.clients
    strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_evaluate_clients=0,
                      min_available_clients=n, evaluate_fn=evaluate_fn, on_fit_config_fn=on_fit_config,
                      fit_metrics_aggregation_fn=fit_aggr,
                      initial_parameters=ndarrays_to_parameters(ev.initial_arrays()))
    start_server(server_address=f"127.0.0.1:{ns.port}", config=ServerConfig(num_rounds=ns.rounds), strategy=strategy)
    Path(ns.result).write_text(json.dumps({"flwr": flwr.__version__, "marks": marks, "clients": fit_metrics}))
    return 0


def legacy_client(ns: argparse.Namespace) -> int:
    """One legacy Flower client: :class:`Trainer` behind a ``NumPyClient``, started with the
    deprecated ``start_client``."""
    from flwr.client import NumPyClient, start_client

    job = load_job(str(ns.job))
    trainer = Trainer(job, ns.client)
    setup = {"s": trainer.setup_s}

    class Client(NumPyClient):
        def get_parameters(self, config: Any) -> list:
            from edge_agent.state import state_arrays

            return list(state_arrays(trainer.prepared.model))

        def fit(self, parameters: list, config: Any) -> tuple[list, int, dict[str, Any]]:
            r = trainer.fit(parameters, int(config["round"]))
            m = {"train_loss": r.train_loss, "train_s": r.train_s, "wait_s": r.wait_s, "setup_s": setup["s"]}
            setup["s"] = 0.0
            return r.tensors, r.num_samples, m

    start_client(server_address=f"127.0.0.1:{ns.port}", client=Client().to_client())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the legacy Flower server or one legacy client of the benchmarks")
    p.add_argument("role", choices=("legacy-server", "legacy-client"))
    p.add_argument("--job", required=True, help="the job file (write_job)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--client", type=int, default=0, help="this client's shard")
    p.add_argument("--result", default="", help="the server's result file")
    ns = p.parse_args(argv)
    return legacy_server(ns) if ns.role == "legacy-server" else legacy_client(ns)


if __name__ == "__main__":
    sys.exit(main())
