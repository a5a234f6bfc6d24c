"""Portable CPU numerics for the reproduction grids: the same cell gives the same bits on any
x86-64 machine with AVX2, Intel or AMD, AVX-512 or not.

A grid of hundreds of cells is made over several sessions, on whatever machine each one gets, and
its records must re-run to the committed numbers. Left alone, PyTorch's CPU kernels are chosen
by the machine: ATen's own kernels by the widest vector instructions the CPU has (AVX-512 or
AVX2), oneDNN's convolutions likewise, and MKL's matrix products by the CPU's vendor and
instructions. Their sums are ordered differently, so the same training gives other float32 bits,
and 15 rounds of SGD turn a last-bit difference into a different accuracy (measured: the CIFAR-10
FedAvg Dir(0.1) cell of the FedPGP grid, seed 0, ended at 27.59 % on the machine that recorded it
and at 27.52 % here, with the same code, the same messages and the same bytes).

Settings read by the libraries when they are loaded pin the kernels (:data:`PORTABLE_ENV`):

* ``ATEN_CPU_CAPABILITY=avx2``: ATen's vectorised kernels use their AVX2 build even where the CPU
  has AVX-512;
* ``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN's just-in-time kernels (convolutions) are AVX2 ones;
* ``MKL_CBWR=COMPATIBLE``: MKL's conditional numerical reproducibility in its vendor-neutral
  branch. Its ``AVX2`` branch is not enough: it gave other bits on an Intel CPU than on an AMD one;
* the server's numpy arithmetic (FedPAD's softmax weights, norms, FedOCP's QR): numpy dispatches
  ``exp``/``log``/``power`` to AVX-512 loops where it can (``NPY_DISABLE_CPU_FEATURES`` names
  those targets, read from numpy's own list) and its OpenBLAS picks kernels by CPU core
  (``OPENBLAS_CORETYPE=Haswell``, the AVX2 ones, on ``OPENBLAS_NUM_THREADS=1``). Measured on 13
  numpy operations: float64 ``exp`` and ``log``, a float32 dot product and ``power`` gave other
  bits under qemu's Haswell than natively until these were set; then all 13 were equal there and
  under qemu's EPYC-v3.

Measured with three SGD steps of the light CNN on CIFAR-shaped data (one torch thread, the
parameters' SHA-256 compared): with the three settings the bits were the same natively on an AMD
EPYC with AVX-512 and under ``qemu-x86_64 -cpu Haswell-v4`` (an Intel AVX2 CPU) and ``-cpu
EPYC-v3`` (an AMD one without AVX-512); without them, or with ``MKL_CBWR=AVX2`` instead, each of
the three gave other bits (``tests/broker_server/test_numerics.py`` runs the Intel comparison where
qemu is installed; ``tools/check_numerics.py`` compares a machine with the reference digest). The
cost, side by side in one run (``tools/bench_numerics.py``, ``benchmarks/numerics.md``): a local
round of the light CNN took a median 1.07× as long on MNIST-shaped inputs and 1.09× on
CIFAR-shaped ones over 7 alternating pairs, whose own ratios spanned 0.86–1.23 (beside a grid).

What this does not cover: a few of ATen's elementwise kernels (``sqrt``, so Adam's root, ``tan``,
``atan``, ``asin``, ``acos``), whose bits still differ between CPUs under these settings — the
project's code calls none of the trigonometric ones and takes :mod:`broker_server.portable_ops`'s
root and Adam (a test finds no other call); another torch (or MKL, oneDNN) build, another numpy or BLAS build, more
than one torch thread (a reduction split over threads is ordered by their count), an x86 CPU without AVX2 and FMA (ATen
obeys ``ATEN_CPU_CAPABILITY`` without checking the CPU, so the settings would make it run
instructions it lacks: they are not applied there), non-x86 machines (ARM has none of these
libraries' x86 kernels) and x86 machines other than Linux (the CPU's flags are read from
``/proc/cpuinfo``). :func:`fingerprint` records which case a record was made in, so a re-run
check can tell a machine difference from a code change.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from collections.abc import Mapping, MutableMapping

__all__ = ["PORTABLE_ENV", "fingerprint", "fingerprint_differences", "child_env", "pin_portable",
           "portable_record", "portable_supported"]


def _numpy_wide_targets() -> str:
    """numpy's run-time dispatch targets wider than AVX2 (``X86_V4``, ``AVX512_*`` …), space-separated:
    what ``NPY_DISABLE_CPU_FEATURES`` must name so that numpy runs its AVX2 loops. Read from this
    numpy's own dispatch list, since the names differ between numpy versions (a name it does not
    dispatch on is only warned about, and its target stays on; a baseline name makes the import
    fail); ``""`` when it has none (or is not numpy 1.22+). :func:`fingerprint` checks that the
    targets are off."""
    dispatch = getattr(_umath(), "__cpu_dispatch__", [])
    return " ".join(t for t in dispatch if t.startswith(("AVX512", "X86_V4")))


def _umath() -> object:
    """numpy's ``_multiarray_umath`` module (``numpy._core`` in numpy 2, ``numpy.core`` before),
    whose ``__cpu_dispatch__`` and ``__cpu_features__`` describe its run-time dispatch; None
    without one."""
    import importlib

    for name in ("numpy._core._multiarray_umath", "numpy.core._multiarray_umath"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


#: The settings that make the CPU kernels machine-independent (read when torch, numpy and
#: OpenBLAS are loaded): torch's three, numpy's wider-than-AVX2 loops off, OpenBLAS's Haswell
#: (AVX2) kernels on one thread.
PORTABLE_ENV: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_CBWR": "COMPATIBLE",
    "OPENBLAS_CORETYPE": "Haswell",
    "OPENBLAS_NUM_THREADS": "1",
}
_WIDE = _numpy_wide_targets()
if _WIDE:
    PORTABLE_ENV["NPY_DISABLE_CPU_FEATURES"] = _WIDE


def child_env(portable: bool, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment for a child process: ``base`` (default ``os.environ``) without any
    :data:`PORTABLE_ENV` setting, then with all of them when ``portable``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in PORTABLE_ENV}
    if portable:
        env.update(PORTABLE_ENV)
    return env

#: fingerprint keys a re-run must share with a record for bit-equal numbers to be expected
NUMERIC_KEYS = ("arch", "torch", "numpy", "cpu_capability", "blas", "numerics", "torch_threads")

log = logging.getLogger(__name__)


def _arch() -> str:
    """The machine's architecture, x86-64 spelt one way (``AMD64`` on Windows is ``x86_64``)."""
    m = platform.machine()
    return "x86_64" if m.lower() in ("x86_64", "amd64") else m


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (lower-case keys); ``{}`` without it."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    return fields


def portable_supported() -> bool:
    """Whether the portable settings can be applied here: Linux on x86-64 with a CPU whose
    ``/proc/cpuinfo`` flags include ``avx2`` and ``fma`` (what ATen's AVX2 build needs)."""
    if _arch() != "x86_64":
        return False
    flags = set(_cpuinfo().get("flags", "").split())
    return {"avx2", "fma"} <= flags


def pin_portable(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set :data:`PORTABLE_ENV` in ``environ`` (default ``os.environ``) for the processes started
    afterwards (the grid's workers are spawned, so they load torch with it). A value set before
    that differs is replaced, and the replacement logged. Nothing is set where
    :func:`portable_supported` is false (logged as a warning: the records made then re-run to the
    same bits only on their own kind of machine).

    Returns:
        The settings applied (empty where they cannot be).
    """
    env = os.environ if environ is None else environ
    if not portable_supported():
        log.warning("portable CPU numerics need Linux on an x86-64 CPU with AVX2 and FMA (this is %s, %s): the "
                    "kernels are left to the machine", _arch(), _cpu_model())
        return {}
    replaced = {k: env[k] for k, v in PORTABLE_ENV.items() if k in env and env[k] != v}
    if replaced:
        log.info("portable CPU numerics replace %s", ", ".join(f"{k}={v}" for k, v in replaced.items()))
    env.update(PORTABLE_ENV)
    return dict(PORTABLE_ENV)


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``, or on ARM its implementer and
    part numbers), else :func:`platform.processor`, else ``"unknown"``."""
    info = _cpuinfo()
    if info.get("model name"):
        return info["model name"]
    if info.get("cpu implementer"):
        return f"implementer {info['cpu implementer']} part {info.get('cpu part', '?')}"
    return platform.processor() or "unknown"


def _cpu_flags_digest() -> str:
    """8 hex digits of the SHA-256 of the CPU's sorted ``/proc/cpuinfo`` flags (``features`` on
    ARM): two CPUs of one model name but other instruction sets differ here; ``""`` without them."""
    info = _cpuinfo()
    flags = info.get("flags") or info.get("features") or ""
    return hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:8] if flags else ""


def fingerprint(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """What decides this process's CPU numerics, for a record (call it where the work ran: it
    imports torch).

    Returns:
        ``cpu`` (model name), ``cpu_flags`` (:func:`_cpu_flags_digest`), ``arch``, ``torch``
        (version with its build suffix: ``2.14.1+cu130``), ``numpy`` (version), ``blas`` (numpy's
        BLAS and the OpenBLAS kernel set in use, ``"scipy-openblas Haswell"``), ``cpu_capability`` (the ATen kernel
        build in use: ``"AVX2"``, ``"AVX512"``, ``"DEFAULT"`` …), ``torch_threads``, and
        ``numerics``: ``"portable"`` when every :data:`PORTABLE_ENV` setting is in ``environ``
        (default ``os.environ``), the CPU can run them (:func:`portable_supported`), ATen runs
        its AVX2 build, numpy's wider targets are off and OpenBLAS runs its Haswell kernels, else
        ``"native"``.
    """
    import numpy
    import torch

    env = os.environ if environ is None else environ
    capability = str(torch.backends.cpu.get_cpu_capability())
    core = _openblas_core()
    try:
        blas = str(numpy.__config__.CONFIG["Build Dependencies"]["blas"]["name"])
    except (AttributeError, KeyError, TypeError):  # numpy < 1.26 has no CONFIG
        blas = "unknown"
    # what the libraries did, not only what was asked: ATen's AVX2 build, numpy's wide loops off,
    # OpenBLAS on its Haswell kernels (a numpy on another BLAS is not portable by these settings)
    pinned = (all(env.get(k) == v for k, v in PORTABLE_ENV.items()) and capability == "AVX2"
              and portable_supported() and _numpy_features_off(PORTABLE_ENV.get("NPY_DISABLE_CPU_FEATURES", ""))
              and core.lower() == "haswell")
    return {"cpu": _cpu_model(), "cpu_flags": _cpu_flags_digest(), "arch": _arch(), "torch": torch.__version__,
            "numpy": numpy.__version__, "blas": f"{blas} {core}".strip(), "cpu_capability": capability,
            "torch_threads": torch.get_num_threads(), "numerics": "portable" if pinned else "native"}


def _numpy_features_off(names: str) -> bool:
    """Whether every dispatch target in ``names`` is off in this process's numpy (its CPU feature
    table after ``NPY_DISABLE_CPU_FEATURES``: a name numpy did not take leaves its target on)."""
    features = getattr(_umath(), "__cpu_features__", None)
    if features is None:
        return not names
    return not any(features.get(t, False) for t in names.split())


def _openblas_core() -> str:
    """The kernel set the OpenBLAS loaded in this process runs (``"Haswell"``, ``"SkylakeX"`` …),
    asked through its ``*openblas_get_corename*`` function; ``""`` when no OpenBLAS is loaded (a
    numpy on MKL or Accelerate) or it cannot be asked."""
    import ctypes

    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            libs = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line})
    except OSError:
        return ""
    for lib in libs:
        try:
            handle = ctypes.CDLL(lib)
        except OSError:
            continue
        for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
                     "openblas_get_corename"):
            fn = getattr(handle, name, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return (fn() or b"").decode(errors="replace").strip()
    return ""


def portable_record(machine: Mapping[str, object] | None) -> bool:
    """Whether a record's :func:`fingerprint` says it was made with every library pinned: portable
    numerics and a ``numpy`` entry (a fingerprint without one predates numpy's and OpenBLAS's
    settings, so its server arithmetic was the machine's own)."""
    return machine is not None and machine.get("numerics") == "portable" and "numpy" in machine


def fingerprint_differences(recorded: Mapping[str, object] | None, rerun: Mapping[str, object] | None) -> str:
    """Why two runs of one cell need not give the same bits, or ``""`` when nothing says so.

    Args:
        recorded, rerun: the two records' :func:`fingerprint` (``None``: the record has none).

    Returns:
        ``""`` when both are portable and share :data:`NUMERIC_KEYS`, or when both are native on
        a known CPU of the same model and flags with the same keys; otherwise a short phrase
        naming the difference (``"unknown: the record has no machine fingerprint"``, ``"native
        numerics on AMD EPYC (AVX512) vs native on Intel … (AVX2)"``, ``"torch 2.14.1+cu130 vs
        2.13.0+cpu"`` …).
    """
    if not recorded:
        return "unknown: the record has no machine fingerprint (made before records carried one)"
    if not rerun:
        return "unknown: the re-run has no machine fingerprint"
    for key in NUMERIC_KEYS:
        if key == "blas" and key not in recorded:
            continue  # recorded since the fingerprint checks OpenBLAS's kernels; the settings were the same
        if key != "numerics" and recorded.get(key) != rerun.get(key):
            if key == "numpy" and key not in recorded:
                return f"numpy not recorded (made before numpy was pinned) vs {rerun.get(key)}"
            return f"{key} {recorded.get(key)} vs {rerun.get(key)}"
    if recorded.get("numerics") != "portable" or rerun.get("numerics") != "portable":
        same_cpu = (recorded.get("cpu") == rerun.get("cpu") not in (None, "", "unknown")
                    and recorded.get("cpu_flags", "") == rerun.get("cpu_flags", ""))
        if recorded.get("numerics") == rerun.get("numerics") == "native" and same_cpu:
            return ""
        return (f"{recorded.get('numerics')} numerics on {recorded.get('cpu')} ({recorded.get('cpu_capability')}) "
                f"vs {rerun.get('numerics')} on {rerun.get('cpu')} ({rerun.get('cpu_capability')})")
    return ""
