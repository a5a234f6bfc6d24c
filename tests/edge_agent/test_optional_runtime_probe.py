"""A broken onnxruntime (import raising ImportError, OSError, RuntimeError, or killing the
interpreter) is found by the child-process probe and cannot take the probing process down:
device detection, the runtime plan's fallbacks, ``edge_agent.onnx_runtime`` and FedMCP++'s soft
predictions all carry on with torch.

Each case runs in a fresh Python process whose ``PYTHONPATH`` starts with a shim folder holding a
fake ``onnxruntime`` package, so the test process itself never imports the broken package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edge_agent.optional_runtime import OPTIONAL_RUNTIMES, RuntimeStatus, probe

ROOT = Path(__file__).resolve().parents[2]

#: What the fake package's __init__.py does, and the reason the probe must give for it.
BROKEN = {
    "ImportError": ('raise ImportError("simulated: DLL load failed")', "ImportError: simulated: DLL load failed"),
    "OSError": ('raise OSError("simulated: libonnxruntime.so.1: cannot open shared object file")',
                "OSError: simulated: libonnxruntime.so.1: cannot open shared object file"),
    "RuntimeError": ('raise RuntimeError("simulated: ABI version mismatch")',
                     "RuntimeError: simulated: ABI version mismatch"),
    "abort": ("import os\nos.abort()", "import killed the probe process (SIGABRT)"),
    "segfault": ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)",
                 "import killed the probe process (SIGSEGV)"),
}


def write_shim(folder: Path, mode: str) -> Path:
    """A folder with a fake ``onnxruntime`` package whose import does ``BROKEN[mode]``."""
    pkg = folder / "onnxruntime"
    pkg.mkdir(parents=True, exist_ok=True)
    body = BROKEN[mode][0] if mode in BROKEN else "import time\ntime.sleep(600)"
    (pkg / "__init__.py").write_text(body + "\n", encoding="utf-8")
    return folder


def run_python(code: str, shim: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("FEDFLEET_DISABLE_RUNTIMES", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


_PROBE_AND_CARRY_ON = """
    import json, logging
    logging.basicConfig(level=logging.WARNING)
    import numpy as np, torch
    from edge_agent.device import detect
    from edge_agent.optional_runtime import probe
    from edge_agent.runtime import agent_runtime

    out = {"ort": probe("onnxruntime").as_dict(), "onnx": probe("onnx").as_dict()}
    info = detect()
    out["providers"] = list(info.onnx_providers_available)
    out["fallbacks"] = agent_runtime("x86-cpu", info=info).join_info["fallbacks"]
    try:
        import edge_agent.onnx_runtime
        out["module"] = "imported"
    except ImportError as exc:
        out["module"] = f"ImportError: {exc}"
    # FedMCP++'s soft predictions: ONNX Runtime first, torch when it is unavailable
    from edge_agent.algorithms.fedmcp import FedMCPClient
    from edge_agent.models import build_model
    torch.manual_seed(0)
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=3)
    x = np.random.default_rng(0).standard_normal((6, 1, 8, 8)).astype(np.float32)
    y = np.array([0, 1, 2, 0, 1, 2], dtype=np.int64)
    client = FedMCPClient(proxy_x=x, proxy_y=y)
    soft, protos, backend = client.proxy_outputs(model, 1.0, use_onnx=True)
    model.eval()
    with torch.no_grad():
        expected = torch.softmax(model.head(model.features(torch.from_numpy(x))).double(), dim=1).float().numpy()
    out["backend"] = backend
    out["soft_matches_torch"] = bool(np.allclose(soft, expected, atol=1e-6))
    print("RESULT " + json.dumps(out))
"""


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("mode", sorted(BROKEN))
def test_broken_onnxruntime_is_reported_and_torch_carries_on(tmp_path: Path, mode: str) -> None:
    res = _result(run_python(_PROBE_AND_CARRY_ON, write_shim(tmp_path / "shim", mode)))
    reason = BROKEN[mode][1]
    assert res["ort"]["available"] is False
    assert res["ort"]["reason"].startswith(reason), res["ort"]["reason"]
    assert res["onnx"]["available"] is True  # probed (again, in a fresh child, after a crash) on its own
    assert res["providers"] == []
    assert f"onnxruntime cannot be used ({reason}" in res["fallbacks"]  # what the join carries
    assert res["module"] == f"ImportError: onnxruntime unavailable: {res['ort']['reason']}"
    assert res["backend"] == "torch"
    assert res["soft_matches_torch"] is True


def test_an_import_that_hangs_is_cut_off_by_the_timeout(tmp_path: Path) -> None:
    """The test waits out the whole timeout, so it is 2 s (the reason is the same whether or not
    the child got as far as the import before it was killed)."""
    res = run_python("""
        import json
        from edge_agent.optional_runtime import probe
        print("RESULT " + json.dumps(probe("onnxruntime", timeout_s=2).as_dict()))
    """, write_shim(tmp_path / "shim", "hang"))
    out = _result(res)
    assert out["available"] is False
    assert out["reason"].startswith("import did not finish within 2 s")


def test_the_probe_runs_once_per_process(tmp_path: Path) -> None:
    """Many callers (threads of a simulated fleet, the server) share one probe: one child in all."""
    res = run_python("""
        import json, subprocess, threading
        from edge_agent import optional_runtime as o
        runs = []
        real = subprocess.run
        def counting(*a, **k):
            runs.append(a[0][-len(o.OPTIONAL_RUNTIMES):])
            return real(*a, **k)
        subprocess.run = counting
        threads = [threading.Thread(target=o.probe, args=("onnxruntime",)) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        o.probe("onnx"); o.report(); o.require("onnx")
        print("RESULT " + json.dumps({"runs": runs, "ort": o.probe("onnxruntime").available}))
    """, write_shim(tmp_path / "shim", "RuntimeError"))
    out = _result(res)
    assert out == {"runs": [list(OPTIONAL_RUNTIMES)], "ort": False}


def test_disabled_by_environment_without_probing(monkeypatch: pytest.MonkeyPatch) -> None:
    from edge_agent import optional_runtime as o

    monkeypatch.setenv(o.DISABLE_ENV, "onnx")
    monkeypatch.setattr(o, "_cache", {"onnxruntime": RuntimeStatus("onnxruntime", True)})  # no child needed
    monkeypatch.delitem(sys.modules, "onnx", raising=False)
    st = probe("onnx")
    assert (st.available, st.reason, st.probed_in) == (False, f"disabled by {o.DISABLE_ENV}", "env")
    with pytest.raises(ImportError, match=f"onnx unavailable: disabled by {o.DISABLE_ENV}"):
        o.require("onnx")


def test_an_imported_module_answers_without_a_child(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    fake = types.ModuleType("onnxruntime")
    fake.__version__ = "9.9"  # type: ignore[attr-defined]
    fake.get_available_providers = lambda: ["CPUExecutionProvider"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "onnxruntime", fake)
    st = probe("onnxruntime")
    assert st == RuntimeStatus("onnxruntime", True, "9.9", "", ("CPUExecutionProvider",), "process")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    assert probe("onnxruntime").available is False


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="not an optional runtime"):
        probe("torch")
    with pytest.raises(ValueError, match="timeout_s"):
        probe("onnx", timeout_s=0)


_WORKING = 'def get_available_providers():\n    return ["CPUExecutionProvider"]\n__version__ = "9.9"\n'


@pytest.mark.parametrize("noise", [
    'import sys\nsys.stdout.write("onnxruntime banner without a newline")',
    'print("FEDFLEET-PROBE not json")',
    'print("FEDFLEET-PROBE 42")',
    'import sys, io\nsys.stdout = io.StringIO()',
])
def test_a_working_runtime_that_prints_at_import_is_found_available(tmp_path: Path, noise: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """What a runtime prints on stdout at import (a banner with no newline, text imitating the
    probe's marker, a replaced ``sys.stdout``) neither hides its answer nor breaks the probe."""
    from edge_agent.optional_runtime import _run_child

    pkg = tmp_path / "onnxruntime"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(noise + "\n" + _WORKING, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))  # seen by the child only: this process never imports it
    got = _run_child(["onnxruntime"], 120.0)["onnxruntime"]
    assert (got.available, got.version, got.providers) == (True, "9.9", ("CPUExecutionProvider",)), got.reason
