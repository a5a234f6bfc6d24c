"""broker_server.portable_ops: a correctly rounded square root (so the same bits on any x86 CPU)
with torch.sqrt's gradient, and Adam with that root. That the two give the same bits natively
and under qemu's CPU models is tests/broker_server/test_numerics.py's (tools/check_numerics.py's
reference digest includes them)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from broker_server import portable_ops


def test_sqrt_is_the_correctly_rounded_root_in_float32_and_float64() -> None:
    """float32: the float64 root of a float32 rounded to float32 is the correctly rounded one (53 ≥
    2·24 + 2 bits: no double-rounding error for the square root); float64: Python's math.sqrt
    (IEEE-754's correctly rounded sqrt), element by element."""
    rng = np.random.default_rng(0)
    x32 = (np.abs(rng.standard_normal(4096)) * 10.0 ** rng.integers(-6, 6, 4096)).astype(np.float32)
    got32 = portable_ops.sqrt(torch.from_numpy(x32)).numpy()
    assert got32.dtype == np.float32
    np.testing.assert_array_equal(got32, np.sqrt(x32.astype(np.float64)).astype(np.float32))
    x64 = np.abs(rng.standard_normal(512)) * 1e3
    got64 = portable_ops.sqrt(torch.from_numpy(x64)).numpy()
    assert got64.tolist() == [math.sqrt(v) for v in x64.tolist()]


def test_sqrt_gradient_is_one_over_twice_the_root() -> None:
    """d√x/dx = 1/(2√x): against the hand formula, against torch.sqrt's backward, and by
    finite differences in float64 (gradcheck)."""
    x = torch.tensor([0.25, 1.0, 4.0, 9.0], requires_grad=True)
    portable_ops.sqrt(x).sum().backward()
    assert x.grad is not None
    assert x.grad.tolist() == [1.0, 0.5, 0.25, float(np.float32(1 / 6))]
    y = torch.rand(3, 5, dtype=torch.float64) + 0.1
    y.requires_grad_(True)
    assert torch.autograd.gradcheck(portable_ops.sqrt, (y,))
    w = torch.randn(3, 5)
    a, b = y.detach().clone().requires_grad_(True), y.detach().clone().requires_grad_(True)
    (portable_ops.sqrt(a) * w).sum().backward()
    (torch.sqrt(b) * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=0)


def test_sqrt_keeps_shape_dtype_and_the_nan_of_a_negative() -> None:
    """A 0-d tensor stays 0-d, a strided view is read as its values, a negative entry gives NaN
    (torch.sqrt's), other dtypes go to torch.sqrt."""
    z = portable_ops.sqrt(torch.tensor(16.0))
    assert z.shape == () and z.item() == 4.0
    m = torch.arange(12, dtype=torch.float32).reshape(3, 4) ** 2
    np.testing.assert_array_equal(portable_ops.sqrt(m.T).numpy(), np.arange(12, dtype=np.float32).reshape(3, 4).T)
    assert math.isnan(portable_ops.sqrt(torch.tensor([-1.0]))[0].item())
    h = portable_ops.sqrt(torch.tensor([4.0, 9.0], dtype=torch.float16))
    assert h.dtype == torch.float16 and h.tolist() == [2.0, 3.0]


def _adam_reference(p0: np.ndarray, grads: list[np.ndarray], lr: float, b1: float, b2: float, eps: float,
                    wd: float) -> np.ndarray:
    """Kingma & Ba (2015), Algorithm 1, in float64, L2 weight decay added to the gradient."""
    p, m, v = p0.astype(np.float64), np.zeros_like(p0, np.float64), np.zeros_like(p0, np.float64)
    for t, g in enumerate(grads, start=1):
        g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return p


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adam_follows_the_paper_and_torch(weight_decay: float) -> None:
    """20 steps on a quadratic: the parameters equal Algorithm 1 in float64 to float32 precision and
    torch.optim.Adam's within a few float32 ulps (the two roots may differ in their last bit)."""
    torch.manual_seed(0)
    target = torch.randn(50)
    start = torch.randn(50)
    ours, theirs = start.clone().requires_grad_(True), start.clone().requires_grad_(True)
    opt = portable_ops.Adam([ours], lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay)
    ref_opt = torch.optim.Adam([theirs], lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay,
                               foreach=False)
    grads = []
    for _ in range(20):
        for p, o in ((ours, opt), (theirs, ref_opt)):
            o.zero_grad()
            ((p - target) ** 2).sum().backward()
            o.step()
        grads.append(ours.grad.detach().numpy().astype(np.float64).copy())  # type: ignore[union-attr]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # the float64 reference, fed the gradients ours saw (at its own float32 parameters)
    expected = _adam_reference(start.numpy(), grads, 0.05, 0.8, 0.99, 1e-6, weight_decay)
    np.testing.assert_allclose(ours.detach().numpy(), expected, rtol=1e-4, atol=1e-5)


def test_adam_state_loads_either_way_with_torch() -> None:
    """torch.optim.Adam's state dict loads into ours (and back): a checkpoint made with one
    continues with the other; the step count and both moments carry over."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    torch_opt = torch.optim.Adam([p], lr=0.1)
    for _ in range(3):
        torch_opt.zero_grad()
        (p ** 2).sum().backward()
        torch_opt.step()
    ours = portable_ops.Adam([p], lr=0.1)
    ours.load_state_dict(torch_opt.state_dict())
    assert float(ours.state[p]["step"]) == 3.0
    torch.testing.assert_close(ours.state[p]["exp_avg_sq"], torch_opt.state[p]["exp_avg_sq"], rtol=0, atol=0)
    back = torch.optim.Adam([p], lr=0.1)
    back.load_state_dict(ours.state_dict())
    assert float(back.state[p]["step"]) == 3.0


@pytest.mark.parametrize("kwargs, word", [({"lr": 0.0}, "lr"), ({"betas": (1.0, 0.9)}, "betas"),
                                          ({"eps": -1.0}, "eps"), ({"weight_decay": -0.1}, "weight_decay")])
def test_adam_refuses_values_out_of_range(kwargs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        portable_ops.Adam([torch.nn.Parameter(torch.zeros(1))], **kwargs)


#: torch calls whose CPU bits differ between CPUs under the portable settings (module docstring of
#: broker_server.portable_ops): a tensor's root, the trigonometric kernels measured, and the
#: optimisers that take a tensor root
_NOT_PORTABLE = re.compile(r"torch\.(sqrt|rsqrt|tan|atan|asin|acos|cdist|pdist)\(|\.(sqrt|rsqrt)\(\)"
                           r"|\.pow\(0?\.5\)|torch\.optim\.(Adam|AdamW|Adamax|NAdam|RAdam|RMSprop|Adagrad)\b")


def test_project_code_takes_the_portable_ops() -> None:
    """No module of the server or the agent (both run in a grid's cells) calls a kernel whose bits
    differ between CPUs: they take broker_server.portable_ops instead. A line naming one in a
    comment or docstring is not a call, so only code lines count."""
    root = Path(__file__).resolve().parents[2]
    found = []
    for package in ("broker_server", "edge_agent", "protocol"):
        for path in sorted((root / package).rglob("*.py")):
            if path.name == "portable_ops.py":
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                code = line.split("#", 1)[0]
                if _NOT_PORTABLE.search(code) and not code.lstrip().startswith(("\"", "'", "``")):
                    found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
    assert _NOT_PORTABLE.search("d = torch.sqrt(d2)") and _NOT_PORTABLE.search("opt = torch.optim.Adam(ps)")
    assert _NOT_PORTABLE.search("s = v.sqrt()") and not _NOT_PORTABLE.search("r = np.sqrt(v) + math.sqrt(2)")
