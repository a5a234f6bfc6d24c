#!/usr/bin/env python3
"""What the grids' portable CPU numerics (``broker_server.numerics``) cost: one local round of
the light CNN, timed in child processes with the machine's own kernels and with the portable
settings, the two alternating in one run so that both see the same machine load.

A local round here is the grids' one: SGD (lr 0.05, momentum 0.9, weight decay 5e-4, batch 32)
over ``--samples`` standard-normal images for ``--epochs`` epochs, one torch thread, after a
warm-up of one batch; MNIST-shaped (1×28×28) and CIFAR-shaped (3×32×32) inputs, 10 classes.
Timed: the training loop's wall seconds (``time.perf_counter``), not the child's start.

    python tools/bench_numerics.py --out benchmarks/numerics.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from broker_server.numerics import PORTABLE_ENV, child_env  # noqa: E402

SHAPES = {"MNIST-shaped 1×28×28": (1, 28), "CIFAR-shaped 3×32×32": (3, 32)}


def _child(channels: int, size: int, samples: int, epochs: int) -> None:
    import time

    import torch
    import torch.nn.functional as F

    from broker_server.numerics import fingerprint
    from edge_agent.models import make_model

    torch.set_num_threads(1)
    model = make_model("lightcnn", in_channels=channels, image_size=size, num_classes=10, seed=0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, channels, size, size, generator=g)
    y = torch.randint(0, 10, (samples,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        out = model(xb)
        F.cross_entropy(out[0] if isinstance(out, tuple) else out, yb).backward()
        opt.step()

    step(x[:32], y[:32])  # warm-up: first-call allocations and kernel set-up
    t0 = time.perf_counter()
    for _ in range(epochs):
        for i in range(0, samples, 32):
            step(x[i:i + 32], y[i:i + 32])
    print(json.dumps({"seconds": time.perf_counter() - t0, "machine": fingerprint()}))


def _run(portable: bool, channels: int, size: int, samples: int, epochs: int) -> dict:
    env = child_env(portable)
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONWARNINGS"] = "ignore"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", f"{channels},{size},{samples},{epochs}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.splitlines()[-5:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}: {tail}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="", help="write the Markdown table here too")
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--note", default="", help="a sentence on the conditions (machine load …) for the table's foot")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(*(int(v) for v in args.child.split(",")))
        return 0
    rows = ["| input | native s (median) | portable s (median) | portable / native | pairs' ratios (min–max) |",
            "|---|---:|---:|---:|---:|"]
    machines = {}
    for name, (c, s) in SHAPES.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for portable in (False, True):  # alternating: both see the same load
                got = _run(portable, c, s, args.samples, args.epochs)
                times[portable].append(got["seconds"])
                machines[portable] = got["machine"]
        nat, por = statistics.median(times[False]), statistics.median(times[True])
        # each portable run over the native run just before it: the spread the load left
        pairs = [p / n for n, p in zip(times[False], times[True], strict=True)]
        rows.append(f"| {name} | {nat:.2f} | {por:.2f} | {por / nat:.2f} | {min(pairs):.2f}–{max(pairs):.2f} |")
    m = machines[False]
    lines = ["# Portable CPU numerics: cost", "",
             f"One local round ({args.samples} samples, {args.epochs} epochs, batch 32, SGD with momentum) of the "
             f"light CNN, {args.repeats} alternating runs of each, one torch thread; machine: {m['cpu']} "
             f"({platform.machine()}, {os.cpu_count()} CPUs), torch {m['torch']}; native ATen kernels "
             f"{m['cpu_capability']}, portable "
             f"{machines[True]['cpu_capability']} ({', '.join(f'{k}={v}' for k, v in PORTABLE_ENV.items())}).", "",
             *rows, "", f"Produced by `python tools/bench_numerics.py --repeats {args.repeats} "
             f"--samples {args.samples} --epochs {args.epochs}`." + (f" {args.note}" if args.note else "")]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
