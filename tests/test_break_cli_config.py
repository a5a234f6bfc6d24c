"""Reproducers (tester): configuration edge cases that the CLI does not turn into a clean
"configuration error" (exit code 2), contrary to broker_server/cli.py's contract.

1. A partition that cannot be made (more clients than ``min_samples`` allows; a tiny Dirichlet
   ``alpha`` such as 0.01 with the default ``min_samples = 10``) escapes as an uncaught
   ``edge_agent.errors.PartitionError`` traceback with exit code 1 (the message itself is good).
2. ``--clients`` cannot rescue a file whose quorum exceeds the file's client count: the file is
   validated before the override is applied, so ``quorum = 9, clients = 4`` plus
   ``--clients 12`` is refused with "quorum = 9 exceeds [data] clients = 4".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from broker_server.cli import main as fedfleet_main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.toml"


@pytest.mark.parametrize("extra, clients", [("", 200), ("alpha_override", 10)])
def test_impossible_partition_is_a_configuration_error(tmp_path: Path, capsys, extra: str, clients: int) -> None:
    cfg = QUICKSTART.read_text()
    if extra == "alpha_override":
        cfg = cfg.replace("alpha = 1.0", "alpha = 0.01")
    path = tmp_path / "cfg.toml"
    path.write_text(cfg)
    code = fedfleet_main(["simulate", "--config", str(path), "--clients", str(clients), "--rounds", "1",
                          "--out", str(tmp_path / "run"), "-q"])
    assert code == 2
    assert "min_samples" in capsys.readouterr().err


def test_clients_override_can_raise_the_client_count_above_the_file_quorum(tmp_path: Path) -> None:
    from broker_server.cli import _load, build_parser

    path = tmp_path / "cfg.toml"
    path.write_text(QUICKSTART.read_text().replace("quorum = 2", "quorum = 9"))
    args = build_parser().parse_args(["simulate", "--config", str(path), "--clients", "12"])
    cfg = _load(args)
    assert cfg.data.clients == 12 and cfg.server.quorum == 9
