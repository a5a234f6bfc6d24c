"""Firmware profiles: one strictly checked TOML file per device class (DESIGN §6).

A profile says what a device class can do and what its link costs: accelerator, ONNX Runtime
execution providers in order of preference, torch threads, training precision, batch size and
memory budget, the network link (kbit/s, RTT, loss), the MQTT packet limits and the codecs it
prefers, and a relative compute speed for fleet simulation. The agent applies a profile and falls
back (with a logged reason) when the hardware offers less than the profile asks.

Example (``firmware_profiles/rpi4.toml``, abridged)::

    name = "rpi4"
    description = "Raspberry Pi 4 Model B (4 GB) on an LTE field link"
    accelerator = "cpu"
    onnx_providers = ["CPUExecutionProvider"]
    cpu_cores = 4
    torch_threads = 4
    precision = "fp32"
    batch_size = 32
    ram_mb = 4096
    memory_budget_mb = 2048
    relative_compute_speed = 0.05

    [link]
    uplink_kbps = 5000.0
    downlink_kbps = 20000.0
    rtt_ms = 60.0
    loss_percent = 1.0

    [mqtt]
    max_packet_bytes = 131072
    chunk_bytes = 131072

    [preferred_codecs]
    update_codec = "int8-channel"
    global_codec = "fp16"

**Strict** (STYLE 8): every key of :data:`SCHEMA` is required, an unknown key is refused, a
``bool`` is not an ``int``, numbers must lie in the ranges of :data:`SCHEMA`, and the cross-field
rules hold (``torch_threads <= cpu_cores``, 0 = one per core of the machine, ``memory_budget_mb <= ram_mb``,
``chunk_bytes <= max_packet_bytes``, ``fp16`` only with ``cuda``, providers known, unique and
ending in ``CPUExecutionProvider``, CUDA/TensorRT providers only with ``cuda``, codec texts in the
:meth:`protocol.tensors.Codec.parse` grammar, ``name`` equal to the file's stem). Every refusal is
a :class:`ProfileError` whose message names the file, the key, the value and the allowed range
or values — the same wording as :mod:`broker_server.config`.

Where profiles are found (:func:`search_dirs`): the folders listed in the environment variable
``FEDFLEET_PROFILES`` (separated by ``os.pathsep``; a user's profile shadows a shipped one of the
same name), then the repository's ``firmware_profiles/`` folder (``<repo>/firmware_profiles``,
located from this file). ``firmware_profiles/`` is a top-level folder, not a Python package: an
installed (non-editable) wheel does not carry it, and then only ``FEDFLEET_PROFILES`` provides
profiles; a search with no folder at all raises :class:`ProfileError` saying so.

Units: kbit/s = 1000 bit/s, ms, percent, bytes; ``*_mb`` are MiB (2²⁰ bytes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from edge_agent.errors import EdgeAgentError

__all__ = [
    "ACCELERATORS",
    "CodecPreference",
    "FirmwareProfile",
    "LinkProfile",
    "MqttProfile",
    "ONNX_PROVIDERS",
    "PRECISIONS",
    "PROFILES_ENV",
    "ProfileError",
    "SCHEMA",
    "SHIPPED_DIR",
    "from_dict",
    "get_profile",
    "link_time_s",
    "list_profiles",
    "load_profile",
    "search_dirs",
]

PROFILES_ENV = "FEDFLEET_PROFILES"
"""Environment variable: folders (``os.pathsep``-separated) searched before the shipped profiles."""

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "firmware_profiles"
"""The repository's ``firmware_profiles/`` folder (absent in a non-editable install)."""

ACCELERATORS = ("cpu", "cuda")
PRECISIONS = ("fp32", "fp16")

#: ONNX Runtime execution provider names (``onnxruntime.get_all_providers()`` of ORT 1.16–1.2x,
#: plus providers removed from recent releases: ROCm, ACL, ArmNN, TVM, SNPE).
ONNX_PROVIDERS = frozenset({
    "ACLExecutionProvider",
    "ArmNNExecutionProvider",
    "AzureExecutionProvider",
    "CANNExecutionProvider",
    "CPUExecutionProvider",
    "CUDAExecutionProvider",
    "CoreMLExecutionProvider",
    "DmlExecutionProvider",
    "DnnlExecutionProvider",
    "JsExecutionProvider",
    "MIGraphXExecutionProvider",
    "NnapiExecutionProvider",
    "NvTensorRTRTXExecutionProvider",
    "OpenVINOExecutionProvider",
    "QNNExecutionProvider",
    "ROCMExecutionProvider",
    "RknpuExecutionProvider",
    "SNPEExecutionProvider",
    "TensorrtExecutionProvider",
    "TvmExecutionProvider",
    "VSINPUExecutionProvider",
    "VitisAIExecutionProvider",
    "WebGpuExecutionProvider",
    "WebNNExecutionProvider",
    "XnnpackExecutionProvider",
})

_NVIDIA_PROVIDERS = frozenset({"CUDAExecutionProvider", "TensorrtExecutionProvider",
                               "NvTensorRTRTXExecutionProvider"})
_MAX_PACKET = 268_435_460  # largest MQTT packet: 1 + 4 header bytes + 268,435,455 remaining


class ProfileError(EdgeAgentError):
    """A firmware profile is missing, unreadable, or invalid (unknown key, wrong type, value out
    of range, inconsistent fields), or a profile name is unknown.

    Defined here rather than in :mod:`edge_agent.errors`; it sits directly under
    :class:`~edge_agent.errors.EdgeAgentError`. The caller fixes the file or the name the
    message gives.

    Attributes:
        path: the profile file concerned, or ``None`` (unknown name, no folder found).
        key: the offending key as ``"uplink_kbps"`` / ``"link.uplink_kbps"``, or ``None``.
    """

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.key = key


# --------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """The device's network link to the broker (``[link]``).

    Attributes:
        uplink_kbps: device → broker goodput, kbit/s (1 kbit = 1000 bit), > 0.
        downlink_kbps: broker → device goodput, kbit/s, > 0.
        rtt_ms: round-trip time device ↔ broker, milliseconds, ≥ 0.
        loss_percent: packet loss, percent in [0, 100).
    """

    uplink_kbps: float
    downlink_kbps: float
    rtt_ms: float
    loss_percent: float


@dataclass(frozen=True, slots=True)
class MqttProfile:
    """MQTT limits the device works under (``[mqtt]``).

    Attributes:
        max_packet_bytes: largest whole PUBLISH packet (fixed header + topic + packet id + payload)
            the broker accepts, bytes; 1024 .. 268,435,460 (the MQTT maximum).
        chunk_bytes: payload size above which a message goes as a chunked transfer, and the
            largest chunk data, bytes; 64 .. ``max_packet_bytes`` (see
            :func:`protocol.chunking.needs_chunking`).
    """

    max_packet_bytes: int
    chunk_bytes: int


@dataclass(frozen=True, slots=True)
class CodecPreference:
    """Tensor codecs the device prefers (``[preferred_codecs]``), in the grammar of
    :meth:`protocol.tensors.Codec.parse` (``"fp16"``, ``"int8-channel"``, ``"topk:0.1:fp16+zstd"``).

    Attributes:
        update_codec: codec of the ``update`` messages the device sends.
        global_codec: codec of the ``global`` messages it would like to receive.
    """

    update_codec: str
    global_codec: str


@dataclass(frozen=True, slots=True)
class FirmwareProfile:
    """One device class.

    Attributes:
        name: profile name, equal to the file's stem, a valid client id (``[A-Za-z0-9_.-]``,
            ≤ 64 characters; announced in ``join``).
        description: one line for people.
        accelerator: ``"cpu"`` or ``"cuda"``.
        onnx_providers: ONNX Runtime execution providers in order of preference, unique, always
            ending in ``"CPUExecutionProvider"``.
        cpu_cores: CPU cores of the device (physical), ≥ 1.
        torch_threads: ``torch.set_num_threads`` value, 1 .. ``cpu_cores``; ``0``: one per core
            of the machine the agent runs on (a reference class such as ``x86-cpu``, whose
            machines differ: no fallback warning on a smaller one).
        precision: ``"fp32"``, or ``"fp16"`` (autocast mixed precision; ``cuda`` only).
        batch_size: default local training batch size, ≥ 1.
        ram_mb: memory the training runs in, MiB: the SoC's unified RAM (Pi, Jetson), the
            system RAM (x86 CPU), the GPU's own memory (x86 CUDA).
        memory_budget_mb: part of ``ram_mb`` the agent may use for training (model, optimiser
            state, activations, data), MiB, 1 .. ``ram_mb``.
        relative_compute_speed: training throughput relative to the ``x86-cpu`` profile (1.0),
            > 0; an estimate used to simulate stragglers.
        link, mqtt, preferred_codecs: the tables above.
        source: where the profile was read from (not part of the schema; ignored by ``==``).
    """

    name: str
    description: str
    accelerator: str
    onnx_providers: tuple[str, ...]
    cpu_cores: int
    torch_threads: int
    precision: str
    batch_size: int
    ram_mb: int
    memory_budget_mb: int
    relative_compute_speed: float
    link: LinkProfile
    mqtt: MqttProfile
    preferred_codecs: CodecPreference
    source: str = dataclasses.field(default="<dict>", compare=False)

    def as_dict(self) -> dict[str, Any]:
        """The schema fields as plain data (tables as nested dicts, providers as a list)."""
        out: dict[str, Any] = {}
        for key, spec in SCHEMA.items():
            value = getattr(self, key)
            if isinstance(spec, dict):
                out[key] = {k: getattr(value, k) for k in spec}
            else:
                out[key] = list(value) if isinstance(value, tuple) else value
        return out

    def to_toml(self) -> str:
        """The profile as TOML text that :func:`load_profile` reads back to an equal profile."""
        lines = [f"# firmware profile {self.name} (resolved from {self.source})"]
        tables = []
        for key, value in self.as_dict().items():
            if isinstance(value, dict):
                tables.append((key, value))
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        for key, table in tables:
            lines.append(f"\n[{key}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in table.items())
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Schema


@dataclass(frozen=True, slots=True)
class _Num:
    """A number of ``type`` in [lo, hi] (``(`` / ``)`` when an end is open)."""

    type: type
    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def ok(self, v: float) -> bool:
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return math.isfinite(v) and above and below

    def text(self) -> str:
        def fmt(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else repr(float(x))

        return f"{'(' if self.lo_open else '['}{fmt(self.lo)}, {fmt(self.hi)}{')' if self.hi_open else ']'}"


@dataclass(frozen=True, slots=True)
class _Str:
    """A string, one of ``choices`` when given, else non-empty and at most ``max_len`` characters."""

    choices: tuple[str, ...] = ()
    max_len: int = 1024


@dataclass(frozen=True, slots=True)
class _StrList:
    """A non-empty list of strings from ``choices``."""

    choices: frozenset[str]


#: key -> rule; a nested dict is a TOML table. Every key is required.
SCHEMA: dict[str, Any] = {
    "name": _Str(max_len=64),
    "description": _Str(),
    "accelerator": _Str(ACCELERATORS),
    "onnx_providers": _StrList(ONNX_PROVIDERS),
    "cpu_cores": _Num(int, 1, 1024),
    "torch_threads": _Num(int, 0, 1024),
    "precision": _Str(PRECISIONS),
    "batch_size": _Num(int, 1, 65536),
    "ram_mb": _Num(int, 1, 16 * 1024 * 1024),
    "memory_budget_mb": _Num(int, 1, 16 * 1024 * 1024),
    "relative_compute_speed": _Num(float, 0, 10_000, lo_open=True),
    "link": {
        "uplink_kbps": _Num(float, 0, 100_000_000, lo_open=True),
        "downlink_kbps": _Num(float, 0, 100_000_000, lo_open=True),
        "rtt_ms": _Num(float, 0, 60_000),
        "loss_percent": _Num(float, 0, 100, hi_open=True),
    },
    "mqtt": {
        "max_packet_bytes": _Num(int, 1024, _MAX_PACKET),
        "chunk_bytes": _Num(int, 64, 256 * 1024 * 1024),
    },
    "preferred_codecs": {
        "update_codec": _Str(),
        "global_codec": _Str(),
    },
}

_TABLE_TYPES = {"link": LinkProfile, "mqtt": MqttProfile, "preferred_codecs": CodecPreference}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def _where(table: str | None, key: str) -> str:
    return f"[{table}] {key}" if table else key


def _check_value(value: Any, rule: Any, src: str, table: str | None, key: str) -> Any:
    """Type and range of one value; returns it normalised (int → float, list → tuple)."""
    where = f"{src}: {_where(table, key)}"
    dotted = f"{table}.{key}" if table else key

    def fail(msg: str) -> ProfileError:
        return ProfileError(f"{where}{msg}", path=src, key=dotted)

    if isinstance(rule, _Num):
        if rule.type is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise fail(f": expected an integer in {rule.text()}, got {value!r}")
        if rule.type is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise fail(f": expected a number in {rule.text()}, got {value!r}")
            value = float(value)
        if not rule.ok(value):
            raise fail(f" = {value!r} is outside the allowed range {rule.text()}")
        return value
    if isinstance(rule, _Str):
        if not isinstance(value, str):
            raise fail(f": expected a string, got {value!r}")
        if rule.choices and value not in rule.choices:
            raise fail(f" = {value!r} is not one of {', '.join(rule.choices)}")
        if not value.strip() or len(value) > rule.max_len:
            raise fail(f" = {value!r}: expected a non-empty string of at most {rule.max_len} characters")
        return value
    if isinstance(rule, _StrList):
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise fail(f": expected a non-empty list of strings, got {value!r}")
        for v in value:
            if v not in rule.choices:
                raise fail(f": {v!r} is not an ONNX Runtime execution provider; allowed: "
                           f"{', '.join(sorted(rule.choices))}")
        return tuple(value)
    raise TypeError(f"bad schema rule {rule!r}")  # pragma: no cover


def _check_keys(raw: Mapping[str, Any], schema: Mapping[str, Any], src: str, table: str | None) -> None:
    allowed = ", ".join(schema)
    for key in raw:
        if key not in schema:
            raise ProfileError(f"{src}: unknown key {_where(table, key)}; allowed: {allowed}",
                               path=src, key=f"{table}.{key}" if table else key)
    for key in schema:
        if key not in raw:
            raise ProfileError(f"{src}: missing key {_where(table, key)} (every key is required; "
                               f"allowed: {allowed})", path=src, key=f"{table}.{key}" if table else key)


def from_dict(raw: Mapping[str, Any], source: str = "<dict>", *, expect_name: str | None = None) -> FirmwareProfile:
    """Build and validate a profile from parsed TOML.

    Args:
        raw: the parsed document.
        source: file name used in messages and kept as ``profile.source``.
        expect_name: the file's stem; ``name`` must equal it (``None``: not checked).

    Raises:
        ProfileError: a missing or unknown key, a wrong type, a value out of range, or an
            inconsistency between fields; the message names ``source``, the key and what is allowed.
    """
    from protocol.messages import valid_id
    from protocol.tensors import Codec

    src = source
    _check_keys(raw, SCHEMA, src, None)
    kw: dict[str, Any] = {}
    for key, rule in SCHEMA.items():
        value = raw[key]
        if isinstance(rule, dict):
            if not isinstance(value, dict):
                raise ProfileError(f"{src}: [{key}] must be a table with keys {', '.join(rule)}, got {value!r}",
                                   path=src, key=key)
            _check_keys(value, rule, src, key)
            kw[key] = _TABLE_TYPES[key](**{k: _check_value(value[k], r, src, key, k) for k, r in rule.items()})
        else:
            kw[key] = _check_value(value, rule, src, None, key)

    def fail(key: str, msg: str) -> ProfileError:
        table, _, leaf = key.rpartition(".")
        return ProfileError(f"{src}: {_where(table or None, leaf)}{msg}", path=src, key=key)

    name = kw["name"]
    if not valid_id(name):
        raise fail("name", f" = {name!r}: expected 1-64 characters of A-Za-z0-9_.- (a client id)")
    if expect_name is not None and name != expect_name:
        raise fail("name", f" = {name!r} must equal the file name's stem {expect_name!r}")
    providers = kw["onnx_providers"]
    if len(set(providers)) != len(providers):
        raise fail("onnx_providers", f" = {list(providers)!r}: each provider may appear once")
    if providers[-1] != "CPUExecutionProvider":
        raise fail("onnx_providers", f" = {list(providers)!r}: the last provider must be "
                   "'CPUExecutionProvider' (the fallback every ONNX Runtime build has)")
    nvidia = [p for p in providers if p in _NVIDIA_PROVIDERS]
    if kw["accelerator"] == "cpu" and nvidia:
        raise fail("onnx_providers", f": {', '.join(nvidia)} need accelerator = \"cuda\"; "
                   "with accelerator = \"cpu\" allowed providers exclude "
                   f"{', '.join(sorted(_NVIDIA_PROVIDERS))}")
    if kw["accelerator"] == "cuda" and "CUDAExecutionProvider" not in providers:
        raise fail("onnx_providers", f" = {list(providers)!r}: accelerator = \"cuda\" needs "
                   "'CUDAExecutionProvider' in the list")
    if kw["precision"] == "fp16" and kw["accelerator"] != "cuda":
        raise fail("precision", " = 'fp16' (autocast training) needs accelerator = \"cuda\"; "
                   "allowed with accelerator = \"cpu\": fp32")
    if kw["torch_threads"] > kw["cpu_cores"]:
        raise fail("torch_threads", f" = {kw['torch_threads']} is outside the allowed range "
                   f"[1, cpu_cores = {kw['cpu_cores']}] (or 0: one per core of the machine)")
    if kw["memory_budget_mb"] > kw["ram_mb"]:
        raise fail("memory_budget_mb", f" = {kw['memory_budget_mb']} is outside the allowed range "
                   f"[1, ram_mb = {kw['ram_mb']}]")
    mqtt = kw["mqtt"]
    if mqtt.chunk_bytes > mqtt.max_packet_bytes:
        raise fail("mqtt.chunk_bytes", f" = {mqtt.chunk_bytes} is outside the allowed range "
                   f"[64, max_packet_bytes = {mqtt.max_packet_bytes}]")
    for key in ("update_codec", "global_codec"):
        text = getattr(kw["preferred_codecs"], key)
        try:
            Codec.parse(text)
        except ValueError as exc:
            raise fail(f"preferred_codecs.{key}", f" = {text!r}: {exc}") from None
    return FirmwareProfile(**kw, source=src)


def load_profile(path: str | os.PathLike[str]) -> FirmwareProfile:
    """Read and validate one profile file; ``name`` must equal the file's stem.

    Raises:
        ProfileError: the file is missing, unreadable, not TOML, or invalid (see :func:`from_dict`).
    """
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProfileError(f"firmware profile file {p} does not exist", path=str(p)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"cannot read firmware profile {p}: {exc}", path=str(p)) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{p} is not valid TOML: {exc}", path=str(p)) from exc
    return from_dict(raw, str(p), expect_name=p.stem)


# --------------------------------------------------------------------------------------------
# Finding profiles by name


def search_dirs(dirs: Iterable[str | os.PathLike[str]] | None = None) -> list[Path]:
    """The folders searched for ``NAME.toml``, first match wins.

    Args:
        dirs: search exactly these (each must exist); ``None``: the folders of
            ``$FEDFLEET_PROFILES`` (each must exist), then :data:`SHIPPED_DIR` when present.

    Raises:
        ProfileError: a folder given explicitly or in ``FEDFLEET_PROFILES`` does not exist, or no
            folder is left to search (an installed package without ``FEDFLEET_PROFILES``).
    """
    if dirs is not None:
        out = [Path(d) for d in dirs]
        origin = "given"
    else:
        env = os.environ.get(PROFILES_ENV, "")
        out = [Path(d) for d in env.split(os.pathsep) if d]
        origin = f"in ${PROFILES_ENV}"
    for d in out:
        if not d.is_dir():
            raise ProfileError(f"firmware profile folder {d} ({origin}) does not exist or is not a folder",
                               path=str(d))
    if dirs is None and SHIPPED_DIR.is_dir():
        out.append(SHIPPED_DIR)
    if not out:
        raise ProfileError(f"no firmware profile folder found: the shipped folder {SHIPPED_DIR} is not "
                           f"there (fedfleet installed without its source tree?) and ${PROFILES_ENV} is "
                           "not set; set it to a folder holding NAME.toml profiles (copy them from the "
                           "repository's firmware_profiles/)")
    return out


def list_profiles(dirs: Iterable[str | os.PathLike[str]] | None = None) -> list[str]:
    """Names (file stems) of every ``*.toml`` in the search folders, sorted, without duplicates.

    Files are not validated here; :func:`get_profile` does that.

    Raises:
        ProfileError: as :func:`search_dirs`.
    """
    return sorted({p.stem for d in search_dirs(dirs) for p in d.glob("*.toml") if p.is_file()})


def get_profile(name: str, dirs: Iterable[str | os.PathLike[str]] | None = None) -> FirmwareProfile:
    """Load the profile called ``name`` from the first search folder that has ``name.toml``.

    Raises:
        ProfileError: unknown name (the message lists the known names and the folders searched),
            or an invalid file (see :func:`load_profile`).
    """
    from protocol.messages import valid_id

    folders = search_dirs(dirs)
    if isinstance(name, str) and valid_id(name):
        for d in folders:
            p = d / f"{name}.toml"
            if p.is_file():
                return load_profile(p)
    known = list_profiles(folders)
    raise ProfileError(f"unknown firmware profile {name!r}; known profiles: {', '.join(known) or '(none)'} "
                       f"(searched {', '.join(str(d) for d in folders)})")


# --------------------------------------------------------------------------------------------
# Link model


def link_time_s(profile: FirmwareProfile, nbytes: int, direction: str) -> float:
    """Estimated time to move ``nbytes`` over the profile's link, seconds.

    ``t = nbytes · 8 / (kbps · 1000) / (1 − loss_percent / 100) + rtt_ms / 1000``

    Serialisation time at the link's goodput, stretched by the expected number of transmissions
    per packet under independent loss with probability p (geometric: 1 / (1 − p)), plus one round
    trip (the QoS 1 PUBACK, or the request that started the download). TCP's congestion control
    under loss (Mathis et al., CCR 1997: rate ≤ MSS / RTT · 1.22 / √p) is not modelled, so on
    lossy, long-RTT links this is a lower bound.

    Args:
        profile: gives ``link.uplink_kbps`` / ``link.downlink_kbps``, ``rtt_ms``, ``loss_percent``.
        nbytes: bytes to move as counted by the caller (e.g. whole MQTT packets), ≥ 0.
        direction: ``"up"`` (device → broker) or ``"down"`` (broker → device).

    Raises:
        ValueError: ``direction`` not ``"up"``/``"down"``, or ``nbytes`` not an int ≥ 0.
    """
    if direction not in ("up", "down"):
        raise ValueError(f"direction must be 'up' or 'down', not {direction!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int ≥ 0, not {nbytes!r}")
    link = profile.link
    kbps = link.uplink_kbps if direction == "up" else link.downlink_kbps
    return nbytes * 8 / (kbps * 1000) / (1 - link.loss_percent / 100) + link.rtt_ms / 1000

