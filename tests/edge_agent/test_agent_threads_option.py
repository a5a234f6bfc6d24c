"""``fedfleet-agent --torch-threads N`` overrides the firmware profile's ``torch_threads`` (several
agents on one machine: 1 each, as the README's "Threads" section measures), and a negative value is
refused before anything starts. Run in a fresh interpreter (the agent sets the process's torch
threads) up to connecting to a broker that is not there (exit 4, reached after the thread plan)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import socket, sys, torch
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
from edge_agent.cli import main
args = ["--broker", f"mqtt://127.0.0.1:{port}", "--federation", "f", "--client-id", "pi-1", "--dataset", "mnist",
        "--data-dir", sys.argv[1], "--shard", "0/2", "--profile", "x86-cpu", "--out", sys.argv[2],
        "--connect-attempts", "1"]
print("rc-negative", main([*args, "--torch-threads", "-1"]), flush=True)
print("rc", main([*args, "--torch-threads", "1"]), "torch", torch.get_num_threads(), flush=True)
"""


def test_torch_threads_option_overrides_the_profile_and_refuses_a_negative_value(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    (tmp_path / "data" / "mnist").mkdir(parents=True)
    for split, n in (("train", 40), ("test", 10)):
        np.savez_compressed(tmp_path / "data" / "mnist" / f"{split}.npz",
                            x=rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), y=np.arange(n) % 10)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "data"), str(tmp_path / "agent")], cwd=ROOT,
                          capture_output=True, text=True, timeout=240,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "4", "FEDFLEET_OFFLINE": "1"})
    out = proc.stdout + proc.stderr
    assert "rc-negative 2" in proc.stdout and "--torch-threads must be >= 0" in proc.stderr, out
    # the x86-cpu profile asks for one thread per core (torch_threads = 0); --torch-threads 1 rules
    plan = next(line for line in proc.stdout.splitlines() if line.startswith("thread plan:"))
    assert "1 training at once x 1 torch thread " in plan, plan
    assert "torch threads 1: configured" in plan, plan  # the flag's, not said to be the profile's
    assert proc.stdout.strip().splitlines()[-1] == "rc 4 torch 1", out
