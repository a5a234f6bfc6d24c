"""From a firmware profile to a running agent (``edge_agent.runtime``) and mixed-profile fleets
(``broker_server.simulate.assign_profiles``, ``[agents] profile``): codec choice, profile counts,
the runtime plan on fake hardware, and one small mixed fleet over a real broker.

Expected values are worked out independently of the code under test: byte costs by hand from
the codec definitions, profile counts by a separate largest-remainder (Hamilton) calculation,
fallbacks from the profile files and the fake hardware, payload ratios from the codec sizes.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections import Counter
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from broker_server import config as config_mod
from broker_server.errors import ConfigError
from broker_server.simulate import assign_profiles
from edge_agent.device import DeviceInfo
from edge_agent.profiles import get_profile, list_profiles
from edge_agent.runtime import AgentRuntime, agent_runtime, cheaper_codec, codec_cost
from protocol.messages import Envelope, Update, encode
from protocol.tensors import Codec

CPU_EP, TRT_EP, CUDA_EP = "CPUExecutionProvider", "TensorrtExecutionProvider", "CUDAExecutionProvider"


# --------------------------------------------------------------------------------------------
# codec_cost / cheaper_codec


@pytest.mark.parametrize("text, bytes_per_value", [
    ("fp32", 4.0), ("fp16", 2.0), ("bf16", 2.0), ("int8", 1.0), ("int8-channel", 1.0),
    # top-k: (value bytes + 1.5 index bytes) per kept value x fraction kept
    ("topk:0.1", (4 + 1.5) * 0.1), ("topk:0.1:fp16", (2 + 1.5) * 0.1), ("topk:0.5", (4 + 1.5) * 0.5),
    ("topk:0.01:fp16", (2 + 1.5) * 0.01),
    # zstd counted at 0.9x
    ("fp32+zstd", 4.0 * 0.9), ("int8+zstd", 0.9), ("topk:0.1:fp16+zstd", (2 + 1.5) * 0.1 * 0.9),
])
def test_codec_cost_by_hand(text: str, bytes_per_value: float) -> None:
    assert codec_cost(text) == pytest.approx(bytes_per_value)


def test_codec_cost_ordering() -> None:
    order = ["fp32", "fp32+zstd", "fp16", "int8-channel", "int8+zstd", "topk:0.1", "topk:0.1:fp16", "topk:0.01"]
    costs = [codec_cost(c) for c in order]
    assert costs == sorted(costs, reverse=True)
    assert codec_cost("fp16") == codec_cost("bf16")
    assert codec_cost("int8") == codec_cost("int8-channel")
    # top-k cost grows linearly with the kept fraction
    fr = [0.01, 0.05, 0.1, 0.3]
    assert [codec_cost(f"topk:{f}") / f for f in fr] == pytest.approx([5.5] * len(fr))


def test_codec_cost_refuses_bad_text() -> None:
    with pytest.raises(ValueError):
        codec_cost("fp64")


@pytest.mark.parametrize("server, device, chosen", [
    ("fp32", "int8-channel", "int8-channel"),   # the rpi4 case: the device's codec is cheaper
    ("int8", "fp16", "int8"),                   # the server's is cheaper: never send more than asked
    ("fp32", "bf16", "bf16"),
    ("fp16", "fp32", "fp16"),
    ("fp16", "bf16", "fp16"),                   # a tie keeps the server's codec
    ("int8", "int8-channel", "int8"),           # a tie keeps the server's codec
    ("fp32", "fp32", "fp32"),
    ("fp32", "topk:0.1", "topk:0.1"),
    ("topk:0.01", "int8-channel", "topk:0.01"),  # 0.055 < 1 byte/value
    ("topk:0.3", "int8-channel", "int8-channel"),  # 1.65 > 1 byte/value
    ("int8-channel", "int8-channel+zstd", "int8-channel+zstd"),
])
def test_cheaper_codec(server: str, device: str, chosen: str) -> None:
    assert cheaper_codec(server, device) == chosen


def test_shipped_profiles_update_codec_against_an_fp32_server() -> None:
    expect = {"rpi4": "int8-channel", "jetson-orin-nano": "bf16", "x86-cpu": "fp32"}
    for name, codec in expect.items():
        assert agent_runtime(name, info=_fake_x86()).update_codec("fp32") == codec
    for name in list_profiles():
        rt = agent_runtime(name, info=_fake_x86())
        chosen = rt.update_codec("fp32")
        assert codec_cost(chosen) <= codec_cost("fp32")
        # and against an int8 server no profile sends more than int8
        assert codec_cost(rt.update_codec("int8")) <= codec_cost("int8")


def _update_payload_bytes(codec: str) -> int:
    """Payload bytes of an update carrying the digits light CNN's parameters in ``codec``."""
    from edge_agent.models import build_model
    from edge_agent.state import state_arrays

    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    rng = np.random.default_rng(0)
    tensors = tuple(rng.standard_normal(t.shape).astype(np.float32) for t in state_arrays(model))
    body = Update(tensors=tensors, num_samples=10, train_loss=0.5)
    return len(encode(Envelope(round=1, sender="client-000", seq=1, body=body), Codec.parse(codec)).payload)


def test_codec_cost_order_matches_real_payloads() -> None:
    """The estimate's order agrees with encoded sizes for the fraction-based codecs."""
    codecs = ["fp32", "fp16", "int8-channel", "topk:0.1"]
    sizes = [_update_payload_bytes(c) for c in codecs]
    assert sizes == sorted(sizes, reverse=True)
    assert _update_payload_bytes("int8-channel") / _update_payload_bytes("fp32") == pytest.approx(0.25, abs=0.03)


def test_device_never_sends_more_than_asked_with_topk_count() -> None:
    server = "int8-channel"
    chosen = cheaper_codec(server, "topk:5000")
    assert _update_payload_bytes(chosen) <= _update_payload_bytes(server)


# --------------------------------------------------------------------------------------------
# assign_profiles / [agents] profile


def _hamilton(mix: list[tuple[str, float]], n: int) -> dict[str, int]:
    """Largest-remainder counts computed in exact rational arithmetic (ties: earlier entry first)."""
    quotas = [Fraction(str(f)) * n for _, f in mix]
    counts = [math.floor(q) for q in quotas]
    left = n - sum(counts)
    order = sorted(range(len(mix)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return {name: c for (name, _), c in zip(mix, counts) if c}


MIX3 = [("rpi4", 0.4), ("jetson-orin-nano", 0.4), ("x86-cpu", 0.2)]


@pytest.mark.parametrize("mix, n, expect", [
    (MIX3, 10, {"rpi4": 4, "jetson-orin-nano": 4, "x86-cpu": 2}),
    (MIX3, 100, {"rpi4": 40, "jetson-orin-nano": 40, "x86-cpu": 20}),
    (MIX3, 3, {"rpi4": 1, "jetson-orin-nano": 1, "x86-cpu": 1}),      # 1.2, 1.2, 0.6
    (MIX3, 7, {"rpi4": 3, "jetson-orin-nano": 3, "x86-cpu": 1}),      # 2.8, 2.8, 1.4
    (MIX3, 1, {"rpi4": 1}),                                           # 0.4, 0.4, 0.2: tie -> first
    ([("rpi4", 0.34), ("x86-cpu", 0.66)], 3, {"rpi4": 1, "x86-cpu": 2}),  # 1.02, 1.98
    ([("rpi4", 0.5), ("x86-cpu", 0.5)], 5, {"rpi4": 3, "x86-cpu": 2}),    # 2.5, 2.5: tie -> first
    ([("a", 0.29), ("b", 0.57), ("c", 0.14)], 100, {"a": 29, "b": 57, "c": 14}),  # 28.999…, 56.999…, 14.000…
    ([("rpi4", 1.0)], 13, {"rpi4": 13}),
])
def test_assign_profiles_counts_by_largest_remainder(mix, n, expect) -> None:
    got = assign_profiles(mix, n, seed=0)
    assert len(got) == n
    assert dict(Counter(got)) == expect == _hamilton(mix, n)


@pytest.mark.parametrize("n", [1, 2, 3, 9, 10, 11, 33, 99, 100, 101, 150, 200, 997])
def test_assign_profiles_matches_hamilton_for_many_sizes(n: int) -> None:
    for mix in (MIX3, [("rpi4", 0.34), ("x86-cpu", 0.66)],
                [("rpi4", 0.1), ("rpi5", 0.15), ("jetson-nano", 0.25), ("x86-cpu", 0.5)]):
        got = assign_profiles(mix, n, seed=3)
        assert dict(Counter(got)) == _hamilton(mix, n)
        assert set(got) <= {name for name, _ in mix}


def test_assign_profiles_order_is_seeded() -> None:
    a = assign_profiles(MIX3, 50, seed=7)
    assert a == assign_profiles(MIX3, 50, seed=7)
    others = [assign_profiles(MIX3, 50, seed=s) for s in range(8, 12)]
    assert all(Counter(o) == Counter(a) for o in others)
    assert any(o != a for o in others)  # the placement depends on the seed, the counts do not
    # placed in random order, not in blocks
    assert a != sorted(a, key=[n for n, _ in MIX3].index)


def test_assign_profiles_names_are_valid_profiles() -> None:
    cfg = config_mod.from_dict({"agents": {"profile": "rpi4=0.4,jetson-orin-nano=0.4,x86-cpu=0.2"}})
    known = set(list_profiles())
    for n in (1, 10, 57):
        for name in assign_profiles(cfg.agents.profile_mix(), n, seed=0):
            assert name in known
            assert get_profile(name).name == name


def _cfg(profile: str) -> config_mod.Config:
    return config_mod.from_dict({"agents": {"profile": profile}}, "<t>")


@pytest.mark.parametrize("text, mix", [
    ("x86-cpu", [("x86-cpu", 1.0)]),
    ("rpi4=1", [("rpi4", 1.0)]),
    ("rpi4=0.4,jetson-orin-nano=0.4,x86-cpu=0.2", MIX3),
    (" rpi4 = 0.5 , x86-cpu = 0.5 ", [("rpi4", 0.5), ("x86-cpu", 0.5)]),
    ("rpi4=0.1,rpi4=0.9", [("rpi4", 0.1), ("rpi4", 0.9)]),  # repeated names are accepted
    ("rpi4=0.3333333,x86-cpu=0.6666667", [("rpi4", 0.3333333), ("x86-cpu", 0.6666667)]),  # |sum - 1| <= 1e-6
])
def test_profile_mix_parses(text: str, mix) -> None:
    assert _cfg(text).agents.profile_mix() == mix


@pytest.mark.parametrize("text, words", [
    ("rpi4=abc,x86-cpu=0.5", "expected NAME=FRACTION"),
    ("rpi4=0,x86-cpu=1", "0 < FRACTION <= 1"),
    ("rpi4=-0.5,x86-cpu=1.5", "0 < FRACTION <= 1"),
    ("rpi4=1.5", "0 < FRACTION <= 1"),
    ("rpi4=nan,x86-cpu=1", "0 < FRACTION <= 1"),
    ("=0.5,x86-cpu=0.5", "expected NAME=FRACTION"),
    ("rpi4,x86-cpu", "expected NAME=FRACTION"),
    ("rpi4=0.5,x86-cpu=0.4", "sum to 0.9, not 1"),
    ("rpi4=0.6,x86-cpu=0.6", "sum to 1.2, not 1"),
    ("rpi4=0.333,x86-cpu=0.666", "not 1"),
])
def test_profile_mix_errors(text: str, words: str) -> None:
    with pytest.raises(ConfigError) as ei:
        _cfg(text)
    msg = str(ei.value)
    assert "<t>: [agents] profile" in msg and words in msg
    with pytest.raises(ValueError):
        config_mod.AgentsSection(profile=text).profile_mix()


@pytest.mark.parametrize("text", ["raspberry-pi-4", "rpi4=0.5,nosuch=0.5", "RPI4"])
def test_profile_mix_unknown_profile_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError) as ei:
        _cfg(text)
    assert "[agents] profile" in str(ei.value) and "unknown firmware profile" in str(ei.value)
    assert "rpi4" in str(ei.value)  # the known names are listed


# --------------------------------------------------------------------------------------------
# agent_runtime on fake hardware


def _fake_pi(memory_mb: int = 3796, providers: tuple[str, ...] = (CPU_EP,)) -> DeviceInfo:
    return DeviceInfo(platform="raspberry-pi", model="Raspberry Pi 4 Model B Rev 1.4", l4t_release=None, cpu_cores=4,
                      memory_mb=memory_mb, cuda_available=False, cuda_device=None, cuda_memory_mb=None,
                      fp16_supported=False, torch_version="2.3.0", onnx_providers_available=providers)


def _fake_x86(cores: int = 2, providers: tuple[str, ...] = (CPU_EP,)) -> DeviceInfo:
    return DeviceInfo(platform="x86", model="Intel(R) Xeon(R) Processor", l4t_release=None, cpu_cores=cores,
                      memory_mb=24_000, cuda_available=False, cuda_device=None, cuda_memory_mb=None,
                      fp16_supported=False, torch_version="2.3.0", onnx_providers_available=providers)


JOIN_KEYS = {"profile", "device", "precision", "platform", "model", "torch_threads", "batch_size", "onnx_providers",
             "fallbacks", "fallback_count", "max_packet_bytes", "chunk_bytes"}


def test_rpi4_on_a_pi_meets_its_profile() -> None:
    rt = agent_runtime("rpi4", info=_fake_pi())
    assert isinstance(rt, AgentRuntime) and rt.profile.name == "rpi4"
    p = rt.plan
    assert (str(p.device), p.precision, p.torch_threads, p.batch_size) == ("cpu", "fp32", 4, 32)
    assert p.onnx_providers == (CPU_EP,) and p.fallbacks == ()
    info = rt.join_info
    assert set(info) == JOIN_KEYS
    assert info["profile"] == "rpi4" and info["fallbacks"] == "" and info["fallback_count"] == 0
    assert info["platform"] == "raspberry-pi" and info["model"] == "Raspberry Pi 4 Model B Rev 1.4"
    assert all(isinstance(v, (str, int, bool)) for v in info.values())
    # the profile's MQTT limits (announced in the join: the server sizes downloads by them) and codec
    assert (rt.max_packet_bytes, rt.chunk_bytes) == (131072, 131072)
    assert (info["max_packet_bytes"], info["chunk_bytes"]) == (131072, 131072)
    assert rt.update_codec("fp32") == "int8-channel"


def test_rpi4_on_a_2gb_pi_reduces_the_batch() -> None:
    rt = agent_runtime("rpi4", info=_fake_pi(memory_mb=1848))
    assert rt.plan.batch_size == 32 * 1848 // 2048 == 28
    assert rt.join_info["fallback_count"] == 1
    assert "batch size reduced from 32 to 28" in rt.join_info["fallbacks"]


def test_rpi4_without_onnxruntime() -> None:
    rt = agent_runtime("rpi4", info=_fake_pi(providers=()))
    assert rt.plan.onnx_providers == ()
    assert rt.join_info["fallback_count"] == 1 and "onnxruntime is not installed" in rt.join_info["fallbacks"]


def test_jetson_orin_nano_on_a_non_cuda_x86() -> None:
    rt = agent_runtime("jetson-orin-nano", info=_fake_x86(cores=2))
    p = rt.plan
    assert (str(p.device), p.precision, p.torch_threads, p.batch_size) == ("cpu", "fp32", 2, 128)
    assert p.onnx_providers == (CPU_EP,)
    # one reason per difference, in the order device, precision, threads, providers
    assert len(p.fallbacks) == 5
    assert "cuda" in p.fallbacks[0] and "training on cpu" in p.fallbacks[0]
    assert "fp16" in p.fallbacks[1] and "fp32" in p.fallbacks[1]
    assert "torch_threads 6 > 2 cores" in p.fallbacks[2]
    assert p.fallbacks[3].startswith(TRT_EP) and p.fallbacks[4].startswith(CUDA_EP)
    info = rt.join_info
    assert set(info) == JOIN_KEYS
    assert info["profile"] == "jetson-orin-nano" and info["device"] == "cpu" and info["precision"] == "fp32"
    assert info["fallback_count"] == 5 and info["fallbacks"] == "; ".join(p.fallbacks)
    assert rt.update_codec("fp32") == "bf16"


def test_jetson_orin_nano_on_x86_with_gpu_onnxruntime_but_no_cuda() -> None:
    rt = agent_runtime("jetson-orin-nano", info=_fake_x86(cores=8, providers=(TRT_EP, CUDA_EP, CPU_EP)))
    p = rt.plan
    assert p.onnx_providers == (CPU_EP,) and p.torch_threads == 6
    assert sum("needs a CUDA device and none is available" in f for f in p.fallbacks) == 2
    assert rt.join_info["fallback_count"] == len(p.fallbacks) == 4


def test_link_s_by_hand() -> None:
    rt = agent_runtime("rpi4", info=_fake_pi())
    # 14,393 bytes up at 5,000 kbit/s, 1 % loss, 60 ms RTT
    assert rt.link_s(14_393, "up") == pytest.approx(14_393 * 8 / 5_000_000 / 0.99 + 0.060)
    assert rt.link_s(54_952, "down") == pytest.approx(54_952 * 8 / 20_000_000 / 0.99 + 0.060)
    assert rt.link_s(0, "up") == pytest.approx(0.060)
    with pytest.raises(ValueError):
        rt.link_s(10, "sideways")


def test_agent_runtime_accepts_a_loaded_profile_and_refuses_unknown_names() -> None:
    from edge_agent.profiles import ProfileError

    prof = get_profile("x86-cpu")
    assert agent_runtime(prof, info=_fake_x86(cores=8)).plan.fallbacks == ()
    with pytest.raises(ProfileError):
        agent_runtime("nosuch", info=_fake_x86())


# --------------------------------------------------------------------------------------------
# integration: a small mixed fleet


MIXED = "rpi4=0.34,x86-cpu=0.66"


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[config_mod.Config, Path]:
    from broker_server.simulate import simulate

    cfg = config_mod.from_dict({
        "run": {"name": "runtime", "seed": 0, "rounds": 1},
        "data": {"dataset": "digits", "partition": "iid", "clients": 3},
        "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "server": {"quorum": 3, "round_deadline_s": 60.0, "join_timeout_s": 60.0},
        "agents": {"profile": MIXED},
    }, "<mixed>")
    run_dir = tmp_path_factory.mktemp("mixed") / "run"
    res = simulate(cfg, run_dir=run_dir)
    assert res.rounds_completed == 1 and res.metrics[0]["clients_reported"] == 3
    return cfg, run_dir


def _rows(run_dir: Path, where: str) -> list[dict]:
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    db.row_factory = sqlite3.Row
    rows = [dict(r) for r in db.execute(f"SELECT * FROM messages WHERE {where} ORDER BY id")]
    db.close()
    return rows


@pytest.mark.slow
def test_mixed_fleet_codecs_and_joins(mixed_run) -> None:
    from edge_agent.device import detect

    cfg, run_dir = mixed_run
    profiles = assign_profiles(cfg.agents.profile_mix(), 3, cfg.run.seed)
    assert Counter(profiles) == {"rpi4": 1, "x86-cpu": 2}  # 1.02 / 1.98 by largest remainder
    of = {f"client-{i:03d}": p for i, p in enumerate(profiles)}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["profiles"] == {"rpi4": 1, "x86-cpu": 2} and summary["agent_errors"] == []
    assert summary["emulated_link_s"] is None  # emulate_link is off

    # the update each agent sent (agent-side rows; one whole message each, none chunked here)
    ups = _rows(run_dir, "side='agent' AND kind='update' AND event='sent'")
    assert sorted(u["client"] for u in ups) == sorted(of)
    for u in ups:
        assert u["codec"] == {"rpi4": "int8-channel", "x86-cpu": "fp32"}[of[u["client"]]]
        assert u["transfer_id"] is None
    pi = [u["payload_bytes"] for u in ups if of[u["client"]] == "rpi4"]
    x86 = [u["payload_bytes"] for u in ups if of[u["client"]] == "x86-cpu"]
    assert len(set(x86)) == 1 and len({u["raw_bytes"] for u in ups}) == 1  # same model, same raw bytes
    assert x86[0] >= ups[0]["raw_bytes"]  # fp32 carries every raw byte
    assert pi[0] / x86[0] == pytest.approx(0.25, abs=0.03)  # 1 byte per value + per-channel scales
    # the server received exactly these payloads
    received = _rows(run_dir, "side='server' AND kind='update' AND event='received'")
    got = {r["client"]: r["payload_bytes"] for r in received}
    assert got == {u["client"]: u["payload_bytes"] for u in ups}

    # the server kept what each device announced in its join: registry.json and the checkpoint
    registry = {d["client_id"]: d for d in json.loads((run_dir / "registry.json").read_text())["devices"]}
    assert set(registry) == set(of)
    hw = detect()
    for cid, p in of.items():
        expect = agent_runtime(p, info=hw).join_info  # computed here, not read from the agent
        dev = registry[cid]
        assert dev["profile"] == p
        for key in ("profile", "fallbacks", "fallback_count", "device", "precision", "torch_threads"):
            assert dev["info"][key] == expect[key], (cid, key)
        assert dev["info"]["fallback_count"] == len([f for f in expect["fallbacks"].split("; ") if f])
    from broker_server.checkpoint import CheckpointStore

    store = CheckpointStore(run_dir / "checkpoints.sqlite")
    try:
        ckpt = store.load()
    finally:
        store.close()
    saved = {r["client_id"]: r for r in ckpt.registry}
    assert ({cid: saved[cid]["info"]["fallbacks"] for cid in of}
            == {cid: registry[cid]["info"]["fallbacks"] for cid in of})


@pytest.mark.slow
def test_server_ledger_records_the_codec_of_received_updates(mixed_run) -> None:
    _, run_dir = mixed_run
    sent = {r["client"]: r["codec"] for r in _rows(run_dir, "side='agent' AND kind='update' AND event='sent'")}
    recv = {r["client"]: r["codec"] for r in _rows(run_dir, "side='server' AND kind='update' AND event='received'")}
    assert recv == sent
