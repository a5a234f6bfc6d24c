"""``fedfleet server``: the aggregation server alone, for real agents started with
``fedfleet-agent`` on the devices."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from edge_agent.data import load_dataset
from protocol.broker_url import has_login, login_placeholder_url, parse_broker_url, public_broker_url, shown_broker_url
from protocol.errors import ConnectError, TransportError
from protocol.ledger import Ledger

from .config import AgentsSection, Config, _toml_value
from .embedded_broker import EmbeddedBroker
from .errors import ConfigError
from .persistence import (
    BROKER_RECORD,
    BrokerRecord,
    broker_record,
    read_broker_record,
    write_broker_record,
    write_summary,
)
from .resumes import note_fresh_run, note_resume, refused_if_raises
from .run_end import (
    FinishedRun,
    finished_run,
    finishing_line,
    nothing_to_resume,
    resume_metrics,
    summary_record,
    write_final_files,
)
from .run_lock import hold_run_folder
from .runtime import check_server_keys, make_server
from .server import RunSummary, final_accuracy_source, final_accuracy_text, final_figures, run_troubles_text
from .simulate import (
    STARTUP_ERRORS,
    check_partition_record,
    check_partition_settings,
    client_data,
    discard_unstarted,
    make_run_id,
    partition_record,
    progress_printer,
    run_folder_entries,
)
from .text import plural
from .tracking import check_tracking, start_tracking

log = logging.getLogger(__name__)


def agent_command(cfg: Config, url: str, federation: str) -> str:
    """The ``fedfleet-agent`` command line (one line, shell-quoted) that joins ``cfg``'s federation
    as device ``i``: every option whose value the server checks at join
    (:func:`~broker_server.runtime.expected_data`: data set, partition and its settings, seed,
    shard count, ``--algorithm`` and one ``--param KEY=VALUE`` per ``[algorithm]`` key), plus the
    key options when ``[security] sign`` is on, and ``--model`` / ``--feature-dim`` when ``[model]``
    is not the default light CNN. ``DEVICE_ID``, ``DEVICE_KEYS``, the ``i`` of ``--shard i/K`` and,
    for a model group of several architectures, ``MODEL`` (see :func:`model_assignment`) are
    placeholders the operator fills in.

    The broker is named without the user name and password of ``url``
    (:func:`protocol.broker_url.public_broker_url`): where the server logs in (``url``'s own
    login, or ``[broker] username`` / ``password_file``), ``--username USER --password-file
    PASSWORD_FILE`` follow it, placeholders too (:func:`agent_login_note` says so in a line).

    Raises:
        ValueError: ``url`` is not a broker URL.
    """
    d = cfg.data
    q = shlex.quote
    words = ["fedfleet-agent", "--broker", public_broker_url(url)]
    if server_logs_in(cfg, url):
        words += ["--username", "USER", "--password-file", "PASSWORD_FILE"]
    words += ["--federation", federation, "--client-id", "DEVICE_ID",
              "--dataset", d.dataset, "--shard", f"i/{d.clients}", "--partition", d.partition]
    if d.partition == "dirichlet":
        words += ["--alpha", repr(float(d.alpha)), "--min-samples", str(d.min_samples)]
    if d.partition == "domain-silo" and d.domain_clients:
        words += ["--domain-clients", d.domain_clients]
    for flag, value in (("--domain-train-cap", d.domain_train_cap), ("--domain-test-cap", d.domain_test_cap),
                        ("--train-samples", d.train_samples)):
        if value:
            words += [flag, str(value)]
    if d.client_test == "local":
        words += ["--client-test", "local", "--client-test-fraction", repr(float(d.client_test_fraction))]
    words += ["--seed", str(cfg.run.seed), "--algorithm", cfg.train.algorithm]
    m = cfg.model
    if m.group or m.name != "lightcnn":  # a model group: the operator fills in each device's MODEL
        words += ["--model", "MODEL" if len(m.architectures()) > 1 else m.name]
    if m.feature_dim != 64:
        words += ["--feature-dim", str(m.feature_dim)]
    for key, value in cfg.algorithm.items():
        text = ("true" if value else "false") if isinstance(value, bool) else (
            repr(value) if isinstance(value, float) else str(value))
        words += ["--param", f"{key}={text}"]
    if cfg.security.sign:
        words += ["--key-dir", "DEVICE_KEYS", "--server-pubkey", str(Path(cfg.security.key_dir) / "server.pub")]
        if cfg.security.encrypt:
            words.append("--encrypt")
    return " ".join(q(w) for w in words)


def server_logs_in(cfg: Config, url: str) -> bool:
    """Whether the server logs in to the broker at ``url``: a user name or password in ``url``,
    or ``[broker] username`` / ``password_file`` (its agents then need a login too).

    Raises:
        ValueError: ``url`` is not a broker URL.
    """
    return has_login(url) or bool(cfg.broker.username or cfg.broker.password_file)


def agent_login_note(cfg: Config, url: str) -> str:
    """The line the server prints under its agent command (:func:`agent_command`) when it logs in
    to the broker (:func:`server_logs_in`): the login is not printed, ``USER`` and
    ``PASSWORD_FILE`` stand for each agent's. ``""`` when the server does not log in.

    Raises:
        ValueError: ``url`` is not a broker URL.
    """
    if not server_logs_in(cfg, url):
        return ""
    return ("  the broker's user name and password are left out: USER is each agent's MQTT user name, PASSWORD_FILE "
            "a file holding its password")


def resume_broker_option(url: str) -> str:
    """The ``--broker`` value a printed ``--resume`` command gives for the broker at ``url``: its
    URL without user name and password (:func:`protocol.broker_url.shown_broker_url`), or, where
    ``url`` has them, ``scheme://USER:PASSWORD@host:port`` (placeholders: a run folder does not
    keep them, and no output shows them)."""
    try:
        return login_placeholder_url(url) if has_login(url) else public_broker_url(url)
    except (TypeError, ValueError):  # not a broker URL: as messages show it
        return shown_broker_url(url)


def local_agents_hint(url: str, agents: int, cores: int | None = None) -> str:
    """The line the server prints under its agent command when the broker is on a loopback
    address, so that the agents run on this machine: add ``--torch-threads 1`` to each (README,
    *Threads*: an agent otherwise plans its training on every core, and several on one machine
    then run many times slower, 4 agents on 2 cores about 40× in a user's trial). ``cores``:
    this machine's (``os.cpu_count()`` when ``None``, counted only for a loopback broker).
    ``""`` for a broker on another host (each agent on its own device)."""
    host = parse_broker_url(url).host.rstrip(".")
    local = host == "localhost"
    try:
        ip = ipaddress.ip_address(host)
        mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
        local = ip.is_loopback or (mapped is not None and mapped.is_loopback)
    except ValueError:  # a host name
        pass
    if not local:
        return ""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return (f"  agents started on this machine (the broker is on {host}): add --torch-threads 1 to each (each would "
            f"otherwise train on all {plural(cores, 'core')}, and {plural(agents, 'agent')} beside this server would "
            "run many times slower)")


def model_assignment(cfg: Config) -> str:
    """One line saying which ``--model`` each device runs under ``cfg``'s model group (``""``
    when every device runs ``[model] name``)."""
    m = cfg.model
    if len(m.architectures()) < 2:
        return ""
    spec = m.group_spec()
    if isinstance(spec, dict):
        pairs = ", ".join(f"--profile {p} -> --model {a}" for p, a in spec.items())
        return f"MODEL by firmware profile: {pairs}; any other profile -> --model {m.name}"
    return "MODEL by shard index i: " + ", ".join(f"i % {len(spec)} = {k} -> --model {a}" for k, a in enumerate(spec))


@dataclass(frozen=True)
class ServedRun:
    """What :func:`run_server` returns: the server's :class:`~broker_server.server.RunSummary`,
    the run folder and the federation id."""

    summary: RunSummary
    run_dir: Path
    federation: str


def serve(cfg: Config, *, broker_url: str | None = None, run_dir: str | os.PathLike | None = None,
          resume: bool = False, verbose: bool = False) -> int:
    """Run the server of ``cfg`` until its last round, printing its progress; return the exit
    code (0). ``fedfleet server`` is this; :func:`run_server` is the same without the prints.

    Prints the agent command line once the broker is reached, the wait for joins and each
    round's progress (:mod:`broker_server.progress`: a live line on a terminal, plain lines
    otherwise; ``verbose``: per device), a line per round, and at the end the server link's byte
    summary. Interrupted (Ctrl-C), or stopped by the broker link (a broker that stopped
    acknowledging: :class:`~protocol.errors.TransportError`), after its first checkpoint, it says
    how to resume (``--broker`` without its user name and password: :func:`resume_broker_option`).
    A broker it cannot connect to at the start (:class:`~protocol.errors.ConnectError`) is no
    stopped run: the error alone says it.

    Raises:
        RunFolderBusy: another process holds the run folder (:mod:`broker_server.run_lock`).
        DataError, ConfigError, BrokerStartError, ConnectError: as :func:`run_server` (a
            ``ConnectError`` names the broker's URL, its user name and password left out).
        TransportError: the broker link failed during the run.
    """
    from .progress import make_progress

    out = Path(run_dir) if run_dir else Path(cfg.run.out) / make_run_id(cfg.run.name, cfg.run.seed)
    prog = make_progress(cfg.run.rounds, verbose=verbose, show_joins=True, round_line=progress_printer(cfg.run.rounds))
    try:
        with prog:
            served = run_server(cfg, broker_url=broker_url, run_dir=out, resume=resume,
                                say=lambda text: print(text, flush=True), on_round=prog.on_round,
                                on_event=prog.on_event)
    except (KeyboardInterrupt, TransportError) as exc:
        if not isinstance(exc, ConnectError) and (out / "checkpoints.sqlite").exists():
            given = broker_url or cfg.broker.url
            broker = f" --broker {resume_broker_option(given)}" if given else ""
            why = "interrupted" if isinstance(exc, KeyboardInterrupt) else "stopped by the broker link"
            print(f"fedfleet server: {why}; the run continues from its last checkpoint with\n"
                  f"  fedfleet server --resume {shlex.quote(str(out))}{broker}", flush=True)
        raise
    print(server_byte_summary(served.run_dir), flush=True)
    return 0


def server_byte_summary(run_dir: Path) -> str:
    """The server link's bytes of a run folder's ledger (:func:`broker_server.audit.totals`,
    server view), as the lines ``fedfleet server`` ends with."""
    from .audit import audit_report

    tot = audit_report(run_dir)["totals"]["server"]
    up, down = tot["up"], tot["down"]
    def packets(t: dict, verb: str) -> str:  # the MQTT control packets (CONNACK, PUBACK …) said apart
        n, ctl = t["messages"], t["control_messages"]
        return f"{n - ctl:,} messages {verb}, {ctl:,} MQTT control packets"

    return (f"bytes on the server link: up {up['wire_bytes']:,} ({packets(up, 'received')})  "
            f"down {down['wire_bytes']:,} ({packets(down, 'sent')}; a broadcast counted once)  "
            f"protocol overhead {100 * (tot['all']['overhead_share'] or 0):.2f} %\n"
            f"each device's own link: fedfleet audit on its --out folder (several folders: a fleet total); "
            f"this run: fedfleet audit {run_dir}")


def check_real_fleet(cfg: Config) -> None:
    """Refuse, before anything is started or written, what a fleet of ``fedfleet-agent`` devices
    cannot follow: a simulation-only ``[data] partition`` (:data:`edge_agent.partition.SIMULATION_ONLY_SCHEMES`:
    ``"classes"``, whose ``classes_per_client`` no device is told, so ``fedfleet-agent
    --partition`` refuses it), and ``[security] sign`` without a usable ``key_dir``
    (:func:`~broker_server.runtime.check_server_keys`: a simulation makes its own keys, a real
    fleet's devices need the server's).

    Raises:
        ConfigError: naming the configuration file, the key, its value and what a real fleet takes.
    """
    from edge_agent.partition import AGENT_SCHEMES, SIMULATION_ONLY_SCHEMES

    scheme = cfg.data.partition
    if scheme in SIMULATION_ONLY_SCHEMES:
        raise ConfigError(f"{cfg.source}: [data] partition = {scheme!r} is simulation-only (fedfleet simulate): "
                          f"a fleet of fedfleet-agent devices takes {', '.join(repr(s) for s in AGENT_SCHEMES)}")
    check_server_keys(cfg, simulated=False)


def simulation_only_settings(cfg: Config) -> list[str]:
    """The ``[agents]`` settings of ``cfg`` that differ from their defaults, as ``key = value``
    texts in TOML, as a configuration file writes them: they shape the simulated fleet of
    ``fedfleet simulate`` (its firmware profiles, training slots, torch threads, emulated links)
    and have no effect on ``fedfleet server``, whose devices each take theirs from
    ``fedfleet-agent --profile`` and the device itself. Empty when none is set."""
    default = AgentsSection()
    return [f"{f.name} = {_toml_value(getattr(cfg.agents, f.name))}" for f in fields(AgentsSection)
            if getattr(cfg.agents, f.name) != getattr(default, f.name)]


def security_text(cfg: Config) -> str:
    """``signed + encrypted`` / ``signed`` / ``unsigned`` for the start-up header."""
    if not cfg.security.sign:
        return "unsigned"
    return "signed (Ed25519) + encrypted uploads (AES-256-GCM)" if cfg.security.encrypt else "signed (Ed25519)"


@dataclass(frozen=True)
class SessionBroker:
    """The broker a ``fedfleet server`` session goes on with (:func:`session_broker`).

    Attributes:
        url: the broker's URL as given (credentials included); ``None``: the session starts an
            embedded broker.
        given: where ``url`` comes from, as messages name it: ``"--broker"``, ``"[broker] url"``
            (the run's configuration), ``"broker.json"`` (the run folder's record of its earlier
            session's broker) or ``""`` (an embedded broker).
        run_dir: the run folder.
        resumed: the session resumes the run.
        earlier: resumed, the broker of the earlier session as ``broker.json`` records it
            (``None``: unknown, see ``unknown``).
        unknown: resumed without a usable record, why: no ``broker.json``, or why it cannot be read.
        note: the line said before the server connects when it goes on with the recorded broker
            (naming its URL), else ``None``.
    """

    url: str | None
    given: str
    run_dir: Path
    resumed: bool = False
    earlier: BrokerRecord | None = None
    unknown: str | None = None
    note: str | None = None

    def warning(self, url: str) -> str | None:
        """The WARNING a resumed session logs once its broker is known (``url``: the one it
        connects to, a new embedded broker's included), or ``None`` when it goes on with the
        broker its earlier session used: its earlier session's broker unknown (said with what this
        session does), its own embedded broker gone (agents must reconnect: both URLs named), or
        another broker than the recorded one (a moved broker: both named)."""
        if not self.resumed or self.given == BROKER_RECORD:
            return None
        try:
            now = public_broker_url(url)
        except ValueError:  # a malformed --broker: the transport refuses it, naming why
            return None
        run = f"--resume {self.run_dir}"
        if self.earlier is None:
            what = {"--broker": f"uses --broker {now}, as given",
                    "[broker] url": f"uses [broker] url {now} of its config.toml"}.get(
                self.given, f"started a new embedded broker on {now}: agents still running against the earlier "
                            f"session's broker will not reach this server; start each again with --broker {now}, "
                            "or resume with --broker URL of the broker they are on")
            return f"{run}: the broker of the run's earlier session is unknown ({self.unknown}); this session {what}"
        old = self.earlier.url
        if old == now:
            return None
        restart = f"agents still running against {old} will not reach this server; start each again with --broker {now}"
        if self.earlier.embedded and not self.given:
            return (f"{run}: the run's earlier session used its own embedded broker {old}, which stopped with it; "
                    f"this session started a new embedded broker on {now}: {restart}")
        by = f"--broker {now}" if self.given == "--broker" else f"[broker] url {now} (its config.toml)"
        was = f"its own embedded broker {old}, which stopped with it" if self.earlier.embedded else old
        moved = "" if self.earlier.embedded else "unless that broker moved there, "
        return (f"{run}: {by} is not the broker of the run's earlier session ({was}; {BROKER_RECORD}): "
                f"{moved}{restart}")


def session_broker(cfg: Config, run_dir: Path, *, broker_url: str | None = None,
                   resume: bool = False) -> SessionBroker:
    """The broker a ``fedfleet server`` session of ``cfg`` in ``run_dir`` goes on with: ``broker_url``
    (``--broker``), else the configuration's ``[broker] url``, else an embedded broker it starts.

    Resumed without ``--broker``, a run whose earlier session used a broker it was given (the run
    folder's ``broker.json``, :func:`~broker_server.persistence.read_broker_record`) goes on with
    that broker, where its agents still are: the returned ``note`` says so, naming its URL (the
    configuration's ``[broker] url`` when it names the same broker, its credentials with it; the
    run folder's own ``config.toml`` keeps none, :meth:`~broker_server.config.Config.to_toml`). A
    run whose earlier session started its own embedded broker starts a new one (that one stopped
    with the session); :meth:`SessionBroker.warning` says what agents must do, as it does for a
    ``--broker`` other than the recorded one and for a run folder without a usable record.

    A resumed run folder whose ``broker.json`` is there but cannot be read (not JSON, a ``url``
    that is not a broker URL, a file this user may not read) is refused without ``--broker``: the
    record is not replaced by that of a broker the user did not name (with ``--broker`` it is; a
    folder in its place, which no record replaces, is a run whose broker is unknown, as a missing
    file).

    Raises:
        ConfigError: resumed without ``--broker`` where ``broker.json`` cannot be read (the message
            names the file and why, no login nor a URL's path, query or fragment shown); or where
            the recorded broker's URL carried a user
            name or password (``broker.json`` does not keep them; a record edited to hold them in its
            ``url`` is read as one that had them, and said in a WARNING naming the file, the login
            not shown nor used) and ``[broker] url`` is not that
            broker with them (another broker, or that broker without a login, as the run folder's
            ``config.toml`` writes it): the message names the recorded URL and the ``--broker``
            option to pass.
    """
    out = Path(run_dir)
    config_url = cfg.broker.url or None
    if not resume:
        url = broker_url or config_url
        return SessionBroker(url, "--broker" if broker_url else "[broker] url" if url else "", out)
    earlier: BrokerRecord | None = None
    unknown: str | None = None
    try:
        earlier = read_broker_record(out)
        if earlier is None:
            unknown = f"no {BROKER_RECORD}: a run folder from before the broker was recorded"
    except (OSError, ValueError) as exc:
        unknown = f"{out / BROKER_RECORD} cannot be read: {exc}"
        if not broker_url and not (out / BROKER_RECORD).is_dir():  # a record this session would replace
            raise ConfigError(
                f"--resume {out}: {out / BROKER_RECORD}, the record of the broker the run's agents are on, cannot be "
                f"read ({exc}); a resume without --broker would go on with another broker and replace the record: "
                f"pass --broker URL of the run's broker (this session's record then replaces the file), or move "
                f"{BROKER_RECORD} away to go on as a run whose broker is unknown") from None
    if broker_url:
        _said_edited_login(out, earlier)
        return SessionBroker(broker_url, "--broker", out, True, earlier, unknown)
    if earlier is None or earlier.embedded:
        _said_edited_login(out, earlier)
        return SessionBroker(config_url, "[broker] url" if config_url else "", out, True, earlier, unknown)
    same = False
    if config_url:
        try:
            same = public_broker_url(config_url) == earlier.url
        except ValueError:  # a malformed [broker] url: not the recorded broker
            pass
    if earlier.credentials_removed and not (same and config_url and has_login(config_url)):
        if earlier.login_in_file:
            raise ConfigError(f"--resume {out}: the run's broker {earlier.url} ({BROKER_RECORD}) is recorded with a "
                              "user name or password in its url, which fedfleet never writes there and does not take "
                              f"from the file; pass the login with the option: --broker "
                              f"{login_placeholder_url(earlier.url)}")
        raise ConfigError(f"--resume {out}: the run's broker {earlier.url} ({BROKER_RECORD}) was given with a user "
                          f"name or password in its URL, which the run folder does not keep; pass it again: --broker "
                          f"{login_placeholder_url(earlier.url)}")
    _said_edited_login(out, earlier)
    other = ""
    if config_url and not same:
        try:
            other = f" (not [broker] url {public_broker_url(config_url)} of its config.toml)"
        except ValueError:
            other = " (not the [broker] url of its config.toml)"
    note = (f"fedfleet server: --resume without --broker: going on with the run's broker {earlier.url}{other}, which "
            f"its earlier session used ({BROKER_RECORD}) and its agents are on; --broker URL to use another")
    return SessionBroker(config_url if same else earlier.url, BROKER_RECORD, out, True, earlier, None, note)


def _said_edited_login(run_dir: Path, record: BrokerRecord | None) -> None:
    """A WARNING, when ``record`` was read from a ``broker.json`` whose ``url`` holds a user name or
    password (:attr:`~broker_server.persistence.BrokerRecord.login_in_file`), naming the file and
    the broker without them: the login is not used, and this session's record leaves it out."""
    if record is not None and record.login_in_file:
        log.warning("%s: its url holds a user name or password, which fedfleet never writes there (an edited "
                    "record): read as the broker %s with a login, not taken from the file; the record this session "
                    "writes once connected leaves it out", run_dir / BROKER_RECORD, record.url)


def run_server(cfg: Config, *, broker_url: str | None = None, run_dir: str | os.PathLike | None = None,
               resume: bool = False, say: Callable[[str], None] = log.info,
               on_round: Callable[[dict], None] | None = None,
               on_start: Callable[[str, str], None] | None = None,
               on_event: Callable[[str, int, str | None, dict], None] | None = None) -> ServedRun:
    """Run the server of ``cfg`` until its last round and return what it did.

    The federation id (the topic level agents must use, ``fedfleet-agent --federation``) is the
    run folder's name. Without a broker URL an embedded broker on 127.0.0.1 is started (useful
    to try agents on the same machine). Once connected, the server records its broker in the run
    folder's ``broker.json`` (:func:`~broker_server.persistence.write_broker_record`: its URL
    without credentials, and whether it was the embedded one); ``resume`` without ``broker_url``
    goes on with the broker recorded there, or says why it cannot (:func:`session_broker`).

    Args:
        say: where the start-up text (the agent command line, printed once the server is
            connected to the broker) and the final line go.
        on_round: called with each round's metrics dict.
        on_start: called with ``(federation, broker URL)`` once the server is connected to the
            broker and subscribed, before it waits for joins (start agents from here); the URL is
            the one connected to, its user name and password included.
        on_event: the server's progress events (:mod:`broker_server.progress`).

    A start-up failure (:data:`~broker_server.simulate.STARTUP_ERRORS`: a configuration error, a
    broker that cannot be started or reached) leaves no run folder behind (what this call wrote
    is removed; a ``--resume``d folder is left as it was); what a real fleet cannot run is
    refused before anything is written (:func:`check_real_fleet`). ``resume`` of a run with no
    round left starts no broker (:mod:`broker_server.run_end`). The call holds the run folder's
    lock (:mod:`broker_server.run_lock`) from before it reads the folder to its return: a second
    server, simulation or resume in that folder meanwhile is refused at once.

    Raises:
        RunFolderBusy: another process holds the run folder (nothing read or written).
        DataError, ConfigError, BrokerStartError, ConnectError: as :func:`~broker_server.simulate.simulate`.
        ConfigError: also a ``resume`` that cannot go on with its recorded broker without credentials
            the run folder does not keep, or without ``broker_url`` where its record cannot be read
            (:func:`session_broker`; nothing written).
    """
    out = Path(run_dir) if run_dir else Path(cfg.run.out) / make_run_id(cfg.run.name, cfg.run.seed)
    check_real_fleet(cfg)
    before = run_folder_entries(out)
    with hold_run_folder(out, "fedfleet server"):  # one process at a time writes the folder
        return _run_server_locked(cfg, out, before, broker_url=broker_url, resume=resume, say=say,
                                  on_round=on_round, on_start=on_start, on_event=on_event)


def _run_server_locked(cfg: Config, out: Path, before: set[str] | None, *, broker_url: str | None, resume: bool,
                       say: Callable[[str], None], on_round: Callable[[dict], None] | None,
                       on_start: Callable[[str, str], None] | None,
                       on_event: Callable[[str, int, str | None, dict], None] | None) -> ServedRun:
    """:func:`run_server` in the run folder ``out``, whose lock this process holds (``before``:
    its entries before this call, :func:`~broker_server.simulate.run_folder_entries`)."""
    if resume and not (out / "checkpoints.sqlite").exists():
        raise ConfigError(f"--resume {out}: no checkpoints.sqlite there (not a run folder, or it never started)")
    if resume:
        resume_metrics(out)  # a damaged metrics.jsonl is refused before a broker, a ledger or a file is touched
        check_partition_settings(out / "partition.json", cfg)  # another seed …: said before the data set is loaded
    if not resume and (out / "metrics.jsonl").exists():
        raise ConfigError(f"{out} already holds a run (metrics.jsonl); choose another --out, or --resume it")
    federation = re.sub(r"[^A-Za-z0-9_.-]", "-", out.name).strip("-._")[:64] or "fedfleet"
    ds = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir or None,
                      domain_train_cap=cfg.data.domain_train_cap, domain_test_cap=cfg.data.domain_test_cap)
    record = partition_record(ds, cfg, client_data(ds, cfg))
    if resume:
        check_partition_record(out / "partition.json", record)
    check_tracking(cfg)  # a tracking package asked for but missing: said before anything is written
    if (ignored := simulation_only_settings(cfg)):
        log.warning("%s: [agents] %s: simulation settings (fedfleet simulate); fedfleet server does not use "
                    "them: each device takes its own (fedfleet-agent --profile)", cfg.source, ", ".join(ignored))
    if resume and (fin := finished_run(out, cfg.run.rounds)) is not None:  # no round left: no broker, no agents
        given = broker_url or cfg.broker.url
        return _served_finished(cfg, ds, fin, federation, broker=shown_broker_url(given) if given else "", say=say)
    broker = session_broker(cfg, out, broker_url=broker_url, resume=resume)  # refused: before anything is written
    try:
        return _serve_run(cfg, ds, record, out, federation, broker=broker, resume=resume, say=say,
                          on_round=on_round, on_start=on_start, on_event=on_event)
    except STARTUP_ERRORS:
        if not resume:
            discard_unstarted(out, before)
        raise


def _served_finished(cfg: Config, ds, fin: FinishedRun, federation: str, *, broker: str,
                     say: Callable[[str], None]) -> ServedRun:
    """:func:`run_server` of a ``--resume`` whose rounds are all done (:mod:`broker_server.run_end`):
    nothing written when its final files are there (said in one line), else those files
    written from its last checkpoint, without a broker or agents."""
    if fin.summary is not None:
        say(nothing_to_resume(fin, cfg.run.rounds, "server"))
        acc = float(fin.summary.get("final_accuracy", float("nan")))
        summary = RunSummary(fin.rounds, acc, final_figures(fin.metrics)[1], fin.metrics)
    else:
        files = write_final_files(cfg, ds, fin, federation=federation, broker=broker,
                                  extra={"resumed_after": fin.rounds})
        summary = files.summary
        say(f"{finishing_line(fin, cfg.run.rounds, 'server', files.written)}; "
            f"{final_accuracy_text(summary.final_accuracy, final_accuracy_source(fin.metrics))} (agents still "
            "waiting for the run's finish message stop at their --idle-timeout-s)")
    return ServedRun(summary=summary, run_dir=fin.run_dir, federation=federation)


def _serve_run(cfg: Config, ds, record: dict, out: Path, federation: str, *, broker: SessionBroker, resume: bool,
               say: Callable[[str], None], on_round: Callable[[dict], None] | None,
               on_start: Callable[[str, str], None] | None,
               on_event: Callable[[str, int, str | None, dict], None] | None) -> ServedRun:
    """The body of :func:`run_server` once the data set is loaded: write the run folder, start or
    reach the broker (``broker``: :func:`session_broker`), connect the server, record its broker
    (``broker.json``), print the agent command, run the rounds."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(cfg.to_toml(), encoding="utf-8")
    (out / "partition.json").write_text(json.dumps(
        {**record, "note": "the split each agent must take (--shard i/n)"}, indent=1), encoding="utf-8")
    embedded = None
    ledger = None
    server = None
    tracker = None
    finished = False
    try:
        if broker.note:
            say(broker.note)
        url = broker.url
        if url is None:
            embedded = EmbeddedBroker(kind=cfg.broker.kind, workdir=out / "broker")
            embedded.start()
            url = embedded.url
        if (warning := broker.warning(url)):
            log.warning("%s", warning)
        ledger = Ledger(out / "ledger.sqlite")
        before_id = ledger.last_row_id()  # the rows of earlier sessions (a --resume's) end here
        ledger.set_meta("federation", federation)
        if not resume:
            note_fresh_run(ledger)
        tracker = start_tracking(cfg, out, federation)
        if tracker is not None:
            on_round = tracker.wrap(on_round)
            say(f"fedfleet server: tracking to {tracker.describe()}")
        server = make_server(cfg, ds, url, federation=federation, run_dir=out, ledger=ledger,
                             expected_clients=cfg.data.clients, on_round=on_round, resuming=resume)
        server.on_event = on_event
        ckpt = server.checkpoints.load() if resume else None
        if resume:  # where this session's rows begin, for the audit
            note_resume(ledger, after_round=ckpt.round if ckpt is not None else 0, after_id=before_id,
                        registry=len(ckpt.registry) if ckpt is not None else 0)
        if ckpt is not None:
            with refused_if_raises(ledger, after_id=before_id):  # a checkpoint that does not load: noted so
                server.resume(ckpt)
            say(f"fedfleet server: resuming {out} after round {ckpt.round} of {cfg.run.rounds} (rounds "
                f"{ckpt.round + 1}..{cfg.run.rounds} to go)")
        try:  # what a --resume goes on with
            write_broker_record(out, broker_record(url, embedded=embedded is not None))
        except OSError as exc:  # a folder in its place, a full disk: the run goes on, a resume names its broker
            then = ("starts a new embedded broker, as this session did" if embedded is not None else
                    f"needs --broker {resume_broker_option(url)}")
            log.warning("%s cannot be written (%s): a --resume of this run will not know its broker and %s",
                        out / BROKER_RECORD, exc, then)
        # the server is connected and subscribed: only now are the agents told how to join
        public = public_broker_url(url)  # what is printed and written: no user name or password
        say(f"fedfleet server: federation {federation!r} on {public} ({security_text(cfg)}); data {ds.name} from "
            f"{ds.source}; waiting for {plural(cfg.data.clients, 'agent')} "
            f"(join timeout {cfg.server.join_timeout_s:g} s). Start each agent i = 0..{cfg.data.clients - 1} with\n"
            f"  {agent_command(cfg, url, federation)}")
        if (login := agent_login_note(cfg, url)):
            say(login)
        if (hint := local_agents_hint(url, cfg.data.clients)):
            say(hint)
        if (assignment := model_assignment(cfg)):
            say(f"  {assignment}")
        if on_start is not None:
            on_start(federation, url)
        t0 = time.monotonic()
        summary = server.run()
        server.close("run finished")  # its retained offline status, then DISCONNECT
        write_summary(out, summary_record(
            cfg, ds, federation=federation, final_accuracy=summary.final_accuracy,
            rounds_completed=summary.rounds_completed, seconds=time.monotonic() - t0, broker=public,
            refusals=server.refusal_totals(), onnx=server.onnx_result, strategy=server.strategy,
            resumed_after=ckpt.round if ckpt else None,
            ignored_settings=[f"[agents] {t}" for t in simulation_only_settings(cfg)],
            **({"devices_rejoined_without_state": server.rejoined_without_state}
               if server.rejoined_without_state else {}),
            **({"metrics_lines_missing": server.metrics_lines_missing} if server.metrics_lines_missing else {}),
            **({"finish_unconfirmed": summary.finish_unconfirmed} if summary.finish_unconfirmed else {})))
        done = summary.rounds_completed
        unconfirmed = ("; its finish was not confirmed by the broker (summary.json: finish_unconfirmed)"
                       if summary.finish_unconfirmed else "")
        this_time = f" ({done - ckpt.round} in this session, resumed after round {ckpt.round})" if ckpt else ""
        say(f"finished {plural(done, 'round')} of {cfg.run.rounds}{this_time}; "
            f"{final_accuracy_text(summary.final_accuracy, final_accuracy_source(summary.metrics))}"
            f"{run_troubles_text(summary.metrics)}{unconfirmed}; run folder {out}")
        finished = True
    finally:
        if tracker is not None and not finished:
            tracker.close(status="FAILED")
        if server is not None:  # every exit path closes what it opened (saying offline); a second close is a no-op
            server.close()
            server.store.close()  # checkpoints.sqlite whole (no -wal left), not when it is garbage-collected
        if ledger is not None:
            ledger.close()
        if embedded is not None:
            embedded.stop()
    if tracker is not None:
        tracker.finish()
    return ServedRun(summary=summary, run_dir=out, federation=federation)
