"""Experiment tracking: each round's metrics to TensorBoard and/or MLflow, with the byte ledger's
per-round figures beside the accuracy. Optional (``pip install 'fedfleet[tracking]'``), off by
default; switched on by ``[tracking]`` in the TOML or ``--tensorboard`` / ``--mlflow [URI]``.

What is logged, step = round number:

- every number of the round's ``metrics.jsonl`` line (``accuracy``, ``loss``, ``train_loss``,
  ``clients_reported``, ``seconds``, the strategy's own figures …; ``None`` and non-numbers
  skipped; a nested map such as ``domain_accuracy`` as ``domain_accuracy/<name>``), as the round
  closes;
- the ledger's bytes: ``ledger/server_up_bytes`` / ``ledger/server_down_bytes`` (the server
  link, ``bytes_up`` / ``bytes_down`` of the line) as the round closes, and, once the run is over
  and every agent's rows are in, ``ledger/device_up_bytes``, ``ledger/device_down_bytes`` and
  ``ledger/device_cumulative_bytes`` per round (the device links,
  :func:`broker_server.audit.by_round`; none for a real fleet's server, whose agents keep their
  own ledgers; round 0 is the joins before round 1);
- the resolved configuration: MLflow parameters ``section.key``, TensorBoard text ``config``.

TensorBoard writes event files to ``[tracking] tensorboard_dir`` (default ``RUN_DIR/tensorboard``:
``tensorboard --logdir RUN_DIR``). MLflow logs one run named after the federation into the
experiment ``mlflow_experiment`` at ``mlflow_uri`` (default ``file:RUN_DIR/mlruns``; for a
``file:`` store, which MLflow ≥ 3 keeps in maintenance mode, ``MLFLOW_ALLOW_FILE_STORE`` is set
for this process: you asked for that store).

A package that is not installed is a :class:`~broker_server.errors.ConfigError` before the run
starts (:func:`check_tracking`), never a silent skip.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .config import Config
from .errors import ConfigError

__all__ = ["Tracker", "check_tracking", "round_scalars", "start_tracking"]

log = logging.getLogger(__name__)

_INSTALL = "pip install 'fedfleet[tracking]'"


def check_tracking(cfg: Config) -> None:
    """Import what ``cfg``'s ``[tracking]`` asks for, before anything runs.

    Raises:
        ConfigError: tracking asked for (naming how) but its package is not installed or broken.
    """
    t = cfg.tracking
    for wanted, module, how in ((t.tensorboard, "tensorboard", "[tracking] tensorboard = true / --tensorboard"),
                                (t.mlflow, "mlflow", "[tracking] mlflow = true / --mlflow")):
        if not wanted:
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or a broken install raising anything
            raise ConfigError(f"tracking asked for ({how}) but the {module} package cannot be imported "
                              f"({type(exc).__name__}: {exc}); install it with {_INSTALL}, or switch it off") from None


def round_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of one ``metrics.jsonl`` line as tracking scalars (see the module docstring):
    ``bool`` as 0/1, ``None``/text/NaN skipped, one level of nested maps as ``key/name``,
    ``round`` left out (it is the step), ``bytes_up``/``bytes_down`` also as
    ``ledger/server_up_bytes``/``ledger/server_down_bytes``."""
    out: dict[str, float] = {}

    def put(key: str, value: Any) -> None:
        if isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)

    for key, value in metrics.items():
        if key == "round":
            continue
        if isinstance(value, Mapping):
            for sub, v in value.items():
                put(f"{key}/{sub}", v)
        else:
            put(key, value)
    for src, dst in (("bytes_up", "ledger/server_up_bytes"), ("bytes_down", "ledger/server_down_bytes")):
        if src in out:
            out[dst] = out[src]
    return out


def _params(cfg: Config) -> dict[str, str]:
    """``cfg`` as MLflow parameters, ``section.key`` to its text (500 characters at most);
    ``broker.url`` without its user name and password (:func:`protocol.broker_url.shown_broker_url`)."""
    import dataclasses

    from protocol.broker_url import shown_broker_url

    out = {}
    for f in dataclasses.fields(cfg):
        sec = getattr(cfg, f.name)
        if dataclasses.is_dataclass(sec):
            for g in dataclasses.fields(sec):
                value = getattr(sec, g.name)
                if (f.name, g.name) == ("broker", "url") and value:
                    value = shown_broker_url(value)
                out[f"{f.name}.{g.name}"] = str(value)[:500]
    for key, value in cfg.algorithm.items():
        out[f"algorithm.{key}"] = str(value)[:500]
    return out


class Tracker:
    """The open TensorBoard writer and/or MLflow run of one fedfleet run.

    Args:
        cfg: the run's configuration (its ``[tracking]`` table says what is on).
        run_dir: the run folder.
        name: the MLflow run name (the federation id).

    Raises:
        ConfigError: as :func:`check_tracking`; an MLflow store that cannot be opened.
    """

    def __init__(self, cfg: Config, run_dir: Path, name: str) -> None:
        check_tracking(cfg)
        t = cfg.tracking
        self.run_dir = Path(run_dir)
        self.writer: Any = None
        self.mlflow: Any = None
        self.mlflow_run_id: str | None = None
        self.tensorboard_dir: Path | None = None
        self.mlflow_uri: str | None = None
        if t.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard_dir = Path(t.tensorboard_dir) if t.tensorboard_dir else self.run_dir / "tensorboard"
            self.writer = SummaryWriter(log_dir=str(self.tensorboard_dir))
            self.writer.add_text("config", "```\n" + cfg.to_toml() + "\n```", 0)
        if t.mlflow:
            from mlflow.tracking import MlflowClient

            uri = t.mlflow_uri or (self.run_dir / "mlruns").resolve().as_uri()
            if uri.startswith("file:") or "://" not in uri:
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            try:
                client = MlflowClient(tracking_uri=uri)
                exp = client.get_experiment_by_name(t.mlflow_experiment)
                exp_id = exp.experiment_id if exp is not None else client.create_experiment(t.mlflow_experiment)
                run = client.create_run(exp_id, run_name=name, tags={"fedfleet.run_dir": str(self.run_dir)})
            except Exception as exc:
                raise ConfigError(f"[tracking] mlflow_uri {uri!r}: cannot open the MLflow store "
                                  f"({type(exc).__name__}: {exc})") from None
            self.mlflow, self.mlflow_uri, self.mlflow_run_id = client, uri, run.info.run_id
            self._mlflow_batch(params=_params(cfg))
        log.info("tracking: %s", self.describe())

    def describe(self) -> str:
        """Where the figures go, in one line."""
        parts = []
        if self.tensorboard_dir is not None:
            parts.append(f"TensorBoard {self.tensorboard_dir}")
        if self.mlflow_run_id is not None:
            parts.append(f"MLflow {self.mlflow_uri} run {self.mlflow_run_id}")
        return ", ".join(parts) or "off"

    def _mlflow_batch(self, metrics: Mapping[str, float] | None = None, step: int = 0,
                      params: Mapping[str, str] | None = None) -> None:
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        ms = [Metric(k, v, now, step) for k, v in (metrics or {}).items()]
        ps = [Param(k, v) for k, v in (params or {}).items()]
        for i in range(0, max(len(ms), len(ps), 1), 100):  # MLflow's batch limits: 1000 metrics, 100 params
            self.mlflow.log_batch(self.mlflow_run_id, metrics=ms[i:i + 100], params=ps[i:i + 100])

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Log ``scalars`` at ``step`` to every open backend."""
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.mlflow is not None and scalars:
            self._mlflow_batch(scalars, step)

    def log_round(self, metrics: Mapping[str, Any]) -> None:
        """One round's ``metrics.jsonl`` line (:func:`round_scalars`)."""
        self.log(int(metrics["round"]), round_scalars(metrics))

    def wrap(self, on_round: Callable[[dict], None] | None) -> Callable[[dict], None]:
        """An ``on_round`` callback that logs the round, then calls ``on_round``. A tracking failure
        is logged and switches tracking off; it never stops the run."""
        def both(m: dict) -> None:
            if self.writer is not None or self.mlflow is not None:
                try:
                    self.log_round(m)
                except Exception as exc:
                    log.error("tracking failed in round %s (%s: %s); switched off for the rest of the run",
                              m.get("round"), type(exc).__name__, exc)
                    self.close(status="FAILED")
            if on_round is not None:
                on_round(m)
        return both

    def finish(self) -> None:
        """After the run: the device links' bytes per round from the complete ledger (when it has
        agent rows), then close with status FINISHED."""
        from .audit import by_round, open_ledger

        if (self.writer is not None or self.mlflow is not None) and (self.run_dir / "ledger.sqlite").exists():
            db = open_ledger(self.run_dir)
            try:
                rows = [r for r in by_round(db, "device") if r["round"] is not None]
            finally:
                db.close()
            total = 0
            for r in rows:
                total += r["up_bytes"] + r["down_bytes"]
                self.log(int(r["round"]), {"ledger/device_up_bytes": float(r["up_bytes"]),
                                           "ledger/device_down_bytes": float(r["down_bytes"]),
                                           "ledger/device_cumulative_bytes": float(total)})
        self.close()

    def close(self, status: str = "FINISHED") -> None:
        """Close the writer and end the MLflow run (``status``); safe to call twice."""
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()
        if self.mlflow is not None:
            client, self.mlflow = self.mlflow, None
            client.set_terminated(self.mlflow_run_id, status=status)


def start_tracking(cfg: Config, run_dir: Path, name: str) -> Tracker | None:
    """A :class:`Tracker` when ``cfg``'s ``[tracking]`` switches anything on, else ``None``."""
    if not (cfg.tracking.tensorboard or cfg.tracking.mlflow):
        return None
    return Tracker(cfg, run_dir, name)
