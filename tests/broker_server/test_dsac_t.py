"""DSAC-T's pure pieces against hand-worked or independently computed values: the squashed
Gaussian's log-density, the target clipping, the variance-weighted critic loss and its gradient,
the low-rank parameter counts, the Polyak targets, the replay ring and the agent's persistence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.distributions import Normal, TransformedDistribution
from torch.distributions.transforms import TanhTransform

from broker_server.rl.dsac_t import (
    Critic,
    DSACTAgent,
    DSACTConfig,
    LowRankLinear,
    ReplayBuffer,
    clipped_target,
    critic_loss,
    maybe_low_rank,
    squashed_gaussian_log_prob,
)


def test_squashed_gaussian_log_prob_equals_torch_and_a_numerical_density() -> None:
    mean = torch.tensor([[0.3, -1.2, 1.0]], dtype=torch.float64)
    log_std = torch.tensor([[-0.5, 0.2, -0.3]], dtype=torch.float64)
    u = torch.tensor([[0.1, -0.4, 1.3]], dtype=torch.float64)
    ours = squashed_gaussian_log_prob(mean, log_std, u)
    # second method: torch's change-of-variables distribution
    dist = TransformedDistribution(Normal(mean, log_std.exp()), [TanhTransform()])
    assert float(ours) == pytest.approx(float(dist.log_prob(torch.tanh(u)).sum()), abs=1e-9)
    # third: the probability of a small interval around a = tanh(u) through the normal CDF of its
    # atanh end points, divided by the interval's width (no Jacobian formula involved)
    total = 0.0
    for j in range(3):
        a, h = math.tanh(float(u[0, j])), 1e-7
        n = Normal(mean[0, j], log_std[0, j].exp())  # float64
        lo, hi = torch.tensor(math.atanh(a - h), dtype=torch.float64), torch.tensor(math.atanh(a + h),
                                                                                    dtype=torch.float64)
        total += math.log(float(n.cdf(hi) - n.cdf(lo)) / (2 * h))
    assert float(ours) == pytest.approx(total, abs=1e-4)


def test_target_clipping_keeps_the_sample_within_three_mean_stds() -> None:
    q = torch.tensor([0.0, 0.0, 0.0, 1.0])
    y_z = torch.tensor([10.0, -10.0, 0.5, 5.0])
    # σ̄ = 1, ξ = 3: q ± 3
    assert clipped_target(y_z, q, 1.0).tolist() == [3.0, -3.0, 0.5, 4.0]
    assert clipped_target(y_z, q, 0.5, xi=2.0).tolist() == [1.0, -1.0, 0.5, 2.0]


def test_variance_weighted_critic_loss_against_a_hand_worked_batch() -> None:
    q = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    std = torch.tensor([0.5, 1.0], dtype=torch.float64, requires_grad=True)
    y_q = torch.tensor([1.5, 1.0], dtype=torch.float64)
    y_z = torch.tensor([2.0, 2.5], dtype=torch.float64)
    loss = critic_loss(q, std, y_q, y_z, 0.8)
    # by hand, b = 0.1, σ̄² = 0.64, all errors < δ = 50 (Huber = ½e²):
    # ω = 0.64/(0.25+0.1), 0.64/(1+0.1); Huber(q, y_q) = 0.125, 0.5; Huber(q, y_z) = 0.5, 0.125
    w1, w2 = 0.64 / 0.35, 0.64 / 1.1
    s1 = w1 * (0.125 + 0.5 * (0.25 - 0.5) / 0.6)
    s2 = w2 * (0.5 + 1.0 * (1.0 - 0.125) / 1.1)
    assert float(loss.detach()) == pytest.approx((s1 + s2) / 2, abs=1e-12)
    loss.backward()
    # d/dq = ω(q − y_q)/B ; d/dstd = ω(std² − Huber(q, y_z))/(std + b)/B
    assert q.grad.tolist() == pytest.approx([w1 * (-0.5) / 2, w2 * 1.0 / 2], abs=1e-12)
    assert std.grad.tolist() == pytest.approx([w1 * (0.25 - 0.5) / 0.6 / 2, w2 * 0.875 / 1.1 / 2], abs=1e-12)


def test_critic_loss_weight_is_clamped_and_huber_is_linear_past_delta() -> None:
    q = torch.tensor([0.0], dtype=torch.float64)
    std = torch.tensor([0.0], dtype=torch.float64)
    # ω = 100/(0 + 0.1) = 1000 → clamped to 10; |e| = 60 > δ = 50: Huber = 50·(60 − 25) = 1750
    loss = critic_loss(q, std, torch.tensor([60.0], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64),
                       10.0)
    assert float(loss) == pytest.approx(10 * 1750.0)


def test_low_rank_parameter_counts_by_hand() -> None:
    lr = LowRankLinear(1000, 256, 96)
    assert sum(p.numel() for p in lr.parameters()) == 1000 * 96 + 96 * 256 + 256
    assert isinstance(maybe_low_rank(104, 256, 96), torch.nn.Linear)  # 96·360 > 104·256: no saving
    assert isinstance(maybe_low_rank(256, 200, 96), LowRankLinear)  # 96·456 < 256·200

    K, S, H = 1000, 1004, 256  # K devices, state K + 4
    hidden = 2 * (H * H + H)
    dense_actor = (S * H + H) + hidden + (H * 2 * K + 2 * K)
    dense_critic = ((S + K) * H + H) + hidden + (H * 2 + 2)
    r = 96
    low_actor = (S * r + r * H + H) + hidden + (H * r + r * 2 * K + 2 * K)
    low_critic = ((S + K) * r + r * H + H) + hidden + (H * 2 + 2)
    dense = DSACTAgent(S, K, DSACTConfig(rank=0), seed=0).parameter_counts()
    low = DSACTAgent(S, K, DSACTConfig(rank=r), seed=0).parameter_counts()
    assert (dense["actor"], dense["critic"]) == (dense_actor, dense_critic) == (902_864, 645_378)
    assert (low["actor"], low["critic"]) == (low_actor, low_critic) == (471_376, 349_314)
    assert dense["agent"] == dense_actor + 2 * dense_critic and dense["with_targets"] == 2 * dense["agent"]
    assert low["agent"] == 1_170_004
    # a LayerNorm (scale and shift, H each) in each of the critic's three hidden layers
    ln = DSACTAgent(S, K, DSACTConfig(rank=r, critic_layer_norm=True), seed=0).parameter_counts()
    assert (ln["actor"], ln["critic"]) == (low_actor, low_critic + 3 * 2 * H)


def test_a_layer_norm_critic_is_bounded_for_any_input_and_a_plain_one_is_not() -> None:
    """With a LayerNorm before each hidden GELU, the last hidden layer's inputs z are standardised,
    each |z_i| ≤ √(H − 1), and |GELU(x)| ≤ |x|, so |Q| ≤ Σ_i |w_i|(|γ_i|√(H − 1) + |β_i|) + |b|
    whatever the state and action (w, b: the output row of Q; γ, β: the last LayerNorm's). A plain
    critic's output grows with its input (GELU is linear for large x)."""
    torch.manual_seed(0)
    ln = Critic(6, 4, (16, 16), rank=0, layer_norm=True)
    plain = Critic(6, 4, (16, 16), rank=0)
    with torch.no_grad():  # a trained-looking LayerNorm, not the identity it starts as
        for m in ln.net:
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(-2, 2)
                m.bias.uniform_(-1, 1)
    last_ln = [m for m in ln.net if isinstance(m, torch.nn.LayerNorm)][-1]
    out = ln.net[-1]
    H = 16
    with torch.no_grad():
        bound = float((out.weight[0].abs() * (last_ln.weight.abs() * math.sqrt(H - 1) + last_ln.bias.abs())).sum()
                      + out.bias[0].abs())
    g = torch.Generator().manual_seed(1)
    s, a = torch.randn(64, 6, generator=g), torch.randn(64, 4, generator=g)
    with torch.no_grad():
        for scale in (1.0, 1e3, 1e6):
            assert float(ln(s * scale, a * scale)[0].abs().max()) <= bound
        q_small, q_big = plain(s, a)[0].abs().max(), plain(s * 1e6, a * 1e6)[0].abs().max()
    assert float(q_big) > 1e3 * float(q_small) and float(q_big) > bound
    # where the LayerNorms sit (the bound would hold with them after the GELUs too): after each
    # hidden linear map — the low-rank input layer's included — before its GELU, none in the actor
    low = Critic(60, 40, (16, 16), rank=4, layer_norm=True)
    assert [type(m).__name__ for m in low.net] == ["LowRankLinear", "LayerNorm", "GELU", "Linear", "LayerNorm", "GELU",
                                                   "Linear"]
    agent = DSACTAgent(60, 40, DSACTConfig(hidden=(16, 16), rank=4, critic_layer_norm=True))
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in agent.actor.modules())


def test_replay_ring_keeps_the_newest_in_order_and_round_trips() -> None:
    buf = ReplayBuffer(3, 2, 1)
    for i in range(5):
        buf.add(np.full(2, i, np.float32), np.full(1, -i, np.float32), float(i), np.full(2, i + 1, np.float32), i == 4)
    st = buf.state_dict()
    assert len(buf) == 3 and st["r"].tolist() == [2.0, 3.0, 4.0] and st["done"].tolist() == [0, 0, 1]
    back = ReplayBuffer(3, 2, 1)
    back.load_state_dict(st)
    assert back.state_dict()["s"].tolist() == st["s"].tolist()
    with pytest.raises(ValueError, match="shape"):
        buf.add(np.zeros(3), np.zeros(1), 0.0, np.zeros(2), False)
    with pytest.raises(ValueError, match="not finite"):
        buf.add(np.zeros(2), np.zeros(1), float("nan"), np.zeros(2), False)


def _tiny(seed: int = 0, **kw) -> DSACTAgent:
    conf = {"hidden": (16, 16), "rank": 2, "warmup": 4, "batch_size": 4, **kw}
    return DSACTAgent(6, 4, DSACTConfig(**conf), seed=seed)


def _fill(agent: DSACTAgent, n: int = 6) -> None:
    rng = np.random.default_rng(1)
    for _ in range(n):
        agent.observe(rng.random(6, dtype=np.float32), agent.act(rng.random(6, dtype=np.float32)),
                      float(rng.normal()), rng.random(6, dtype=np.float32), False)


def test_targets_move_by_polyak_after_each_delayed_update() -> None:
    agent = _tiny(tau=0.25, delay_update=2)
    _fill(agent)
    before = [p.detach().clone() for p in agent.critic_targets.parameters()]
    first = agent.update(1)  # update 1: critics only, no target move
    assert "actor_loss" not in first
    assert all(torch.equal(a, b) for a, b in zip(before, agent.critic_targets.parameters(), strict=True))
    out = agent.update(1)  # update 2: actor, α and targets
    assert {"actor_loss", "alpha", "entropy", "critic_loss"} <= set(out)
    for old, new, online in zip(before, agent.critic_targets.parameters(), agent.critics.parameters(), strict=True):
        torch.testing.assert_close(new, 0.75 * old + 0.25 * online.detach())
    assert out["alpha"] != pytest.approx(math.e)  # the temperature is learned


def test_an_update_reports_the_critics_mean_q_on_its_batch_before_their_step() -> None:
    """The batch is the replay rows the agent's generator draws (uniform, with replacement): drawn
    again from a copy of it, the two critics' mean Q there is the update's ``q_mean``."""
    import copy

    agent = _tiny()
    _fill(agent)
    idx = copy.deepcopy(agent.rng).integers(0, len(agent.buffer), agent.config.batch_size)
    s, a = torch.from_numpy(agent.buffer.s[idx]), torch.from_numpy(agent.buffer.a[idx])
    with torch.no_grad():
        want = sum(float(q(s, a)[0].mean()) for q in agent.critics) / 2
    out = agent.update(1)
    assert out["q_mean"] == pytest.approx(want, rel=1e-6)
    with torch.no_grad():  # the critics moved: the same batch now gives another mean
        assert sum(float(q(s, a)[0].mean()) for q in agent.critics) / 2 != pytest.approx(want, rel=1e-6)


def test_nothing_is_learned_before_the_warmup() -> None:
    agent = _tiny(warmup=10)
    _fill(agent, 5)
    assert agent.update(3) == {} and agent.updates == 0


def test_agent_bytes_restore_weights_optimisers_and_generators() -> None:
    agent = _tiny()
    _fill(agent)
    agent.update(3)
    twin = _tiny(seed=99)
    twin.load_bytes(agent.to_bytes())
    twin.buffer.load_state_dict(agent.buffer.state_dict())
    for a, b in zip(agent.actor.state_dict().values(), twin.actor.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    s = np.linspace(0, 1, 6, dtype=np.float32)
    np.testing.assert_array_equal(agent.act(s), twin.act(s))  # same noise generator state
    assert agent.update(2) == twin.update(2)  # same replay draws, same optimiser moments
