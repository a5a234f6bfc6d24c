"""edge_agent.assembly: one agent assembly for fedfleet-agent and simulate."""

from __future__ import annotations

import shlex
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from edge_agent.assembly import AgentSpec, build_agent, channel_limits, offline_will, prepare_agent
from edge_agent.data import load_dataset
from edge_agent.models import make_model, manifest_hash, model_manifest
from edge_agent.partition import split_dataset
from edge_agent.runtime import agent_runtime


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _spec(**over) -> AgentSpec:
    base = dict(client_id="pi-07", shard=2, shards=4, dataset="digits", partition="dirichlet", alpha=1.0, seed=3,
                algorithm="fedproto", model="resnet8", feature_dim=32, info={"virtual": True})
    return AgentSpec(**{**base, **over})


def test_prepare_draws_the_shard_the_model_and_the_announcement(digits) -> None:
    spec = _spec()
    p = prepare_agent(spec, digits)
    expected_idx = split_dataset(digits, 4, scheme="dirichlet", seed=3, alpha=1.0, min_samples=10)[2]
    assert np.array_equal(p.indices, expected_idx)
    twin = make_model("resnet8", in_channels=1, image_size=8, num_classes=10, feature_dim=32, seed=3 + 1 + 2)
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in p.model.state_dict().items())
    assert p.info["model"] == "resnet8" and p.info["feature_dim"] == 32 and p.info["num_classes"] == 10
    assert p.info["virtual"] is True and p.info["algorithm"] == "fedproto" and p.info["dataset"] == "digits"
    assert p.info["shards"] == "4" and p.info["seed"] == "3"
    assert p.eval_split is not None and len(p.eval_split.y) == len(digits.test.y)  # FedProto reserves nothing
    assert prepare_agent(spec, digits, eval_split=None).eval_split is None


def test_a_simulated_agent_and_a_real_one_from_the_printed_command_are_the_same(digits) -> None:
    """The drift the assembly removes: the server's printed fedfleet-agent command, parsed by the
    agent's own parser, gives the spec simulate builds for that shard (ids and timeouts aside)."""
    from broker_server import config as C
    from broker_server.runtime import agent_spec as sim_spec
    from broker_server.server_main import agent_command
    from edge_agent.agent import param_value
    from edge_agent.cli import agent_spec as cli_spec
    from edge_agent.cli import build_parser

    cfg = C.from_dict({"data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.7, "clients": 3},
                       "run": {"seed": 5}, "train": {"algorithm": "fedproto"},
                       "model": {"name": "resnet8", "feature_dim": 32}, "algorithm": {"lambda_proto": 0.5}})
    words = shlex.split(agent_command(cfg, "mqtt://127.0.0.1:1883", "fed").replace("i/3", "1/3"))[1:]
    args = build_parser().parse_args([w.replace("DEVICE_ID", "pi-01") for w in words])
    params = {k: param_value(v) for k, _, v in (p.partition("=") for p in args.param)}
    real = cli_spec(args, params)
    virtual = sim_spec(cfg, client_id="pi-01", shard=1, profile="x86-cpu", idle_timeout_s=args.idle_timeout_s)
    assert real == virtual
    a, b = prepare_agent(real, digits), prepare_agent(virtual, digits)
    assert a.info == b.info and np.array_equal(a.indices, b.indices)
    assert manifest_hash(model_manifest(a.model)) == manifest_hash(model_manifest(b.model))


def test_build_agent_wires_the_runtime_and_the_spec(digits) -> None:
    rt = agent_runtime("rpi4")
    p = prepare_agent(_spec(model="lightcnn", feature_dim=64, algorithm="fedavg"), digits, precision=rt.plan.precision)
    subscriptions = []
    transport = SimpleNamespace(subscribe=lambda topic, qos: subscriptions.append(topic))
    channel = SimpleNamespace(node_id="pi-07", federation="fed", transport=transport, qos=1)
    agent = build_agent(p, channel, runtime=rt)
    assert agent.client_index == 2 and agent.profile == "rpi4"
    assert agent.train_defaults.batch_size == rt.plan.batch_size and agent.train_defaults.seed == 3
    assert agent.info["profile"] == "rpi4" and agent.info["model"] == "lightcnn"  # runtime + spec announcements
    assert agent.manifest_hash == manifest_hash(model_manifest(p.model))
    assert len(agent.y) == len(p.indices) and agent.idle_timeout_s == 3600.0
    assert len(subscriptions) == 1  # the agent's own topics, nothing sent yet
    assert (agent.receipt_timeout_s, agent.max_resends) == (10.0, 3)  # EdgeAgent's defaults
    other = build_agent(p, channel, runtime=rt, receipt_timeout_s=2.5, max_resends=0)  # fedfleet-agent's flags
    assert (other.receipt_timeout_s, other.max_resends) == (2.5, 0)


def _fake_channel(node_id: str) -> SimpleNamespace:
    transport = SimpleNamespace(subscribe=lambda topic, qos: None)
    return SimpleNamespace(node_id=node_id, federation="fed", transport=transport, qos=1)


def test_virtual_agents_share_the_cached_data_set(digits) -> None:
    """Two agents of one fleet hold the cached data set itself (no float copy of their shards);
    what they train on equals the copy each used to make, value for value and in the same order."""
    rt = agent_runtime("x86-cpu")
    agents, shards = [], []
    for shard in (0, 1):
        p = prepare_agent(_spec(model="lightcnn", feature_dim=64, algorithm="fedavg", shard=shard), digits)
        agents.append(build_agent(p, _fake_channel(f"c{shard}"), runtime=rt))
        shards.append(p.indices)
    assert not np.array_equal(np.sort(shards[0]), np.sort(shards[1]))
    for agent, idx in zip(agents, shards):
        assert np.shares_memory(agent.x.numpy(), digits.train.x)
        assert agent.indices is not None and np.array_equal(agent.indices.numpy(), idx)
        old_x, old_y = digits.train.x[idx], digits.train.y[idx]  # what each agent copied before
        assert torch.equal(agent.train_x(), torch.from_numpy(old_x))
        assert torch.equal(agent.y, torch.from_numpy(old_y))
        own = agent.y.numpy().nbytes + agent.indices.numpy().nbytes
        assert own == 16 * len(idx) < old_x.nbytes  # int64 labels and rows, nothing float
    assert np.shares_memory(agents[0].x.numpy(), agents[1].x.numpy())


def test_a_contiguous_shard_trains_on_a_view(digits) -> None:
    from edge_agent.agent import EdgeAgent

    rt = agent_runtime("x86-cpu")
    p = prepare_agent(_spec(model="lightcnn", feature_dim=64, algorithm="fedavg"), digits)
    agent = build_agent(p, _fake_channel("c9"), runtime=rt)
    run = EdgeAgent(channel=agent.channel, model=agent.model, algorithm=agent.algorithm, x=digits.train.x,
                    y=digits.train.y, indices=np.arange(100, 160), num_classes=10, train_defaults=agent.train_defaults)
    xs = run.train_x()
    assert np.shares_memory(xs.numpy(), digits.train.x) and torch.equal(xs, torch.from_numpy(digits.train.x[100:160]))
    with pytest.raises(ValueError, match="indices"):
        EdgeAgent(channel=agent.channel, model=agent.model, algorithm=agent.algorithm, x=digits.train.x,
                  y=digits.train.y, indices=np.array([len(digits.train.y)]), num_classes=10,
                  train_defaults=agent.train_defaults)


def test_offline_will_and_channel_limits() -> None:
    from protocol import topics
    from protocol.messages import Status, decode

    will = offline_will("fed", "pi-07")
    assert will.topic == topics.status("fed", "pi-07") and will.qos == 1 and will.retain
    body = decode(will.payload).envelope.body
    assert isinstance(body, Status) and body.state == "offline"
    rt = agent_runtime("rpi4")
    assert channel_limits(rt) == {"chunk_bytes": rt.chunk_bytes, "max_packet_bytes": rt.max_packet_bytes}
    small = channel_limits(rt, chunk_bytes=1024, max_packet_bytes=4096)
    assert small == {"chunk_bytes": min(1024, rt.chunk_bytes), "max_packet_bytes": min(4096, rt.max_packet_bytes)}
    big = channel_limits(rt, chunk_bytes=1 << 30, max_packet_bytes=1 << 28)
    assert big == {"chunk_bytes": rt.chunk_bytes, "max_packet_bytes": rt.max_packet_bytes}


def test_bad_specs() -> None:
    with pytest.raises(ValueError, match="shard 4/4"):
        _spec(shard=4)
    with pytest.raises(ValueError, match="feature_dim"):
        _spec(feature_dim=0)
