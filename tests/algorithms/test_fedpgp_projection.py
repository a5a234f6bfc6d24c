"""FedPGP's projection (``project_conflicting``) as a pure function: the constraint holds after
it, it is the closest point of the half-space (checked against SciPy's constrained solver and
against random feasible points), the norm never grows, a non-conflicting gradient is untouched
and a zero prototype gradient is safe."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from edge_agent.algorithms.fedpgp import project_conflicting


def _conflicting_pair(rng: np.random.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    while True:
        g, a = rng.standard_normal(n), rng.standard_normal(n)
        if g @ a < -0.1:
            return torch.tensor(g, dtype=torch.float64), torch.tensor(a, dtype=torch.float64)


def test_a_hand_worked_conflict() -> None:
    """g = (1, −2), g_p = (0, 1): ⟨g, g_p⟩ = −2, ‖g_p‖² = 1, g' = g + 2·g_p = (1, 0)."""
    out, changed = project_conflicting(torch.tensor([1.0, -2.0]), torch.tensor([0.0, 1.0]))
    assert changed
    np.testing.assert_array_equal(out.numpy(), [1.0, 0.0])


@pytest.mark.parametrize("seed", range(5))
def test_constraint_holds_norm_shrinks_and_change_is_minimal(seed: int) -> None:
    rng = np.random.default_rng(seed)
    g, a = _conflicting_pair(rng, 7)
    out, changed = project_conflicting(g, a)
    assert changed
    assert float(out @ a) >= -1e-12  # ⟨g', g_p⟩ ≥ 0 (= 0 up to rounding)
    assert float(out.norm()) <= float(g.norm())
    # the closest point of {v : ⟨v, a⟩ ≥ 0} to g, found by a general constrained solver
    gn, an = g.numpy(), a.numpy()
    sol = minimize(lambda v: float(((v - gn) ** 2).sum()), x0=np.zeros(7), jac=lambda v: 2 * (v - gn),
                   constraints=[{"type": "ineq", "fun": lambda v: float(v @ an), "jac": lambda v: an}],
                   method="SLSQP", options={"ftol": 1e-10, "maxiter": 500})
    assert sol.success, sol.message
    np.testing.assert_allclose(out.numpy(), sol.x, atol=1e-5)
    # and no random feasible point is closer
    d = float(np.linalg.norm(out.numpy() - gn))
    cand = gn + rng.standard_normal((20_000, 7)) * d * 1.5
    feasible = cand[cand @ an >= 0]
    assert feasible.size and np.linalg.norm(feasible - gn, axis=1).min() >= d - 1e-9


def test_non_conflicting_gradient_is_untouched() -> None:
    g = torch.tensor([1.0, 2.0, -3.0])
    a = torch.tensor([1.0, 1.0, 0.5])  # ⟨g, a⟩ = 1.5 > 0
    out, changed = project_conflicting(g, a)
    assert not changed and torch.equal(out, g)
    orth = torch.tensor([2.0, -1.0, 0.0])  # ⟨g, orth⟩ = 0: on the boundary, feasible
    out, changed = project_conflicting(g, orth)
    assert not changed and torch.equal(out, g)


def test_zero_or_non_finite_prototype_gradient_changes_nothing() -> None:
    g = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    for a in (torch.zeros(2, 2), torch.full((2, 2), float("nan")), torch.tensor([[0.0, float("inf")], [0.0, 0.0]])):
        out, changed = project_conflicting(g, a)
        assert not changed and torch.equal(out, g) and torch.isfinite(out).all()
    out, changed = project_conflicting(g, torch.zeros(2, 2), always=True)
    assert not changed and torch.equal(out, g)


def test_inputs_are_not_modified_and_dtype_shape_kept() -> None:
    g = torch.tensor([[1.0, -2.0], [0.5, 0.0]], dtype=torch.float32)
    a = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float32)
    g0, a0 = g.clone(), a.clone()
    out, _ = project_conflicting(g, a)
    assert torch.equal(g, g0) and torch.equal(a, a0)
    assert out.dtype == torch.float32 and out.shape == (2, 2)
    np.testing.assert_array_equal(out.numpy(), [[1.0, 0.0], [0.5, 0.0]])


def test_always_projects_onto_the_hyperplane_whatever_the_sign() -> None:
    """g = (1, 2), g_p = (0, 1): ⟨g, g_p⟩ = 2 > 0, so the half-space rule keeps g, the
    every-step rule removes the g_p component: (1, 0)."""
    g, a = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0])
    assert not project_conflicting(g, a)[1]
    out, changed = project_conflicting(g, a, always=True)
    assert changed
    np.testing.assert_array_equal(out.numpy(), [1.0, 0.0])


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        project_conflicting(torch.zeros(3), torch.zeros(4))
