"""Shared by the interop tests: the Node.js decoder (tests/interop/decode.js) as a fixture.

It skips with a reason where node or tests/interop/node_modules is missing (``npm ci`` in
tests/interop installs it), except under CI=true, where a missing decoder is a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def node_decoder() -> Callable[..., subprocess.CompletedProcess]:
    """``run(*args)`` runs ``node tests/interop/decode.js *args`` (300 s at most) and returns the
    completed process (text stdout/stderr)."""
    node = shutil.which("node")
    why = None
    if node is None:
        why = "node is not installed"
    elif not all((HERE / "node_modules" / pkg).is_dir() for pkg in ("@msgpack/msgpack", "fzstd")):
        why = "tests/interop/node_modules is missing (run npm ci in tests/interop)"
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: the interop decoder must run, but {why}")
        pytest.skip(reason=why)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([node, str(HERE / "decode.js"), *args], capture_output=True, text=True, timeout=300)

    return run
