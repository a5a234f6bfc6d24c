"""From a firmware profile to a running agent: the device plan, the codec the profile forces,
the MQTT limits, and what the agent announces about itself in ``join``.

One function serves the real device (``fedfleet-agent --profile jetson-orin-nano``) and every
virtual agent of a simulated fleet, so both take the same path.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.tensors import Codec

from .device import DeviceInfo, RuntimePlan, detect, plan_runtime
from .profiles import FirmwareProfile, get_profile, link_time_s

#: bytes per float32 element each codec sends (index overhead of top-k ≈ 1.5 bytes per kept value)
_BYTES_PER_VALUE = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int8-channel": 1.0}


def codec_cost(text: str, n_values: int | None = None) -> float:
    """Estimated wire bytes per float32 value of a codec (zstd counted at 0.9×; a rough order,
    used only to pick the cheaper of two codecs).

    ``topk:K`` (a count) costs depend on the tensor size ``n_values``; without it the count is
    priced as fp32, so a count is never taken for cheaper blindly.
    """
    c = Codec.parse(text)
    if c.name == "topk":
        per_kept = (2.0 if c.topk_values == "fp16" else 4.0) + 1.5
        if c.topk_fraction is not None:
            kept = c.topk_fraction
        elif n_values and c.topk_k is not None:  # Codec.parse: topk has a fraction or a count
            kept = min(1.0, c.topk_k / n_values)
        else:
            return 4.0
        cost = per_kept * kept
    else:
        cost = _BYTES_PER_VALUE[c.name]
    return cost * (0.9 if c.zstd else 1.0)


def cheaper_codec(server: str, device: str, n_values: int | None = None) -> str:
    """The codec an agent uses: the server's, unless the firmware profile's is cheaper on the
    wire (a device may always send less than it is asked to, never more). ``n_values``: float
    values in the update (prices ``topk:K`` counts)."""
    return device if codec_cost(device, n_values) < codec_cost(server, n_values) else server


@dataclass(frozen=True)
class AgentRuntime:
    """Everything the agent takes from its profile and its hardware.

    Attributes:
        profile: the firmware profile.
        plan: the device plan (torch device, precision, threads, batch size, providers,
            fallbacks — each difference from the profile with its reason).
        join_info: flat scalars for ``join.info`` (profile, plan, fallbacks, and the device's
            MQTT limits ``max_packet_bytes`` and ``chunk_bytes``: the server sizes the packets it
            sends to this device by them).
    """

    profile: FirmwareProfile
    plan: RuntimePlan

    @property
    def join_info(self) -> dict[str, str | int | bool]:
        return {"profile": self.profile.name, **self.plan.as_join_info(),
                "max_packet_bytes": self.max_packet_bytes, "chunk_bytes": self.chunk_bytes}

    @property
    def chunk_bytes(self) -> int:
        """Chunk size for this device's transfers (bytes)."""
        return self.profile.mqtt.chunk_bytes

    @property
    def max_packet_bytes(self) -> int:
        """The largest PUBLISH packet this device's broker link takes (bytes)."""
        return self.profile.mqtt.max_packet_bytes

    def update_codec(self, server_codec: str, n_values: int | None = None) -> str:
        """The codec for this device's updates (see :func:`cheaper_codec`)."""
        return cheaper_codec(server_codec, self.profile.preferred_codecs.update_codec, n_values)

    def link_s(self, nbytes: int, direction: str, round_trip: bool = True) -> float:
        """Seconds the profile's link needs for ``nbytes`` (``"up"`` or ``"down"``); without the
        RTT when ``round_trip`` is false (the later chunks of a pipelined transfer)."""
        t = link_time_s(self.profile, nbytes, direction)
        return t if round_trip else max(0.0, t - self.profile.link.rtt_ms / 1000.0)


def agent_runtime(profile: str | FirmwareProfile, *, info: DeviceInfo | None = None) -> AgentRuntime:
    """Resolve ``profile`` (a name or a loaded profile) against the hardware (``info``; detected
    when ``None``).

    Raises:
        ProfileError: unknown profile name or invalid profile file.
    """
    prof = get_profile(profile) if isinstance(profile, str) else profile
    return AgentRuntime(prof, plan_runtime(prof, info if info is not None else detect()))
