"""The Python API (``fedfleet``): the README's example, extracted from the README and run as it
stands (so the README cannot drift), and a server with agents run from Python; what they return
is checked against the run folder's own files. Also the public names and versions."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from broker_server.config import tomllib
from protocol.ledger import read_rows

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _readme_python_blocks() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("### Bring your own code", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_readme_example_runs_and_returns_the_run_s_history(tmp_path) -> None:
    blocks = _readme_python_blocks()
    assert len(blocks) == 1
    env = {**os.environ, "FEDFLEET_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", blocks[0]], cwd=tmp_path, capture_output=True, text=True, env=env,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = out.stdout.strip().splitlines()[-2:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    accs = [m["accuracy"] for m in metrics]
    assert first == f"{accs} {accs[-1]}" and len(accs) == 2
    rows = [r for r in read_rows(run_dir / "ledger.sqlite")
            if r["side"] == "agent" and r["direction"] == "up" and r["event"] in ("sent", "received", "rejected")]
    assert second == f"{sum(r['mqtt_header_bytes'] + r['topic_bytes'] + r['payload_bytes'] for r in rows)} bytes " \
                     "uploaded by the devices"


def test_a_server_and_its_agents_from_python(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """Also: the simulation-only ``[agents]`` settings of a shared configuration file are said to
    be unused, in the log and in summary.json's ``ignored_settings``."""
    import fedfleet

    cfg = fedfleet.load_config({"run": {"name": "py", "rounds": 2, "seed": 1},
                                "data": {"dataset": "digits", "partition": "iid", "clients": 2},
                                "server": {"quorum": 2, "round_deadline_s": 60.0}, "broker": {"kind": "amqtt"},
                                "agents": {"torch_threads": 1, "profile": "rpi4"}})
    agents: list = []
    threads: list[threading.Thread] = []

    def start_agents(federation: str, url: str) -> None:
        for i in range(2):
            t = threading.Thread(target=lambda i=i: agents.append(fedfleet.run_agent(
                cfg, broker_url=url, federation=federation, client_id=f"py-{i}", shard=i,
                out=tmp_path / f"py-{i}", idle_timeout_s=120)), daemon=True)
            t.start()
            threads.append(t)

    with caplog.at_level("WARNING", logger="broker_server.server_main"):
        history = fedfleet.run_server(cfg, run_dir=tmp_path / "run", on_start=start_agents)
    for t in threads:
        t.join(60)
    said = [r.getMessage() for r in caplog.records if r.name == "broker_server.server_main"]
    assert any('[agents] profile = "rpi4", torch_threads = 1: simulation settings (fedfleet simulate); fedfleet '
               "server does not use them" in m for m in said), said
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["ignored_settings"] == ['[agents] profile = "rpi4"', "[agents] torch_threads = 1"]
    assert history.metric("clients_reported") == [2, 2]
    assert sorted((a.client_id, a.rounds_trained, a.finished) for a in agents) == [("py-0", 2, True),
                                                                                  ("py-1", 2, True)]
    server_rows = [r for r in read_rows(tmp_path / "run" / "ledger.sqlite")
                   if r["side"] == "server" and r["event"] in ("sent", "received", "rejected")]
    assert history.ledger["server"]["all"]["wire_bytes"] == sum(
        r["mqtt_header_bytes"] + r["topic_bytes"] + r["payload_bytes"] for r in server_rows)
    assert history.ledger["device"]["all"]["messages"] == 0  # the agents keep their own ledgers
    for a in agents:
        own = [r for r in read_rows(a.ledger_dir / "ledger.sqlite") if r["direction"] == "up"
               and r["event"] in ("sent", "received", "rejected")]
        assert a.ledger["up"]["wire_bytes"] == sum(r["mqtt_header_bytes"] + r["topic_bytes"] + r["payload_bytes"]
                                                   for r in own)


def test_the_public_names_and_versions() -> None:
    import fedfleet

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert fedfleet.__version__ == version and fedfleet.API_VERSION == 1
    for name in fedfleet.__all__:
        assert getattr(fedfleet, name) is not None, name
    assert fedfleet.Strategy.__module__ == "broker_server.strategies._base"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        fedfleet.Nope  # noqa: B018
