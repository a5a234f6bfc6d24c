"""Reinforcement-learning pieces used by server strategies (FedDO's DSAC-T agent,
:mod:`broker_server.rl.dsac_t`). PyTorch only; nothing here knows about federated learning."""

from __future__ import annotations

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

__all__ = ["DSACTAgent", "DSACTConfig", "LowRankLinear", "ReplayBuffer", "clipped_target", "critic_loss",
           "maybe_low_rank", "squashed_gaussian_log_prob"]
