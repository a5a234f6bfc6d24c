"""Reinforcement-learning pieces used by server strategies: FedDO's DSAC-T agent
(:mod:`broker_server.rl.dsac_t`) and FedAA's DDPG agent (:mod:`broker_server.rl.ddpg`). PyTorch
only; nothing here knows about federated learning."""

from __future__ import annotations

from .ddpg import DDPGAgent, DDPGConfig, SimplexActor, ddpg_target, soft_update
from .dsac_t import (
    DSACTAgent,
    DSACTConfig,
    LowRankLinear,
    ReplayBuffer,
    clipped_target,
    critic_loss,
    maybe_low_rank,
    squashed_gaussian_log_prob,
)

__all__ = ["DDPGAgent", "DDPGConfig", "DSACTAgent", "DSACTConfig", "LowRankLinear", "ReplayBuffer", "SimplexActor",
           "clipped_target", "critic_loss", "ddpg_target", "maybe_low_rank", "soft_update",
           "squashed_gaussian_log_prob"]
