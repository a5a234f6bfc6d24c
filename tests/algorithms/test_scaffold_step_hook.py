"""SCAFFOLD's gradient correction is the contract's one training-step hook, ``before_step``: the
shared loop has no second hook, and the correction it applies is g + c − c_i, step by step."""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.nn.functional as F

from edge_agent.algorithms import ClientAlgorithm, TrainConfig
from edge_agent.algorithms._base import step_hook
from edge_agent.algorithms.fedavg import sgd_epochs
from edge_agent.algorithms.scaffold import CONTROL, ScaffoldClient


def test_the_shared_loop_has_one_training_step_hook() -> None:
    params = inspect.signature(sgd_epochs).parameters
    assert "before_step" in params and "after_backward" not in params
    assert ScaffoldClient.before_step is not ClientAlgorithm.before_step
    client = ScaffoldClient()
    assert step_hook(client) == client.before_step


def test_one_full_batch_step_takes_the_corrected_gradient() -> None:
    """K = 1 step from x with c = 0.3 everywhere and c_i = 0: y = x − η·(∇CE(x) + 0.3), computed
    here with autograd; c_i⁺ = c_i − c + (x − y)/(K·η) = ∇CE(x) (option II)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32))
    y = torch.tensor([0, 1, 1, 0, 1])
    p = sum(t.numel() for t in model.parameters())
    glob = tuple(t.detach().numpy().copy() for t in model.state_dict().values())
    client = ScaffoldClient()
    res = client.local_round(model, glob, x, y, TrainConfig(local_epochs=1, batch_size=5, lr=0.1), round=1,
                             client_index=0, device=torch.device("cpu"),
                             global_extras={CONTROL: np.full(p, 0.3, np.float32)})
    assert client.steps == 1
    grads = torch.autograd.grad(F.cross_entropy(ref(x), y), list(ref.parameters()))
    for got, w, g in zip(res.tensors, ref.parameters(), grads, strict=True):
        np.testing.assert_allclose(got, (w - 0.1 * (g + 0.3)).detach().numpy(), rtol=1e-5, atol=1e-6)
    want = np.concatenate([g.reshape(-1).numpy() for g in grads])
    np.testing.assert_allclose(res.extras["control_delta"], want, rtol=1e-4, atol=1e-5)
