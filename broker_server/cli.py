"""The ``fedfleet`` command line: ``simulate``, ``server``, ``audit``.

Exit codes (never reused): 0 success; 1 the run failed; 2 bad usage or configuration (the
message says what to fix); 3 data set not found; 4 broker not reachable or not started.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .errors import ConfigError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_DATA = 3
EXIT_BROKER = 4


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
    return out


def _load(args):
    """The configuration file with the command-line overrides; a quorum above an overridden
    client count is lowered to it (and said so)."""
    from . import config as config_mod

    over = _overrides(args)
    try:
        return config_mod.load(args.config, over)
    except ConfigError as exc:
        if ("data", "clients") not in over or "quorum" not in str(exc):
            raise
        cfg = config_mod.load(args.config, {**over, ("server", "quorum"): over[("data", "clients")]})
        print(f"fedfleet: note: [server] quorum lowered to --clients {over[('data', 'clients')]}", file=sys.stderr)
        return cfg


def _cmd_simulate(args) -> int:
    from .simulate import progress_printer, simulate

    cfg = _load(args)
    show = None if args.quiet else progress_printer(cfg.run.rounds)
    print(f"fedfleet simulate: {cfg.data.dataset}, {cfg.data.clients} clients ({cfg.data.partition}"
          f"{f', α={cfg.data.alpha:g}' if cfg.data.partition == 'dirichlet' else ''}), {cfg.train.algorithm}, "
          f"{cfg.run.rounds} rounds", flush=True)
    res = simulate(cfg, broker_url=args.broker, run_dir=args.out, on_round=show)
    _print_summary(res.run_dir, res.final_accuracy, res.rounds_completed, res.seconds, res.broker)
    return EXIT_OK


def _print_summary(run_dir: Path, accuracy: float, rounds: int, seconds: float, broker: str) -> None:
    from .audit import audit_report

    rep = audit_report(run_dir)
    dev = rep["totals"]["device"]
    print(f"\nfinished {rounds} round{'s' if rounds != 1 else ''} in {seconds:.1f} s over {broker}; "
          f"final test accuracy {accuracy:.4f}")
    print(f"bytes on the device links (all agents together): up {dev['up']['wire_bytes']:,}  "
          f"down {dev['down']['wire_bytes']:,}  (protocol overhead {100 * (dev['all']['overhead_share'] or 0):.2f} %)")
    for k in rep["by_kind"]:
        print(f"  {k['kind']:<12} {k['direction']:<5} {k['messages']:>6} messages  {k['wire_bytes']:>14,} bytes")
    print(f"run folder: {run_dir}   (fedfleet audit {run_dir})")


def _cmd_server(args) -> int:
    from .server_main import serve

    cfg = _load(args)
    return serve(cfg, broker_url=args.broker, run_dir=args.out)


def _cmd_audit(args) -> int:
    from .audit import run_audit

    return run_audit(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fedfleet``."""
    p = argparse.ArgumentParser(prog="fedfleet", description="Federated learning for edge fleets over MQTT.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--config", required=True, help="TOML run configuration (see examples/)")
        sp.add_argument("--broker", help="mqtt://host:port of an existing broker (default: start an embedded one)")
        sp.add_argument("--rounds", type=int, help="override [run] rounds")
        sp.add_argument("--seed", type=int, help="override [run] seed")
        sp.add_argument("--out", help="run folder (default: <[run] out>/<run-id>)")
        sp.add_argument("--data-dir", help="folder holding the data sets (overrides [data] data_dir)")

    s = sub.add_parser("simulate", help="run a whole federation on this machine over MQTT")
    common(s)
    s.add_argument("--clients", type=int, help="override [data] clients")
    s.add_argument("-q", "--quiet", action="store_true", help="no per-round progress lines")
    s.set_defaults(func=_cmd_simulate)

    s = sub.add_parser("server", help="run the aggregation server for real agents (fedfleet-agent)")
    common(s)
    s.add_argument("--clients", type=int, help="start round 1 once this many agents joined")
    s.set_defaults(func=_cmd_server)

    from .audit import add_audit_arguments

    s = sub.add_parser("audit", help="the byte ledger of run folders as tables, JSON, HTML or CSV; compares runs")
    add_audit_arguments(s)
    s.set_defaults(func=_cmd_audit)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fedfleet`` console script; returns the exit code."""
    from edge_agent.errors import DataError
    from protocol.errors import ConnectError

    from .errors import BrokerStartError, FedfleetServerError

    args = build_parser().parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"fedfleet: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except DataError as exc:
        print(f"fedfleet: data error: {exc}", file=sys.stderr)
        return EXIT_DATA
    except (BrokerStartError, ConnectError) as exc:
        print(f"fedfleet: broker error: {exc}", file=sys.stderr)
        return EXIT_BROKER
    except FedfleetServerError as exc:
        print(f"fedfleet: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("fedfleet: interrupted", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
