"""What the server writes to its run folder: ``metrics.jsonl`` (one line per round), the per-round
checkpoints (``checkpoints.sqlite``), the final model and ``broker.json`` (the broker its latest
session used), and what ``--resume`` reads back."""

from __future__ import annotations

import io
import json
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from protocol.broker_url import has_login, parse_broker_url, public_broker_url, typed_login, without_login
from protocol.files import write_atomically

from .checkpoint import Checkpoint, CheckpointStore
from .metrics_file import METRICS_NAME, metrics_line, read_metrics, restore_non_finite, strict_json
from .text import round_list

log = logging.getLogger(__name__)


def write_summary(run_dir: Path, record: dict) -> None:
    """``run_dir/summary.json``: ``record`` as indented strict JSON
    (:func:`~broker_server.metrics_file.strict_json`: a NaN ``final_accuracy`` — no accuracy was
    measured — is ``null``, named under ``non_finite``; :func:`read_summary` gives it back), written whole or not at all
    (:func:`protocol.files.write_atomically`: a run killed while writing it keeps the previous
    one, never half of one, which ``--resume`` would read as no summary).

    Raises:
        OSError: the folder cannot be written (full disk, read-only); the previous file is kept.
    """
    write_atomically(Path(run_dir) / "summary.json", strict_json(record, indent=1).encode("utf-8"))


def read_summary(run_dir: Path) -> dict:
    """``run_dir/summary.json`` as :func:`write_summary` wrote it (non-finite numbers given back).

    Raises:
        OSError: no file, or it cannot be read.
        ValueError: not JSON, not a JSON object, or a malformed ``non_finite`` table.
    """
    record = json.loads((Path(run_dir) / "summary.json").read_text(encoding="utf-8"))
    if not isinstance(record, dict):
        raise ValueError(f"{Path(run_dir) / 'summary.json'}: expected a JSON object, got {type(record).__name__}")
    if (bad := restore_non_finite(record)) is not None:
        raise ValueError(f"{Path(run_dir) / 'summary.json'}: {bad}")
    return record


#: The run folder's record of the broker its server's latest session used (:func:`write_broker_record`).
BROKER_RECORD = "broker.json"


@dataclass(frozen=True)
class BrokerRecord:
    """The broker a ``fedfleet server`` session used, as its run folder's ``broker.json`` keeps it.

    Attributes:
        url: ``scheme://host:port`` (:func:`protocol.broker_url.public_broker_url`: no user name or
            password).
        embedded: the session started this broker itself (an embedded broker, on a free port of
            127.0.0.1: it stopped with that session); ``False``: a broker it was given
            (``--broker``, ``[broker] url``), which may still be running.
        credentials_removed: the URL the session was given carried a user name or password,
            which the record does not keep.
        login_in_file: the file's ``url`` itself holds a user name or password (an edited record:
            :func:`write_broker_record` never writes them): read as a record of a broker that had a
            login (``credentials_removed``), the login itself neither kept nor shown.
    """

    url: str
    embedded: bool
    credentials_removed: bool = False
    login_in_file: bool = False


def broker_record(url: str, *, embedded: bool) -> BrokerRecord:
    """The :class:`BrokerRecord` of a session that used the broker at ``url`` (``embedded``: one
    it started itself).

    Raises:
        ValueError: ``url`` is not a broker URL (:func:`protocol.broker_url.parse_broker_url`).
    """
    addr = parse_broker_url(url)
    return BrokerRecord(url=public_broker_url(addr), embedded=embedded, credentials_removed=has_login(addr))


def write_broker_record(run_dir: Path, record: BrokerRecord) -> None:
    """``run_dir/broker.json``: ``record`` as a JSON object (``url``, ``embedded``,
    ``credentials_removed``), written whole or not at all (:func:`protocol.files.write_atomically`).

    Raises:
        OSError: the folder cannot be written (full disk, read-only); the previous file is kept.
    """
    text = json.dumps({"url": record.url, "embedded": record.embedded,
                       "credentials_removed": record.credentials_removed}, indent=1)
    write_atomically(Path(run_dir) / BROKER_RECORD, (text + "\n").encode("utf-8"))


def read_broker_record(run_dir: Path) -> BrokerRecord | None:
    """The :class:`BrokerRecord` in ``run_dir/broker.json`` (:func:`write_broker_record`), or
    ``None`` when the run folder holds none (written before it was kept, or a ``fedfleet
    simulate`` run's). A ``url`` edited to hold a user name or password is read as the record of a
    broker that had a login (``credentials_removed`` and ``login_in_file`` true), its URL given
    back without them: a ``--resume`` asks for the login as for one the server left out. So is a
    ``url`` with a malformed login (any text before an ``@`` after its ``scheme://``: a password
    without a user name, a ``#`` or ``/`` not percent-encoded) whose address part is valid.

    Raises:
        OSError: the file is there but cannot be read.
        ValueError: not JSON, not an object, a ``url`` that is not a broker URL (its address
            part, a login left aside), or an ``embedded`` / ``credentials_removed`` that is not a
            boolean: the message says which, and never shows a user name or password of the file's
            ``url``, nor its path, query or fragment.
    """
    path = Path(run_dir) / BROKER_RECORD
    if not path.exists() and not path.is_symlink():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    url, embedded, removed = data.get("url"), data.get("embedded"), data.get("credentials_removed", False)
    if not isinstance(url, str):  # its type only: a value not a string may still hold a login
        raise ValueError(f"'url' must be a string, got {_json_kind(url)}")
    login = typed_login(url)
    try:
        addr = parse_broker_url(url)
    except ValueError:
        if not login:
            raise
        try:  # a malformed login ('mqtt://:PW@host', a '#' not percent-encoded): still a broker that had one
            addr = parse_broker_url(without_login(url))
        except ValueError as bare:  # the same error, said of the URL without its login
            raise ValueError(f"{bare} (its user name and password left out here)") from None
    else:
        login = login and has_login(addr)
    if not isinstance(embedded, bool):
        raise ValueError(f"'embedded' must be true or false, got {embedded!r}")
    if not isinstance(removed, bool):
        raise ValueError(f"'credentials_removed' must be true or false, got {removed!r}")
    return BrokerRecord(url=public_broker_url(addr), embedded=embedded, credentials_removed=removed or login,
                        login_in_file=login)


def _json_kind(value: object) -> str:
    """What JSON value ``value`` is, as a message names it without showing it: ``null``, ``a list`` …"""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "a list"
    return "an object" if isinstance(value, dict) else type(value).__name__


class RunStore:
    """The run folder of one server.

    Args:
        run_dir: an existing folder; ``metrics.jsonl``, ``checkpoints.sqlite`` and
            ``model_final.pt`` go there.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.checkpoints = CheckpointStore(self.run_dir / "checkpoints.sqlite")

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / METRICS_NAME

    def append_metrics(self, metrics: dict) -> None:
        """Append one round's metrics as a strict JSON line (:func:`~broker_server.metrics_file.
        metrics_line`: a NaN loss is ``null``, named under ``non_finite``)."""
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(metrics_line(metrics))

    def keep_metrics_until(self, round: int, lines: list[dict] | None = None) -> list[dict]:
        """Drop ``metrics.jsonl`` lines of rounds after ``round`` (an interrupted round is run
        again after a resume: the rounds dropped are named in an info line of the log) and return
        the lines kept (``[]`` without a file). ``lines``: the file as
        :func:`~broker_server.metrics_file.read_metrics` gave it, when the caller read it already
        (a last line cut short is dropped there). The file is rewritten whole or not at
        all (:func:`protocol.files.write_atomically`), through a symbolic link to its target,
        keeping its permission bits.

        Raises:
            ValueError: a damaged line (:func:`~broker_server.metrics_file.read_metrics`); the
                file is kept as it is.
        """
        path = self.metrics_path
        if not path.exists():
            return []
        lines = read_metrics(path) if lines is None else lines
        kept = [m for m in lines if m["round"] <= round]
        if (dropped := [m["round"] for m in lines if m["round"] > round]):
            one = len(dropped) == 1
            log.info("%s: %s dropped: %s again after the resume", METRICS_NAME,
                     f"round {dropped[0]}'s line" if one else f"the lines of rounds {round_list(dropped)}",
                     "that round runs" if one else "those rounds run")
        target = path.resolve()
        mode = stat.S_IMODE(target.stat().st_mode)
        write_atomically(target, "".join(metrics_line(m) for m in kept).encode("utf-8"))
        os.chmod(target, mode)  # the umask would narrow a mode passed to the write
        return kept

    def save_checkpoint(self, ckpt: Checkpoint) -> None:
        """Write the checkpoint of ``ckpt.round`` (one transaction)."""
        self.checkpoints.save(ckpt)

    def save_final_model(self, model: torch.nn.Module) -> None:
        """``model_final.pt``: the global model's ``state_dict``, written whole or not at all
        (serialised in memory first, then :func:`protocol.files.write_atomically`)."""
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        write_atomically(self.run_dir / "model_final.pt", buf.getvalue())

    def close(self) -> None:
        self.checkpoints.close()
