"""``fedfleet simulate``: a whole federation on one machine over a real MQTT broker.

The server runs on the calling thread; every virtual agent runs on its own thread with its own
MQTT connection, client id and data shard; the broker is an embedded child process (Mosquitto
when installed, else amqtt) unless a broker URL is given. Everything goes over real MQTT.

A run folder holds ``config.toml`` (resolved), ``partition.json`` (the settings the split came
from, which ``--resume`` must find unchanged, and each client's shard size and class histogram;
under ``[data] client_test = "local"`` also its held-out test set's size, histogram and indices,
:func:`partition_record`), ``ledger.sqlite``, ``metrics.jsonl``,
``checkpoints.sqlite``, ``model_final.pt`` and ``summary.json`` (with ``client_test``: which
data the client figures were measured on).
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from edge_agent.agent import AgentSummary, EdgeAgent
from edge_agent.algorithms import ClientAlgorithm, TrainConfig, get_client_algorithm_class, restarted_device_state
from edge_agent.assembly import build_agent, channel_limits, offline_will, prepare_agent
from edge_agent.data import load_dataset
from edge_agent.device import ThreadPlan, apply_threads, detect, plan_threads, usable_cores
from edge_agent.errors import EdgeAgentError, LocalTestSplitError, ModelError, PartitionError
from edge_agent.partition import ClientSplits, client_splits, describe
from edge_agent.runtime import agent_runtime
from edge_agent.slots import TrainingSlots
from edge_agent.state_store import DeviceStateStore
from protocol.broker_url import parse_broker_url, public_broker_url
from protocol.channel import Channel
from protocol.errors import ConnectError, LedgerError, SecurityConfigError
from protocol.ledger import Ledger, read_meta
from protocol.messages import SERVER_ID
from protocol.security import ChannelSecurity, Identity, enroll, generate_identity, load_identity, write_key_dir
from protocol.tensors import Codec
from protocol.topics import mqtt_client_id
from protocol.transport import ConnectRetry

from .config import Config, _toml_value
from .embedded_broker import EmbeddedBroker
from .errors import BrokerStartError, ConfigError
from .persistence import write_summary
from .resumes import note_fresh_run, note_resume, refused_if_raises
from .run_end import FinishedRun, finished_run, last_checkpoint_round, resume_metrics, summary_record, write_final_files
from .run_lock import LOCK_NAME, hold_run_folder
from .runtime import (
    agent_spec,
    channel_options,
    check_fleet_size,
    check_server_keys,
    client_eval_split,
    device_model,
    local_eval_split,
    make_server,
    make_strategy,
    open_transport,
    server_security,
)
from .tracking import check_tracking, start_tracking

log = logging.getLogger(__name__)

#: the ledger's meta key listing the rounds after which a resume restarted the devices' own state
#: (``summary.json``'s ``device_state_restarted``)
RESTARTED_META = "device_state_restarted_after_rounds"
#: the simulated devices' state file in the run folder (:mod:`edge_agent.state_store`), for an
#: algorithm whose devices keep something between rounds: ``--resume`` carries on from it
DEVICE_STATE_FILE = "device_state.sqlite"


def kept_device_state(cfg: Config, buffers: str | None = None) -> list[str]:
    """What a device of ``cfg``'s algorithm keeps between rounds, one phrase per part
    (:func:`~edge_agent.algorithms.restarted_device_state`; ``buffers``: the server half's
    setting, default the client class's), and its error-feedback residuals under ``[protocol]
    error_feedback`` (whatever the codec: a firmware profile may force a lossy one); ``[]``:
    nothing, no state file is kept."""
    parts = restarted_device_state(get_client_algorithm_class(cfg.train.algorithm), buffers)
    if cfg.protocol.error_feedback:
        parts.append("the error-feedback residuals of its update codec")
    return parts


def device_state_summary(agents: list[EdgeAgent], *, resumed: bool) -> dict:
    """``summary.json``'s account of a resumed fleet's kept state: per device, the round whose
    state it carried on from (``device_state_restored``) and the round of an update whose answer
    it never read and took as accepted (``device_state_taken_as_accepted``,
    :mod:`edge_agent.state_store`), both on a resume only, and why a device's state file stopped
    being written during the run (``device_state_errors``, ``{}`` when it never failed); ``{}``
    for an algorithm whose devices keep nothing between rounds."""
    restored = {a.client_id: a.restored_round for a in agents if a.restored_round is not None}
    taken = {a.client_id: a.taken_as_accepted for a in agents if a.taken_as_accepted is not None}
    failed = {a.client_id: a.state_store_error for a in agents if a.state_store_error is not None}
    if not any(a.state_store is not None or a.state_store_error is not None for a in agents):
        return {}  # the algorithm's devices keep nothing between rounds
    out: dict = {"device_state_restored": restored, "device_state_taken_as_accepted": taken} if resumed else {}
    return {**out, "device_state_errors": failed}


@dataclass(frozen=True)
class SimulationResult:
    """Outcome of :func:`simulate`.

    Attributes:
        run_dir: the run folder.
        federation: federation id used in topics.
        final_accuracy: test accuracy after the last round (fraction 0–1).
        rounds_completed: rounds run.
        metrics: one dict per round (as in ``metrics.jsonl``).
        agents: per-agent summaries.
        seconds: wall time of the whole run.
        broker: ``"mosquitto"``, ``"amqtt"`` or the external broker's URL without its user name and
            password (:func:`protocol.broker_url.public_broker_url`).
    """

    run_dir: Path
    federation: str
    final_accuracy: float
    rounds_completed: int
    metrics: list[dict]
    agents: list[AgentSummary]
    seconds: float
    broker: str


def make_run_id(name: str, seed: int) -> str:
    """``<name>-<YYYYmmdd-HHMMSS>-s<seed>`` squeezed to a valid topic level (≤ 64 chars)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "-", name).strip("-._") or "run"
    return f"{stem[:36]}-{time.strftime('%Y%m%d-%H%M%S')}-s{seed}"[:64]


#: Errors of a run that never started (its configuration, its broker): :func:`simulate` and
#: :func:`~broker_server.server_main.run_server` remove what it wrote (:func:`discard_unstarted`).
STARTUP_ERRORS: tuple[type[Exception], ...] = (ConfigError, BrokerStartError, ConnectError)


def run_folder_entries(out: Path) -> set[str] | None:
    """The names in run folder ``out`` now (``None``: it does not exist), for :func:`discard_unstarted`."""
    return {p.name for p in out.iterdir()} if out.is_dir() else None


def discard_unstarted(out: Path, before: set[str] | None) -> None:
    """Remove what a run that never started (a :data:`STARTUP_ERRORS` error: its configuration,
    its broker) wrote to ``out``: the folder itself when it did not exist before (``before`` is
    ``None``), else the entries not in ``before``. A folder holding a checkpoint (a store with a
    row, or one that cannot be read) is a run that started: left alone. The run folder's lock file
    (:data:`~broker_server.run_lock.LOCK_NAME`) is its holder's to remove. Said in the log, so that
    nothing disappears without a word."""
    if not out.is_dir() or (before is not None and "checkpoints.sqlite" in before):
        return
    store = out / "checkpoints.sqlite"
    if store.exists():
        try:
            if last_checkpoint_round(store) is not None:
                return
        except ConfigError:  # not readable: kept, as a run's
            return
    made = sorted(p.name for p in out.iterdir() if (before is None or p.name not in before) and p.name != LOCK_NAME)
    for name in made:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if before is None:
        try:
            out.rmdir()
        except OSError:  # something else appeared there meanwhile: left
            pass
    if made:
        log.warning("the run never started: removed what it had written to %s (%s)", out, ", ".join(made))


def client_data(ds, cfg: Config) -> ClientSplits:
    """The configured partition of ``ds``'s training split into ``[data] clients`` shards and,
    under ``[data] client_test = "local"``, each shard's held-out test set
    (:func:`edge_agent.partition.client_splits` of the ``[data]`` settings and ``[run] seed``:
    what every ``fedfleet-agent`` computes from the same announced settings).

    Raises:
        ConfigError: the partition is impossible (too many clients for the data, α too small), or
            a client's local test set would be empty.
    """
    d = cfg.data
    try:  # the same function fedfleet-agent splits with
        return client_splits(ds, d.clients, client_test=d.client_test, client_test_fraction=d.client_test_fraction,
                             scheme=d.partition, seed=cfg.run.seed, alpha=d.alpha, min_samples=d.min_samples,
                             train_samples=d.train_samples, domain_clients=d.domain_clients,
                             classes=d.classes_per_client)
    except PartitionError as exc:
        local = (f", {d.client_test_fraction:g} of each held out as its local test set"
                 if d.client_test == "local" else "")
        n = len(ds.train.y)
        pool = (f"{min(d.train_samples, n):,} of its {n:,} training samples" if d.train_samples
                else f"{n:,} training samples")
        # a shard too small for its local test set: the error already says what to change (a
        # larger fraction, larger shards); the partition's advice below would say the opposite
        advice = "" if isinstance(exc, LocalTestSplitError) else (
            " Use fewer clients (--clients), a larger [data] alpha, or a smaller [data] min_samples")
        raise ConfigError(
            f"cannot split {ds.name} ({pool}) into {cfg.data.clients} clients "
            f"({cfg.data.partition}, at least {cfg.data.min_samples} samples each{local}): {exc}.{advice}") from None


def split_clients(ds, cfg: Config) -> list:
    """Every client's training indices (:func:`client_data`'s ``train``: under ``client_test =
    "local"`` without its held-out test samples).

    Raises:
        ConfigError: as :func:`client_data`.
    """
    return client_data(ds, cfg).train


def partition_record(ds, cfg: Config, splits: ClientSplits) -> dict:
    """The content of a run folder's ``partition.json``: data set, the settings the split came
    from (:data:`PARTITION_SETTINGS`: scheme, seed, α …), the client test protocol and one entry
    per client (:func:`edge_agent.partition.describe` of its training
    samples: ``samples``, ``histogram``, ``domain``); under ``client_test = "local"`` each entry
    also has ``test_samples``, ``test_histogram`` and ``test_indices`` (sorted indices into the
    training split), so the held-out sets can be audited and a resumed run checked against them
    (:func:`check_partition_record`)."""
    shards = describe(splits.train, ds.train.y, ds.num_classes, domains=ds.train_domains,
                      domain_names=ds.domain_names)
    if splits.test is not None:
        tests = describe(splits.test, ds.train.y, ds.num_classes)
        for entry, test, idx in zip(shards, tests, splits.test, strict=True):
            entry.update(test_samples=test["samples"], test_histogram=test["histogram"],
                         test_indices=[int(i) for i in idx])
    return {"dataset": ds.name, "source": ds.source, **partition_settings(cfg, ds.name),
            "client_test": splits.client_test, "client_test_fraction": splits.fraction,
            "clients": shards, **ds.domain_summary()}


#: The settings a run's split comes from, as ``partition.json`` records them (:func:`partition_record`)
#: and ``--resume`` finds them unchanged (:func:`check_partition_settings`): record key → the
#: ``(section, key)`` of the configuration, and the partition schemes it applies to (``None``: all).
PARTITION_SETTINGS: dict[str, tuple[tuple[str, str], tuple[str, ...] | None]] = {
    "dataset": (("data", "dataset"), None),
    "scheme": (("data", "partition"), None),
    "seed": (("run", "seed"), None),
    "alpha": (("data", "alpha"), ("dirichlet",)),
    "train_samples": (("data", "train_samples"), None),
    "min_samples": (("data", "min_samples"), ("dirichlet",)),  # the others only check it: the split is the same
    "classes_per_client": (("data", "classes_per_client"), ("classes",)),
    "domain_clients": (("data", "domain_clients"), ("domain-silo",)),
    "domain_train_cap": (("data", "domain_train_cap"), None),
    "domain_test_cap": (("data", "domain_test_cap"), None),
}


def partition_settings(cfg: Config, dataset: str | None = None) -> dict:
    """:data:`PARTITION_SETTINGS` of ``cfg``, keyed as ``partition.json`` records them; ``dataset``:
    the data set's own name (:class:`~edge_agent.data.Dataset`'s ``name``; ``None``: the registry's
    name of ``[data] dataset``, or the text itself when the registry does not know it)."""
    if dataset is None:
        from edge_agent.data import dataset_info
        from edge_agent.errors import DataError

        try:
            dataset = dataset_info(cfg.data.dataset).name
        except DataError:  # said with its reason when the data set is loaded
            dataset = cfg.data.dataset
    out = {key: getattr(getattr(cfg, sec), name) for key, ((sec, name), _) in PARTITION_SETTINGS.items()}
    return {**out, "dataset": dataset}


def check_partition_settings(path: Path, cfg: Config, flags: Mapping[tuple[str, str], str] | None = None) -> None:
    """On ``--resume``, before the data set is loaded: the settings the run's split came from, as
    its ``partition.json`` (``path``) records them (:data:`PARTITION_SETTINGS` and the client
    count), must be ``cfg``'s: a resumed run keeps its split, and its seed, whose draws also made
    its initial model and its training. A setting the file does not record (one written by an
    earlier version), or no file, is left to :func:`check_partition_record`.

    Args:
        flags: the command-line option of each ``(section, key)`` given on the command line
            (``{("run", "seed"): "--seed"}``), which the message names; the others are said to
            come from ``cfg.source``.

    Raises:
        ConfigError: the file cannot be read, or a setting differs: the message names the
            setting, both values, where the new one came from, and how to resume.
    """
    old = _recorded_partition(path)
    if old is None:
        return
    now = partition_settings(cfg)
    differ: list[tuple[tuple[str, str], object, object]] = [
        (where, old[key], now[key]) for key, (where, schemes) in PARTITION_SETTINGS.items()
        if key in old and (schemes is None or now["scheme"] in schemes) and old[key] != now[key]]
    if isinstance(old.get("clients"), list) and len(old["clients"]) != cfg.data.clients:
        differ.append((("data", "clients"), len(old["clients"]), cfg.data.clients))
    if not differ:  # the first that differs is said
        return
    (sec, key), was, given = differ[0]
    flag = (flags or {}).get((sec, key))
    source = "" if cfg.source.startswith("<") else cfg.source
    if (sec, key) == ("run", "seed"):
        what, keeps, new = f"seed {was}", "its seed (its split, initial model and training draws come from it)", \
            f"{given}"
    elif (sec, key) == ("data", "clients"):
        what, keeps, new = f"{was} clients", "its clients (each one's shard is the one it trained on)", f"{given}"
    else:
        what, keeps, new = f"[{sec}] {key} = {was!r}", "the settings its split came from", f"{given!r}"
    by = f" ({flag} {given})" if flag else f" ({source})" if source else ""
    fix = (f"resume without {flag}" if flag else
           f"set [{sec}] {key} back to {_toml_value(was)}{f' in {source}' if source else ''}")
    raise ConfigError(f"--resume: {path} records {what}, the configuration gives {new}{by}: a resumed run keeps "
                      f"{keeps}; {fix}")


def _recorded_partition(path: Path) -> dict | None:
    """A run's ``partition.json`` (``None`` without the file), for the ``--resume`` checks.

    Raises:
        ConfigError: the file cannot be read, or is not a JSON object.
    """
    if not path.exists():
        return None
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--resume: cannot read {path}: {exc}") from None
    if not isinstance(old, dict):
        raise ConfigError(f"--resume: cannot read {path}: not a JSON object")
    return old


def check_partition_record(path: Path, record: dict) -> None:
    """On ``--resume``: the split recomputed now (``record``, :func:`partition_record`) must be the
    one the run started with (``path``, its ``partition.json``): the same client test protocol and,
    client by client, the same training histogram and held-out indices. A folder without the
    file, or a file written before the client test keys existed (read as ``"shared"``), is
    checked on what it holds.

    Raises:
        ConfigError: the file cannot be read, or the splits differ (the message names the first
            client that differs): a resumed run must not train or evaluate on other samples.
    """
    old = _recorded_partition(path)
    if old is None:
        return
    was = old.get("client_test", "shared")
    if was != record["client_test"] or old.get("client_test_fraction") != record["client_test_fraction"]:
        raise ConfigError(f"--resume: {path} records client_test = {was!r} (fraction "
                          f"{old.get('client_test_fraction')}), the configuration now gives "
                          f"{record['client_test']!r} (fraction {record['client_test_fraction']})")
    keys = ("samples", "histogram", "test_samples", "test_histogram", "test_indices")
    before, now = old.get("clients", []), record["clients"]
    if len(before) != len(now):
        raise ConfigError(f"--resume: {path} records {len(before)} clients, the configuration gives {len(now)}")
    unrecorded = [f"[{sec}] {key}" for k, ((sec, key), schemes) in PARTITION_SETTINGS.items()
                  if k not in old and (schemes is None or record.get("scheme") in schemes)
                  and (k not in ("domain_train_cap", "domain_test_cap") or "domains" in record)]
    why = ("another NumPy version, or changed data?" if not unrecorded else
           f"another NumPy version, changed data, or a changed {', '.join(unrecorded)}, which this partition.json, "
           "written by an earlier version, does not record?")
    for a, b in zip(before, now, strict=True):
        if any(a.get(k) != b.get(k) for k in keys):
            raise ConfigError(f"--resume: client {b['client']}'s samples differ from those recorded in {path} "
                              f"({why}): the run cannot continue on another split")


def assign_profiles(mix: list[tuple[str, float]], clients: int, seed: int) -> list[str]:
    """Profile name of each virtual agent: counts by largest remainder of ``fraction × clients``,
    placed in a seeded random order (the same for a given seed)."""
    raw = [f * clients for _, f in mix]
    counts = [int(r) for r in raw]
    for i in sorted(range(len(mix)), key=lambda i: raw[i] - counts[i], reverse=True)[:clients - sum(counts)]:
        counts[i] += 1
    names = [name for (name, _), c in zip(mix, counts, strict=True) for _ in range(c)]
    order = np.random.default_rng(seed).permutation(clients)
    return [names[i] for i in order]


def _num(value: float | None) -> str:
    return "   n/a" if value is None else f"{value:.4f}"


def _source(m: dict) -> str:
    return " (clients' own models)" if m.get("accuracy_source") == "clients" else ""


def fleet_security(cfg: Config, run_dir: Path, client_ids: list[str]
                   ) -> tuple[ChannelSecurity | None, dict[str, Identity]]:
    """Keys of a simulated fleet when ``[security] sign`` is on: ``(server channel security,
    {client id: identity})``; ``(None, {})`` when off.

    Every virtual agent gets its own key folder ``RUN_DIR/keys/<client id>`` (made on the first
    run, reused by ``--resume``). The server's keys come from ``[security] key_dir`` when set
    (its ``enrolled/`` folder is left as it is: the virtual agents are allowed in memory only),
    else from ``RUN_DIR/keys/server``, into whose ``enrolled/`` the agents are enrolled.

    Raises:
        ConfigError: a key folder that cannot be read or written.
    """
    if not cfg.security.sign:
        return None, {}
    root = run_dir / "keys"

    def load_or_make(node_id: str) -> Identity:
        d = root / node_id
        if not (d / "ed25519.key").exists():
            write_key_dir(generate_identity(node_id), d)
        return load_identity(d, expected_id=node_id)

    try:
        server_id = None if cfg.security.key_dir else load_or_make(SERVER_ID)
        agents = {cid: load_or_make(cid) for cid in client_ids}
        if server_id is not None:
            for ident in agents.values():
                enroll(root / SERVER_ID, ident.public, replace=True)
            return server_security(cfg, identity=server_id), agents
    except SecurityConfigError as exc:
        raise ConfigError(f"{cfg.source}: [security] keys of the simulated fleet: {exc}") from None
    return server_security(cfg, extra_peers={cid: ident.public for cid, ident in agents.items()}), agents


#: Open files one virtual agent holds: its MQTT socket and paho's wake-up socket pair.
FILES_PER_AGENT = 3

#: Open files of a simulation beyond its agents' (server socket, ledger and checkpoint databases
#: with their journals, data files, the broker's pipes, torch's own), with room to spare.
FILES_FIXED = 256

#: How a virtual agent retries its connect (:class:`protocol.transport.ConnectRetry`): agents
#: connect one after another, so the embedded broker is never hit by all of them at once; a
#: loaded machine may still leave a CONNACK late, and an external broker may be busy.
AGENT_CONNECT_RETRY = ConnectRetry(attempts=5, base_s=0.5, cap_s=8.0)


def ensure_open_files(clients: int) -> int:
    """Raise this process's soft open-files limit (``RLIMIT_NOFILE``) to what ``clients`` virtual
    agents need (:data:`FILES_PER_AGENT` each plus :data:`FILES_FIXED`) when it is lower, up to the
    hard limit; the embedded broker, started afterwards, inherits it (Mosquitto holds one file per
    connection). Returns the soft limit in force.

    Raises:
        ConfigError: the hard limit is below the need (the message says how many files and how to
            raise the limit): otherwise connects would fail part-way through the fleet.
    """
    need = FILES_PER_AGENT * clients + FILES_FIXED
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ConfigError(f"{clients} virtual agents need about {need:,} open files ({FILES_PER_AGENT} each plus "
                          f"{FILES_FIXED}); this process may open at most {hard:,} (the hard limit, ulimit -Hn). "
                          f"Raise it (ulimit -n {need}, or LimitNOFILE in a systemd unit) or simulate fewer clients")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    log.info("open files limit raised from %d to %d for %d virtual agents", soft, need, clients)
    return need


def progress_printer(rounds: int, stream: TextIO | None = None) -> Callable[[dict], None]:
    """A callback printing one line per round: round, accuracy, clients, bytes, elapsed (to
    ``stream``; ``None``: ``sys.stdout`` as it is when called, not when this module was imported).
    A round the server did not evaluate (``[server] eval_every``: no ``accuracy`` key,
    ``test_evaluated`` false) shows ``-`` for its accuracy and loss and says so at the end;
    ``n/a`` is a figure that was to be measured and was not (a personalised algorithm's round
    without client evaluation)."""
    t0 = time.monotonic()
    out = stream if stream is not None else sys.stdout

    def show(m: dict) -> None:
        skipped = "  SKIPPED: " + m.get("skip_reason", "") if m.get("skipped") else ""
        untested = "accuracy" not in m and m.get("test_evaluated") is False
        acc, loss = ("     -", "     -") if untested else (_num(m.get("accuracy")), _num(m.get("loss")))
        if untested:
            skipped += "  (not evaluated this round: [server] eval_every)"
        out.write(
            f"round {m['round']:>3}/{rounds}  acc {acc}{_source(m)}  loss {loss}  "
            f"clients {m['clients_reported']}/{m['clients_selected']}  "
            f"server link: up {m['bytes_up'] / 1024:,.1f} KiB, down {m['bytes_down'] / 1024:,.1f} KiB  "
            f"{m['seconds']:.1f} s  (elapsed {time.monotonic() - t0:.0f} s){skipped}\n")
        out.flush()

    return show


def _finished_result(cfg: Config, ds, fin: FinishedRun, federation: str, t_start: float) -> SimulationResult:
    """:func:`simulate`'s result for a ``--resume`` of a run whose rounds are all done
    (:mod:`broker_server.run_end`): read from its files when they are complete (nothing is
    written), else its final files written first (:func:`~broker_server.run_end.write_final_files`)."""
    if fin.summary is not None:
        acc, broker = float(fin.summary.get("final_accuracy", float("nan"))), str(fin.summary.get("broker", ""))
    else:
        try:  # the broker the run's rounds went over, as its ledger recorded it
            broker = read_meta(fin.run_dir / "ledger.sqlite").get("broker", "")
        except LedgerError:
            broker = ""
        profiles = assign_profiles(cfg.agents.profile_mix(), cfg.data.clients, cfg.run.seed)
        acc = write_final_files(cfg, ds, fin, federation=federation, broker=broker, extra={
            "substitutions": list(ds.substitutions), "agent_errors": [], "thread_plan": None,
            "profiles": {name: profiles.count(name) for name in sorted(set(profiles))},
            "emulated_link_s": None, "resumed_after": fin.rounds}).summary.final_accuracy
    return SimulationResult(run_dir=fin.run_dir, federation=federation, final_accuracy=acc,
                            rounds_completed=fin.rounds, metrics=fin.metrics, agents=[],
                            seconds=time.monotonic() - t_start, broker=broker)


def simulate(cfg: Config, *, broker_url: str | None = None, run_dir: str | os.PathLike | None = None,
             on_round: Callable[[dict], None] | None = None, agent_hook: Callable[[int, EdgeAgent], None] | None = None,
             resume: bool = False, on_plan: Callable[[ThreadPlan], None] | None = None,
             on_start: Callable[[], None] | None = None,
             on_event: Callable[[str, int, str | None, dict], None] | None = None) -> SimulationResult:
    """Run the federation described by ``cfg`` and return its result.

    Args:
        cfg: validated configuration.
        broker_url: ``mqtt://host:port`` of an existing broker; ``None`` starts an embedded one
            (``cfg.broker.url`` is used when set).
        run_dir: the run folder (created); default ``<cfg.run.out>/<run-id>``.
        on_round: progress callback (one dict per round).
        agent_hook: called with (index, agent) before each agent thread starts (tests use it to
            make agents misbehave).
        resume: continue the run in ``run_dir`` from its last checkpoint (after a crash): same
            federation, the ledger and metrics are appended to, the fleet joins again. A run
            with no round left starts no broker and no agent (:mod:`broker_server.run_end`):
            its result is read from its files, its final files written first when missing.
        on_plan: called once with the thread plan (:func:`edge_agent.device.plan_threads`:
            torch threads and trainings at once, from the cores this process may use and
            ``[agents] torch_threads``/``train_slots``) before any agent starts; the plan is also
            logged and written to ``summary.json`` (``thread_plan``).
        on_event: the server's progress events (:mod:`broker_server.progress`).
        on_start: called once the configuration checks have passed (data set, partition,
            ``[algorithm]``, fleet size, tracking, keys, models), before anything is written:
            ``fedfleet simulate`` prints its first line there, so a configuration error comes alone.

    The call holds the run folder's lock (:mod:`broker_server.run_lock`) from before it reads the
    folder to its return: a second simulation, server or resume in that folder is refused at once.

    Raises:
        RunFolderBusy: another process holds the run folder (nothing read or written).
        ConfigError: unknown algorithm, data set or partition settings.
        DataError: the data set cannot be found.
        BrokerStartError: the embedded broker did not start.
        ConnectError: a client could not connect to the broker.
    """
    out = Path(run_dir) if run_dir is not None else Path(cfg.run.out) / make_run_id(cfg.run.name, cfg.run.seed)
    before = run_folder_entries(out)
    try:
        with hold_run_folder(out, "fedfleet simulate"):  # one process at a time writes the folder
            return _simulate(cfg, out, broker_url=broker_url, on_round=on_round, agent_hook=agent_hook,
                             resume=resume, on_event=on_event, on_plan=on_plan, on_start=on_start)
    except STARTUP_ERRORS:  # nothing ran: no half-made run folder that --resume refuses
        if not resume:
            discard_unstarted(out, before)
        raise


def _simulate(cfg: Config, out: Path, *, broker_url: str | None, on_round: Callable[[dict], None] | None,
              agent_hook: Callable[[int, EdgeAgent], None] | None, resume: bool,
              on_event: Callable[[str, int, str | None, dict], None] | None,
              on_plan: Callable[[ThreadPlan], None] | None,
              on_start: Callable[[], None] | None = None) -> SimulationResult:
    """:func:`simulate` in the run folder ``out``."""
    t_start = time.monotonic()
    run_id = out.name
    if resume and not (out / "checkpoints.sqlite").exists():
        raise ConfigError(f"--resume {out}: no checkpoints.sqlite there (not a run folder, or it never started)")
    if resume:
        resume_metrics(out)  # a damaged metrics.jsonl is refused before a broker, a ledger or a file is touched
        check_partition_settings(out / "partition.json", cfg)  # another seed …: said before the data set is loaded
    if not resume and (out / "metrics.jsonl").exists():
        raise ConfigError(f"{out} already holds a run (metrics.jsonl); choose another --out, or --resume it")
    federation = re.sub(r"[^A-Za-z0-9_.-]", "-", out.name).strip("-._")[:64] or run_id
    url = broker_url or cfg.broker.url or None
    if url is not None:
        try:
            parse_broker_url(url)
        except ValueError as exc:
            raise ConfigError(f"--broker / [broker] url: {exc}") from None

    ds = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir or None,
                      domain_train_cap=cfg.data.domain_train_cap, domain_test_cap=cfg.data.domain_test_cap)
    splits = client_data(ds, cfg)
    parts = splits.train
    ensure_open_files(len(parts))  # before anything is written, and before the broker starts: it inherits the limit
    record = partition_record(ds, cfg, splits)
    shards = record["clients"]
    if resume:
        check_partition_record(out / "partition.json", record)
    try:
        get_client_algorithm_class(cfg.train.algorithm)  # the name only: setup needs the data
    except EdgeAgentError as exc:
        raise ConfigError(f"{cfg.source}: [train] algorithm: {exc}") from exc
    strategy = make_strategy(cfg, ds, resuming=resume)  # the [algorithm] table is checked before anything is written,
    check_fleet_size(cfg, strategy)    # and the run serves with this strategy (built once: its warnings said once)
    check_tracking(cfg)  # a tracking package asked for but missing: said now, not after the run
    check_server_keys(cfg, simulated=True)  # [security] key_dir: said before the run folder is made
    for name in cfg.model.architectures():  # every architecture of the fleet is built and checked once
        device_model(ds, cfg.run.seed, name, cfg.model.feature_dim)
    if on_start is not None:
        on_start()
    if resume and (fin := finished_run(out, cfg.run.rounds)) is not None:  # no round left: no broker, no agents
        return _finished_result(cfg, ds, fin, federation, t_start)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(cfg.to_toml(), encoding="utf-8")
    (out / "partition.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    for note in ds.substitutions:
        log.warning("data set %s: %s", ds.name, note)
    for s in shards:
        log.info("client %d: %d samples, histogram %s%s", s["client"], s["samples"], s["histogram"],
                 f"; local test {s['test_samples']} samples, histogram {s['test_histogram']}"
                 if "test_samples" in s else "")

    server_sec, fleet_keys = fleet_security(cfg, out, [f"client-{i:03d}" for i in range(len(parts))])
    broker: EmbeddedBroker | None = None
    if url is None:
        broker = EmbeddedBroker(kind=cfg.broker.kind, workdir=out / "broker")
        broker.start()
        url = broker.url
        broker_name = broker.kind
    else:
        broker_name = public_broker_url(url)  # as summary.json and the ledger name it: no user name or password
    ledger = Ledger(out / "ledger.sqlite")
    before_id = ledger.last_row_id()  # the rows of earlier sessions (a --resume's) end here
    ledger.set_meta("federation", federation)
    ledger.set_meta("broker", broker_name)
    if not resume:
        note_fresh_run(ledger)
    profiles = assign_profiles(cfg.agents.profile_mix(), cfg.data.clients, cfg.run.seed)
    hw = detect()
    # one process trains every virtual device: the plan, not each virtual profile's torch_threads, rules
    thread_plan = apply_threads(plan_threads(
        usable_cores(hw), role="simulation", clients=cfg.data.clients, embedded_broker=broker is not None,
        torch_threads=cfg.agents.torch_threads, train_slots=cfg.agents.train_slots))
    if on_plan is not None:  # the caller shows it (fedfleet simulate prints it): not said twice
        on_plan(thread_plan)
    else:
        log.info("%s", thread_plan.describe())
    runtimes = {name: agent_runtime(name, info=hw) for name in set(profiles)}
    agents: list[EdgeAgent] = []
    threads: list[threading.Thread] = []
    errors: list[BaseException] = []
    summaries: list[AgentSummary] = []
    server = None
    tracker = None
    slots: TrainingSlots | None = None
    state_store: DeviceStateStore | None = None
    finished = False
    try:
        tracker = start_tracking(cfg, out, federation)
        if tracker is not None:
            on_round = tracker.wrap(on_round)
        server = make_server(cfg, ds, url, federation=federation, run_dir=out, ledger=ledger,
                             expected_clients=cfg.data.clients, on_round=on_round, security=server_sec,
                             strategy=strategy)
        server.on_event = on_event
        # each device announces its own packet limit and chunk size in its join (and, over MQTT 5,
        # in its CONNECT): the server sizes every download for the devices it goes to
        restarted: list[int] = []  # rounds after which a resume restarted the devices' own state
        resumed_after: int | None = None  # the checkpoint's round a --resume went on from
        lost: list[str] = []  # what that state is
        lost_devices: list[str] = []  # whose
        algo_cls: type[ClientAlgorithm] = get_client_algorithm_class(cfg.train.algorithm)
        keeps = kept_device_state(cfg, type(server.strategy).buffers)
        had_file = (out / DEVICE_STATE_FILE).exists()
        if keeps:  # what the devices keep between rounds is kept on disk: a resumed fleet carries on from it
            state_store = DeviceStateStore(out / DEVICE_STATE_FILE)
            if not resume:
                state_store.clear()
        if resume:
            restarted = json.loads(read_meta(ledger.path).get(RESTARTED_META, "[]"))
            ckpt = server.checkpoints.load()
            # where this session's rows begin, for the audit (before the checkpoint is taken back:
            # a resume refused from here on still wrote its connection's rows)
            note_resume(ledger, after_round=ckpt.round if ckpt is not None else 0, after_id=before_id,
                        registry=len(ckpt.registry) if ckpt is not None else 0)
            if ckpt is not None:
                with refused_if_raises(ledger, after_id=before_id):  # a checkpoint that does not load: noted so
                    server.resume(ckpt)
                resumed_after = ckpt.round
                ids = [f"client-{i:03d}" for i in range(len(parts))]
                # a device with no row at all, not even its initial state, lost what it kept: the run
                # folder has no state file (made before it existed), or it was emptied or copied
                # without its -wal file; an algorithm that cannot write its state loses that part
                # a device of an algorithm that keeps nothing else has rows only once its codec held
                # something back (a zero residual is no loss): its rows cannot tell a loss
                algo_keeps = restarted_device_state(algo_cls, type(server.strategy).buffers)
                missing = ([c for c in ids if not state_store.rounds(c)]
                           if state_store is not None and algo_keeps else [])
                if (not algo_keeps and not had_file and cfg.protocol.error_feedback
                        and Codec.parse(cfg.protocol.codec_for("update")).lossy):
                    missing = list(ids)  # the file is gone: whatever residuals the devices held are
                cannot = ([algo_cls.device_state] if algo_cls.device_state
                          and not algo_cls.keeps_device_state_on_disk() else [])
                if ckpt.round >= 1 and (missing or cannot):
                    lost, lost_devices = (keeps, missing) if missing else (cannot, ids)
                if lost:  # said out loud: those devices are new objects, the server's state is the checkpoint's
                    restarted.append(int(ckpt.round))
                    ledger.set_meta(RESTARTED_META, json.dumps(restarted))
                    log.warning("--resume: %d of %d simulated devices start afresh (%s%s): a %s device keeps %s "
                                "between rounds, which starts again from its initial values there, so from round %d "
                                "on this run is not the one that was interrupted (the server's state continues from "
                                "its checkpoint)", len(lost_devices), len(ids), ", ".join(lost_devices[:5]),
                                " …" if len(lost_devices) > 5 else "", cfg.train.algorithm, "; ".join(lost),
                                ckpt.round + 1)
                elif keeps:
                    log.info("--resume: the devices carry on from their state in %s (%s)", DEVICE_STATE_FILE,
                             "; ".join(keeps))

        # the fleet trains on train_slots threads of their own, which lend their working model to
        # agents whose algorithm keeps no model between rounds (edge_agent.slots: per-thread
        # compute state and a model per agent were most of a virtual agent's memory)
        slots = TrainingSlots(thread_plan.train_slots)
        # an evaluation while the devices train (evaluation overlap) holds a training slot: the
        # busy threads never outnumber the plan's slots
        server.eval_slot = slots.holder()
        defaults = TrainConfig(local_epochs=cfg.train.local_epochs, batch_size=cfg.train.batch_size, lr=cfg.train.lr,
                               momentum=cfg.train.momentum, weight_decay=cfg.train.weight_decay, seed=cfg.run.seed)
        shared_eval = client_eval_split(cfg, ds) if splits.test is None else None
        for i, idx in enumerate(parts):
            eval_split = shared_eval if splits.test is None else local_eval_split(cfg, ds, splits.test[i])
            cid = f"client-{i:03d}"
            agent_sec = None
            if server_sec is not None:  # each virtual agent signs with its own keys; the server's key is pinned
                agent_sec = ChannelSecurity(fleet_keys[cid], side="agent",
                                            peers={SERVER_ID: server_sec.identity.public},
                                            encrypt=cfg.security.encrypt, replay_window=cfg.security.replay_window)
            rt = runtimes[profiles[i]]
            spec = agent_spec(cfg, client_id=cid, shard=i, profile=profiles[i],
                              idle_timeout_s=max(120.0, 2 * cfg.server.round_deadline_s),
                              info={"virtual": True, "torch": torch.__version__})
            try:
                prepared = prepare_agent(spec, ds, precision=rt.plan.precision, indices=idx, eval_split=eval_split)
            except ModelError as exc:
                raise ConfigError(f"{cfg.source}: [model] for {cid}: {exc}") from None
            tr = open_transport(mqtt_client_id(federation, cid), cfg, url,
                                will=offline_will(federation, cid, agent_sec),
                                receive_max_packet_bytes=rt.max_packet_bytes)
            tr.connect(retry=AGENT_CONNECT_RETRY)
            ch = Channel(tr, node_id=cid, side="agent", federation=federation, ledger=ledger, security=agent_sec,
                         **{**channel_options(cfg), **channel_limits(rt, chunk_bytes=cfg.protocol.chunk_bytes,
                                                                     max_packet_bytes=cfg.protocol.max_packet_bytes)})
            try:
                agent = build_agent(prepared, ch, runtime=rt, train_defaults=defaults, slots=slots,
                                    emulate_link=cfg.agents.emulate_link, state_store=state_store)
            except BaseException:  # e.g. its kept state does not fit: its connection is not an agent's yet
                ch.close()
                raise
            del prepared  # a borrowing agent gave its model up: nothing else holds it
            if agent_hook is not None:
                agent_hook(i, agent)
            agents.append(agent)

        def agent_main(a: EdgeAgent) -> None:
            try:
                summaries.append(a.run())
            except BaseException as exc:  # reported after the run; one agent must not stop the others
                log.error("%s failed: %s", a.client_id, exc)
                errors.append(exc)
            finally:
                a.channel.close()

        for a in agents:
            t = threading.Thread(target=agent_main, args=(a,), name=a.client_id, daemon=True)
            t.start()
            threads.append(t)
        summary = server.run()
        for t in threads:
            t.join(timeout=30)
        server.close("run finished")  # its retained offline status, then DISCONNECT
        finished = True
    finally:
        if tracker is not None and not finished:
            tracker.close(status="FAILED")
        for a in agents:
            a.stop()
        if slots is not None:
            slots.close()  # trainings still waiting (a failed run) end with SlotsClosed
        for t in threads:
            t.join(timeout=5)
        if server is not None:  # its offline status (a stopped run), unless said at the end of a finished one
            server.close()
        for ch in [a.channel for a in agents] + ([server.channel] if server is not None else []):
            ch.close()  # every exit path closes what it opened; a second close is a no-op
        if server is not None:
            server.store.close()  # checkpoints.sqlite whole (no -wal left), not when it is garbage-collected
        ledger.close()
        if state_store is not None:
            state_store.close()
        if broker is not None:
            broker.stop()
    if tracker is not None:  # the ledger is complete now: the device links' bytes per round
        tracker.finish()
    result = SimulationResult(run_dir=out, federation=federation, final_accuracy=summary.final_accuracy,
                              rounds_completed=summary.rounds_completed, metrics=summary.metrics,
                              agents=sorted(summaries, key=lambda s: s.client_id),
                              seconds=time.monotonic() - t_start, broker=broker_name)
    write_summary(out, summary_record(
        cfg, ds, federation=federation, final_accuracy=result.final_accuracy,
        rounds_completed=result.rounds_completed, seconds=result.seconds, broker=broker_name,
        refusals=server.refusal_totals(), onnx=server.onnx_result, strategy=server.strategy,
        substitutions=list(ds.substitutions),
        agent_errors=[repr(e) for e in errors], thread_plan=thread_plan.as_dict(),
        profiles={name: profiles.count(name) for name in sorted(set(profiles))},
        emulated_link_s={s.client_id: round(s.link_s, 3) for s in summaries} if cfg.agents.emulate_link else None,
        device_state_restarted=({"after_rounds": restarted, "state": lost or keeps,
                                 **({"devices": lost_devices} if lost else {})} if restarted else None),
        resumed_after=resumed_after,
        **device_state_summary(agents, resumed=resume),
        **({"devices_rejoined_without_state": server.rejoined_without_state}
           if server.rejoined_without_state else {}),
        **({"metrics_lines_missing": server.metrics_lines_missing} if server.metrics_lines_missing else {}),
        **({"finish_unconfirmed": summary.finish_unconfirmed} if summary.finish_unconfirmed else {}),
    ))
    if state_store is not None and finished_run(out, cfg.run.rounds) is not None:
        for f in out.glob(DEVICE_STATE_FILE + "*"):  # no round left to resume: the devices' kept state is spent
            f.unlink()
    return result
