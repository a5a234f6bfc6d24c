"""Portable CPU numerics (broker_server.numerics): the settings, the fingerprint, and what a
re-run check says about two fingerprints."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
from pathlib import Path

import pytest

from broker_server import numerics
from broker_server.experiments import numerics_line, pinned_numerics
from broker_server.numerics import PORTABLE_ENV, fingerprint_differences, pin_portable

ROOT = Path(__file__).resolve().parents[2]
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _check_tool():
    spec = importlib.util.spec_from_file_location("check_numerics", ROOT / "tools" / "check_numerics.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pin_portable_sets_the_three_settings_where_the_cpu_runs_them_and_nothing_elsewhere(monkeypatch,
                                                                                            caplog) -> None:
    """Applied on x86-64 with AVX2 and FMA, a different earlier value replaced (and logged); not
    on an x86 CPU without AVX2 (ATen would run instructions it lacks), nor on ARM."""
    avx2 = {"model name": "Some CPU", "flags": "sse2 avx fma avx2"}
    monkeypatch.setattr(numerics, "_cpuinfo", lambda: avx2)
    monkeypatch.setattr(numerics.platform, "machine", lambda: "x86_64")
    env: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx512", "OTHER": "1"}
    with caplog.at_level("INFO", logger="broker_server.numerics"):
        assert pin_portable(env) == PORTABLE_ENV
    assert env == {**PORTABLE_ENV, "OTHER": "1"} and env["ATEN_CPU_CAPABILITY"] == "avx2"
    pins = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE", "OPENBLAS_CORETYPE": "Haswell"}
    assert pins.items() <= env.items()
    assert "replace ATEN_CPU_CAPABILITY=avx512" in caplog.text
    monkeypatch.setattr(numerics.platform, "machine", lambda: "AMD64")  # Windows spells it so
    assert numerics._arch() == "x86_64"
    old: dict[str, str] = {}
    monkeypatch.setattr(numerics, "_cpuinfo", lambda: {"model name": "Old CPU", "flags": "sse2 avx"})
    assert pin_portable(old) == {} and old == {}
    arm: dict[str, str] = {}
    monkeypatch.setattr(numerics, "_cpuinfo", lambda: {"cpu implementer": "0x41", "cpu part": "0xd08",
                                                       "features": "fp asimd"})
    monkeypatch.setattr(numerics.platform, "machine", lambda: "aarch64")
    assert pin_portable(arm) == {} and arm == {}
    assert numerics._cpu_model() == "implementer 0x41 part 0xd08"


def test_pinned_numerics_puts_the_environment_back(monkeypatch) -> None:
    monkeypatch.setattr(numerics.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    with pinned_numerics("portable"):
        assert {k: os.environ.get(k) for k in PORTABLE_ENV} == PORTABLE_ENV
    assert os.environ.get("MKL_CBWR") == "AVX2"
    assert "ATEN_CPU_CAPABILITY" not in os.environ and "ONEDNN_MAX_CPU_ISA" not in os.environ
    with pinned_numerics("native"):
        assert os.environ.get("MKL_CBWR") == "AVX2" and "ATEN_CPU_CAPABILITY" not in os.environ


_PORTABLE = {"cpu": "AMD EPYC", "arch": "x86_64", "torch": "2.14.1", "numpy": "2.4.6", "cpu_capability": "AVX2",
             "torch_threads": 1, "numerics": "portable"}


def test_fingerprint_differences_by_case() -> None:
    intel = {**_PORTABLE, "cpu": "Intel Xeon"}
    assert fingerprint_differences(_PORTABLE, intel) == ""  # portable: the CPU model does not matter
    assert fingerprint_differences(None, _PORTABLE).startswith("unknown: the record has no machine fingerprint")
    assert fingerprint_differences(_PORTABLE, None) == "unknown: the re-run has no machine fingerprint"
    assert fingerprint_differences(_PORTABLE, {**_PORTABLE, "torch": "2.13.0"}) == "torch 2.14.1 vs 2.13.0"
    assert fingerprint_differences(_PORTABLE, {**_PORTABLE, "torch_threads": 2}) == "torch_threads 1 vs 2"
    blas = {**_PORTABLE, "blas": "scipy-openblas Haswell"}
    assert fingerprint_differences(_PORTABLE, blas) == ""  # a record from before the BLAS was recorded
    assert fingerprint_differences(blas, {**blas, "blas": "mkl"}) == "blas scipy-openblas Haswell vs mkl"
    before_numpy = {k: v for k, v in _PORTABLE.items() if k != "numpy"}
    assert fingerprint_differences(before_numpy, _PORTABLE) == (
        "numpy not recorded (made before numpy was pinned) vs 2.4.6")
    native = {**_PORTABLE, "cpu_capability": "AVX512", "numerics": "native"}
    assert fingerprint_differences(native, native) == ""  # native on the same CPU model: equal bits expected
    assert fingerprint_differences(native, _PORTABLE) == "cpu_capability AVX512 vs AVX2"
    native_avx2 = {**_PORTABLE, "numerics": "native"}
    assert fingerprint_differences(native_avx2, {**native_avx2, "cpu": "Intel Xeon"}) == (
        "native numerics on AMD EPYC (AVX2) vs native on Intel Xeon (AVX2)")
    flags = {**native_avx2, "cpu_flags": "0000aaaa"}  # one model name, other instruction sets
    assert fingerprint_differences(flags, {**flags, "cpu_flags": "1111bbbb"}) != ""
    unknown = {**native_avx2, "cpu": "unknown"}
    assert fingerprint_differences(unknown, unknown) != ""  # nothing says the two CPUs are alike
    assert fingerprint_differences(native_avx2, _PORTABLE) == (
        "native numerics on AMD EPYC (AVX2) vs portable on AMD EPYC (AVX2)")


def test_numerics_line_counts_records_by_machine() -> None:
    native = {**_PORTABLE, "cpu": "Intel Xeon", "cpu_capability": "AVX512", "numerics": "native"}
    before_numpy = {k: v for k, v in _PORTABLE.items() if k != "numpy"}
    results = {"a": {"machine": _PORTABLE}, "b": {"machine": _PORTABLE}, "c": {"machine": native}, "d": {},
               "e": {"error": "boom"}, "f": {"machine": before_numpy}}
    assert numerics_line(results) == (
        "2 of 5 records were made with portable CPU numerics (the same bits on any x86-64 AVX2 machine); the others "
        "re-run to the same bits only on the machine kind that made them: 1 native on Intel Xeon (AVX512), "
        "1 no machine fingerprint, 1 portable before numpy was pinned.")
    assert numerics_line({}) == ""


@pytest.fixture(scope="module")
def portable_here() -> dict:
    """:func:`check_numerics.measure` of a portable child on this CPU, once for the module's tests."""
    return _check_tool().measure(portable=True)


@pytest.mark.skipif(not numerics.portable_supported(), reason="portable numerics need Linux x86-64 with AVX2 and FMA")
def test_the_settings_reach_a_child_and_change_its_bits_only_through_the_kernels(portable_here: dict) -> None:
    """A child started with the settings runs ATen's AVX2 kernels and says "portable"; one with
    ATen's default build instead is "native". Two portable children give the same digest; the
    default-build child, whose sums are vectorised otherwise, another one."""
    tool = _check_tool()
    a, b = portable_here, tool.measure(portable=True)
    assert a["machine"]["cpu_capability"] == "AVX2" and a["machine"]["numerics"] == "portable"
    assert a["machine"]["torch_threads"] == 1 and a["machine"]["blas"].endswith("Haswell")
    assert a["digest"] == b["digest"]
    other = tool.measure(portable=False, extra_env={"ATEN_CPU_CAPABILITY": "default"})
    assert other["machine"]["cpu_capability"] == "DEFAULT" and other["machine"]["numerics"] == "native"
    assert other["digest"] != a["digest"]


QEMU = shutil.which("qemu-x86_64")


def _require_qemu() -> None:
    """Skip without ``qemu-x86_64`` (Debian package qemu-user); fail when CI == "true" (it is
    installed there, .ci/run)."""
    if QEMU:
        return
    reason = "qemu-x86_64 not found (apt-get install qemu-user)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; it is required when CI=true", pytrace=False)
    pytest.skip(reason=reason)


@pytest.mark.skipif(not numerics.portable_supported(), reason="qemu-x86_64 user mode on Linux x86-64 with AVX2")
@pytest.mark.timeout(900)
def test_portable_bits_are_the_same_on_an_emulated_intel_cpu(portable_here: dict) -> None:
    """The reference training under portable numerics gives the same digest on this CPU and on
    qemu's Intel Haswell-v4 model (AVX2, no AVX-512, GenuineIntel: MKL and oneDNN pick their code
    by vendor and instructions). That the digest is sensitive to the kernels is the test above;
    that qemu's CPU model took effect, the child's cpuid, which has no AVX-512."""
    _require_qemu()
    tool = _check_tool()
    here = portable_here
    haswell = tool.measure(portable=True, wrapper=[str(QEMU), "-cpu", "Haswell-v4"],
                           timeout_s=720)  # a hang guard: ≈ 90 s idle, 240 s was passed beside 5 busy processes
    assert not haswell["cpuid_avx512"]  # the emulated CPU model took effect (cpuid is qemu's)
    assert haswell["machine"]["numerics"] == "portable"
    assert here["digest"] == haswell["digest"]


def test_numpy_is_asked_to_drop_exactly_its_wider_than_avx2_targets() -> None:
    """``NPY_DISABLE_CPU_FEATURES`` names only targets this numpy dispatches on (numpy refuses to
    import with any other name) and every AVX-512 one, none at AVX2 level."""
    from numpy._core._multiarray_umath import __cpu_dispatch__ as dispatch

    named = PORTABLE_ENV.get("NPY_DISABLE_CPU_FEATURES", "").split()
    assert set(named) <= set(dispatch)
    assert set(named) == {t for t in dispatch if t.startswith("AVX512") or t == "X86_V4"}
    assert not {"X86_V3", "AVX2", "FMA3"} & set(named)
