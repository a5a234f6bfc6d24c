"""FedAA and its DDPG agent: the target, the soft update, the simplex actor and one learning step
against hand or NumPy computations; the distance state by hand; the strategy's aggregate equal to
the action-weighted mean; the transition stored on commit with the reward evaluate gave; the
checkpoint restoring the agent; the client's gradient clip; a federation in memory (digits,
three devices) checked on the wire."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from helpers.memory_federation import Device, run_federation

from broker_server.rl.ddpg import DDPGAgent, DDPGConfig, SimplexActor, ddpg_target, soft_update
from broker_server.strategies import ClientResult
from broker_server.strategies.fedaa import FedAA, distance_state, pairwise_distances
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedaa import FedAAClient
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.models import build_model
from protocol.messages import Update, decode

SMALL = {"hidden": 8, "warmup": 1, "batch_size": 2}


def test_ddpg_target_and_soft_update_by_hand() -> None:
    y = ddpg_target(torch.tensor([[1.0], [0.5]]), torch.tensor([[0.0], [1.0]]), torch.tensor([[2.0], [3.0]]), 0.9)
    torch.testing.assert_close(y, torch.tensor([[1.0 + 0.9 * 2.0], [0.5]]))  # done: no bootstrap
    src, tgt = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    with torch.no_grad():
        for p in src.parameters():
            p.fill_(1.0)
        for p in tgt.parameters():
            p.fill_(0.0)
    soft_update(tgt, src, 0.25)
    soft_update(tgt, src, 0.25)
    for p in tgt.parameters():  # 0.25, then 0.25 + 0.75·0.25
        torch.testing.assert_close(p, torch.full_like(p, 0.4375))


def test_simplex_actor_matches_numpy_and_sums_to_one() -> None:
    torch.manual_seed(0)
    actor = SimplexActor(3, 4, hidden=5)
    s = torch.rand(6, 3)
    w = {k: v.detach().double().numpy() for k, v in actor.state_dict().items()}
    h = np.maximum(w["fc2.weight"] @ np.maximum(w["fc1.weight"] @ s.double().numpy().T
                                                + w["fc1.bias"][:, None], 0) + w["fc2.bias"][:, None], 0)
    a = np.abs(w["fc3.weight"] @ h + w["fc3.bias"][:, None]).T
    want = a / a.sum(axis=1, keepdims=True)
    got = actor(s).detach().double().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert (got >= 0).all()
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-6)
    # the DDPG paper's initialisation: hidden layers within ±1/sqrt(fan-in), the output within ±3e-3
    assert np.abs(w["fc1.weight"]).max() <= 1 / np.sqrt(3) and np.abs(w["fc3.weight"]).max() <= 3e-3


def test_one_ddpg_step_losses_equal_an_independent_computation() -> None:
    agent = DDPGAgent(3, 3, DDPGConfig(hidden=6, batch_size=4, warmup=1), seed=1)
    b = {"s": torch.rand(4, 3), "a": torch.softmax(torch.rand(4, 3), 1), "r": torch.rand(4),
         "s2": torch.rand(4, 3), "done": torch.tensor([0.0, 0.0, 1.0, 0.0])}
    critic, critic_t, actor_t = (copy.deepcopy(m) for m in (agent.critic, agent.critic_target, agent.actor_target))
    with torch.no_grad():
        y = b["r"][:, None] + 0.99 * (1 - b["done"][:, None]) * critic_t(b["s2"], actor_t(b["s2"]))
        want_critic = float(((y - critic(b["s"], b["a"])) ** 2).mean())
    out = agent.step(b)
    assert out["critic_loss"] == pytest.approx(want_critic, rel=1e-6)
    with torch.no_grad():  # the actor's loss is taken with the critic after its step
        assert out["actor_loss"] == pytest.approx(-float(agent.critic(b["s"], actor_before(agent, b)).mean()),
                                                  rel=1e-5)
    # the targets moved by τ = 0.001 towards the trained networks, not onto them
    for t, p, p0 in zip(agent.critic_target.parameters(), agent.critic.parameters(), critic.parameters(), strict=True):
        torch.testing.assert_close(t, 0.999 * p0 + 0.001 * p)


def actor_before(agent: DDPGAgent, b) -> torch.Tensor:
    """μ(s) of the actor as it was before its own step: re-derived from the target's soft update
    θ' = 0.999·θ'_0 + 0.001·θ with θ'_0 = θ_0 (the target starts as a copy)."""
    before = copy.deepcopy(agent.actor)
    with torch.no_grad():
        for p0, t, p in zip(before.parameters(), agent.actor_target.parameters(), agent.actor.parameters(),
                            strict=True):
            p0.copy_((t - 0.001 * p) / 0.999)
    return before(b["s"])


def test_distance_state_by_hand() -> None:
    models = [(np.array([0.0, 0.0], np.float32),), (np.array([3.0, 0.0], np.float32),),
              (np.array([0.0, 4.0], np.float32),)]
    d = pairwise_distances(models)
    np.testing.assert_allclose(d, [[0, 3, 4], [3, 0, 5], [4, 5, 0]], atol=1e-12)
    s = distance_state(d, [0, 1, 2], 4)  # row sums 7, 8, 9 over their maximum; slot 3 did not report
    np.testing.assert_allclose(s, [7 / 9, 8 / 9, 1.0, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(distance_state(np.zeros((2, 2)), [0, 1], 2), [0.0, 0.0])


def _results() -> list[ClientResult]:
    rng = np.random.default_rng(3)
    return [ClientResult(c, (rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)),
                         n, 0.1) for c, n in (("dev-b", 10), ("dev-a", 30), ("dev-c", 20))]


def test_aggregate_is_the_action_weighted_mean_and_mutates_nothing() -> None:
    strategy = FedAA(participation_rate=1.0, validation=None, run_seed=5, **SMALL)
    strategy.width = 3
    res = _results()
    up = strategy.aggregate(1, [np.zeros((4, 3), np.float32), np.zeros(3, np.float32)], res)
    assert up is not None and strategy.pending is None and len(strategy.agent.buffer) == 0
    ordered = sorted(res, key=lambda r: r.client_id)
    s = distance_state(pairwise_distances([r.tensors for r in ordered]), [0, 1, 2], 3)
    a = strategy.agent.act(s, noise=torch.Generator().manual_seed(5 * 1_000_003 + 1))
    for i, t in enumerate(up.tensors):
        np.testing.assert_allclose(t, sum(a[k] * ordered[k].tensors[i].astype(np.float64) for k in range(3)),
                                   rtol=1e-5, atol=1e-6)
    assert up.metrics["fedaa_weights"] == pytest.approx({r.client_id: a[k] for k, r in enumerate(ordered)})
    again = strategy.aggregate(1, [], res)  # the same round again: the same action (no state moved)
    for x, y in zip(up.tensors, again.tensors, strict=True):
        np.testing.assert_array_equal(x, y)
    uniform = FedAA(mode="uniform", validation=None).aggregate(1, [], res)
    for i, t in enumerate(uniform.tensors):  # the control: equal weights, not FedAvg's sample counts
        np.testing.assert_allclose(t, np.mean([r.tensors[i] for r in res], axis=0), rtol=1e-6)


def test_commit_stores_the_transition_with_the_evaluated_reward_and_the_checkpoint_restores_it() -> None:
    digits_like = (np.random.default_rng(0).random((20, 1, 8, 8), dtype=np.float32),
                   np.arange(20, dtype=np.int64) % 10)
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    strategy = FedAA(validation=digits_like, run_seed=2, **SMALL)
    strategy.width = 3
    up1 = strategy.aggregate(1, [], _results())
    strategy.commit(1, up1)
    acc1 = strategy.evaluate(1, model)["fedaa_reward"]
    assert strategy.pending["r"] == acc1 and len(strategy.agent.buffer) == 0
    res2 = [ClientResult(r.client_id, tuple(t * 2 for t in r.tensors), r.num_samples, 0.1) for r in _results()]
    up2 = strategy.aggregate(2, [], res2)
    strategy.commit(2, up2)
    buf = strategy.agent.buffer.state_dict()
    assert len(strategy.agent.buffer) == 1 and strategy.agent.updates == 1  # warmup 1: it learned
    np.testing.assert_array_equal(buf["s"][0], up1.state["next_state"])
    np.testing.assert_array_equal(buf["s2"][0], up2.state["next_state"])
    np.testing.assert_array_equal(buf["a"][0], up1.state["next_action"])
    assert buf["r"][0] == pytest.approx(acc1)
    fresh = FedAA(validation=digits_like, run_seed=2, **SMALL)
    fresh.load_state_dict(copy.deepcopy(strategy.state_dict()))
    s = np.linspace(0, 1, 3, dtype=np.float32)
    np.testing.assert_array_equal(fresh.agent.act(s, explore=False), strategy.agent.act(s, explore=False))
    assert fresh.agent.updates == 1 and fresh.pending["r"] is None
    np.testing.assert_array_equal(fresh.pending["s"], strategy.pending["s"])
    restored = fresh.agent.buffer.state_dict()
    for k in ("s", "a", "r", "s2", "done"):  # the replay buffer comes back as float32 arrays, row for row
        assert restored[k].dtype == np.float32
        np.testing.assert_array_equal(restored[k], buf[k])


RAN: list[str] = []


class _Payload:
    """An object whose unpickling would run code (appends to RAN)."""

    def __reduce__(self):
        return (RAN.append, ("code ran",))


def test_a_checkpointed_ddpg_agent_is_read_without_running_the_blobs_code() -> None:
    """The agent's checkpoint bytes are read by torch's restricted unpickler: a blob holding an
    object that would run code on load, or numpy arrays (the older buffer format), is refused
    with a ValueError that says why, and nothing in it runs."""
    agent = DDPGAgent(3, 3, DDPGConfig(hidden=6, batch_size=4, warmup=1), seed=1)
    for bad in ({"dims": (3, 3), "x": _Payload()}, {"dims": (3, 3), "buffer": {"s": np.zeros((1, 3), np.float32)}}):
        blob = io.BytesIO()
        torch.save(bad, blob)
        with pytest.raises(ValueError, match="saved DDPG agent cannot be read .*restricted load refused it"):
            agent.load_bytes(blob.getvalue())
    assert RAN == []
    with pytest.raises(ValueError, match="saved DDPG agent cannot be read"):
        agent.load_bytes(b"not a torch archive")


def test_client_clip_bounds_the_step_by_lr_times_clip_norm(digits) -> None:
    x, y = torch.from_numpy(np.array(digits.train.x[:16])), torch.from_numpy(np.array(digits.train.y[:16]))
    cfg = TrainConfig(local_epochs=1, batch_size=16, lr=0.1, momentum=0.0, weight_decay=0.0)
    torch.manual_seed(0)
    start = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    init = tuple(t.detach().numpy().copy() for t in start.state_dict().values())

    def step_norm(algo, params) -> float:
        model = copy.deepcopy(start)
        out = algo.local_round(model, init, x, y, cfg, round=1, client_index=0, device=torch.device("cpu"),
                               params=params)
        return float(np.sqrt(sum(np.sum((a.astype(np.float64) - b) ** 2) for a, b in zip(out.tensors, init,
                                                                                            strict=True))))

    free = step_norm(FedAvgClient(), {})  # one batch, plain SGD: ‖Δw‖ = lr·‖g‖
    assert free > 0.1 * 1e-3
    clipped = step_norm(FedAAClient(), {"clip_norm": 1e-3})
    assert clipped == pytest.approx(0.1 * 1e-3, rel=1e-3)  # ‖Δw‖ = lr·clip_norm
    assert step_norm(FedAAClient(), {"clip_norm": 0.0}) == free  # 0: no clipping, FedAvg bit for bit
    with pytest.raises(ValueError, match="clip_norm"):
        step_norm(FedAAClient(), {"clip_norm": -1.0})


def test_fedaa_federation_weights_on_the_wire(tmp_path, digits, memory_hub) -> None:
    sizes = {"dev-a": 40, "dev-b": 70, "dev-c": 90}
    x, y = digits.train.x, digits.train.y
    val = (np.asarray(digits.test.x[:100]), np.asarray(digits.test.y[:100]))
    strategy = FedAA(train_config={"lr": 0.05, "batch_size": 16}, validation=val, run_seed=3, **SMALL)
    devices, start = {}, 0
    for cid, n in sizes.items():
        devices[cid] = Device(FedAAClient(), x[start:start + n], y[start:start + n])
        start += n
    server = run_federation(tmp_path, memory_hub, strategy, devices, digits.test, rounds=3)
    msgs = [(m.sender, decode(m.payload).envelope) for m in memory_hub.published]
    for r in (1, 2, 3):
        ups = {s: env.body for s, env in msgs if env.round == r and isinstance(env.body, Update)}
        assert set(ups) == set(sizes)
        line = server.metrics[r - 1]
        weights = line["fedaa_weights"]
        assert set(weights) == set(sizes) and sum(weights.values()) == pytest.approx(1.0)
        d = pairwise_distances([tuple(ups[c].tensors) for c in sorted(ups)])
        np.testing.assert_allclose(line["fedaa_state"], distance_state(d, [0, 1, 2], 3), rtol=1e-5)
        assert line["fedaa_replay"] == r - 1  # one transition per round after the first
    # every round_start told the devices FedAA's clip norm
    assert all(env.body.config["clip_norm"] == 60.0 for s, env in msgs if s == "server" and env.kind.value ==
               "round_start")
