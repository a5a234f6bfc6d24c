"""Parameters, multiply-accumulates and one SGD step's time for every zoo model (or a named group).

The numbers behind the table in :mod:`edge_agent.models.group`: each model is built for
3×32×32 inputs (CIFAR-10), ``feature_dim`` 64, 10 classes; a step is forward + cross-entropy +
backward + SGD on a batch of 32 random images, on ``--threads`` CPU threads (default 1), the
median of ``--steps`` steps after one warm-up step. A time bound belongs here, never in a test.

Usage::

    python tools/bench_model_zoo.py                  # every zoo model
    python tools/bench_model_zoo.py --group htfe4-cpu --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from edge_agent.models import get_group, list_models, make_model  # noqa: E402


def macs(model: nn.Module, c: int, s: int) -> int:
    """Multiply-accumulates of one ``c``×``s``×``s`` image through every Conv2d and Linear."""
    total = 0

    def hook(m: nn.Module, inp: tuple, out: torch.Tensor) -> None:
        nonlocal total
        if isinstance(m, nn.Conv2d):
            total += out[0].numel() * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
        elif isinstance(m, nn.Linear):
            total += m.in_features * m.out_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    was = model.training
    with torch.no_grad():
        model.eval()(torch.zeros(1, c, s, s))
    model.train(was)
    for h in handles:
        h.remove()
    return total


def step_ms(model: nn.Module, steps: int, batch: int = 32) -> float:
    """Median milliseconds of one SGD step on a random 3×32×32 batch (one warm-up step first)."""
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i:
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", help="a named group (edge_agent.models.MODEL_GROUPS); default every zoo model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = list_models()
    if args.group:
        g = get_group(args.group)
        names = list(dict.fromkeys(g.values() if isinstance(g, dict) else g))
    print(f"| architecture | parameters | MACs / image | step (ms, batch 32, {args.threads} thread(s)) |")
    print("|---|---:|---:|---:|")
    total = 0.0
    for name in names:
        m = make_model(name, in_channels=3, image_size=32, num_classes=10, feature_dim=64, seed=0)
        ms = step_ms(m, args.steps)
        total += ms
        print(f"| {name} | {sum(p.numel() for p in m.parameters()):,} | {macs(m, 3, 32):,} | {ms:.1f} |", flush=True)
    print(f"\none step of each: {total:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
