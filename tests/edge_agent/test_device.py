"""Device detection on fake roots, and the profile → runtime plan fallback table."""

from __future__ import annotations

import dataclasses
import logging
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from edge_agent import device as D
from edge_agent.device import CPU_PROVIDER, DeviceInfo, RuntimePlan, apply, detect, plan_runtime

TRT, CUDA_EP = "TensorrtExecutionProvider", "CUDAExecutionProvider"


# --------------------------------------------------------------------------------------------
# fakes


def _write(root: Path, rel: str, data: bytes | str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def _meminfo(kib: int) -> str:
    return f"MemTotal:        {kib} kB\nMemFree:          123456 kB\nMemAvailable:    2345678 kB\n"


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def fake_ort(monkeypatch: pytest.MonkeyPatch):
    """Install a fake ``onnxruntime`` module; returns a setter for its provider list."""
    mod = types.ModuleType("onnxruntime")
    mod.providers = [CPU_PROVIDER]  # type: ignore[attr-defined]
    mod.get_available_providers = lambda: list(mod.providers)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "onnxruntime", mod)

    def set_providers(*names: str) -> None:
        mod.providers = list(names)  # type: ignore[attr-defined]

    return set_providers


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch):
    """Make torch report one CUDA device (no GPU needed); returns a setter for its properties."""
    state = {"name": "Orin", "total_memory": 7620 * 2**20, "capability": (8, 7)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: state["name"])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: types.SimpleNamespace(total_memory=state["total_memory"], name=state["name"]))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: state["capability"])
    return state


@dataclass
class Profile:
    """Duck-typed firmware profile (the attributes ``plan_runtime`` reads)."""

    name: str = "test"
    accelerator: str = "cpu"
    onnx_providers: list[str] = field(default_factory=lambda: [CPU_PROVIDER])
    torch_threads: int = 4
    precision: str = "fp32"
    batch_size: int = 32
    memory_budget_mb: int = 1024


def _info(**kw) -> DeviceInfo:
    base = dict(platform="x86", model="test box", l4t_release=None, cpu_cores=4, memory_mb=8000,
                cuda_available=False, cuda_device=None, cuda_memory_mb=None, fp16_supported=False,
                torch_version="2.x", onnx_providers_available=(CPU_PROVIDER,))
    base.update(kw)
    return DeviceInfo(**base)


def _jetson(**kw) -> DeviceInfo:
    base = dict(platform="jetson", model="NVIDIA Jetson Orin Nano Developer Kit", l4t_release="35.4.1",
                cpu_cores=6, memory_mb=7620, cuda_available=True, cuda_device="Orin", cuda_memory_mb=7620,
                fp16_supported=True, onnx_providers_available=(TRT, CUDA_EP, CPU_PROVIDER))
    base.update(kw)
    return _info(**base)


# --------------------------------------------------------------------------------------------
# detect()


def test_detect_raspberry_pi_4(tmp_path: Path, no_cuda, fake_ort) -> None:
    _write(tmp_path, "proc/device-tree/model", b"Raspberry Pi 4 Model B Rev 1.4\x00")
    _write(tmp_path, "proc/meminfo", _meminfo(3884000))
    info = detect(tmp_path, machine="aarch64")
    assert info.platform == "raspberry-pi"
    assert info.model == "Raspberry Pi 4 Model B Rev 1.4"  # trailing NUL stripped
    assert info.l4t_release is None
    assert info.memory_mb == 3884000 // 1024 == 3792
    assert info.cuda_available is False and info.cuda_device is None and info.cuda_memory_mb is None
    assert info.fp16_supported is False
    assert info.cpu_cores >= 1
    assert info.torch_version == str(torch.__version__)
    assert info.onnx_providers_available == (CPU_PROVIDER,)


def test_detect_jetson_orin_nano(tmp_path: Path, fake_cuda, fake_ort) -> None:
    fake_ort(TRT, CUDA_EP, CPU_PROVIDER)
    _write(tmp_path, "proc/device-tree/model", b"NVIDIA Jetson Orin Nano Developer Kit\x00")
    _write(tmp_path, "etc/nv_tegra_release",
           "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, "
           "DATE: Tue Aug  1 19:57:35 UTC 2023\n# KERNEL_VARIANT: oot\n")
    _write(tmp_path, "proc/meminfo", _meminfo(7802392))
    info = detect(tmp_path, machine="aarch64")
    assert info.platform == "jetson"
    assert info.model == "NVIDIA Jetson Orin Nano Developer Kit"
    assert info.l4t_release == "35.4.1"
    assert info.memory_mb == 7802392 // 1024
    assert info.cuda_available is True
    assert info.cuda_device == "Orin"
    assert info.cuda_memory_mb == 7620
    assert info.fp16_supported is True
    assert info.onnx_providers_available == (TRT, CUDA_EP, CPU_PROVIDER)


def test_detect_plain_x86(tmp_path: Path, no_cuda, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import raises ImportError
    _write(tmp_path, "proc/cpuinfo", "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) CPU @ 2.20GHz\n")
    _write(tmp_path, "proc/meminfo", _meminfo(16384000))
    info = detect(tmp_path, machine="x86_64")
    assert info.platform == "x86"
    assert info.model == "Intel(R) Xeon(R) CPU @ 2.20GHz"
    assert info.l4t_release is None
    assert info.memory_mb == 16000
    assert info.onnx_providers_available == ()


def test_detect_empty_root_is_not_an_error(tmp_path: Path, no_cuda) -> None:
    info = detect(tmp_path, machine="riscv64")
    assert (info.platform, info.model, info.memory_mb, info.l4t_release) == ("unknown", "riscv64", 0, None)
    assert detect(tmp_path, machine="armv7l").platform == "arm"


def test_detect_defaults_to_this_machine(tmp_path: Path, no_cuda, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D._pyplatform, "machine", lambda: "aarch64")
    info = detect(tmp_path)
    assert (info.platform, info.model) == ("arm", "aarch64")
    real = detect()  # the real machine: whatever it is, detection does not fail
    assert real.platform in {"raspberry-pi", "jetson", "x86", "arm", "unknown"} and real.cpu_cores >= 1


def test_detect_unparsed_l4t_keeps_the_line(tmp_path: Path, no_cuda) -> None:
    _write(tmp_path, "etc/nv_tegra_release", "# something new\n")
    info = detect(tmp_path, machine="aarch64")
    assert info.platform == "jetson" and info.l4t_release == "something new"


def test_detect_old_cuda_device_has_no_fp16(tmp_path: Path, fake_cuda, fake_ort) -> None:
    fake_cuda["capability"] = (5, 2)
    assert detect(tmp_path, machine="x86_64").fp16_supported is False
    fake_cuda["capability"] = (5, 3)  # Jetson Nano / TX1
    assert detect(tmp_path, machine="x86_64").fp16_supported is True


def test_detect_broken_cuda_driver_is_no_cuda(tmp_path: Path, fake_cuda, monkeypatch, caplog) -> None:
    def boom(i=0):
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.setattr(torch.cuda, "get_device_properties", boom)
    with caplog.at_level(logging.WARNING, logger="edge_agent.device"):
        info = detect(tmp_path, machine="x86_64")
    assert info.cuda_available is False and info.cuda_device is None
    assert "insufficient" in caplog.text


def test_device_info_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        _info().platform = "jetson"  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# plan_runtime(): the fallback table


@pytest.mark.parametrize(
    ("profile", "info", "expect", "fallbacks"),
    [
        pytest.param(
            Profile(accelerator="cuda", onnx_providers=[CPU_PROVIDER]), _info(),
            dict(device="cpu"),
            ["profile asks for cuda but no CUDA device is available: training on cpu"],
            id="cuda-profile-without-cuda"),
        pytest.param(
            Profile(accelerator="cuda", precision="fp16"), _info(),
            dict(device="cpu", precision="fp32"),
            ["profile asks for cuda but no CUDA device is available: training on cpu",
             "fp16 autocast needs cuda: training in fp32"],
            id="cuda-fp16-without-cuda"),
        pytest.param(
            Profile(accelerator="cpu", precision="fp16"), _info(),
            dict(device="cpu", precision="fp32"),
            ["fp16 autocast needs cuda: training in fp32"],
            id="fp16-on-cpu"),
        pytest.param(
            Profile(accelerator="cuda", precision="fp16", onnx_providers=[CUDA_EP, CPU_PROVIDER], torch_threads=6),
            _jetson(fp16_supported=False, cuda_device="Tegra X2?"),
            dict(device="cuda:0", precision="fp32"),
            ["fp16 autocast needs compute capability >= 5.3, Tegra X2? lacks it: training in fp32"],
            id="fp16-on-old-gpu"),
        pytest.param(
            Profile(torch_threads=6), _info(cpu_cores=4),
            dict(torch_threads=4),
            ["profile torch_threads 6 > 4 cores: using 4"],
            id="threads-capped"),
        pytest.param(
            Profile(accelerator="cuda", precision="fp16", onnx_providers=[TRT, CUDA_EP, CPU_PROVIDER],
                    torch_threads=6),
            _jetson(onnx_providers_available=(CUDA_EP, CPU_PROVIDER)),
            dict(device="cuda:0", precision="fp16", onnx_providers=(CUDA_EP, CPU_PROVIDER)),
            [f"{TRT} not available: using {CUDA_EP}"],
            id="tensorrt-missing"),
        pytest.param(
            Profile(onnx_providers=[TRT, CUDA_EP, CPU_PROVIDER]),
            _info(onnx_providers_available=(CPU_PROVIDER,)),
            dict(onnx_providers=(CPU_PROVIDER,)),
            [f"{TRT} not available: using {CPU_PROVIDER}", f"{CUDA_EP} not available: using {CPU_PROVIDER}"],
            id="gpu-providers-missing"),
        pytest.param(
            Profile(onnx_providers=[CUDA_EP, CPU_PROVIDER]),
            _info(onnx_providers_available=(CUDA_EP, CPU_PROVIDER)),  # onnxruntime-gpu on a box without GPU
            dict(onnx_providers=(CPU_PROVIDER,)),
            [f"{CUDA_EP} needs a CUDA device and none is available: using {CPU_PROVIDER}"],
            id="gpu-provider-without-cuda"),
        pytest.param(
            Profile(onnx_providers=[CPU_PROVIDER]), _info(onnx_providers_available=()),
            dict(onnx_providers=()),
            [f"onnxruntime is not installed: none of {CPU_PROVIDER} can be used"],
            id="no-onnxruntime"),
        pytest.param(
            Profile(onnx_providers=[CPU_PROVIDER, "XnnpackExecutionProvider"]),
            _info(onnx_providers_available=("XnnpackExecutionProvider", CPU_PROVIDER)),
            dict(onnx_providers=("XnnpackExecutionProvider", CPU_PROVIDER)),
            [f"{CPU_PROVIDER} moved last (the profile lists it before XnnpackExecutionProvider)"],
            id="cpu-moved-last"),
        pytest.param(
            Profile(onnx_providers=["XnnpackExecutionProvider"]),
            _info(onnx_providers_available=("XnnpackExecutionProvider", CPU_PROVIDER)),
            dict(onnx_providers=("XnnpackExecutionProvider", CPU_PROVIDER)),
            [f"{CPU_PROVIDER} appended as the last resort (the profile does not list it)"],
            id="cpu-appended"),
        pytest.param(
            Profile(batch_size=64, memory_budget_mb=4096), _info(memory_mb=1910),
            dict(batch_size=29),  # 64 * 1910 // 4096
            ["memory budget 4096 MB > 1910 MB available (RAM): batch size reduced from 64 to 29 "
             "(scaled by 1910/4096)"],
            id="memory-budget-over-ram"),
        pytest.param(
            Profile(accelerator="cuda", batch_size=64, memory_budget_mb=8000, torch_threads=6,
                    onnx_providers=[TRT, CUDA_EP, CPU_PROVIDER]),
            _jetson(memory_mb=16000, cuda_memory_mb=4000),
            dict(device="cuda:0", batch_size=32),
            ["memory budget 8000 MB > 4000 MB available (CUDA device memory): batch size reduced from 64 "
             "to 32 (scaled by 4000/8000)"],
            id="memory-budget-over-gpu"),
        pytest.param(
            Profile(batch_size=1, memory_budget_mb=4096), _info(memory_mb=100),
            dict(batch_size=1), [],
            id="memory-budget-batch-already-1"),
        pytest.param(
            Profile(memory_budget_mb=4096), _info(memory_mb=0),
            dict(batch_size=32), [],
            id="memory-unknown"),
    ],
)
def test_plan_runtime_fallbacks(profile: Profile, info: DeviceInfo, expect: dict, fallbacks: list[str]) -> None:
    plan = plan_runtime(profile, info)
    got = {"device": str(plan.device), "precision": plan.precision, "torch_threads": plan.torch_threads,
           "batch_size": plan.batch_size, "onnx_providers": plan.onnx_providers}
    for key, value in expect.items():
        assert got[key] == value, key
    assert list(plan.fallbacks) == fallbacks
    # never a silent downgrade: whatever differs from the profile has a reason
    assert (plan.device.type != profile.accelerator) <= any("cuda" in f for f in plan.fallbacks)
    assert (plan.precision != profile.precision) <= any("fp32" in f for f in plan.fallbacks)
    assert (plan.torch_threads != profile.torch_threads) <= any("torch_threads" in f for f in plan.fallbacks)
    assert (plan.batch_size != profile.batch_size) <= any("batch size" in f for f in plan.fallbacks)
    assert (plan.onnx_providers != tuple(profile.onnx_providers)) <= any("Provider" in f or "onnxruntime" in f
                                                                           for f in plan.fallbacks)


@pytest.mark.parametrize(
    ("profile", "info"),
    [
        pytest.param(Profile(), _info(), id="cpu-box"),
        pytest.param(Profile(name="jetson-orin-nano", accelerator="cuda", precision="fp16", torch_threads=6,
                             onnx_providers=[TRT, CUDA_EP, CPU_PROVIDER], batch_size=64, memory_budget_mb=4096),
                     _jetson(), id="jetson"),
    ],
)
def test_plan_runtime_exact_match_has_no_fallbacks(profile: Profile, info: DeviceInfo) -> None:
    plan = plan_runtime(profile, info)
    assert plan.fallbacks == ()
    assert plan.device.type == profile.accelerator
    assert plan.precision == profile.precision
    assert plan.torch_threads == profile.torch_threads
    assert plan.batch_size == profile.batch_size
    assert plan.onnx_providers == tuple(profile.onnx_providers)
    assert (plan.platform, plan.model) == (info.platform, info.model)


def test_plan_runtime_is_pure() -> None:
    profile, info = Profile(accelerator="cuda", torch_threads=64), _info()
    before = (dataclasses.asdict(profile), info)
    assert plan_runtime(profile, info) == plan_runtime(profile, info)
    assert (dataclasses.asdict(profile), info) == before


@pytest.mark.parametrize(
    "bad",
    [dict(accelerator="tpu"), dict(precision="bf16"), dict(torch_threads=-1), dict(batch_size=0)],
    ids=["accelerator", "precision", "threads", "batch"],
)
def test_plan_runtime_refuses_invalid_profiles(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        plan_runtime(Profile(**bad), _info())


def test_threads_zero_means_one_per_core_without_a_fallback() -> None:
    for cores in (1, 2, 16):
        plan = plan_runtime(Profile(torch_threads=0), _info(cpu_cores=cores))
        assert plan.torch_threads == cores and plan.fallbacks == ()


def test_the_default_profile_asks_for_no_more_threads_than_a_small_machine_has() -> None:
    from edge_agent.profiles import get_profile

    plan = plan_runtime(get_profile("x86-cpu"), _info(cpu_cores=2))
    assert plan.torch_threads == 2
    assert not [f for f in plan.fallbacks if "threads" in f]


def test_as_join_info_is_flat_scalars() -> None:
    plan = plan_runtime(Profile(accelerator="cuda", precision="fp16", torch_threads=8), _info())
    info = plan.as_join_info()
    assert all(isinstance(k, str) for k in info)
    assert all(type(v) in (str, int, bool) for v in info.values()), info
    assert info["device"] == "cpu" and info["precision"] == "fp32"
    assert info["platform"] == "x86" and info["model"] == "test box"
    assert info["fallback_count"] == 3 == len(plan.fallbacks)
    assert info["fallbacks"] == "; ".join(plan.fallbacks)
    assert info["onnx_providers"] == CPU_PROVIDER
    exact = plan_runtime(Profile(), _info()).as_join_info()
    assert (exact["fallbacks"], exact["fallback_count"]) == ("", 0)


def test_apply_sets_threads_and_logs_each_fallback(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    plan = plan_runtime(Profile(accelerator="cuda", precision="fp16", torch_threads=8), _info(cpu_cores=2))
    with caplog.at_level(logging.WARNING, logger="edge_agent.device"):
        apply(plan)
    assert calls == [2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(plan.fallbacks) == 3
    for reason, message in zip(plan.fallbacks, warnings):
        assert reason in message


def test_plan_is_frozen_and_exported() -> None:
    plan = plan_runtime(Profile(), _info())
    assert isinstance(plan, RuntimePlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.batch_size = 1  # type: ignore[misc]
    public = {n for n in vars(D) if not n.startswith("_") and getattr(getattr(D, n), "__module__", None) == D.__name__}
    assert public <= set(D.__all__)
    assert D.__all__ == sorted(D.__all__)


# --------------------------------------------------------------------------------------------
# cores: affinity and cgroup quota


@pytest.mark.parametrize("files, quota", [
    ({"sys/fs/cgroup/cpu.max": "150000 100000\n"}, 1.5),
    ({"sys/fs/cgroup/cpu.max": "max 100000\n"}, None),
    ({"sys/fs/cgroup/cpu.max": "garbage\n"}, None),
    ({"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "200000\n", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
    ({"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_cgroup_cpu_quota(tmp_path: Path, files: dict[str, str], quota: float | None) -> None:
    for rel, text in files.items():
        _write(tmp_path, rel, text)
    assert D.cgroup_cpu_quota(tmp_path) == quota


def test_detect_reads_the_cgroup_quota(tmp_path: Path, no_cuda) -> None:
    _write(tmp_path, "sys/fs/cgroup/cpu.max", "250000 100000")
    assert detect(tmp_path).cpu_quota == 2.5


@pytest.mark.parametrize("cores, quota, usable", [(4, None, 4), (4, 1.5, 1), (4, 0.5, 1), (2, 8.0, 2), (16, 3.99, 3)])
def test_usable_cores_is_affinity_capped_by_the_quota_rounded_down(cores: int, quota: float | None,
                                                                    usable: int) -> None:
    assert D.usable_cores(_info(cpu_cores=cores, cpu_quota=quota)) == usable


def test_plan_runtime_caps_threads_at_the_quota() -> None:
    plan = plan_runtime(Profile(torch_threads=4), _info(cpu_cores=4, cpu_quota=2.0))
    assert plan.torch_threads == 2
    assert plan.fallbacks == ("profile torch_threads 4 > 2 cores (cgroup CPU quota 2): using 2",)


# --------------------------------------------------------------------------------------------
# thread plan (worked by hand from the rules in plan_threads' docstring)


# (cores, embedded broker, clients) -> (train_slots, torch_threads, reserved cores)
@pytest.mark.parametrize("cores, broker, clients, expect", [
    (1, True, 10, (1, 1, 0)),    # 1 // 4 = 0 reserved; 1 usable
    (1, False, 10, (1, 1, 0)),
    (2, True, 10, (2, 1, 0)),    # both cores train, one thread each
    (2, False, 10, (2, 1, 0)),
    (2, True, 1, (1, 2, 0)),     # one client: one training with both cores
    (4, True, 10, (3, 1, 1)),    # min(2 services, 4 // 4) = 1 reserved, 3 usable
    (4, False, 10, (3, 1, 1)),   # min(1, 1) = 1
    (16, True, 10, (4, 3, 2)),   # min(2, 4) = 2 reserved, 14 usable: 4 slots x 14 // 4 = 3
    (16, False, 10, (4, 3, 1)),  # 15 usable: 4 x 3
    (16, True, 2, (2, 7, 2)),    # 14 usable, 2 clients: 2 x 7
    (8, True, 10, (4, 1, 2)),    # 6 usable: 4 x 1
])
def test_plan_threads_simulation(cores: int, broker: bool, clients: int, expect: tuple[int, int, int]) -> None:
    plan = D.plan_threads(cores, role="simulation", clients=clients, embedded_broker=broker)
    assert (plan.train_slots, plan.torch_threads, plan.reserved_cores) == expect
    assert plan.interop_threads == 1 and plan.busy_threads + plan.reserved_cores <= cores


def test_plan_threads_never_busier_than_the_cores() -> None:
    for cores in range(1, 65):
        for clients in (1, 2, 3, 5, 10, 100):
            for broker in (False, True):
                p = D.plan_threads(cores, role="simulation", clients=clients, embedded_broker=broker)
                assert 1 <= p.train_slots <= min(clients, D.MAX_TRAIN_SLOTS)
                assert p.busy_threads + p.reserved_cores <= cores, (cores, clients, broker)
                assert not any("oversubscribed" in r for r in p.reasons)


@pytest.mark.parametrize("cores, kw, expect", [
    (2, {"torch_threads": 2}, (1, 2)),           # configured threads: 2 // 2 = 1 slot
    (16, {"torch_threads": 2}, (4, 2)),          # 14 usable // 2 = 7, capped at 4 slots
    (2, {"train_slots": 1}, (1, 2)),             # configured slots: 2 // 1 = 2 threads
    (4, {"train_slots": 3, "torch_threads": 2}, (3, 2)),  # both configured: kept, said to be oversubscribed
])
def test_plan_threads_configured_values_rule(cores: int, kw: dict, expect: tuple[int, int]) -> None:
    plan = D.plan_threads(cores, role="simulation", clients=10, embedded_broker=True, **kw)
    assert (plan.train_slots, plan.torch_threads) == expect
    assert any("oversubscribed" in r for r in plan.reasons) == (plan.busy_threads > cores)


@pytest.mark.parametrize("cores, profile_threads, threads", [(4, 4, 4), (2, 8, 2), (16, 4, 4), (1, 4, 1), (4, None, 4)])
def test_plan_threads_device_follows_the_profile(cores: int, profile_threads: int | None, threads: int) -> None:
    plan = D.plan_threads(cores, role="device", profile_threads=profile_threads, embedded_broker=True, clients=10)
    assert (plan.train_slots, plan.torch_threads, plan.reserved_cores, plan.interop_threads) == (1, threads, 0, 1)


def test_plan_threads_refuses_bad_input() -> None:
    for kw in ({"role": "server"}, {"role": "device", "clients": 0}, {"role": "simulation", "torch_threads": -1}):
        with pytest.raises(ValueError):
            D.plan_threads(2, **kw)
    with pytest.raises(ValueError):
        D.plan_threads(0, role="device")


def test_thread_plan_record_and_line() -> None:
    plan = D.plan_threads(2, role="simulation", clients=10)
    rec = plan.as_dict()
    assert rec["train_slots"] == 2 and rec["torch_threads"] == 1 and rec["busy_threads"] == 2
    assert rec["reasons"] == list(plan.reasons)
    assert plan.describe().startswith("thread plan: 2 cores, 2 trainings at once x 1 torch thread (inter-op 1)")
    # the reason says why 2, not the 2 trainings again: one per usable core (2: no core reserved
    # without an embedded broker), under the cap of 4 and the 10 clients
    assert plan.reasons == ("by default one training per usable core (2), at most 4 and at most the 10 clients",)
    assert plan.describe().count("at once") == 1


def test_apply_threads_sets_torch_and_reports_the_interop_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(torch, "get_num_interop_threads", lambda: 3)

    def refuse(n: int) -> None:
        raise RuntimeError("cannot set number of interop threads after parallel work has started")

    monkeypatch.setattr(torch, "set_num_interop_threads", refuse)
    got = D.apply_threads(D.plan_threads(4, role="device", profile_threads=2))
    assert calls == [2] and got.interop_threads == 3
    assert "already started with 3 threads" in got.reasons[-1]
