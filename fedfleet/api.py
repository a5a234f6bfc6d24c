"""Run fedfleet from Python: a simulation, a server or one agent, from a configuration object,
returning the run's history (metrics per round, the byte ledger's totals).

>>> import fedfleet
>>> history = fedfleet.run_simulation({"data": {"dataset": "digits", "clients": 3}, "run": {"rounds": 2}})
>>> history.metric("accuracy")        # one value per round

``config`` is a :class:`~broker_server.config.Config` (the TOML's dataclasses), a dict shaped like
the TOML file (``{"run": {...}, "data": {...}, "algorithm": {...}}``: every key checked as in a
file), or the path of a TOML file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker_server import config as _config
from broker_server.config import Config

__all__ = ["AgentHistory", "History", "load_config", "run_agent", "run_server", "run_simulation"]


def load_config(config: Config | Mapping[str, Any] | str | os.PathLike[str]) -> Config:
    """A validated :class:`Config` from a Config (returned as it is), a dict shaped like the TOML
    file, or the path of a TOML file.

    Raises:
        ConfigError: an unknown section or key, a wrong type or a value out of range (naming it).
        TypeError: ``config`` is none of the three.
    """
    if isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        return _config.from_dict({k: dict(v) if isinstance(v, Mapping) else v for k, v in config.items()},
                                 "<python dict>")
    if isinstance(config, (str, os.PathLike)):
        return _config.load(config)
    raise TypeError(f"config: expected a Config, a dict or a TOML path, got {type(config).__name__}")


@dataclass(frozen=True)
class History:
    """What a run did, as the server saw it.

    Attributes:
        run_dir: the run folder (``metrics.jsonl``, ``ledger.sqlite``, ``summary.json`` …).
        federation: the federation id (topic level).
        rounds: one dict per round, as the lines of ``metrics.jsonl`` (``round``, ``accuracy``
            0–1, ``loss``, ``bytes_up``/``bytes_down`` of the server link, the strategy's own
            figures …).
        final_accuracy: the last measured accuracy (fraction 0–1; NaN when none was).
        ledger: the byte ledger's totals (bytes) by view — ``"device"`` (what every agent sent and
            received; empty for :func:`run_server`, whose agents keep their own ledgers) and
            ``"server"`` (the server's link, a broadcast counted once) — each ``{"up": T, "down":
            T, "all": T}`` with ``T`` holding ``messages``, ``wire_bytes``, ``body_bytes``,
            ``overhead_share`` … (:func:`broker_server.audit.totals`).
        ledger_by_round: per view, the ledger's bytes per round (:func:`broker_server.audit.by_round`).
    """

    run_dir: Path
    federation: str
    rounds: list[dict]
    final_accuracy: float
    ledger: dict[str, dict[str, Any]] = field(default_factory=dict)
    ledger_by_round: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def metric(self, key: str) -> list[Any]:
        """The value of ``key`` in every round's metrics (``None`` where a round has none)."""
        return [m.get(key) for m in self.rounds]


def _history(run_dir: Path, federation: str, rounds: list[dict], final_accuracy: float) -> History:
    from broker_server.audit import by_round, open_ledger, totals

    db = open_ledger(run_dir)
    try:
        ledger = {view: totals(db, view) for view in ("device", "server")}
        per_round = {view: by_round(db, view) for view in ("device", "server")}
    finally:
        db.close()
    return History(run_dir=run_dir, federation=federation, rounds=list(rounds), final_accuracy=final_accuracy,
                   ledger=ledger, ledger_by_round=per_round)


def run_simulation(config: Config | Mapping[str, Any] | str | os.PathLike[str], *,
                   run_dir: str | os.PathLike[str] | None = None, broker_url: str | None = None,
                   on_round: Callable[[dict], None] | None = None, resume: bool = False) -> History:
    """A whole federation on this machine (``fedfleet simulate``): an embedded MQTT broker (or
    ``broker_url``), the server, and one virtual agent per ``[data] clients``, each a real MQTT
    client.

    Args:
        config: see :func:`load_config`.
        run_dir: the run folder (default ``[run] out/<name>-<time>-s<seed>``); must not hold a run.
        broker_url: ``mqtt://host:port`` of a broker to use instead of an embedded one.
        on_round: called with each round's metrics dict as the round closes.
        resume: continue the run in ``run_dir`` from its last checkpoint.

    Returns:
        The run's :class:`History`.

    Raises:
        ConfigError, DataError, BrokerStartError, ConnectError, RunFolderBusy: as
            :func:`broker_server.simulate.simulate` (``RunFolderBusy``: another process holds the run folder).
    """
    from broker_server.simulate import simulate

    res = simulate(load_config(config), broker_url=broker_url, run_dir=run_dir, on_round=on_round, resume=resume)
    return _history(res.run_dir, res.federation, res.metrics, res.final_accuracy)


def run_server(config: Config | Mapping[str, Any] | str | os.PathLike[str], *,
               run_dir: str | os.PathLike[str] | None = None, broker_url: str | None = None,
               on_round: Callable[[dict], None] | None = None,
               on_start: Callable[[str, str], None] | None = None, resume: bool = False) -> History:
    """The aggregation server alone (``fedfleet server``), for agents that join over MQTT
    (``fedfleet-agent`` processes, or :func:`run_agent`).

    Args:
        config, run_dir, broker_url, on_round, resume: as :func:`run_simulation`.
        on_start: called with ``(federation, broker URL)`` once the broker is up and before the
            server waits for ``[data] clients`` joins: start the agents from there.

    Returns:
        The run's :class:`History` (its ``"device"`` ledger view is empty: the agents write
        their own ledgers).

    Raises:
        ConfigError, DataError, BrokerStartError, ConnectError, RunError, RunFolderBusy: as ``fedfleet server``
            (``RunFolderBusy``: another process holds the run folder).
    """
    from broker_server.server_main import run_server as _run_server

    served = _run_server(load_config(config), broker_url=broker_url, run_dir=run_dir, resume=resume,
                         on_round=on_round, on_start=on_start)
    s = served.summary
    return _history(served.run_dir, served.federation, s.metrics, s.final_accuracy)


@dataclass(frozen=True)
class AgentHistory:
    """What one agent did (:func:`run_agent`).

    Attributes:
        client_id: its id.
        rounds_trained: rounds in which it published an update.
        receipts_accepted: updates the server acknowledged as accepted.
        finished: whether the run ended with the server's ``finish``.
        ledger: its ledger's totals (bytes, :func:`broker_server.audit.totals`, device view).
        ledger_dir: the folder holding its ``ledger.sqlite``.
    """

    client_id: str
    rounds_trained: int
    receipts_accepted: int
    finished: bool
    ledger: dict[str, Any]
    ledger_dir: Path


def run_agent(config: Config | Mapping[str, Any] | str | os.PathLike[str], *, broker_url: str, federation: str,
              client_id: str, shard: int, profile: str = "x86-cpu", out: str | os.PathLike[str] | None = None,
              idle_timeout_s: float = 3600.0) -> AgentHistory:
    """One edge agent (``fedfleet-agent``) for device ``shard`` of ``config``'s fleet: the
    ``[data]``, ``[train] algorithm``, ``[algorithm]`` and ``[model]`` settings the server checks
    at join come from the same configuration, so they agree by construction.

    Args:
        config: see :func:`load_config` (the server's configuration).
        broker_url: the broker the server uses (:func:`run_server`'s ``on_start`` gives it).
        federation: the server's federation id.
        client_id: this device's id (A-Za-z0-9_.-, at most 64 characters).
        shard: this device's shard, ``0 <= shard < [data] clients``.
        profile: firmware profile name.
        out: folder for this agent's ``ledger.sqlite`` (default ``fedfleet-agent-<client_id>``).
        idle_timeout_s: give up after this many seconds without a message from the server.

    Raises:
        ConfigError: ``federation`` or ``client_id`` is not a valid id, ``client_id`` is
            ``"server"`` (the server's), ``[security] sign`` is on (sign with ``fedfleet-agent
            --key-dir``), or a setting the agent cannot use.
        DataError, ModelError, EdgeAgentError: the data, model or algorithm of the device.
        ConnectError: the broker did not accept the agent.
        AgentError: the run failed (join refused, nothing heard for ``idle_timeout_s``).
    """
    import torch

    from broker_server.errors import ConfigError
    from broker_server.runtime import agent_spec, channel_options, open_transport
    from edge_agent.algorithms import TrainConfig
    from edge_agent.assembly import build_agent, channel_limits, offline_will, prepare_agent
    from edge_agent.device import apply
    from edge_agent.runtime import agent_runtime
    from protocol.channel import Channel
    from protocol.errors import FieldError
    from protocol.ledger import Ledger
    from protocol.topics import check_device_id, mqtt_client_id

    try:
        mqtt_id = mqtt_client_id(federation, check_device_id(client_id))
    except FieldError as exc:
        raise ConfigError(f"run_agent: {exc}") from None
    cfg = load_config(config)
    if cfg.security.sign:
        raise ConfigError("run_agent does not sign messages: run fedfleet-agent with --key-dir and --server-pubkey")
    rt = agent_runtime(profile)
    apply(rt.plan)
    spec = agent_spec(cfg, client_id=client_id, shard=shard, profile=profile, idle_timeout_s=idle_timeout_s,
                      info={"torch": torch.__version__})
    ds = spec.load_dataset(cfg.data.data_dir or None)
    prepared = prepare_agent(spec, ds, precision=rt.plan.precision)
    folder = Path(out or f"fedfleet-agent-{client_id}")
    folder.mkdir(parents=True, exist_ok=True)
    tr = open_transport(mqtt_id, cfg, broker_url, will=offline_will(federation, client_id))
    tr.connect()
    ledger = Ledger(folder / "ledger.sqlite")
    ledger.set_meta("federation", federation)
    ch = Channel(tr, node_id=client_id, side="agent", federation=federation, ledger=ledger,
                 **{**channel_options(cfg), **channel_limits(rt, chunk_bytes=cfg.protocol.chunk_bytes,
                                                             max_packet_bytes=cfg.protocol.max_packet_bytes)})
    t = cfg.train
    defaults = TrainConfig(local_epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr, momentum=t.momentum,
                           weight_decay=t.weight_decay, seed=cfg.run.seed)
    try:
        agent = build_agent(prepared, ch, runtime=rt, train_defaults=defaults, device=rt.plan.device)
        summary = agent.run()
    finally:
        ch.close()
        ledger.close()
    from broker_server.audit import open_ledger, totals

    db = open_ledger(folder)
    try:
        tot = totals(db, "device")
    finally:
        db.close()
    return AgentHistory(client_id=summary.client_id, rounds_trained=summary.rounds_trained,
                        receipts_accepted=summary.receipts_accepted, finished=summary.finished, ledger=tot,
                        ledger_dir=folder)
