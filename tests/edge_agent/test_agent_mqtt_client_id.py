"""Every device connects to the broker under :func:`protocol.topics.mqtt_client_id`
(``{federation}:{client_id}``), read back from the CONNECT packet a relay in front of a real broker
sees, so one device id in two federations on one broker makes two MQTT clients; and ``server``,
the server's node id, is refused as a device id before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.federation import small_config

from broker_server.embedded_broker import EmbeddedBroker
from broker_server.errors import ConfigError
from protocol.topics import mqtt_client_id, node_of
from tools.counting_relay import CountingRelay

ROOT = Path(__file__).resolve().parents[2]


def _client_ids(relay: CountingRelay) -> list[str]:
    """The client ids of the relay's connections that sent a CONNECT (a connection may close
    before one: the transport's reachability check)."""
    return sorted(cid for n in range(16) if (cid := relay.client_id(n)))

# fedfleet-agent in a fresh interpreter (it sets the process's torch threads): joins a federation
# no server answers and gives up after --join-timeout-s (exit 5)
SCRIPT = r"""
import sys
from edge_agent.cli import main
port, fed, cid = sys.argv[3:6]
print("rc", main(["--broker", f"mqtt://127.0.0.1:{port}", "--federation", fed, "--client-id", cid,
                  "--dataset", "mnist", "--data-dir", sys.argv[1], "--shard", "0/2", "--profile", "x86-cpu",
                  "--out", sys.argv[2], "--connect-attempts", "1", "--join-timeout-s", "0.5"]), flush=True)
"""


def _agent(tmp_path: Path, port: int, federation: str, client_id: str) -> subprocess.CompletedProcess:
    data = tmp_path / "data"
    if not data.exists():
        rng = np.random.default_rng(0)
        (data / "mnist").mkdir(parents=True)
        for split, n in (("train", 40), ("test", 10)):
            np.savez_compressed(data / "mnist" / f"{split}.npz",
                                x=rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), y=np.arange(n) % 10)
    return subprocess.run([sys.executable, "-c", SCRIPT, str(data), str(tmp_path / f"agent-{federation}"), str(port),
                           federation, client_id], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "FEDFLEET_OFFLINE": "1"})


def test_the_mqtt_client_id_keeps_federation_and_device_apart() -> None:
    """Worked by hand: the ids joined by ``:``; a 62-character federation cut to 31 characters,
    ``.`` and the first 8 hex digits of its SHA-256; :func:`node_of` reads the node back."""
    import hashlib

    assert mqtt_client_id("trial-1", "pi-07") == "trial-1:pi-07"
    # the old ``-`` join made these two one client id
    assert mqtt_client_id("lab", "a-pi-07") != mqtt_client_id("lab-a", "pi-07")
    long_fed = "field-trial-" + "x" * 50
    digest = hashlib.sha256(long_fed.encode()).hexdigest()[:8]
    assert mqtt_client_id(long_fed, "server") == "field-trial-xxxxxxxxxxxxxxxxxxx." + digest + ":server"
    # two runs whose ids differ only after 40 characters (seeds 0 and 1 of one long run name)
    stem = "fedmcp-fashion-mnist-dirichlet-0.1-20261205-213000"
    assert mqtt_client_id(stem + "-s0", "client-000") != mqtt_client_id(stem + "-s1", "client-000")
    assert node_of("trial-1:pi-07") == "pi-07" and node_of(mqtt_client_id(long_fed, "server")) == "server"
    assert node_of("mosquitto_sub-123") is None and node_of(":pi-07") is None


def test_fedfleet_agent_connects_under_its_federation_s_client_id(tmp_path: Path) -> None:
    """Two fedfleet-agent processes with one --client-id in two federations: their CONNECTs carry
    ``trial-a:pi-07`` and ``trial-b:pi-07``."""
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        try:
            runs = [_agent(tmp_path, relay.port, fed, "pi-07") for fed in ("trial-a", "trial-b")]
            ids = _client_ids(relay)
        finally:
            relay.close()
    for proc in runs:
        assert proc.stdout.strip().splitlines()[-1] == "rc 5", proc.stdout + proc.stderr  # the join went unanswered
    assert ids == ["trial-a:pi-07", "trial-b:pi-07"]


def test_fedfleet_agent_refuses_the_server_s_id(tmp_path: Path) -> None:
    proc = _agent(tmp_path, 1, "trial-a", "server")
    assert proc.stdout.strip().splitlines()[-1] == "rc 2"
    assert "fedfleet-agent: client id 'server' is the server's: give the device another id" in proc.stderr


def test_run_agent_connects_under_its_federation_s_client_id(tmp_path: Path) -> None:
    import fedfleet
    from edge_agent.agent import AgentError

    with pytest.raises(ConfigError, match="run_agent: client id 'server' is the server's"):
        fedfleet.run_agent(small_config(), broker_url="mqtt://127.0.0.1:1", federation="trial-a", client_id="server",
                           shard=0, out=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()  # refused before anything was written
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        try:
            with pytest.raises(AgentError):  # no server: nothing is heard
                fedfleet.run_agent(small_config(), broker_url=f"mqtt://127.0.0.1:{relay.port}", federation="trial-a",
                                   client_id="py-0", shard=0, out=tmp_path / "py-0", idle_timeout_s=0.5)
            got = _client_ids(relay)
        finally:
            relay.close()
    assert got == ["trial-a:py-0"]
