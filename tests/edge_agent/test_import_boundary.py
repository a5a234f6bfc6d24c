"""edge_agent never imports broker_server: every edge_agent module, and the agent's whole
start-up path, in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib, pkgutil, sys
import edge_agent
names = sorted(m.name for m in pkgutil.walk_packages(edge_agent.__path__, "edge_agent."))
for name in names:
    importlib.import_module(name)
from edge_agent.cli import main
rc = main(["--broker", "http://nowhere", "--federation", "f", "--client-id", "c"])  # past the lazy imports
assert rc == 2, rc
bad = sorted(m for m in sys.modules if m == "broker_server" or m.startswith("broker_server."))
print(len(names), "modules;", "broker_server modules:", bad)
sys.exit(1 if bad else 0)
"""


def test_no_edge_agent_module_imports_broker_server() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    count = int(proc.stdout.split()[0])
    assert count >= 20  # the package, its algorithms and models subpackages
