"""Firmware profiles (edge_agent.profiles, firmware_profiles/*.toml, ``fedfleet profiles``).

Every shipped profile is loaded, and what its numbers imply is recomputed (STYLE 15): the light
CNN's default FedAvg update, encoded for real with the profile's update codec, goes as one PUBLISH
packet within ``max_packet_bytes`` or as a chunked transfer whose every chunk packet fits; the
file comments' claims (one packet / N chunks) hold. A table of broken files, each with an id,
must be refused with a message naming the file and the key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch

from broker_server.cli import main
from edge_agent import profiles as profiles_mod
from edge_agent.errors import EdgeAgentError
from edge_agent.models import build_model
from edge_agent.profiles import (
    PROFILES_ENV,
    SCHEMA,
    SHIPPED_DIR,
    FirmwareProfile,
    ProfileError,
    get_profile,
    link_time_s,
    list_profiles,
    load_profile,
)
from edge_agent.state import state_arrays
from protocol import topics
from protocol.chunking import chunk_data_budget, needs_chunking, split
from protocol.messages import Envelope, Kind, Update, encode
from protocol.mqtt_bytes import publish_size
from protocol.tensors import Codec

REQUIRED = ("jetson-nano", "jetson-orin-nano", "jetson-xavier-nx", "rpi4", "rpi5", "x86-cpu", "x86-cuda")

#: what each file's comment says about the light CNN's update: None = one packet, N = N chunks
UPDATE_CHUNKS = {"rpi4": None, "rpi5": None, "jetson-nano": 4, "jetson-xavier-nx": 2,
                 "jetson-orin-nano": None, "x86-cpu": None, "x86-cuda": None}

SENDER = "device-0001"
QOS = 1  # [protocol] qos default


@pytest.fixture(autouse=True)
def _no_user_profiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROFILES_ENV, raising=False)


@pytest.fixture(scope="module")
def update_tensors() -> tuple[np.ndarray, ...]:
    """The light CNN's state (28×28 grayscale, 10 classes) as FedAvg uploads it."""
    torch.manual_seed(0)
    model = build_model("lightcnn")
    backbone = sum(p.numel() for p in model.backbone.parameters())
    head = sum(p.numel() for p in model.classifier.parameters())
    assert (backbone, head) == (105_216, 64 * 10 + 10)
    arrays = state_arrays(model)
    assert all(a.dtype == np.float32 for a in arrays)
    assert sum(a.size for a in arrays) == 105_866
    return arrays


def _toml(value) -> str:
    """A tiny TOML writer for the broken-file table (tests must write what the loader refuses)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value == math.inf else repr(value))
    if isinstance(value, (int, str)):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(value)


def _dump(raw: dict) -> str:
    top = [f"{k} = {_toml(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    tables = [f"\n[{k}]\n" + "\n".join(f"{kk} = {_toml(vv)}" for kk, vv in v.items())
              for k, v in raw.items() if isinstance(v, dict)]
    return "\n".join(top) + "\n" + "\n".join(tables) + "\n"


# --------------------------------------------------------------------------------------------
# Shipped profiles


def test_required_profiles_are_shipped() -> None:
    assert set(REQUIRED) <= set(list_profiles())
    assert set(UPDATE_CHUNKS) == set(list_profiles())  # a new profile needs its claim below


@pytest.mark.parametrize("name", REQUIRED)
def test_profile_schema(name: str, tmp_path: Path) -> None:
    path = SHIPPED_DIR / f"{name}.toml"
    raw = tomllib.loads(path.read_text(encoding="utf-8"))
    assert list(raw) == list(SCHEMA), "keys in schema order, every key present"
    text = path.read_text(encoding="utf-8")
    assert text.startswith("#") and "Sources" in text, "each file cites its sources in a comment"
    prof = get_profile(name)
    assert prof == load_profile(path)
    assert prof.name == name and prof.source == str(path)
    assert prof.onnx_providers[-1] == "CPUExecutionProvider"
    assert (prof.precision == "fp16") <= (prof.accelerator == "cuda")
    assert 1 <= prof.torch_threads <= prof.cpu_cores or prof.torch_threads == 0  # 0: one per core of the machine
    assert 1 <= prof.memory_budget_mb <= prof.ram_mb
    assert 64 <= prof.mqtt.chunk_bytes <= prof.mqtt.max_packet_bytes
    assert 0 <= prof.link.loss_percent < 100
    for text_codec in (prof.preferred_codecs.update_codec, prof.preferred_codecs.global_codec):
        assert str(Codec.parse(text_codec)) == text_codec, "codec written in canonical form"
    # the TOML rendering reads back to the same profile
    out = tmp_path / f"{name}.toml"
    out.write_text(prof.to_toml(), encoding="utf-8")
    assert load_profile(out) == prof
    assert prof.as_dict()["link"] == raw["link"] and prof.as_dict()["onnx_providers"] == raw["onnx_providers"]


def test_reference_speed() -> None:
    speeds = {n: get_profile(n).relative_compute_speed for n in REQUIRED}
    assert speeds["x86-cpu"] == 1.0
    assert speeds["rpi4"] < speeds["rpi5"] < speeds["x86-cpu"] < speeds["x86-cuda"]


@pytest.mark.parametrize("name", REQUIRED)
def test_default_update_fits_or_is_chunked(name: str, update_tensors) -> None:
    prof = get_profile(name)
    codec = Codec.parse(prof.preferred_codecs.update_codec)
    env = Envelope(round=100_000, sender=SENDER, seq=2**32, timestamp_ms=2**63 - 1,
                   body=Update(tensors=update_tensors, num_samples=60_000, train_loss=0.1234,
                               metrics={"train_accuracy": 0.9, "train_seconds": 12.5}))
    enc = encode(env, codec)
    assert enc.raw_tensor_bytes == 105_866 * 4 == 423_464
    payload = enc.payload
    topic = topics.up("fedfleet-test", SENDER, Kind.UPDATE)
    max_packet, chunk_bytes = prof.mqtt.max_packet_bytes, prof.mqtt.chunk_bytes
    chunked = needs_chunking(topic, len(payload), max_packet_bytes=max_packet, chunk_bytes=chunk_bytes, qos=QOS)
    if not chunked:
        assert publish_size(topic, len(payload), QOS).packet_bytes <= max_packet
        assert len(payload) <= chunk_bytes
        assert UPDATE_CHUNKS[name] is None, f"{name}: comment says chunked, update goes as one packet"
        return
    budget = min(chunk_bytes, chunk_data_budget(topic, max_packet, qos=QOS, sender=SENDER, round=env.round))
    assert budget > 0
    chunks = split(payload, chunk_bytes=budget)
    assert len(chunks) == UPDATE_CHUNKS[name], f"{name}: the comment's chunk count"
    for i, chunk in enumerate(chunks):
        cenc = encode(Envelope(round=env.round, sender=SENDER, seq=2**32 + 1 + i, timestamp_ms=2**63 - 1, body=chunk))
        assert publish_size(topic, len(cenc.payload), QOS).packet_bytes <= max_packet


def test_chunk_budget_positive_for_every_profile() -> None:
    for name in list_profiles():
        prof = get_profile(name)
        topic = topics.up("fedfleet-test", SENDER, Kind.UPDATE)
        assert chunk_data_budget(topic, prof.mqtt.max_packet_bytes, qos=QOS, sender=SENDER, round=100_000) > 0


# --------------------------------------------------------------------------------------------
# Link time


def test_link_time_by_hand() -> None:
    rpi4 = get_profile("rpi4")  # 5,000 up / 20,000 down kbit/s, 60 ms, 1 % loss
    # 423,464 bytes = 3,387,712 bit; / 5,000,000 bit/s = 0.6775424 s; / 0.99 = 0.6843862626 s; + 0.06 s
    assert link_time_s(rpi4, 423_464, "up") == pytest.approx(0.7443862626, rel=1e-9)
    # / 20,000,000 bit/s = 0.1693856 s; / 0.99 = 0.1710965657 s; + 0.06 s
    assert link_time_s(rpi4, 423_464, "down") == pytest.approx(0.2310965657, rel=1e-9)
    assert link_time_s(rpi4, 0, "up") == pytest.approx(0.06)
    x86 = get_profile("x86-cpu")  # 940,000 kbit/s, 0.5 ms, no loss: 8e6 bit / 9.4e8 bit/s + 0.0005 s
    assert link_time_s(x86, 1_000_000, "down") == pytest.approx(8e6 / 9.4e8 + 0.0005, rel=1e-12)


@pytest.mark.parametrize("nbytes, direction", [(-1, "up"), (1.5, "up"), (True, "up"), (10, "sideways")],
                         ids=["negative", "float", "bool", "bad-direction"])
def test_link_time_bad_arguments(nbytes, direction) -> None:
    with pytest.raises(ValueError):
        link_time_s(get_profile("rpi4"), nbytes, direction)


# --------------------------------------------------------------------------------------------
# Broken files


def _set(raw: dict, key: str, value) -> None:
    table, _, leaf = key.rpartition(".")
    target = raw[table] if table else raw
    if value is _DELETE:
        del target[leaf]
    else:
        target[leaf] = value


_DELETE = object()

BROKEN = [
    # id, {dotted key: value (or _DELETE)}, key the message must name
    ("unknown-top-key", {"torch_thread": 4}, "torch_thread"),
    ("unknown-link-key", {"link.bandwidth_kbps": 10.0}, "bandwidth_kbps"),
    ("unknown-table", {"gpu": {"cores": 128}}, "gpu"),
    ("missing-key", {"precision": _DELETE}, "precision"),
    ("missing-table-key", {"link.rtt_ms": _DELETE}, "rtt_ms"),
    ("missing-table", {"mqtt": _DELETE}, "mqtt"),
    ("table-not-table", {"link": 5}, "link"),
    ("bool-as-int", {"torch_threads": True}, "torch_threads"),
    ("float-as-int", {"batch_size": 32.0}, "batch_size"),
    ("bool-as-float", {"link.uplink_kbps": True}, "uplink_kbps"),
    ("string-as-number", {"link.uplink_kbps": "5000"}, "uplink_kbps"),
    ("negative-uplink", {"link.uplink_kbps": -1.0}, "uplink_kbps"),
    ("zero-downlink", {"link.downlink_kbps": 0}, "downlink_kbps"),
    ("inf-downlink", {"link.downlink_kbps": math.inf}, "downlink_kbps"),
    ("nan-rtt", {"link.rtt_ms": math.nan}, "rtt_ms"),
    ("negative-rtt", {"link.rtt_ms": -5.0}, "rtt_ms"),
    ("loss-100", {"link.loss_percent": 100.0}, "loss_percent"),
    ("loss-negative", {"link.loss_percent": -0.1}, "loss_percent"),
    ("unknown-accelerator", {"accelerator": "tpu"}, "accelerator"),
    ("unknown-precision", {"precision": "int8"}, "precision"),
    ("fp16-on-cpu", {"precision": "fp16"}, "precision"),
    ("providers-not-ending-in-cpu", {"onnx_providers": ["CPUExecutionProvider", "XnnpackExecutionProvider"]},
     "onnx_providers"),
    ("providers-unknown-name", {"onnx_providers": ["CudaExecutionProvider", "CPUExecutionProvider"]},
     "onnx_providers"),
    ("providers-empty", {"onnx_providers": []}, "onnx_providers"),
    ("providers-not-list", {"onnx_providers": "CPUExecutionProvider"}, "onnx_providers"),
    ("providers-duplicate", {"onnx_providers": ["CPUExecutionProvider", "CPUExecutionProvider"]}, "onnx_providers"),
    ("cuda-provider-on-cpu", {"onnx_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]}, "onnx_providers"),
    ("cuda-without-cuda-provider", {"accelerator": "cuda"}, "onnx_providers"),
    ("codec-unknown", {"preferred_codecs.update_codec": "int4"}, "update_codec"),
    ("codec-topk-zero", {"preferred_codecs.update_codec": "topk:0"}, "update_codec"),
    ("codec-bad-suffix", {"preferred_codecs.global_codec": "fp16+gzip"}, "global_codec"),
    ("codec-not-string", {"preferred_codecs.global_codec": 16}, "global_codec"),
    ("chunk-above-max-packet", {"mqtt.chunk_bytes": 262_144}, "chunk_bytes"),
    ("chunk-tiny", {"mqtt.chunk_bytes": 16}, "chunk_bytes"),
    ("max-packet-tiny", {"mqtt.max_packet_bytes": 512, "mqtt.chunk_bytes": 256}, "max_packet_bytes"),
    ("max-packet-above-mqtt", {"mqtt.max_packet_bytes": 268_435_461}, "max_packet_bytes"),
    ("memory-zero", {"memory_budget_mb": 0}, "memory_budget_mb"),
    ("memory-above-ram", {"memory_budget_mb": 8192}, "memory_budget_mb"),
    ("threads-negative", {"torch_threads": -1}, "torch_threads"),
    ("threads-above-cores", {"torch_threads": 8}, "torch_threads"),
    ("batch-zero", {"batch_size": 0}, "batch_size"),
    ("speed-zero", {"relative_compute_speed": 0.0}, "relative_compute_speed"),
    ("name-not-stem", {"name": "rpi4"}, "name"),
    ("name-invalid", {"name": "bad/name"}, "name"),
    ("description-empty", {"description": "  "}, "description"),
]


@pytest.mark.parametrize("changes, key", [pytest.param(c, k, id=i) for i, c, k in BROKEN])
def test_broken_profile_refused(changes: dict, key: str, tmp_path: Path) -> None:
    raw = tomllib.loads((SHIPPED_DIR / "rpi4.toml").read_text(encoding="utf-8"))
    raw["name"] = "broken-dev"
    for k, v in changes.items():
        _set(raw, k, v)
    path = tmp_path / "broken-dev.toml"
    path.write_text(_dump(raw), encoding="utf-8")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    msg = str(info.value)
    assert str(path) in msg and key in msg, msg
    assert info.value.path == str(path)
    assert info.value.key is not None and info.value.key.split(".")[-1] == key


def test_broken_control_case_loads(tmp_path: Path) -> None:
    """The table's base file, unchanged but renamed, is valid (so each case fails for its own reason)."""
    raw = tomllib.loads((SHIPPED_DIR / "rpi4.toml").read_text(encoding="utf-8"))
    raw["name"] = "broken-dev"
    path = tmp_path / "broken-dev.toml"
    path.write_text(_dump(raw), encoding="utf-8")
    assert load_profile(path).link == get_profile("rpi4").link


def test_range_message_wording(tmp_path: Path) -> None:
    raw = tomllib.loads((SHIPPED_DIR / "rpi4.toml").read_text(encoding="utf-8"))
    raw["link"]["loss_percent"] = 100.0
    path = tmp_path / "rpi4.toml"
    path.write_text(_dump(raw), encoding="utf-8")
    with pytest.raises(ProfileError, match=r"\[link\] loss_percent = 100\.0 is outside the allowed range \[0, 100\)"):
        load_profile(path)
    raw["link"]["loss_percent"] = 1.0
    raw["mqtt"]["max_packet_bytes"] = 268_435_461
    path.write_text(_dump(raw), encoding="utf-8")
    with pytest.raises(ProfileError, match=r"\[mqtt\] max_packet_bytes = 268435461 is outside the allowed "
                                           r"range \[1024, 268435460\]"):
        load_profile(path)


@pytest.mark.parametrize("content", ["name = ", b"\xff\xfe"], ids=["not-toml", "not-utf8"])
def test_unreadable_file(content, tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ProfileError, match="x.toml"):
        load_profile(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "none.toml")


# --------------------------------------------------------------------------------------------
# Search


def test_user_folder_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = tomllib.loads((SHIPPED_DIR / "rpi4.toml").read_text(encoding="utf-8"))
    raw["batch_size"] = 8
    (tmp_path / "rpi4.toml").write_text(_dump(raw), encoding="utf-8")
    raw["name"] = "my-pi"
    (tmp_path / "my-pi.toml").write_text(_dump(raw), encoding="utf-8")
    monkeypatch.setenv(PROFILES_ENV, str(tmp_path))
    assert get_profile("rpi4").batch_size == 8
    assert get_profile("rpi5").name == "rpi5"  # shipped ones stay reachable
    assert "my-pi" in list_profiles() and set(REQUIRED) <= set(list_profiles())
    assert get_profile("rpi4", dirs=[SHIPPED_DIR]).batch_size == 32


def test_env_folder_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROFILES_ENV, str(tmp_path / "nope"))
    with pytest.raises(ProfileError, match=f"nope.*{PROFILES_ENV}"):
        list_profiles()


def test_installed_without_profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiles_mod, "SHIPPED_DIR", tmp_path / "not-installed")
    with pytest.raises(ProfileError, match=PROFILES_ENV):
        get_profile("rpi4")


@pytest.mark.parametrize("name", ["rpi3", "../firmware_profiles/rpi4", "", "RPI4"])
def test_unknown_name_lists_known(name: str) -> None:
    with pytest.raises(ProfileError) as info:
        get_profile(name)
    assert "unknown firmware profile" in str(info.value)
    assert all(n in str(info.value) for n in REQUIRED)


# --------------------------------------------------------------------------------------------
# API conventions


def test_public_api() -> None:
    assert profiles_mod.__all__ == sorted(profiles_mod.__all__)
    assert all(hasattr(profiles_mod, n) for n in profiles_mod.__all__)
    assert issubclass(ProfileError, EdgeAgentError)
    prof = get_profile("rpi4")
    with pytest.raises(AttributeError):
        prof.batch_size = 1  # type: ignore[misc]
    assert isinstance(prof, FirmwareProfile)


def test_provider_names_cover_onnxruntime() -> None:
    ort = pytest.importorskip("onnxruntime")
    assert set(ort.get_all_providers()) <= profiles_mod.ONNX_PROVIDERS


# --------------------------------------------------------------------------------------------
# CLI


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["name", "accel", "precision"]
    rows = {line.split()[0]: line.split() for line in out[2:]}
    assert set(rows) == set(list_profiles())
    assert rows["rpi4"] == ["rpi4", "cpu", "fp32", "4/4", "2,048/4,096", "5,000", "20,000", "60", "1",
                            "131,072", "131,072", "int8-channel", "0.05"]


def test_cli_show(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles", "show", "rpi4"]) == 0
    text = capsys.readouterr().out
    assert profiles_mod.from_dict(tomllib.loads(text)) == get_profile("rpi4")
    assert main(["profiles", "show", str(SHIPPED_DIR / "rpi5.toml")]) == 0
    assert 'name = "rpi5"' in capsys.readouterr().out


def test_cli_unknown_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles", "show", "rpi3"]) == 2
    err = capsys.readouterr().err
    assert "unknown firmware profile 'rpi3'" in err and "rpi4" in err


def test_cli_invalid_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    raw = tomllib.loads((SHIPPED_DIR / "rpi4.toml").read_text(encoding="utf-8"))
    raw["precision"] = "fp16"
    (tmp_path / "rpi4.toml").write_text(_dump(raw), encoding="utf-8")
    monkeypatch.setenv(PROFILES_ENV, str(tmp_path))
    for argv in (["profiles"], ["profiles", "show", "rpi4"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert str(tmp_path / "rpi4.toml") in err and "precision" in err
