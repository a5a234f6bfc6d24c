"""Optional native runtimes: probed once per process in a child process, never trusted blindly.

``onnxruntime`` and ``onnx`` are native extensions that fedfleet can do without (ONNX export and
ONNX Runtime inference fall back to torch). A broken install does not always fail politely: its
import may raise ``ImportError``, ``OSError`` (a shared library that does not load),
``RuntimeError`` (an ABI or CPU-feature check), or kill the interpreter outright (a segfault, an
``abort()`` in a static initialiser). So before anything in this process imports one of them,
:func:`probe` imports all of them in a *child* Python process (the same interpreter, environment
and ``sys.path``) with a timeout, one after the other, and caches the answer for the process:

- the child reports each runtime on its own line before it tries the next, so a runtime that kills
  the child is named by what it did (``killed by SIGABRT``), and the ones after it are probed again
  in a fresh child;
- a runtime that is already imported in this process (``sys.modules``) is answered from there
  without a child (``None`` there means "import refused", as Python treats it);
- ``FEDFLEET_DISABLE_RUNTIMES=onnxruntime,onnx`` marks runtimes unavailable without probing.

A runtime found unavailable is logged once (a warning with the reason); :func:`require` raises
``ImportError`` carrying the reason, so the callers' existing torch fallbacks apply (FedMCP++ soft
predictions, the server's ONNX export of the final model); :func:`report` is what the server and
``simulate`` write into ``summary.json`` (``optional_runtimes``), and device detection turns the
reason into a ``join`` fallback (:func:`edge_agent.device.detect`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: The optional runtimes, in probing order.
OPTIONAL_RUNTIMES: tuple[str, ...] = ("onnxruntime", "onnx")

#: Seconds the probe of all runtimes may take (an ``import onnxruntime`` on a Pi takes a few).
PROBE_TIMEOUT_S = 60.0

#: Environment variable: comma-separated runtimes to treat as unavailable without probing.
DISABLE_ENV = "FEDFLEET_DISABLE_RUNTIMES"

_MARK = "FEDFLEET-PROBE "

# The child: import each named module in order; one JSON line per module, flushed before the next.
_CHILD = r"""
import json, os, sys
sys.path[:] = json.loads(sys.argv[1])
# the answers go to a private copy of stdout, each on a line of its own: a runtime that prints
# at import (without a newline), or replaces / closes sys.stdout, cannot garble or swallow them
out = open(os.dup(1), "w", buffering=1)
def say(rec):
    out.write("\nFEDFLEET-PROBE " + json.dumps(rec) + "\n")
    out.flush()
for name in sys.argv[2:]:
    say({"name": name, "started": True})
    try:
        mod = __import__(name)
        rec = {"name": name, "ok": True, "version": str(getattr(mod, "__version__", ""))}
        if name == "onnxruntime":
            rec["providers"] = [str(p) for p in mod.get_available_providers()]
    except BaseException as exc:
        rec = {"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    say(rec)
"""


@dataclass(frozen=True, slots=True)
class RuntimeStatus:
    """What the probe found about one optional runtime.

    Attributes:
        name: the module name (``"onnxruntime"``).
        available: it imports (in a child process, and hence may be imported here).
        version: its ``__version__`` ("" when unavailable or unversioned).
        reason: why it is unavailable ("" when available), e.g. ``"OSError: libonnxruntime.so:
            cannot open shared object file"`` or ``"import killed the probe process (SIGABRT)"``.
        providers: ``onnxruntime.get_available_providers()`` (onnxruntime only; () otherwise).
        probed_in: ``"child"`` (a probe process), ``"process"`` (already imported here),
            ``"env"`` (disabled by :data:`DISABLE_ENV`).
    """

    name: str
    available: bool
    version: str = ""
    reason: str = ""
    providers: tuple[str, ...] = ()
    probed_in: str = "child"

    def as_dict(self) -> dict:
        """JSON-ready form (for ``summary.json``)."""
        d: dict = {"available": self.available, "version": self.version or None,
                   "reason": self.reason or None, "probed_in": self.probed_in}
        if self.name == "onnxruntime":
            d["providers"] = list(self.providers)
        return d


_lock = threading.Lock()
_cache: dict[str, RuntimeStatus] = {}


def _from_process(name: str) -> RuntimeStatus | None:
    """The answer for a runtime already in ``sys.modules`` (no child needed), else ``None``."""
    if name not in sys.modules:
        return None
    mod = sys.modules[name]
    if mod is None:
        return RuntimeStatus(name, False, reason=f"ModuleNotFoundError: import of {name} halted; None in sys.modules",
                             probed_in="process")
    providers: tuple[str, ...] = ()
    if name == "onnxruntime":
        try:
            providers = tuple(str(p) for p in mod.get_available_providers())
        except Exception as exc:  # a module object that is not a working onnxruntime
            return RuntimeStatus(name, False, reason=f"get_available_providers() failed: {type(exc).__name__}: "
                                                     f"{exc}", probed_in="process")
    return RuntimeStatus(name, True, version=str(getattr(mod, "__version__", "")), providers=providers,
                         probed_in="process")


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _record(line: str, names: list[str]) -> dict | None:
    """One answer line of the child as a dict, or ``None`` for any other line (the runtime's own
    output, even one that imitates the marker with no valid answer after it)."""
    if not line.startswith(_MARK):
        return None
    try:
        rec = json.loads(line[len(_MARK):])
    except ValueError:
        return None
    if not isinstance(rec, dict) or rec.get("name") not in names:
        return None
    if rec.get("started") is True or isinstance(rec.get("ok"), bool):
        return rec
    return None


def _run_child(names: list[str], timeout_s: float) -> dict[str, RuntimeStatus]:
    """Probe ``names`` in one child; the result holds the names it got to (at least the first)."""
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(sys.path), *names], capture_output=True,
                              text=True, timeout=timeout_s, env=os.environ.copy(), stdin=subprocess.DEVNULL,
                              check=False)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        ended = None if rc == 0 else (f"killed the probe process ({_signal_name(rc)})" if rc < 0
                                      else f"ended the probe process with exit status {rc}")
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        ended = f"did not finish within {timeout_s:g} s (probe process killed)"
    except OSError as exc:  # no way to start a child here: say so rather than risk this process
        return {n: RuntimeStatus(n, False, reason=f"could not start the probe process: {exc}") for n in names}
    found: dict[str, RuntimeStatus] = {}
    started: str | None = None
    for line in stdout.splitlines():
        rec = _record(line, names)
        if rec is None:
            continue
        if rec.get("started"):
            started = rec["name"]
            continue
        started = None
        found[rec["name"]] = (RuntimeStatus(rec["name"], True, version=rec.get("version", ""),
                                            providers=tuple(rec.get("providers", ())))
                              if rec["ok"] else RuntimeStatus(rec["name"], False, reason=str(rec.get("error", ""))))
    culprit = started if started is not None else next((n for n in names if n not in found), None)
    if culprit is not None and culprit not in found:
        tail = stderr.strip().splitlines()[-1:] if stderr.strip() else []
        why = f"import {ended or 'gave no answer'}" + (f"; last stderr line: {tail[0][:300]}" if tail else "")
        found[culprit] = RuntimeStatus(culprit, False, reason=why)
    return found


def probe(name: str, *, timeout_s: float = PROBE_TIMEOUT_S) -> RuntimeStatus:
    """Whether the optional runtime ``name`` can be imported, probed once per process (cached).

    The first call probes every runtime of :data:`OPTIONAL_RUNTIMES` not yet known (one child
    process in the usual case; see the module docstring) and logs a warning per unavailable one.

    Args:
        name: one of :data:`OPTIONAL_RUNTIMES`.
        timeout_s: seconds the probe process may take (all runtimes together); > 0.

    Returns:
        The :class:`RuntimeStatus` of ``name``.

    Raises:
        ValueError: ``name`` is not an optional runtime, or ``timeout_s`` <= 0.
    """
    if name not in OPTIONAL_RUNTIMES:
        raise ValueError(f"{name!r} is not an optional runtime (known: {', '.join(OPTIONAL_RUNTIMES)})")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r}: need a positive number of seconds")
    here = _from_process(name)  # tests and callers that imported it already: the live module answers
    if here is not None:
        return here
    with _lock:
        if name in _cache:
            return _cache[name]
        disabled = {s.strip() for s in os.environ.get(DISABLE_ENV, "").split(",") if s.strip()}
        todo = []
        for n in OPTIONAL_RUNTIMES:
            if n in _cache or _from_process(n) is not None:
                continue
            if n in disabled:
                _cache[n] = RuntimeStatus(n, False, reason=f"disabled by {DISABLE_ENV}", probed_in="env")
            else:
                todo.append(n)
        while todo:  # each child answers at least its first name, so this ends
            got = _run_child(todo, timeout_s)
            _cache.update(got)
            todo = [n for n in todo if n not in got]
        for n, st in _cache.items():
            if not st.available and n not in _warned:
                _warned.add(n)
                log.warning("optional runtime %s unavailable (%s): fedfleet carries on without it (torch)",
                            n, st.reason)
        return _cache.get(name) or _from_process(name) or RuntimeStatus(name, False, reason="not probed")


_warned: set[str] = set()


def unavailable(*names: str) -> str | None:
    """The reason the first unavailable runtime of ``names`` cannot be used, ``None`` if all can.

    Raises:
        ValueError: a name that is not an optional runtime.
    """
    for n in names:
        st = probe(n)
        if not st.available:
            return f"{n} unavailable: {st.reason}"
    return None


def require(*names: str) -> None:
    """Raise ``ImportError`` (with the probe's reason) unless every runtime of ``names`` can be
    imported; call it before ``import onnxruntime`` so that a broken install cannot take this
    process down with it.

    Raises:
        ImportError: a runtime is unavailable; the message names it and says why.
        ValueError: a name that is not an optional runtime.
    """
    why = unavailable(*names)
    if why is not None:
        raise ImportError(why)


def report() -> dict[str, dict]:
    """Every optional runtime (probed now if not yet) as ``{name: RuntimeStatus.as_dict()}``, for
    ``summary.json``."""
    return {n: probe(n).as_dict() for n in OPTIONAL_RUNTIMES}


def clear_cache() -> None:
    """Forget the probes of this process (tests)."""
    with _lock:
        _cache.clear()
        _warned.clear()
