"""A federation on a machine whose onnxruntime is broken completes on torch alone, and says so
: ``fedfleet simulate`` of examples/quickstart.toml (sklearn digits), 2 rounds, with a
fake ``onnxruntime`` package first on ``PYTHONPATH`` whose import raises or kills the interpreter.
Also: ``simulate`` exits non-zero when agents failed."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import broker_server.cli as cli
import broker_server.simulate as simulate_mod
from broker_server import config as config_mod
from broker_server.embedded_broker import EmbeddedBroker
from broker_server.server_main import agent_command

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

SHIM = {  # the fake package's __init__.py, and the start of the reason the run must report
    "ImportError": ('raise ImportError("simulated: DLL load failed")', "ImportError: simulated: DLL load failed"),
    "OSError": ('raise OSError("simulated: cannot open libonnxruntime.so.1")',
                "OSError: simulated: cannot open libonnxruntime.so.1"),
    "RuntimeError": ('raise RuntimeError("simulated: ABI mismatch")', "RuntimeError: simulated: ABI mismatch"),
    "abort": ("import os\nos.abort()", "import killed the probe process (SIGABRT)"),
}


def _simulate(tmp_path: Path, mode: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    shim = tmp_path / "shim" / "onnxruntime"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(SHIM[mode][0] + "\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim.parent), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "broker_server.cli", "simulate", *extra, "--rounds", "2",
                           "--out", str(out), "-q"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return proc, out


# every failure kind is probed in tests/edge_agent/test_optional_runtime_probe.py; a whole run is
# repeated for the two ways the probe ends (an exception it reports, a killed child process)
@pytest.mark.parametrize("mode", ["RuntimeError", "abort"])
def test_quickstart_completes_without_onnxruntime(tmp_path: Path, mode: str) -> None:
    proc, out = _simulate(tmp_path, mode, "--config", "examples/quickstart.toml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_completed"] == 2
    assert summary["agent_errors"] == []
    ort = summary["optional_runtimes"]["onnxruntime"]
    assert ort["available"] is False and ort["reason"].startswith(SHIM[mode][1]), ort
    assert summary["optional_runtimes"]["onnx"]["available"] is True
    assert summary["onnx_error"] == f"onnxruntime unavailable: {ort['reason']}"  # the server's export said why
    assert "optional runtime onnxruntime unavailable" in proc.stderr  # the log warning
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [1, 2]
    assert all(m["accuracy"] is not None and 0.0 <= m["accuracy"] <= 1.0 for m in metrics)


def test_fedmcp_agents_complete_on_torch_when_onnxruntime_aborts(tmp_path: Path) -> None:
    cfg = tmp_path / "fedmcp.toml"
    cfg.write_text((ROOT / "examples" / "quickstart.toml").read_text().replace(
        'algorithm = "fedavg"', 'algorithm = "fedmcp"') + "\n[algorithm]\nproxy_size = 100\n", encoding="utf-8")
    proc, out = _simulate(tmp_path, "abort", "--config", str(cfg), "--clients", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and summary["agent_errors"] == []
    assert summary["optional_runtimes"]["onnxruntime"]["reason"] == SHIM["abort"][1]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(m["round"], m["clients_reported"], m["skipped"]) for m in metrics] == [(1, 2, False), (2, 2, False)]
    assert all(0.0 <= m["accuracy"] <= 1.0 for m in metrics)  # not NaN: the devices' models were evaluated
    assert "FedMCP++ soft predictions through torch: ONNX Runtime unavailable (onnxruntime unavailable: " \
           "import killed the probe process (SIGABRT))" in proc.stderr


def test_simulate_exits_nonzero_when_agents_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    import protocol.lifecycle

    monkeypatch.setattr(protocol.lifecycle, "install_signal_handlers", lambda *a: False)  # leave pytest's alone
    real = simulate_mod.simulate

    def break_agent_0(i, agent) -> None:
        if i == 0:
            def fail():
                raise RuntimeError("simulated device failure")
            agent.run = fail

    monkeypatch.setattr(simulate_mod, "simulate", lambda cfg, **kw: real(cfg, **kw, agent_hook=break_agent_0))
    cfg = tmp_path / "quick.toml"  # the two healthy agents start round 1 after 3 s instead of 60
    cfg.write_text((ROOT / "examples" / "quickstart.toml").read_text().replace(
        "round_deadline_s = 60.0", "round_deadline_s = 60.0\njoin_timeout_s = 3.0"), encoding="utf-8")
    rc = cli.main(["simulate", "--config", str(cfg), "--rounds", "1", "--clients", "3",
                   "--out", str(tmp_path / "run"), "-q"])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_FAILED
    assert "1 agent(s) failed: RuntimeError('simulated device failure')" in err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rounds_completed"] == 1  # the other two made the quorum of 2
    assert summary["agent_errors"] == ["RuntimeError('simulated device failure')"]


def test_real_server_and_agents_finish_when_onnxruntime_aborts(tmp_path: Path) -> None:
    """``fedfleet server`` + two ``fedfleet-agent`` processes: the server used to exit 1 without
    summary.json after the federation, the agents to crash in device detection."""
    shim = tmp_path / "shim" / "onnxruntime"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(SHIM["abort"][0] + "\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim.parent), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cfg_path = tmp_path / "quick.toml"
    # round 1 starts once both agents joined; the join window is wide for a loaded machine, where an agent
    # process took over 60 s (the default window) to import torch and connect, and the server then gave up
    cfg_path.write_text((ROOT / "examples" / "quickstart.toml").read_text().replace("clients = 4", "clients = 2")
                        .replace("round_deadline_s = 60.0", "round_deadline_s = 60.0\njoin_timeout_s = 300.0"),
                        encoding="utf-8")
    cfg = config_mod.load(cfg_path)
    run = tmp_path / "fed"
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        server = subprocess.Popen([sys.executable, "-m", "broker_server.cli", "server", "--config", str(cfg_path),
                                   "--rounds", "2", "--broker", broker.url, "--out", str(run)],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        words = shlex.split(agent_command(cfg, broker.url, "fed"))[1:]
        agents = [subprocess.Popen(
            [sys.executable, "-m", "edge_agent.cli",
             *[w.replace("DEVICE_ID", f"client-{i:03d}").replace("i/2", f"{i}/2") for w in words],
             "--out", str(tmp_path / f"agent-{i}")],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
        try:
            server_out, _ = server.communicate(timeout=600)
            agent_outs = [a.communicate(timeout=120)[0] for a in agents]
        finally:
            for p in (server, *agents):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert server.returncode == 0, server_out[-3000:]
    assert [a.returncode for a in agents] == [0, 0], agent_outs
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds_completed"] == 2
    assert summary["optional_runtimes"]["onnxruntime"]["reason"] == SHIM["abort"][1]
    assert summary["onnx_error"] == f"onnxruntime unavailable: {SHIM['abort'][1]}"
    for out in agent_outs:  # the reason the device plan fell back, as its join carries it
        assert f"fallback: onnxruntime cannot be used ({SHIM['abort'][1]})" in out

