"""``fedfleet audit``: the command line over :func:`audit_report` and the renderers."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ._csv import write_csv
from ._html import write_html
from ._load import AuditError
from ._report import DEFAULT_TARGET, audit_report, fleet_total
from ._text import render_comparison_text, render_text


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an accuracy fraction such as 0.95, got {text!r}") from None
    if not (0 < value <= 1):
        raise argparse.ArgumentTypeError(f"expected an accuracy fraction in (0, 1] such as 0.95, got {text!r}")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a speed in kbit/s such as 256, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive speed in kbit/s, got {text!r}")
    return value


def add_audit_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the arguments of ``fedfleet audit`` to ``parser`` (shared by the CLI and :func:`main_audit`)."""
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folder(s) holding ledger.sqlite")
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON instead of tables (a list of reports for several runs, each "
                             "with the runs' fleet_total)")
    parser.add_argument("--html", metavar="OUT.html",
                        help="also write a self-contained HTML report with plots to this file")
    parser.add_argument("--csv", metavar="DIR",
                        help="also write by_round.csv, by_client.csv, by_kind.csv, comparison.csv, fields.csv "
                             "to this folder")
    parser.add_argument("--target", type=_fraction, default=DEFAULT_TARGET, metavar="ACC",
                        help=f"test accuracy (fraction) for 'bytes to reach the target' (default {DEFAULT_TARGET})")
    parser.add_argument("--uplink-kbps", type=_positive, metavar="K",
                        help="per-client uplink speed in kbit/s (1000 bit/s) for the transfer-time estimate")
    parser.add_argument("--downlink-kbps", type=_positive, metavar="K",
                        help="per-client downlink speed in kbit/s for the transfer-time estimate")
    return parser


def _error(message: str) -> int:
    print(f"fedfleet audit: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def run_audit(ns: argparse.Namespace) -> int:
    """Run ``fedfleet audit`` for parsed arguments (see :func:`add_audit_arguments`).

    Prints text tables (default; with several runs each run, then the comparison) or JSON to
    stdout, writes the HTML and CSV files asked for, and says on stderr which files it wrote.

    The JSON is the :func:`audit_report` of the run (a list of them, in the order given, for
    several runs), each with one more key, ``fleet_total``: :func:`._report.fleet_total` of all the
    runs given, the same object in every report, whose numbers the text and HTML comparisons
    print as the fleet total (``federation``, ``runs``, ``up_bytes``, ``down_bytes``,
    ``wire_bytes``, ``messages``, ``repeat_bytes``, ``repeat_messages``, ``repeat_unknown``);
    None for a single run, or runs of different or unknown federations.

    Returns:
        0 on success; 2 when a run folder cannot be audited or an output cannot be written, after
        one line ``fedfleet audit: error: …`` on stderr.
    """
    try:
        reports = [audit_report(d, target=ns.target, uplink_kbps=ns.uplink_kbps, downlink_kbps=ns.downlink_kbps)
                   for d in ns.run_dirs]
    except AuditError as exc:
        return _error(str(exc))
    if ns.html:
        try:  # before anything is written: a missing extra leaves no half of the outputs
            import matplotlib.figure  # noqa: F401
        except ImportError as exc:
            return _error(f"--html draws its plots with matplotlib, which cannot be imported ({exc}); install it "
                          "with pip install 'fedfleet[plots]', or leave out --html")
    written: list[Path] = []
    try:
        if ns.csv:
            written += write_csv(reports, ns.csv)
        if ns.html:
            written.append(write_html(reports, ns.html))
    except OSError as exc:
        return _error(f"cannot write {exc.filename or ''}: {exc.strerror or exc}")
    if ns.json:
        fleet = fleet_total(reports)
        out = [{**r, "fleet_total": fleet} for r in reports]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
    else:
        texts = [render_text(r) for r in reports]
        if len(reports) > 1:
            texts.append(render_comparison_text(reports))
        sys.stdout.write(("\n" + "=" * 120 + "\n\n").join(texts))
    sys.stdout.flush()
    for path in written:
        print(f"fedfleet audit: wrote {path}", file=sys.stderr)
    return 0


def main_audit(args: list[str] | None = None) -> int:
    """``fedfleet audit RUN_DIR [RUN_DIR ...] [--json] [--html OUT.html] [--csv DIR] [--target ACC]
    [--uplink-kbps K] [--downlink-kbps K]``: print (and write) the audit of run folders.

    Returns:
        See :func:`run_audit`. Bad arguments exit through argparse with status 2.
    """
    parser = argparse.ArgumentParser(
        prog="fedfleet audit",
        description="Bytes every link carried in a run, from RUN_DIR/ledger.sqlite: device links "
                    "(what the agents sent and received) and the server link; several runs are compared.")
    add_audit_arguments(parser)
    return run_audit(parser.parse_args(args))

