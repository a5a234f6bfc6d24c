"""A real heterogeneous fleet over Mosquitto: one ``fedfleet server`` process running FedOCP and
three ``fedfleet-agent`` processes, each with another architecture (lightcnn, resnet8,
inception_small: the printed command's ``MODEL`` filled in by shard index), on scikit-learn's
digits; every round completes with three updates, and each device's own model beats chance by a
wide margin. (About 30 s on an idle 2-core machine; 100 s measured under a load average of 8.)"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.brokers import require_mosquitto

from broker_server.embedded_broker import EmbeddedBroker

pytestmark = [pytest.mark.slow, pytest.mark.mosquitto]

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "FEDFLEET_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
ARCHS = ["lightcnn", "resnet8", "inception_small"]

TOML = """\
[run]
name = "hetero-fedocp"
seed = 0
rounds = 2
out = "{out}"

[data]
dataset = "digits"
partition = "iid"
train_samples = 600
clients = 3

[train]
algorithm = "fedocp"
local_epochs = 2
batch_size = 16
lr = 0.05
momentum = 0.5

[model]
name = "lightcnn"
feature_dim = 64
group = ["lightcnn", "resnet8", "inception_small"]

[algorithm]
server_epochs = 5

[server]
quorum = 3
round_deadline_s = 900.0
join_timeout_s = 300.0
client_eval = true
"""


def test_three_architectures_as_processes_over_mosquitto(tmp_path: Path) -> None:
    require_mosquitto()
    # one torch thread per agent (three agents and a server share the machine): a profile like x86-cpu
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    text = (REPO / "firmware_profiles" / "x86-cpu.toml").read_text(encoding="utf-8")
    text = text.replace('name = "x86-cpu"', 'name = "x86-cpu-1t"').replace("torch_threads = 8", "torch_threads = 1")
    (profiles / "x86-cpu-1t.toml").write_text(text, encoding="utf-8")
    env = {**ENV, "FEDFLEET_PROFILES": str(profiles)}
    config = tmp_path / "fedocp.toml"
    config.write_text(TOML.format(out=tmp_path / "runs"), encoding="utf-8")
    run_dir = tmp_path / "run"
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "broker") as broker:
        logs = {"server": tmp_path / "server.log"}
        with open(logs["server"], "wb") as fh:
            server = subprocess.Popen([sys.executable, "-m", "broker_server.cli", "server", "--config", str(config),
                                       "--broker", broker.url, "--out", str(run_dir)], cwd=tmp_path, stdout=fh,
                                      stderr=subprocess.STDOUT, env=env)
        procs = {"server": server}
        try:
            deadline, words = time.monotonic() + 120, None
            while time.monotonic() < deadline and words is None:
                m = re.search(r"^  (fedfleet-agent .*)$", logs["server"].read_text(errors="replace"), re.M)
                words = shlex.split(m.group(1)) if m else None
                if server.poll() is not None:
                    break
                time.sleep(0.2)
            assert words is not None, logs["server"].read_text(errors="replace")
            assert "MODEL" in words  # a model group: the operator fills in each device's architecture
            for i, arch in enumerate(ARCHS):
                cid = f"dev-{i}"
                argv = [w.replace("DEVICE_ID", cid).replace("MODEL", arch) for w in words[1:]]
                argv = [f"{i}/{w.split('/')[1]}" if w.startswith("i/") else w for w in argv]
                logs[cid] = tmp_path / f"{cid}.log"
                with open(logs[cid], "wb") as fh:
                    procs[cid] = subprocess.Popen([sys.executable, "-m", "edge_agent.cli", *argv, "--out",
                                                   str(tmp_path / cid), "--idle-timeout-s", "900", "--profile",
                                                   "x86-cpu-1t"], cwd=tmp_path, stdout=fh,
                                                  stderr=subprocess.STDOUT, env=env)
            codes = {}
            end = time.monotonic() + 270  # under pytest's 300 s; ~30 s on an idle machine
            for name, p in procs.items():
                try:
                    codes[name] = p.wait(timeout=max(1.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    text = "\n".join(f"--- {n}\n{logs[n].read_text(errors='replace')[-2000:]}" for n in procs)
                    raise AssertionError(f"{name} did not finish:\n{text}") from None
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
    assert codes == {name: 0 for name in procs}, {n: logs[n].read_text(errors="replace")[-2000:] for n in procs}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [m["clients_reported"] for m in metrics] == [3, 3]
    last = metrics[-1]
    # every device's own accuracy (its own head on the 359-image digits test split) is at least the
    # worst one's: measured mean 0.66, worst 0.37 (200 digits per device, 2 rounds × 2 epochs). Chance
    # is 0.10 with a standard error of √(0.1·0.9/359) = 0.016, so 0.25 is 9 standard errors above it.
    assert last["client_accuracy_worst"] > 0.25, last
    assert last["client_accuracy_mean"] > 0.5, last
