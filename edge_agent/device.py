"""What the hardware really offers, and how a firmware profile is fitted to it (DESIGN.md §6).

Two steps, kept apart so the decision is testable without the hardware:

1. :func:`detect` reads the machine: the device-tree model (Raspberry Pi, Jetson), the Jetson L4T
   release file, CPU cores, RAM, CUDA (through torch) and the ONNX Runtime execution providers.
   Every file is read under a ``root`` directory, so tests run it on a fake root in ``tmp_path``.
2. :func:`plan_runtime` is pure: a profile and a :class:`DeviceInfo` in, a :class:`RuntimePlan`
   out. Whatever the profile asks for and the device cannot give is downgraded, and every
   downgrade is recorded as a human-readable reason in :attr:`RuntimePlan.fallbacks` — nothing
   is changed silently. :func:`apply` then sets torch's thread count and logs each reason at
   WARNING; :meth:`RuntimePlan.as_join_info` gives the flat scalars announced in ``join.info``.

Usage (``profile`` from ``edge_agent.profiles``)::

    plan = plan_runtime(profile, detect())
    apply(plan)
    algorithm = get_client_algorithm("fedavg", precision=plan.precision)
    # EdgeAgent(..., device=plan.device, info={**data_info, **plan.as_join_info()})
"""

from __future__ import annotations

import logging
import os
import platform as _pyplatform
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

__all__ = ["CPU_PROVIDER", "DeviceInfo", "FP16_MIN_CAPABILITY", "GPU_PROVIDERS", "MAX_TRAIN_SLOTS", "ProfileLike",
           "RuntimePlan", "ThreadPlan", "apply", "apply_threads", "cgroup_cpu_quota", "detect", "plan_runtime",
           "plan_threads", "usable_cores"]

log = logging.getLogger(__name__)

#: ONNX Runtime's CPU execution provider: always last in a plan, the catch-all for every node.
CPU_PROVIDER = "CPUExecutionProvider"

#: ONNX Runtime execution providers that need a CUDA device at run time (an onnxruntime-gpu
#: build lists them in ``get_available_providers()`` even on a machine without a GPU).
GPU_PROVIDERS = frozenset({"TensorrtExecutionProvider", "CUDAExecutionProvider"})

#: Lowest CUDA compute capability with native fp16 arithmetic (sm_53: Jetson TX1 / Nano; every
#: Jetson since, and desktop GPUs from Pascal sm_60 on).
FP16_MIN_CAPABILITY = (5, 3)

_ACCELERATORS = ("cpu", "cuda")
_PRECISIONS = ("fp32", "fp16")
_X86 = {"x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"}
_L4T = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([0-9.]+)", re.IGNORECASE)


class ProfileLike(Protocol):
    """The firmware-profile attributes :func:`plan_runtime` reads (``edge_agent.profiles.FirmwareProfile``
    has them; any object with these attributes will do).

    Attributes:
        name: profile name (``"jetson-orin-nano"``).
        accelerator: ``"cpu"`` or ``"cuda"``.
        onnx_providers: ONNX Runtime execution providers, most preferred first.
        torch_threads: intra-op CPU threads for torch, >= 1; 0: one per core of this machine.
        precision: ``"fp32"``, or ``"fp16"`` (CUDA autocast).
        batch_size: samples per SGD step, >= 1.
        memory_budget_mb: memory the training process may use, MiB (0 = no budget).
    """

    # read-only members, so that frozen dataclasses such as FirmwareProfile fit

    @property
    def name(self) -> str: ...
    @property
    def accelerator(self) -> str: ...
    @property
    def onnx_providers(self) -> Sequence[str]: ...
    @property
    def torch_threads(self) -> int: ...
    @property
    def precision(self) -> str: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def memory_budget_mb(self) -> int: ...


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What :func:`detect` found.

    Attributes:
        platform: ``"raspberry-pi"``, ``"jetson"``, ``"x86"``, ``"arm"`` (another ARM board) or
            ``"unknown"``.
        model: the board model from the device tree (``"Raspberry Pi 4 Model B Rev 1.4"``,
            ``"NVIDIA Jetson Orin Nano Developer Kit"``), else the CPU's ``model name`` from
            ``/proc/cpuinfo``, else the machine architecture (``"x86_64"``), else ``"unknown"``.
        l4t_release: Jetson Linux (L4T) release as ``"35.4.1"`` (from ``/etc/nv_tegra_release``),
            the file's first line when it does not parse, ``None`` when there is no such file.
        cpu_cores: CPUs this process may run on (affinity mask), >= 1.
        memory_mb: total RAM (``MemTotal`` in ``/proc/meminfo``), MiB; 0 when unknown.
        cuda_available: torch sees a usable CUDA device.
        cuda_device: name of CUDA device 0, ``None`` without CUDA.
        cuda_memory_mb: total memory of CUDA device 0, MiB (on a Jetson the RAM it shares with
            the CPU), ``None`` without CUDA.
        fp16_supported: CUDA device 0 has native fp16 (compute capability >= 5.3); ``False``
            without CUDA (fp16 autocast is only used on CUDA).
        torch_version: ``torch.__version__``.
        onnx_providers_available: ``onnxruntime.get_available_providers()``, empty when
            onnxruntime is not installed or cannot be loaded (a tuple, so the record stays
            immutable); from the probe of :mod:`edge_agent.optional_runtime` (a child process),
            so a broken onnxruntime cannot crash detection.
        onnx_unavailable: why onnxruntime cannot be used (``"OSError: …"``, ``"import killed the
            probe process (SIGABRT)"``), "" when it can or when the reason is unknown.
        cpu_quota: the cgroup CPU quota of this process in cores (``cpu.max`` 150000/100000 →
            1.5), ``None`` when none is set; :func:`usable_cores` combines it with ``cpu_cores``.
    """

    platform: str
    model: str
    l4t_release: str | None
    cpu_cores: int
    memory_mb: int
    cuda_available: bool
    cuda_device: str | None
    cuda_memory_mb: int | None
    fp16_supported: bool
    torch_version: str
    onnx_providers_available: tuple[str, ...]
    onnx_unavailable: str = ""
    cpu_quota: float | None = None


@dataclass(frozen=True, slots=True)
class RuntimePlan:
    """How this device will run, after fitting the profile to :class:`DeviceInfo`.

    Attributes:
        device: torch device to train on (``cuda:0`` or ``cpu``).
        precision: ``"fp32"`` or ``"fp16"`` (fp16 only with a CUDA ``device``).
        torch_threads: intra-op threads for torch, 1 <= threads <= cores.
        batch_size: samples per SGD step, >= 1 (the profile's, or less under the memory rule).
        onnx_providers: the profile's providers that are available, order kept, with
            ``CPUExecutionProvider`` last; empty when onnxruntime is not installed.
        fallbacks: one human-readable reason per difference between the profile and this plan,
            in the order device, precision, threads, providers, batch size; empty when the
            profile was met exactly.
        platform: :attr:`DeviceInfo.platform`.
        model: :attr:`DeviceInfo.model`.
    """

    device: torch.device
    precision: str
    torch_threads: int
    batch_size: int
    onnx_providers: tuple[str, ...]
    fallbacks: tuple[str, ...]
    platform: str
    model: str

    def as_join_info(self) -> dict[str, str | int | bool]:
        """Flat scalars for ``join.info``.

        Returns:
            ``device`` (``"cuda:0"`` / ``"cpu"``), ``precision``, ``platform``, ``model``,
            ``torch_threads``, ``batch_size``, ``onnx_providers`` (comma-separated),
            ``fallbacks`` (the reasons joined with ``"; "``, ``""`` when none) and
            ``fallback_count``.
        """
        return {
            "device": str(self.device),
            "precision": self.precision,
            "platform": self.platform,
            "model": self.model,
            "torch_threads": int(self.torch_threads),
            "batch_size": int(self.batch_size),
            "onnx_providers": ",".join(self.onnx_providers),
            "fallbacks": "; ".join(self.fallbacks),
            "fallback_count": len(self.fallbacks),
        }


# --------------------------------------------------------------------------------------------
# detection


def _read_text(path: Path) -> str | None:
    """The file's text (undecodable bytes replaced), ``None`` when it cannot be read."""
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return None


def _device_tree_model(root: Path) -> str | None:
    for rel in ("proc/device-tree/model", "sys/firmware/devicetree/base/model"):
        text = _read_text(root / rel)
        if text is not None:
            model = text.rstrip("\x00").strip()
            if model:
                return model
    return None


def _cpuinfo_model(root: Path) -> str | None:
    text = _read_text(root / "proc/cpuinfo")
    if text is None:
        return None
    for key in ("model name", "Model", "Hardware"):
        for line in text.splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key and value.strip():
                return value.strip()
    return None


def _l4t_release(root: Path) -> str | None:
    text = _read_text(root / "etc/nv_tegra_release")
    if text is None:
        return None
    first = text.splitlines()[0].strip() if text.strip() else ""
    m = _L4T.search(first)
    if m:
        return f"{m.group(1)}.{m.group(2).strip('.')}"
    return first.lstrip("#").strip() or None


def _memory_mb(root: Path) -> int:
    text = _read_text(root / "proc/meminfo")
    if text is None:
        return 0
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            try:
                return int(parts[1]) // 1024  # the kernel always reports kB (KiB)
            except (IndexError, ValueError):
                return 0
    return 0


def _cpu_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cgroup_cpu_quota(root: str | Path = "/") -> float | None:
    """The cgroup CPU quota of this process, in cores, or ``None`` when none is set.

    Reads cgroup v2 ``sys/fs/cgroup/cpu.max`` (``"150000 100000"`` → 1.5; ``"max 100000"`` → no
    quota), else cgroup v1 ``sys/fs/cgroup/cpu/cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (a
    quota of ``-1`` → none), under ``root``. An unreadable or malformed file counts as no quota.
    """
    root = Path(root)
    text = _read_text(root / "sys/fs/cgroup/cpu.max")
    if text is not None:
        parts = text.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                quota, period = int(parts[0]), int(parts[1])
            except ValueError:
                return None
            return quota / period if quota > 0 and period > 0 else None
        return None
    q = _read_text(root / "sys/fs/cgroup/cpu/cpu.cfs_quota_us")
    per = _read_text(root / "sys/fs/cgroup/cpu/cpu.cfs_period_us")
    try:
        quota_us, period_us = int((q or "").strip()), int((per or "").strip())
    except ValueError:
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cores(info: DeviceInfo) -> int:
    """Cores this process can keep busy: its affinity mask's CPUs, capped by the cgroup quota
    rounded down (a quota of 1.5 cores gives 1: a second busy thread would be throttled), >= 1."""
    cores = max(1, int(info.cpu_cores))
    if info.cpu_quota is not None:
        cores = min(cores, max(1, int(info.cpu_quota)))
    return cores


def _platform(model: str | None, l4t: str | None, machine: str) -> str:
    if l4t is not None or (model is not None and "jetson" in model.lower()):
        return "jetson"
    if model is not None and model.lower().startswith("raspberry pi"):
        return "raspberry-pi"
    arch = machine.lower()
    if arch in _X86:
        return "x86"
    if arch.startswith(("arm", "aarch64")):
        return "arm"
    return "unknown"


def _cuda() -> tuple[bool, str | None, int | None, bool]:
    """(available, name, memory MiB, fp16) of CUDA device 0 as torch sees it. A driver that
    answers ``is_available()`` but then fails is logged and treated as no CUDA."""
    if not torch.cuda.is_available():
        return False, None, None, False
    try:
        name = str(torch.cuda.get_device_name(0))
        memory_mb = int(torch.cuda.get_device_properties(0).total_memory) // (1024 * 1024)
        capability = tuple(torch.cuda.get_device_capability(0))
    except (RuntimeError, AssertionError, OSError) as exc:
        log.warning("CUDA reports a device but querying it failed (%s): treating the device as CPU-only", exc)
        return False, None, None, False
    return True, name, memory_mb, capability >= FP16_MIN_CAPABILITY


def _onnx_providers() -> tuple[tuple[str, ...], str]:
    """ONNX Runtime's providers and, when it cannot be used, why (probed once, in a child)."""
    from .optional_runtime import probe

    st = probe("onnxruntime")
    return (st.providers, "") if st.available else ((), st.reason)


def detect(root: str | Path = "/", *, machine: str | None = None) -> DeviceInfo:
    """Detect the device.

    Args:
        root: directory under which ``proc/device-tree/model`` (or
            ``sys/firmware/devicetree/base/model``), ``etc/nv_tegra_release``, ``proc/meminfo``
            and ``proc/cpuinfo`` are read; ``"/"`` on a real device, a fake tree in tests.
        machine: CPU architecture (``"x86_64"``, ``"aarch64"``) for devices without a known
            device-tree model; ``None`` = ``platform.machine()``.

    Returns:
        A :class:`DeviceInfo`. Cores come from this process's affinity mask (and the cgroup CPU
        quota under ``root``, :func:`cgroup_cpu_quota`), CUDA from torch
        (device 0), providers from onnxruntime; missing files give ``None`` / 0, never an error.
    """
    root = Path(root)
    arch = machine if machine is not None else _pyplatform.machine()
    tree_model = _device_tree_model(root)
    l4t = _l4t_release(root)
    cuda_available, cuda_device, cuda_memory_mb, fp16 = _cuda()
    providers, no_onnx = _onnx_providers()
    return DeviceInfo(
        platform=_platform(tree_model, l4t, arch),
        model=tree_model or _cpuinfo_model(root) or arch or "unknown",
        l4t_release=l4t,
        cpu_cores=_cpu_cores(),
        memory_mb=_memory_mb(root),
        cuda_available=cuda_available,
        cuda_device=cuda_device,
        cuda_memory_mb=cuda_memory_mb,
        fp16_supported=fp16,
        torch_version=str(torch.__version__),
        onnx_providers_available=providers,
        onnx_unavailable=no_onnx,
        cpu_quota=cgroup_cpu_quota(root),
    )


# --------------------------------------------------------------------------------------------
# planning


def _plan_providers(requested: Sequence[str], info: DeviceInfo) -> tuple[tuple[str, ...], list[str]]:
    """The profile's providers that can run here, order kept, CPU last; and the reasons."""
    reasons: list[str] = []
    wanted = list(dict.fromkeys(str(p) for p in requested))  # duplicates carry no meaning
    available = set(info.onnx_providers_available)
    if not available:
        if wanted:
            why = info.onnx_unavailable
            what = ("onnxruntime is not installed" if not why or why.startswith("ModuleNotFoundError")
                    else f"onnxruntime cannot be used ({why})")
            reasons.append(f"{what}: none of {', '.join(wanted)} can be used")
        return (), reasons
    kept: list[str] = []
    missing: list[tuple[int, str, str]] = []  # (position, provider, why)
    for i, p in enumerate(wanted):
        if p == CPU_PROVIDER:
            continue
        if p not in available:
            missing.append((i, p, "not available"))
        elif p in GPU_PROVIDERS and not info.cuda_available:
            missing.append((i, p, "needs a CUDA device and none is available"))
        else:
            kept.append(p)
    final = (*kept, CPU_PROVIDER) if CPU_PROVIDER in available else tuple(kept)
    for i, p, why in missing:
        later = [q for q in wanted[i + 1:] if q in final and q != CPU_PROVIDER]
        instead = later[0] if later else CPU_PROVIDER if CPU_PROVIDER in final else "no other provider"
        reasons.append(f"{p} {why}: using {instead}")
    if CPU_PROVIDER in final:
        if CPU_PROVIDER not in wanted:
            reasons.append(f"{CPU_PROVIDER} appended as the last resort (the profile does not list it)")
        elif wanted[-1] != CPU_PROVIDER:
            reasons.append(f"{CPU_PROVIDER} moved last (the profile lists it before "
                           f"{', '.join(wanted[wanted.index(CPU_PROVIDER) + 1:])})")
    elif CPU_PROVIDER in wanted:
        reasons.append(f"{CPU_PROVIDER} not available in this onnxruntime build")
    return final, reasons


def plan_runtime(profile: ProfileLike, info: DeviceInfo) -> RuntimePlan:
    """Fit ``profile`` to what ``info`` says the device offers. Pure: no I/O, no logging.

    Rules, each recorded in :attr:`RuntimePlan.fallbacks` when it changes something:

    - **device**: ``cuda`` when the profile asks for it and ``info.cuda_available``, else ``cpu``.
    - **precision**: ``fp16`` only on a CUDA device with ``info.fp16_supported``, else ``fp32``.
    - **threads**: ``min(profile.torch_threads, usable_cores(info))`` (the affinity mask's
      cores, capped by the cgroup CPU quota); a profile's ``0`` means one per usable core, which
      is not a fallback (nothing differs from what the profile asked for).
    - **ONNX providers**: the profile's list without those onnxruntime does not offer (and without
      TensorRT/CUDA when there is no CUDA device), order kept, ``CPUExecutionProvider`` last
      (appended or moved there if the profile did not put it last). Empty without onnxruntime.
    - **batch size** (memory rule): the memory limit is ``info.memory_mb`` (total RAM), or the
      smaller of that and ``info.cuda_memory_mb`` when training on CUDA; unknown (0 / None)
      limits are ignored. When ``profile.memory_budget_mb`` exceeds the limit, the batch size is
      scaled by limit / budget (activation memory grows about linearly with the batch):
      ``max(1, profile.batch_size * limit_mb // memory_budget_mb)`` (a batch size already at
      1 stays 1, and then nothing is recorded: the plan does not differ from the profile).

    Args:
        profile: a firmware profile (see :class:`ProfileLike`).
        info: from :func:`detect`.

    Returns:
        The plan; ``fallbacks`` is empty exactly when the plan is what the profile asked for.

    Raises:
        ValueError: the profile's ``accelerator`` or ``precision`` is not one of the known
            values, ``torch_threads`` is negative, or ``batch_size`` is below 1.
    """
    if profile.accelerator not in _ACCELERATORS:
        raise ValueError(f"profile {profile.name!r}: accelerator must be one of {_ACCELERATORS}, "
                         f"got {profile.accelerator!r}")
    if profile.precision not in _PRECISIONS:
        raise ValueError(f"profile {profile.name!r}: precision must be one of {_PRECISIONS}, got {profile.precision!r}")
    if int(profile.torch_threads) < 0:
        raise ValueError(f"profile {profile.name!r}: torch_threads must be >= 1 (or 0: one per core), "
                         f"got {profile.torch_threads}")
    if int(profile.batch_size) < 1:
        raise ValueError(f"profile {profile.name!r}: batch_size must be >= 1, got {profile.batch_size}")
    fallbacks: list[str] = []

    if profile.accelerator == "cuda" and info.cuda_available:
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cpu")
        if profile.accelerator == "cuda":
            fallbacks.append("profile asks for cuda but no CUDA device is available: training on cpu")

    precision = profile.precision
    if precision == "fp16":
        if device.type != "cuda":
            precision = "fp32"
            fallbacks.append("fp16 autocast needs cuda: training in fp32")
        elif not info.fp16_supported:
            precision = "fp32"
            fallbacks.append(f"fp16 autocast needs compute capability >= {FP16_MIN_CAPABILITY[0]}."
                             f"{FP16_MIN_CAPABILITY[1]}, {info.cuda_device} lacks it: training in fp32")

    cores = usable_cores(info)
    threads = int(profile.torch_threads) or cores  # 0: as many as this process may use
    if threads > cores:
        quota = "" if cores == max(1, int(info.cpu_cores)) else f" (cgroup CPU quota {info.cpu_quota:g})"
        fallbacks.append(f"profile torch_threads {threads} > {cores} cores{quota}: using {cores}")
        threads = cores

    providers, reasons = _plan_providers(profile.onnx_providers, info)
    fallbacks.extend(reasons)

    batch_size = int(profile.batch_size)
    budget_mb = int(profile.memory_budget_mb or 0)
    limits = [("RAM", int(info.memory_mb))] if info.memory_mb > 0 else []
    if device.type == "cuda" and info.cuda_memory_mb:
        limits.append(("CUDA device memory", int(info.cuda_memory_mb)))
    if budget_mb > 0 and limits:
        what, limit_mb = min(limits, key=lambda kv: kv[1])
        if budget_mb > limit_mb:
            reduced = max(1, batch_size * limit_mb // budget_mb)
            if reduced < batch_size:
                fallbacks.append(f"memory budget {budget_mb} MB > {limit_mb} MB available ({what}): batch size "
                                 f"reduced from {batch_size} to {reduced} (scaled by {limit_mb}/{budget_mb})")
                batch_size = reduced

    return RuntimePlan(device=device, precision=precision, torch_threads=threads, batch_size=batch_size,
                       onnx_providers=providers, fallbacks=tuple(fallbacks), platform=info.platform,
                       model=info.model)


def apply(plan: RuntimePlan, *, log_fallbacks: bool = True) -> None:
    """Put ``plan`` into effect for this process: ``torch.set_num_threads(plan.torch_threads)``,
    one torch inter-op thread (when torch still allows setting it, see :func:`apply_threads`),
    and log each of ``plan.fallbacks`` at WARNING (logger ``edge_agent.device``; not with
    ``log_fallbacks=False``, for a caller that prints them itself: each is said once).

    The device, precision and batch size are not process settings: the caller passes
    ``plan.device`` to the agent, ``precision=plan.precision`` to the client algorithm and
    ``plan.batch_size`` to its training defaults.
    """
    torch.set_num_threads(int(plan.torch_threads))
    _set_interop_threads(1)
    for reason in plan.fallbacks if log_fallbacks else ():
        log.warning("runtime fallback: %s", reason)
    log.info("runtime: %s, %s, %d torch threads, batch size %d, ONNX providers [%s]", plan.device,
             plan.precision, plan.torch_threads, plan.batch_size, ", ".join(plan.onnx_providers))


# --------------------------------------------------------------------------------------------
# threads and concurrency

MAX_TRAIN_SLOTS = 4
"""Most virtual devices training at once in one simulating process. Every training thread holds
the GIL between torch operations (autograd dispatch, the optimiser step, the data gather), a
sizeable fraction of a small model's step; beyond about four concurrent trainers that share of
the GIL becomes the bottleneck, so a larger machine gives each trainer more intra-op threads
instead."""


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    """How many threads train, and how many trainings run at once.

    Attributes:
        role: ``"device"`` (``fedfleet-agent``: one device per process) or ``"simulation"``
            (``fedfleet simulate``: the server and every virtual device in one process).
        cores: cores this process can keep busy (:func:`usable_cores`).
        torch_threads: intra-op threads of each training (``torch.set_num_threads``; process-wide).
        interop_threads: torch inter-op threads (1: fedfleet runs no parallel torch graphs).
        train_slots: trainings at once (a simulation's virtual devices; 1 on a device).
        reserved_cores: cores left to the server, the embedded broker and the MQTT network
            threads (busy in bursts between trainings) rather than given to training.
        reasons: one sentence per decision, in the order slots, threads, reservation.
    """

    role: str
    cores: int
    torch_threads: int
    interop_threads: int
    train_slots: int
    reserved_cores: int
    reasons: tuple[str, ...] = ()

    @property
    def busy_threads(self) -> int:
        """Training threads busy at once: ``train_slots * torch_threads``."""
        return self.train_slots * self.torch_threads

    def as_dict(self) -> dict[str, int | str | list[str]]:
        """The plan as JSON-ready values (``summary.json``'s ``thread_plan``)."""
        return {"role": self.role, "cores": self.cores, "torch_threads": self.torch_threads,
                "interop_threads": self.interop_threads, "train_slots": self.train_slots,
                "reserved_cores": self.reserved_cores, "busy_threads": self.busy_threads,
                "reasons": list(self.reasons)}

    def describe(self) -> str:
        """One line for start-up output."""
        return (f"thread plan: {self.cores} core{'s' * (self.cores != 1)}, {self.train_slots} training"
                f"{'s' * (self.train_slots != 1)} at once x {self.torch_threads} torch thread"
                f"{'s' * (self.torch_threads != 1)} (inter-op {self.interop_threads}), {self.reserved_cores} "
                f"core{'s' * (self.reserved_cores != 1)} left to server/broker/network"
                + (f" — {'; '.join(self.reasons)}" if self.reasons else ""))


def plan_threads(cores: int, *, role: str, clients: int = 1, embedded_broker: bool = False,
                 profile_threads: int | None = None, torch_threads: int = 0, train_slots: int = 0) -> ThreadPlan:
    """Choose intra-op threads and concurrent trainings for ``cores`` cores. Pure.

    Rules (measured reasons in the README's "Threads" section):

    - **device** (``role="device"``): one training; ``torch_threads`` = the firmware profile's
      ``profile_threads`` (it rules on a real device), at most ``cores``; no core is reserved.
    - **simulation**: the server thread, every agent's MQTT network thread and an embedded
      broker are idle while devices train and busy in bursts between trainings. On 4 or more
      cores, ``min(services, cores // 4)`` cores are left to them, ``services`` = 1 (the server
      and the network threads, one process under one GIL) + 1 for an embedded broker; on 1–3
      cores none (a reserved core would stand idle through most of each round, and a
      one-thread training yields its core to a burst gracefully, unlike a multi-threaded one
      whose threads wait on each other at every barrier). Of the ``usable = cores - reserved``
      cores, ``train_slots = min(usable, MAX_TRAIN_SLOTS, clients)`` trainings run at once, each
      with ``usable // train_slots`` intra-op threads (one-thread trainings side by side beat one
      multi-threaded training: no barrier waits, no oversubscription when the machine is shared).
    - An explicit ``torch_threads`` or ``train_slots`` (> 0, from ``[agents]``) is kept; the other
      value is then derived from it; a combination busier than ``cores`` is kept and said so.
    - inter-op threads: 1.

    Args:
        cores: usable cores (>= 1), :func:`usable_cores`.
        role: ``"device"`` or ``"simulation"``.
        clients: virtual devices in the simulation (caps the concurrent trainings).
        embedded_broker: the simulation starts its own broker on this machine.
        profile_threads: a device's firmware-profile ``torch_threads`` (``role="device"``).
        torch_threads, train_slots: configured values; 0 = choose.

    Raises:
        ValueError: an unknown role, ``cores`` or ``clients`` below 1, a negative setting.
    """
    if role not in ("device", "simulation"):
        raise ValueError(f"role must be 'device' or 'simulation', not {role!r}")
    if int(cores) < 1 or int(clients) < 1:
        raise ValueError(f"cores and clients must be >= 1, got cores={cores}, clients={clients}")
    if torch_threads < 0 or train_slots < 0 or (profile_threads is not None and profile_threads < 1):
        raise ValueError(f"torch_threads/train_slots must be >= 0 and profile_threads >= 1, got {torch_threads}, "
                         f"{train_slots}, {profile_threads}")
    cores = int(cores)
    reasons: list[str] = []
    if role == "device":
        wanted = torch_threads or profile_threads or cores
        threads = min(wanted, cores)
        source = "configured" if torch_threads else "the firmware profile's" if profile_threads else "one per core"
        reasons.append(f"torch threads {threads}: {source}" + (f" ({wanted}, capped at {cores} cores)"
                                                               if wanted > cores else ""))
        return ThreadPlan(role, cores, threads, 1, 1, 0, tuple(reasons))
    services = 1 + int(embedded_broker)
    reserved = min(services, cores // 4)
    usable = cores - reserved
    if reserved:
        reasons.append(f"{reserved} core{'s' * (reserved != 1)} left to the server and network threads"
                       + (" and the embedded broker" if embedded_broker and reserved > 1 else ""))
    if train_slots and torch_threads:
        slots, threads = train_slots, torch_threads
        reasons.append(f"{slots} slots x {threads} threads as configured")
    elif train_slots:
        slots = train_slots
        threads = max(1, usable // slots)
        reasons.append(f"{slots} slots as configured: {threads} thread{'s' * (threads != 1)} each")
    elif torch_threads:
        threads = torch_threads
        slots = max(1, min(usable // threads, MAX_TRAIN_SLOTS, clients))
        reasons.append(f"{threads} threads as configured: {slots} slot{'s' * (slots != 1)}")
    else:
        slots = min(usable, MAX_TRAIN_SLOTS, clients)
        threads = max(1, usable // slots)
        reasons.append(f"by default one training per usable core ({usable}), at most {MAX_TRAIN_SLOTS} and at most "
                       f"the {clients} client{'s' * (clients != 1)}")
    if slots * threads > cores:
        reasons.append(f"oversubscribed: {slots * threads} busy training threads on {cores} cores")
    return ThreadPlan("simulation", cores, threads, 1, slots, reserved, tuple(reasons))


def _set_interop_threads(n: int) -> int:
    """Set torch's inter-op threads when it still can (only before its first parallel work);
    the number in effect."""
    if torch.get_num_interop_threads() != n:
        try:
            torch.set_num_interop_threads(n)
        except RuntimeError:  # already started in this process: it keeps its pool (idle in fedfleet)
            pass
    return int(torch.get_num_interop_threads())


def apply_threads(plan: ThreadPlan) -> ThreadPlan:
    """Put ``plan``'s torch thread counts into effect for this process and return the plan as
    applied: ``interop_threads`` is what torch has, which differs from the plan once torch's
    inter-op pool has started in this process (it cannot be resized then; it is said in
    ``reasons``)."""
    torch.set_num_threads(int(plan.torch_threads))
    got = _set_interop_threads(plan.interop_threads)
    if got == plan.interop_threads:
        return plan
    return ThreadPlan(plan.role, plan.cores, plan.torch_threads, got, plan.train_slots, plan.reserved_cores,
                      (*plan.reasons, f"torch's inter-op pool had already started with {got} threads (idle here)"))
