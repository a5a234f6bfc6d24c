"""broker_server.portable_ops: a correctly rounded square root (so the same bits on any x86 CPU)
with torch.sqrt's gradient, and Adam with that root. That the two give the same bits natively
and under qemu's CPU models is tests/broker_server/test_numerics.py's (tools/check_numerics.py's
reference digest includes them)."""

from __future__ import annotations

import math
import re
import sys
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
#: broker_server.portable_ops), matched on code with its strings and comments removed: a tensor's
#: root in any spelling (``sqrt``, ``sqrt_``, a power with a fractional exponent, whose value or
#: gradient takes the root kernel), the trigonometric kernels measured and their aliases, the
#: pairwise distances, and torch's optimisers that take a tensor root, however imported
_FRACTION = r"-?\d*\.\d*[1-9]\d*"
_NOT_PORTABLE = re.compile(
    r"\b(sqrt|sqrt_|rsqrt|rsqrt_|tan|tan_|atan|atan_|asin|asin_|acos|acos_|arctan|arcsin|arccos|cdist|pdist)\s*\("
    rf"|\*\*\s*\(?\s*{_FRACTION}|\bpow_?\s*\([^()]*,\s*{_FRACTION}\s*\)|\.pow_?\s*\(\s*{_FRACTION}\s*\)"
    r"|\b(Adam|AdamW|NAdam|RAdam|RMSprop|Adagrad|Adadelta|SparseAdam|Adafactor|Adamax)\b")
#: numpy's and math's roots and trigonometry are correctly rounded or computed by the portable
#: numpy settings, and portable_ops' are the point: the names they are called through
_NUMPY_OR_MATH = re.compile(r"\b(np|numpy|math|portable_ops)\.(sqrt|tan|arctan|arcsin|arccos|power|Adam)\s*\(")


def _code_lines(text: str) -> dict[int, str]:
    """Each line's code with strings (docstrings included) and comments replaced by blanks."""
    import io
    import tokenize

    lines: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENCODING):
            continue
        if sys.version_info >= (3, 12) and tok.type in (tokenize.FSTRING_START, tokenize.FSTRING_MIDDLE,
                                                        tokenize.FSTRING_END):
            continue
        lines.setdefault(tok.start[0], []).append(tok.string)
    return {n: " ".join(parts) for n, parts in lines.items()}


def _flagged(code: str) -> bool:
    return bool(_NOT_PORTABLE.search(_NUMPY_OR_MATH.sub("", code.replace(" . ", ".").replace(" (", "(")
                                                              .replace(" )", ")").replace(" ,", ","))))


def test_project_code_takes_the_portable_ops() -> None:
    """No module of the server, the agent, the protocol or the CLI (all run in a grid's cells) calls
    a kernel whose bits differ between CPUs: they take broker_server.portable_ops instead (numpy's
    and math's roots are correctly rounded). Strings, docstrings and comments are not code."""
    root = Path(__file__).resolve().parents[2]
    found = []
    for package in ("broker_server", "edge_agent", "protocol", "fedfleet"):
        for path in sorted((root / package).rglob("*.py")):
            if path.name == "portable_ops.py":
                continue
            for n, code in _code_lines(path.read_text(encoding="utf-8")).items():
                if _flagged(code):
                    found.append(f"{path.relative_to(root)}:{n}: {code}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("code, flagged", [
    ("d = torch.sqrt(d2)", True), ("s = v.sqrt()", True), ("v.sqrt_()", True), ("r = x ** 0.5", True),
    ("r = x ** 1.5", True), ("r = torch.pow(x, 0.5)", True), ("r = x.pow(.5)", True), ("a = y.atan()", True),
    ("a = torch.arcsin(y)", True), ("d = F.pdist(x)", True), ("opt = torch.optim.Adam(ps)", True),
    ("from torch.optim import AdamW", True), ("opt = optim.RMSprop(ps)", True), ('x = {"d": torch.sqrt(d2)}', True),
    ("r = np.sqrt(v) + math.sqrt(2)", False), ("r = x ** 2", False), ("r = x ** 2.0", False), ("r = x.pow(2)", False),
    ('s = "torch.sqrt(x) # in a string"', False), ("y = x  # torch.sqrt(x) in a comment", False),
    ("opt = portable_ops.Adam(ps)", False), ("d = portable_ops.sqrt(d2)", False),
])
def test_the_guard_flags_each_spelling(code: str, flagged: bool) -> None:
    """What the guard above flags and lets pass, spelling by spelling."""
    assert any(_flagged(c) for c in _code_lines(code + "\n").values()) is flagged
