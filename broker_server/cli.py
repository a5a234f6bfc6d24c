"""The ``fedfleet`` command line: ``simulate``, ``server``, ``audit``, ``keys``, ``profiles``,
``feddo pretrain``.

Exit codes (never reused): 0 success; 1 the run failed; 2 bad usage or configuration (the
message says what to fix); 3 data set not found; 4 broker not reachable or not started; 5 the run
folder is in use by another process (a server, simulation or resume writing it: the message names
the folder and that process's pid, host and start time; nothing was written); 130 stopped
by Ctrl-C (SIGINT, 128 + 2 as a shell reports it; SIGTERM exits 143): one line says so and, for a
run with a checkpoint, how to continue it.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from protocol.version import VersionAction

from .errors import ConfigError
from .text import plural

EXIT_OK = 0
EXIT_FAILED = 1
#: stopped by Ctrl-C (SIGINT): 128 + SIGINT, as a shell reports it (SIGTERM exits 128 + 15)
EXIT_INTERRUPTED = 130
EXIT_USAGE = 2
EXIT_DATA = 3
EXIT_BROKER = 4
#: another process holds the run folder (:mod:`broker_server.run_lock`)
EXIT_BUSY = 5

#: The exit codes as ``fedfleet --help`` lists them.
EXIT_CODES_HELP = ("exit codes: 0 success, 1 the run failed, 2 bad usage or configuration, 3 data set not found, "
                   "4 broker not reachable or not started, 5 the run folder is in use by another process (its pid, "
                   "host and start time named), 130 Ctrl-C (SIGTERM: 143)")


def _overrides(args) -> dict:
    """Command-line overrides as ``{(section, key): value}``, each checked with the flag's name."""
    out: dict = {}
    if args.rounds is not None:
        if args.rounds < 1:
            raise ConfigError(f"--rounds must be ≥ 1, got {args.rounds}")
        out[("run", "rounds")] = args.rounds
    if args.seed is not None:
        if args.seed < 0:
            raise ConfigError(f"--seed must be ≥ 0, got {args.seed}")
        out[("run", "seed")] = args.seed
    if getattr(args, "clients", None) is not None:
        if args.clients < 1:
            raise ConfigError(f"--clients must be ≥ 1, got {args.clients}")
        out[("data", "clients")] = args.clients
    if getattr(args, "data_dir", None):
        out[("data", "data_dir")] = args.data_dir
    if getattr(args, "tensorboard", False):
        out[("tracking", "tensorboard")] = True
    if getattr(args, "mlflow", None) is not None:
        out[("tracking", "mlflow")] = True
        if args.mlflow:
            out[("tracking", "mlflow_uri")] = args.mlflow
    return out


def _load(args):
    """The configuration file with the command-line overrides; a quorum above an overridden
    client count is lowered to it (and said so). With ``--resume RUN_DIR`` the run's resolved
    ``config.toml`` is the file (and ``--out`` is the run folder)."""
    from . import config as config_mod

    if getattr(args, "resume", None) is not None:
        if args.config:
            raise ConfigError("--resume uses the run's own config.toml: do not pass --config too")
        run = Path(args.resume)
        what = _not_a_run_folder(str(args.resume), run)
        if what:
            raise ConfigError(f"--resume {args.resume}: {what}")
        args.config = str(run / "config.toml")
        args.out = args.resume
    elif not args.config:
        raise ConfigError("--config FILE is required (or --resume RUN_DIR)")
    over = _overrides(args)
    try:
        cfg = config_mod.load(args.config, over)
    except ConfigError as exc:
        if ("data", "clients") not in over or "quorum" not in str(exc):
            raise
        cfg = config_mod.load(args.config, {**over, ("server", "quorum"): over[("data", "clients")]})
        print(f"fedfleet: note: [server] quorum lowered to --clients {over[('data', 'clients')]}", file=sys.stderr)
    if getattr(args, "resume", None) is not None:  # another --seed, --clients: refused now, naming the option
        from .simulate import check_partition_settings

        check_partition_settings(Path(args.resume) / "partition.json", cfg,
                                 {k: flag for k, flag in _FLAGS.items() if k in over})
    return absolute_path_keys(cfg)


#: The command-line option of each configuration key it overrides (:func:`_overrides`), as
#: messages name it.
_FLAGS = {("run", "rounds"): "--rounds", ("run", "seed"): "--seed", ("data", "clients"): "--clients",
          ("data", "data_dir"): "--data-dir"}


def _not_a_run_folder(given: str, run: Path) -> str | None:
    """Why ``--resume given`` names no run folder (``None``: it is one, holding its config.toml)."""
    if not given.strip():
        return "an empty path"
    try:
        if not run.exists():
            return "no such run folder (a folder an earlier run wrote, holding its config.toml)"
        if not run.is_dir():
            return "a file, not a run folder (the folder an earlier run wrote, holding its config.toml)"
        if not (run / "config.toml").is_file():
            return ("the folder holds no config.toml file, so it is not a run folder (a run writes its resolved "
                    "configuration there when it starts)")
    except OSError as exc:  # a folder this user may not enter
        return f"the run folder cannot be read ({exc.strerror or exc})"
    return None


def absolute_path_keys(cfg):  # noqa: ANN001, ANN201  (a Config)
    """``cfg`` with the ``[algorithm]`` keys its algorithm names as file paths (a strategy's
    ``path_keys``: FedDO's ``policy``) and its own file keys (:data:`FILE_KEYS`: ``[broker]
    password_file`` …) made absolute against the current folder, ``~`` expanded
    (:func:`os.path.abspath`: ``..`` is resolved by name), so that the run folder's config.toml
    names the file wherever a ``--resume`` is started from; a relative one remembers it was
    (:class:`~broker_server.given_paths.GivenPath`: an error reading it says so). An unknown
    algorithm is left to the strategy's own check."""
    import dataclasses

    from .given_paths import absolute_path
    from .strategies import get_strategy_class

    for section, names in FILE_KEYS.items():
        part = getattr(cfg, section)
        given = {k: absolute_path(v) for k in names if (v := getattr(part, k))}
        if given:
            cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(part, **given)})
    try:
        keys = getattr(get_strategy_class(cfg.train.algorithm), "path_keys", ())
    except Exception:  # noqa: BLE001 - said with its reason by make_strategy
        return cfg
    found = {k: v for k in keys if isinstance(v := cfg.algorithm.get(k), str) and v}
    if not found:
        return cfg
    return dataclasses.replace(cfg, algorithm={**cfg.algorithm, **{k: absolute_path(v) for k, v in found.items()}})


#: The configuration's own file and folder keys, per section, made absolute with the strategy's
#: path keys (:func:`absolute_path_keys`): what a ``--resume`` from another folder must still find
#: (the broker's login and TLS files, the key folder, the data folder).
FILE_KEYS = {"broker": ("password_file", "ca_file", "cert_file", "key_file"), "security": ("key_dir",),
             "data": ("data_dir",)}


def run_header(cfg, command: str = "simulate", resumed_after: int | None = None) -> str:
    """The first line of ``fedfleet simulate``: data set, clients, partition, algorithm (with the
    files its ``[algorithm]`` path keys name: FedDO's pre-trained ``policy``, or, resumed after
    round N, its agent from that checkpoint: ``Strategy.header_files``), rounds,
    signing/encryption (``1 client, 1 round``)."""
    from .server_main import security_text
    from .strategies import get_strategy_class

    d = cfg.data
    alpha = f", α={d.alpha:g}" if d.partition == "dirichlet" else ""
    try:
        files = get_strategy_class(cfg.train.algorithm).header_files(cfg.algorithm, resumed_after)
    except ConfigError:  # an unknown algorithm: make_strategy says so right after
        files = ""
    return (f"fedfleet {command}: {d.dataset}, {plural(d.clients, 'client')} ({d.partition}{alpha}), "
            f"{cfg.train.algorithm}{f' ({files})' if files else ''}, {plural(cfg.run.rounds, 'round')}, "
            f"{security_text(cfg)}")


def _cmd_simulate(args) -> int:
    from protocol.errors import ConnectError, TransportError

    from .progress import make_progress
    from .run_lock import check_not_held
    from .simulate import DEVICE_STATE_FILE, kept_device_state, make_run_id, progress_printer, simulate

    cfg = _load(args)
    out = Path(args.out) if args.out else Path(cfg.run.out) / make_run_id(cfg.run.name, cfg.run.seed)
    check_not_held(out)  # a folder another process holds: refused before the first line (simulate holds the lock)
    fin = _finished(args, cfg)
    if fin is not None and fin.complete:
        from .run_end import nothing_to_resume
        from .simulate import kept_device_state

        print(nothing_to_resume(fin, cfg.run.rounds, "simulate", kept_device_state(cfg)), flush=True)
        return EXIT_OK
    last = None
    if fin is not None:
        last = fin.rounds
    elif args.resume and (out / "checkpoints.sqlite").exists():
        from .run_end import last_checkpoint_round

        last = last_checkpoint_round(out / "checkpoints.sqlite") or 0

    def started() -> None:  # the configuration checks passed: the first lines (an error comes alone)
        print(run_header(cfg, resumed_after=last), flush=True)
        if fin is not None:
            from .run_end import finishing_line

            print(finishing_line(fin, cfg.run.rounds, "simulate"), flush=True)
        elif last is not None:
            print(f"fedfleet simulate: resuming {out} after round {last} of {cfg.run.rounds} (rounds {last + 1}.."
                  f"{cfg.run.rounds} to go)", flush=True)
            if (out / DEVICE_STATE_FILE).exists() and (kept := kept_device_state(cfg)):
                print(f"fedfleet simulate: the devices carry on from their kept state in {DEVICE_STATE_FILE} "
                      f"({'; '.join(kept)})", flush=True)
    show = None if args.quiet else progress_printer(cfg.run.rounds)
    prog = make_progress(cfg.run.rounds, verbose=args.verbose + args.sub_verbose > 0, round_line=show)
    try:
        with prog:
            res = simulate(cfg, broker_url=args.broker, run_dir=out, on_round=prog.on_round,
                           on_event=None if args.quiet else prog.on_event, resume=bool(args.resume),
                           on_plan=lambda plan: print(plan.describe(), flush=True), on_start=started)
    except (KeyboardInterrupt, TransportError) as exc:
        # a broker it could not connect to at the start stopped nothing: the error alone says it
        if not isinstance(exc, ConnectError) and (out / "checkpoints.sqlite").exists():
            why = "interrupted" if isinstance(exc, KeyboardInterrupt) else "stopped by the broker link"
            print(f"fedfleet simulate: {why}; continue the run from its last checkpoint with\n"
                  f"  fedfleet simulate --resume {shlex.quote(str(out))}{_login_broker_option(cfg)}", flush=True)
        raise
    from .server import final_accuracy_source

    source = final_accuracy_source(res.metrics)  # that of the line the final accuracy is from
    _print_summary(res.run_dir, res.final_accuracy, res.rounds_completed, res.seconds, res.broker,
                   accuracy_source=source, total_rounds=cfg.run.rounds,
                   resumed_after=last, metrics=res.metrics)
    t = cfg.tracking
    if t.tensorboard:
        print(f"TensorBoard: tensorboard --logdir {t.tensorboard_dir or res.run_dir / 'tensorboard'}")
    if t.mlflow:
        print(f"MLflow: {t.mlflow_uri or (res.run_dir / 'mlruns').resolve().as_uri()}, experiment "
              f"{t.mlflow_experiment!r}, run {res.federation!r}")
    from .persistence import read_summary

    if failed := read_summary(res.run_dir).get("agent_errors"):
        print(f"fedfleet simulate: {len(failed)} agent(s) failed: {'; '.join(failed)}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


def _login_broker_option(cfg) -> str:  # noqa: ANN001  (a Config)
    """`` --broker scheme://USER:PASSWORD@host:port`` when ``cfg``'s ``[broker] url`` has a user
    name or password, which the run folder's config.toml leaves out (a ``--resume`` needs them
    again), else ``""``."""
    from protocol.broker_url import has_login, login_placeholder_url

    url = cfg.broker.url
    try:
        login = bool(url) and has_login(url)
    except ValueError:  # not a broker URL: refused before anything ran
        return ""
    return f" --broker {login_placeholder_url(url)}" if login else ""


def _print_summary(run_dir: Path, accuracy: float, rounds: int, seconds: float, broker: str, *,
                   accuracy_source: str | None = "global", total_rounds: int | None = None,
                   resumed_after: int | None = None, metrics: Sequence[Mapping] = ()) -> None:
    """The end of ``fedfleet simulate``: rounds, time, the final accuracy named by the
    ``accuracy_source`` of its line (:func:`~broker_server.server.final_accuracy_text`), skipped
    rounds and a diverged global model in ``metrics`` (:func:`~broker_server.server.run_troubles_text`),
    the device links' bytes per kind and the run folder."""
    from .audit import audit_report
    from .server import final_accuracy_text, run_troubles_text

    rep = audit_report(run_dir)
    dev = rep["totals"]["device"]
    of = f" of {total_rounds}" if total_rounds is not None else ""
    session = (f" ({rounds - resumed_after} in this session, resumed after round {resumed_after})"
               if resumed_after is not None else "")
    print(f"\nfinished {plural(rounds, 'round')}{of}{session} in {seconds:.1f} s over {broker}; "
          f"{final_accuracy_text(accuracy, accuracy_source)}{run_troubles_text(metrics)}")
    print(f"bytes on the device links (all agents together): up {dev['up']['wire_bytes']:,}  "
          f"down {dev['down']['wire_bytes']:,}  (protocol overhead {100 * (dev['all']['overhead_share'] or 0):.2f} %)")
    for k in rep["by_kind"]:
        print(f"  {k['kind']:<12} {k['direction']:<5} {k['messages']:>6} messages  {k['wire_bytes']:>14,} bytes")
    print(f"run folder: {run_dir}   (fedfleet audit {run_dir})")


def _finished(args, cfg):
    """With ``--resume``: the run's :class:`~broker_server.run_end.FinishedRun` when its rounds are
    all done (:func:`~broker_server.run_end.finished_run`), else ``None``.

    Raises:
        ConfigError: ``--rounds`` (or the run's own ``[run] rounds``) is below the rounds the run,
            which has not ended, has done: the message names the option, or the file, and the
            rounds the run was to run.
    """
    if not getattr(args, "resume", None):
        return None
    from .run_end import config_rounds, finished_run

    if args.rounds is not None:
        given, planned = f"--rounds {args.rounds}", config_rounds(args.config)
    else:
        given, planned = f"[run] rounds = {cfg.run.rounds} in {args.config}", None
    return finished_run(Path(args.resume), cfg.run.rounds, given=given, planned=planned)


def _cmd_server(args) -> int:
    from .run_lock import check_not_held
    from .server_main import serve

    cfg = _load(args)
    if args.out:  # a folder another process holds: refused before the first line (run_server holds the lock)
        check_not_held(args.out)
    fin = _finished(args, cfg)
    if fin is not None and fin.complete:  # one line, nothing written: no data set loaded, no broker
        from .run_end import nothing_to_resume

        print(nothing_to_resume(fin, cfg.run.rounds, "server"), flush=True)
        return EXIT_OK
    last = fin.rounds if fin is not None else None
    if fin is None and args.resume and (Path(args.out) / "checkpoints.sqlite").exists():
        from .run_end import last_checkpoint_round

        last = last_checkpoint_round(Path(args.out) / "checkpoints.sqlite") or 0
    print(run_header(cfg, "server", resumed_after=last), flush=True)
    return serve(cfg, broker_url=args.broker, run_dir=args.out, resume=bool(args.resume),
                 verbose=args.verbose + args.sub_verbose > 0)


def _cmd_keys(args) -> int:
    from .keys import run_keys

    return run_keys(args)


def _cmd_audit(args) -> int:
    from .audit import run_audit

    return run_audit(args)


def _cmd_feddo_pretrain(args) -> int:
    from .feddo_pretrain import run_pretrain

    return run_pretrain(args)


def _cmd_profiles(args) -> int:
    """``fedfleet profiles``: a table of every firmware profile found; ``fedfleet profiles show NAME``:
    one resolved profile as TOML (``NAME`` may also be a path ending in ``.toml``). Profiles are
    searched in ``$FEDFLEET_PROFILES`` and then the repository's ``firmware_profiles/``
    (:func:`edge_agent.profiles.search_dirs`). An unknown name or an invalid file: exit 2."""
    from edge_agent.profiles import ProfileError, get_profile, list_profiles, load_profile

    try:
        if args.profiles_command == "show":
            name = args.name
            prof = load_profile(name) if name.endswith(".toml") else get_profile(name)
            print(prof.to_toml(), end="")
            return EXIT_OK
        profiles = [get_profile(n) for n in list_profiles()]
    except ProfileError as exc:
        print(f"fedfleet: profile error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(_profiles_table(profiles))
    return EXIT_OK


def _profiles_table(profiles) -> str:
    """Profiles as a fixed-width text table (units in the header)."""
    head = ("name", "accel", "precision", "cores/threads", "memory MiB (budget/RAM)", "up kbit/s",
            "down kbit/s", "RTT ms", "loss %", "max packet B", "chunk B", "update codec", "rel. speed")
    rows = [(p.name, p.accelerator, p.precision, f"{p.cpu_cores}/{p.torch_threads or 'auto'}",
             f"{p.memory_budget_mb:,}/{p.ram_mb:,}", f"{p.link.uplink_kbps:,.0f}", f"{p.link.downlink_kbps:,.0f}",
             f"{p.link.rtt_ms:g}", f"{p.link.loss_percent:g}", f"{p.mqtt.max_packet_bytes:,}",
             f"{p.mqtt.chunk_bytes:,}", p.preferred_codecs.update_codec, f"{p.relative_compute_speed:g}")
            for p in profiles]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    left = {0, 1, 2, 11}
    lines = ["  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class _CommandParser(argparse.ArgumentParser):
    """The parser of one ``fedfleet`` command (``simulate``, ``feddo pretrain`` …): arguments it
    does not know are reported by it, with its own usage, and an option close to one of its own
    is named (``--rouns``: did you mean ``--rounds``?). A plain sub-parser hands them up to
    ``fedfleet``'s parser, which knows none of the command's options and prints its own usage."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201  (argparse's signature)
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized_text(extras, self._option_string_actions))
        return ns, extras


def unrecognized_text(extras: Sequence[str], options: Iterable[str]) -> str:
    """argparse's ``unrecognized arguments: …`` for ``extras``, with ``did you mean --x?`` for each
    option among them that is close to one of ``options`` (:func:`difflib.get_close_matches`;
    ``--opt=value`` is matched on ``--opt``)."""
    import difflib

    known = sorted(options)
    hints = []
    for word in extras:
        if not word.startswith("-") or len(word) < 2:
            continue
        name = word.split("=", 1)[0]
        if (close := difflib.get_close_matches(name, known, n=1)):
            hints.append((name, close[0]))
    text = f"unrecognized arguments: {' '.join(extras)}"
    if len(hints) == 1:
        return f"{text}; did you mean {hints[0][1]}?"
    if hints:
        return f"{text}; did you mean {', '.join(f'{m} (for {w})' for w, m in hints)}?"
    return text


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fedfleet``: each command's own parser reports the arguments it
    does not know (:class:`_CommandParser`)."""
    p = argparse.ArgumentParser(prog="fedfleet", description="Federated learning for edge fleets over MQTT.",
                                epilog=EXIT_CODES_HELP)
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    p.add_argument("--version", action=VersionAction)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_CommandParser)

    def common(sp):
        sp.add_argument("--config", help="TOML run configuration (see examples/)")
        sp.add_argument("--resume", metavar="RUN_DIR",
                        help="continue a run that was interrupted, from its last checkpoint")
        sp.add_argument("--broker", help="mqtt://host:port of an existing broker (default: start an embedded one)")
        sp.add_argument("--rounds", type=int, help="override [run] rounds")
        sp.add_argument("--seed", type=int, help="override [run] seed")
        sp.add_argument("--out", help="run folder (default: <[run] out>/<run-id>)")
        sp.add_argument("--data-dir", help="folder holding the data sets (overrides [data] data_dir)")
        sp.add_argument("--tensorboard", action="store_true",
                        help="log each round's metrics and ledger bytes to TensorBoard (RUN_DIR/tensorboard; "
                             "[tracking]; needs fedfleet[tracking])")
        sp.add_argument("--mlflow", nargs="?", const="", default=None, metavar="URI",
                        help="log each round to MLflow (default URI file:RUN_DIR/mlruns; [tracking]; "
                             "needs fedfleet[tracking])")
        # also after the command (`fedfleet simulate -v`); a separate dest, added to fedfleet's own -v
        sp.add_argument("-v", "--verbose", dest="sub_verbose", action="count", default=0,
                        help="per-device progress and more log output (-vv: debug); same as fedfleet -v")

    s = sub.add_parser("simulate", help="run a whole federation on this machine over MQTT")
    common(s)
    s.add_argument("--clients", type=int, help="override [data] clients")
    s.add_argument("-q", "--quiet", action="store_true", help="no per-round progress lines")
    s.set_defaults(func=_cmd_simulate)

    s = sub.add_parser("server", help="run the aggregation server for real agents (fedfleet-agent)")
    common(s)
    s.add_argument("--clients", type=int, help="override [data] clients: the number of shards (each agent's "
                   "--shard i/N); round 1 starts once that many agents joined (or, at [server] join_timeout_s, "
                   "with the quorum)")
    s.set_defaults(func=_cmd_server)

    from .audit import add_audit_arguments

    s = sub.add_parser("audit", help="the byte ledger of run folders as tables, JSON, HTML or CSV; compares runs")
    add_audit_arguments(s)
    s.set_defaults(func=_cmd_audit)

    from .keys import add_keys_arguments

    s = sub.add_parser("keys", help="device and server keys: gen, enroll, revoke, list, show")
    add_keys_arguments(s)
    s.set_defaults(func=_cmd_keys)

    from .feddo_pretrain import add_pretrain_arguments

    s = sub.add_parser("feddo", help="FedDO tools: `feddo pretrain` trains the DSAC-T policy in simulation")
    fs = s.add_subparsers(dest="feddo_command", required=True)
    pre = fs.add_parser("pretrain", help="pre-training episodes in an in-process simulation; writes the policy")
    add_pretrain_arguments(pre)
    pre.set_defaults(func=_cmd_feddo_pretrain)

    s = sub.add_parser("profiles", help="list the firmware profiles as a table; `profiles show NAME` prints one")
    s.set_defaults(func=_cmd_profiles, profiles_command=None)
    ps = s.add_subparsers(dest="profiles_command")
    show = ps.add_parser("show", help="the resolved profile NAME (or a PATH.toml, validated) as TOML")
    show.add_argument("name", metavar="NAME", help="profile name (see `fedfleet profiles`) or a .toml file")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fedfleet`` console script; returns the exit code. Standard output is guarded
    (:func:`protocol.lifecycle.guard_stdout`): a reader that goes away (``| head -1``) ends the
    output, not the run."""
    from protocol.lifecycle import guard_stdout

    with guard_stdout("fedfleet"):
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    """:func:`main` inside its stdout guard."""
    from edge_agent.errors import DataError, EdgeAgentError
    from protocol.errors import ConnectError, TransportError

    from .errors import BrokerStartError, FedfleetServerError, RunFolderBusy

    args = build_parser().parse_args(argv)
    args.verbose += getattr(args, "sub_verbose", 0)
    args.sub_verbose = 0
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from protocol.lifecycle import install_signal_handlers
    install_signal_handlers()  # SIGTERM/SIGINT: ledgers committed, run folders closed in order
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"fedfleet: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except DataError as exc:
        print(f"fedfleet: data error: {exc}", file=sys.stderr)
        return EXIT_DATA
    except EdgeAgentError as exc:  # a simulated device that cannot start: its kept state (state file) unusable …
        print(f"fedfleet: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (BrokerStartError, ConnectError) as exc:
        print(f"fedfleet: broker error: {exc}", file=sys.stderr)
        return EXIT_BROKER
    except TransportError as exc:  # the link failed during a run (a broker that stopped acknowledging)
        print(f"fedfleet: broker link error: {exc}", file=sys.stderr)
        return EXIT_BROKER
    except RunFolderBusy as exc:
        print(f"fedfleet: {exc}", file=sys.stderr)
        return EXIT_BUSY
    except FedfleetServerError as exc:
        print(f"fedfleet: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("fedfleet: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
