"""broker_server.admission: which joins a server admits by model, with hand-made joins."""

from __future__ import annotations

import pytest

from broker_server.admission import admit, model_requirement
from broker_server.strategies import Strategy, get_strategy_class
from protocol.messages import Join

SERVER = "00112233aabbccdd"
OTHER = "ffeeddccbbaa9988"


def _join(manifest: str, **info) -> Join:
    return Join(profile="rpi4", manifest_hash=manifest, num_samples=10, class_histogram=(5, 5), info=info)


def _admit(join: Join, requirement: str) -> str | None:
    return admit(join, requirement=requirement, expected_manifest_hash=SERVER, feature_dim=64, num_classes=10)


def test_manifest_requirement_needs_the_assigned_manifest() -> None:
    assert _admit(_join(SERVER), "manifest") is None
    assert _admit(_join(SERVER, model="lightcnn", feature_dim=64, num_classes=10), "manifest") is None
    reason = _admit(_join(OTHER, model="resnet8", feature_dim=64, num_classes=10), "manifest")
    assert reason == (f"model manifest {OTHER} (resnet8) does not match the server's {SERVER}: same model "
                      "architecture and data shape needed")
    # the same prototype width does not help a parameter-averaging method
    assert _admit(_join(OTHER), "manifest") is not None


def test_prototype_requirement_takes_any_architecture_with_the_agreed_width_and_classes() -> None:
    assert _admit(_join(OTHER, model="resnet8", feature_dim=64, num_classes=10), "prototype") is None
    assert _admit(_join(OTHER, model="x", feature_dim="64", num_classes="10"), "prototype") is None  # text ints
    reason = _admit(_join(OTHER, model="resnet8", feature_dim=32, num_classes=10), "prototype")
    assert reason is not None and "feature_dim 32 (server: 64)" in reason and "num_classes" not in reason
    reason = _admit(_join(OTHER, feature_dim=64, num_classes=7), "prototype")
    assert reason is not None and "num_classes 7 (server: 10)" in reason
    # the manifest alone cannot vouch for another width: announced numbers are checked
    assert _admit(_join(SERVER, feature_dim=32, num_classes=10), "prototype") is not None


def test_prototype_requirement_without_announced_numbers_falls_back_to_the_manifest() -> None:
    assert _admit(_join(SERVER), "prototype") is None  # an older agent with the server's own model
    reason = _admit(_join(OTHER, model="resnet8"), "prototype")
    assert reason is not None and "announces no feature_dim / num_classes" in reason
    assert _admit(_join(OTHER, feature_dim=True, num_classes=10), "prototype") is not None  # a bool is no width


def test_unknown_requirement_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown model requirement 'weights'"):
        _admit(_join(SERVER), "weights")


def test_model_requirement_is_what_the_strategy_class_declares() -> None:
    class Declared(Strategy):
        share = "none"
        model_requirement = "manifest"

    class Bad(Strategy):
        model_requirement = "anything"

    assert model_requirement(Declared) == "manifest"
    with pytest.raises(ValueError, match="declares model_requirement 'anything'"):
        model_requirement(Bad)
    expected = {"fedavg": "manifest", "fedprox": "manifest", "scaffold": "manifest", "fedper": "manifest",
                "fedrep": "manifest", "fedpad": "manifest", "fedproto-avg": "manifest", "fpl": "manifest",
                "fedproto": "prototype", "fedmcp": "prototype", "enskd": "prototype", "local": "prototype"}
    assert {n: model_requirement(get_strategy_class(n)) for n in expected} == expected


@pytest.mark.parametrize("width", [float("inf"), float("-inf"), float("nan"), 64.9, "6_4", "64.0x", b"\xff"])
def test_an_announced_width_that_is_no_integer_never_counts(width) -> None:
    """A non-finite, fractional or malformed ``feature_dim`` is no announced width: the join
    falls back to the manifest (refused with another one), never truncated or raised."""
    assert _admit(_join(OTHER, feature_dim=width, num_classes=10), "prototype") is not None
    assert _admit(_join(SERVER, feature_dim=width, num_classes=10), "prototype") is None
    assert _admit(_join(OTHER, feature_dim=64.0, num_classes=10), "prototype") is None  # integral float


def test_a_join_announcing_an_infinite_width_is_refused_and_the_server_keeps_running(tmp_path) -> None:
    from helpers.memory_server import memory_server

    from broker_server.strategies import get_strategy
    from edge_agent.models import build_model
    from protocol import topics
    from protocol.messages import Envelope, Kind, Receipt, decode, encode

    srv = memory_server(tmp_path, model=build_model("lightcnn", in_channels=1, image_size=28, num_classes=10),
                        clients=[], strategy=get_strategy("fedproto", min_clients=1))
    join = _join(OTHER, feature_dim=float("inf"), num_classes=10)
    topic = topics.up("mem", "evil", Kind.JOIN)
    srv.channel.transport.broker.connect("evil").publish(
        topic, encode(Envelope(round=0, sender="evil", seq=1, body=join)).payload, qos=1)
    srv._handle(srv.channel.receive(1.0))
    assert "evil" not in srv.devices.records
    replies = [decode(payload).envelope.body for _, payload in srv.channel.transport.sent]
    assert any(isinstance(b, Receipt) and not b.accepted for b in replies)


def test_a_run_short_of_its_quorum_names_the_refused_joins(tmp_path) -> None:
    """A device announcing ``client_test = "shared"`` to a server configured with ``"local"`` is
    refused; when no one else joins, the quorum error says that join was refused and why, not
    only to check the federation name and the broker."""
    import dataclasses

    from helpers.memory_server import memory_server

    from broker_server.errors import RunError
    from broker_server.strategies import get_strategy
    from edge_agent.models import build_model
    from protocol import topics
    from protocol.messages import Envelope, Kind, encode

    srv = memory_server(tmp_path, model=build_model("lightcnn", in_channels=1, image_size=28, num_classes=10),
                        clients=[], strategy=get_strategy("fedproto", min_clients=1))
    srv.settings = dataclasses.replace(srv.settings, join_timeout_s=0.2, expected_data=(("client_test", "local"),))
    join = _join(OTHER, feature_dim=64, num_classes=10, client_test="shared")
    srv.channel.transport.broker.connect("pi-0").publish(
        topics.up("mem", "pi-0", Kind.JOIN), encode(Envelope(round=0, sender="pi-0", seq=1, body=join)).payload, qos=1)
    srv._handle(srv.channel.receive(1.0))
    assert "pi-0" not in srv.devices.records
    with pytest.raises(RunError, match=r"only 0 agent\(s\) joined .* the quorum is 1; pi-0's join was refused: "
                                       r"settings differ from the server's configuration \(data and algorithm\): "
                                       r"client_test 'shared' "
                                       r"\(server: 'local'\)\. Check that"):
        srv.run()
