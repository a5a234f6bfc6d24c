"""``fedfleet server``: the aggregation server alone, for real agents started with
``fedfleet-agent`` on the devices."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from edge_agent.data import load_dataset
from protocol.ledger import Ledger

from .config import Config
from .embedded_broker import EmbeddedBroker
from .runtime import make_server
from .simulate import make_run_id, progress_printer

log = logging.getLogger(__name__)


def serve(cfg: Config, *, broker_url: str | None = None, run_dir: str | os.PathLike | None = None) -> int:
    """Run the server of ``cfg`` until its last round; return the exit code (0).

    The federation id (the topic level agents must use, ``fedfleet-agent --federation``) is the
    run folder's name and is printed at start. Without a broker URL an embedded broker on
    127.0.0.1 is started (useful to try agents on the same machine).

    Raises:
        DataError, ConfigError, BrokerStartError, ConnectError: as :func:`~broker_server.simulate.simulate`.
    """
    out = Path(run_dir) if run_dir else Path(cfg.run.out) / make_run_id(cfg.run.name, cfg.run.seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(cfg.to_toml(), encoding="utf-8")
    federation = re.sub(r"[^A-Za-z0-9_.-]", "-", out.name).strip("-._")[:64] or "fedfleet"
    ds = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir or None)
    broker = None
    url = broker_url or cfg.broker.url or None
    if url is None:
        broker = EmbeddedBroker(kind=cfg.broker.kind, workdir=out / "broker")
        broker.start()
        url = broker.url
    print(f"fedfleet server: federation {federation!r} on {url}; waiting for {cfg.data.clients} agents "
          f"(join timeout {cfg.server.join_timeout_s:g} s)", flush=True)
    ledger = Ledger(out / "ledger.sqlite")
    ledger.set_meta("federation", federation)
    try:
        server = make_server(cfg, ds, url, federation=federation, run_dir=out, ledger=ledger,
                             expected_clients=cfg.data.clients, on_round=progress_printer(cfg.run.rounds))
        summary = server.run()
        server.channel.transport.close()
        print(f"finished {summary.rounds_completed} rounds; final test accuracy {summary.final_accuracy:.4f}; "
              f"run folder {out}")
    finally:
        ledger.close()
        if broker is not None:
            broker.stop()
    return 0
