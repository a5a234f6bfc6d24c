"""A minimal install (the core dependencies of pyproject.toml, no extra) runs ``fedfleet-agent``:
in a fresh interpreter where every optional package is made unimportable (as if not installed),
the agent starts (arguments, profile, data from npz files, model, algorithm, ledger folder) up to
connecting to the broker, and no optional package was imported on the way. The optional parts
are the extras of pyproject.toml; this test keeps their list and the core's in step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]

#: import names of the packages in pyproject's extras (onnx, broker, plots, tracking, digits, fpl)
OPTIONAL = ("onnx", "onnxruntime", "amqtt", "matplotlib", "tensorboard", "mlflow", "sklearn", "finch", "scipy")

SCRIPT = r"""
import importlib.abc, socket, sys
OPTIONAL = {optional!r}
tried = []

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in OPTIONAL:
            tried.append(name)
            raise ImportError(f"{{name}} is not installed (minimal install)")
        return None

sys.meta_path.insert(0, Blocker())
try:
    import sklearn  # noqa: F401
    raise SystemExit("the blocker does not block")
except ImportError:
    tried.clear()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
from edge_agent.cli import main
rc = main(["--broker", f"mqtt://127.0.0.1:{{port}}", "--federation", "f", "--client-id", "pi-1",
           "--dataset", "mnist", "--data-dir", {data!r}, "--shard", "0/2", "--profile", "rpi4",
           "--out", {out!r}, "--connect-attempts", "1"])
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set(OPTIONAL))
print("rc", rc, "tried", sorted(set(tried)), "loaded", loaded)
"""


def test_extras_hold_the_optional_packages_and_the_core_none() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(meta["dependencies"]).lower()
    for dist in ("onnx", "onnxruntime", "amqtt", "matplotlib", "tensorboard", "mlflow", "scikit-learn", "finch"):
        assert dist not in core, dist
    extras = meta["optional-dependencies"]
    named = {k: " ".join(v) for k, v in extras.items()}
    assert "onnxruntime" in named["onnx"] and "amqtt" in named["broker"] and "matplotlib" in named["plots"]
    assert "tensorboard" in named["tracking"] and "mlflow" in named["tracking"]
    assert "fedfleet[all]" in named["dev"]  # CI's pip install -e ".[dev]" covers every optional test


def test_fedfleet_agent_starts_without_any_optional_package(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    (tmp_path / "data" / "mnist").mkdir(parents=True)
    for split, n in (("train", 40), ("test", 10)):
        np.savez_compressed(tmp_path / "data" / "mnist" / f"{split}.npz",
                            x=rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), y=np.arange(n) % 10)
    script = SCRIPT.format(optional=OPTIONAL, data=str(tmp_path / "data"), out=str(tmp_path / "agent"))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "FEDFLEET_OFFLINE": "1"})
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    # exit 4: the broker is not there, reached only after the data (else 3), the model, the algorithm and
    # the profile (else 2) were set up; no optional package was even looked for
    assert last == "rc 4 tried [] loaded []", proc.stdout + proc.stderr
    assert "cannot reach the MQTT broker" in proc.stderr
