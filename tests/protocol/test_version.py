"""``fedfleet --version`` and ``fedfleet-agent --version``: the installed distribution's version,
the one pyproject.toml declares (read here with tomllib, independently of importlib.metadata)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from broker_server.cli import main as fedfleet_main
from edge_agent.cli import main as agent_main
from protocol.version import fedfleet_version

DECLARED = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["version"]


def test_the_version_is_the_declared_one() -> None:
    assert fedfleet_version() == DECLARED


@pytest.mark.parametrize(("main", "prog"), [(fedfleet_main, "fedfleet"), (agent_main, "fedfleet-agent")])
def test_both_commands_print_it_and_exit_0(main, prog, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"{prog} {DECLARED}\n"


def test_a_checkout_pip_never_installed_says_so(monkeypatch) -> None:
    import importlib.metadata

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert fedfleet_version() == "unknown (not installed)"
