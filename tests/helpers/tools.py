"""Loading a script of ``tools/`` (not a package) as a module, for tests of its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` executed as a fresh module named ``name`` (put in ``sys.modules``
    under that name, replacing an earlier load).

    Raises:
        FileNotFoundError: no such script under ``tools/``.
    """
    path = ROOT / "tools" / f"{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"no tool script {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # a dataclass of the script looks its module up there
    spec.loader.exec_module(mod)
    return mod
