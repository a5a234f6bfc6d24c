#!/usr/bin/env python3
"""Does this machine compute the reproduction grids' bits? Three SGD steps of the light CNN, a
few numpy operations and the server's own training (FedTGP's prototypes, a DSAC-T agent) under the
portable CPU numerics (``broker_server.numerics``), their SHA-256
beside the reference machines' one.

    python tools/check_numerics.py            # portable numerics (what the grids use)
    python tools/check_numerics.py --native   # the machine's own kernels, for comparison

Prints the machine fingerprint, the digest and whether it is the reference digest of this torch
version (:data:`REFERENCE`): the same digest means records made with portable numerics re-run here to the same
bits; another one means they will differ in their last digits and, after 15 rounds, in their
accuracy (a record's re-run check then says so). Exit status 0 when the digest is the reference
one, 1 when it is not or no reference is known for this torch version.

The training runs in a child process started with the settings, since they are read when torch
is loaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from broker_server.numerics import child_env  # noqa: E402

#: torch and numpy versions (torch's with its build suffix, as ``torch.__version__`` spells it) → the reference
#: digest (16 hex digits) of :func:`reference_training` under portable numerics, one torch thread:
#: the same natively on an AMD EPYC with AVX-512 and under qemu-x86_64's Intel Haswell-v4 and AMD
#: EPYC-v3 CPU models (measured 2026-12-05, the DSAC-T agent of :func:`reference_server` with its
#: critics' LayerNorm, FedDO's default). The digest before it, 2e4e838de8cf4a67 (plain critics),
#: was the same natively on an Intel Xeon with AVX-512, on an AMD EPYC with AVX-512 and under both
#: models; the one before that (no server part), 2e4e2b8e5d511876, natively on an AMD EPYC too.
REFERENCE = {"torch 2.14.1+cu130, numpy 2.4.6": "bb35da707247b0c2"}


def reference_training() -> str:
    """Three SGD steps (lr 0.05, momentum 0.9, weight decay 5e-4) of the light CNN for
    3×32×32 inputs and 10 classes (``torch.manual_seed(0)`` weights) on one batch of 64 standard-
    normal images and uniform labels (``torch.Generator`` seed 1), one torch thread.

    Returns:
        The first 16 hex digits of the SHA-256 of the trained ``state_dict``'s float32 bytes, in
        its order, followed by :func:`reference_numpy`'s bytes.
    """
    import torch
    import torch.nn.functional as F

    from edge_agent.models import make_model

    torch.set_num_threads(1)
    model = make_model("lightcnn", in_channels=3, image_size=32, num_classes=10, seed=0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    for _ in range(3):
        opt.zero_grad()
        out = model(x)
        logits = out[0] if isinstance(out, tuple) else out
        F.cross_entropy(logits, y).backward()
        opt.step()
    state = b"".join(t.detach().contiguous().numpy().tobytes() for t in model.state_dict().values())
    return hashlib.sha256(state + reference_numpy() + reference_server()).hexdigest()[:16]


def reference_server() -> bytes:
    """The bytes of the server-side training the grids run besides the clients' SGD: FedTGP's
    prototype network (5 epochs of its margin loss, whose distances take
    :func:`broker_server.portable_ops.sqrt`) on seeded uploads, and 10 updates of a small DSAC-T
    agent (FedDO's; :class:`broker_server.portable_ops.Adam`) on 40 seeded transitions. With
    ``torch.sqrt`` and ``torch.optim.Adam`` these gave other bits natively on an Intel Xeon with
    AVX-512 than under qemu's Haswell-v4 and EPYC-v3 models."""
    import numpy as np

    from broker_server.rl.dsac_t import DSACTAgent, DSACTConfig
    from broker_server.strategies._prototype_net import prototype_net, train_prototype_net
    from broker_server.strategies.fedtgp import adaptive_margin, margin_contrastive_loss

    rng = np.random.default_rng(0)
    classes = np.concatenate([rng.choice(10, size=3, replace=False) for _ in range(20)]).astype(np.int64)
    protos = (rng.standard_normal((len(classes), 64)) * 0.5 + classes[:, None] * 0.1).astype(np.float32)
    margin = adaptive_margin({int(c): protos[classes == c].astype(np.float64).mean(0) for c in np.unique(classes)},
                             100.0)
    _, state, _ = train_prototype_net(prototype_net(10, 64, 0), protos, classes,
                                      lambda p, c, centers: margin_contrastive_loss(p, c, centers, margin),
                                      epochs=5, lr=0.01, batch=10, seed=1)
    agent = DSACTAgent(6, 4, DSACTConfig(hidden=(32, 32), warmup=16, batch_size=16, critic_layer_norm=True), seed=0)
    for _ in range(40):
        s = rng.standard_normal(6).astype(np.float32)
        agent.observe(s, agent.act(s), float(rng.standard_normal()), rng.standard_normal(6).astype(np.float32), False)
    agent.update(10)
    return b"".join(np.ascontiguousarray(a).tobytes() for a in state) + agent.to_bytes()


def reference_numpy() -> bytes:
    """The bytes of numpy operations of the kind the server's strategies run (softmax weights,
    norms, a QR factorisation, float32 and float64) on seeded standard-normal data: the part of a
    cell that numpy's run-time dispatch and its OpenBLAS compute."""
    import numpy as np

    rng = np.random.default_rng(0)
    x64 = rng.standard_normal(100_003) * 5
    x32 = x64.astype(np.float32)
    m = rng.standard_normal((64, 10))
    outs = [np.exp(x64), np.exp(x32), np.log(np.abs(x64) + 1e-3), np.log(np.abs(x32) + np.float32(1e-3)),
            np.tanh(x32), np.sum(x64), np.sum(x32), x32 @ x32, np.power(np.abs(x32), np.float32(0.7)),
            np.linalg.norm(m, axis=1), np.linalg.qr(m)[0], m.T @ m]
    return b"".join(np.asarray(o).tobytes() for o in outs)


def _child() -> None:
    """In the child: the fingerprint and the digest, as one JSON line."""
    import torch

    from broker_server.numerics import fingerprint

    digest = reference_training()  # sets the one torch thread the fingerprint then reports
    # the CPU's own instruction sets (cpuid: an emulator's CPU model where there is one)
    avx512 = bool(getattr(torch.cpu, "_is_avx512_supported", lambda: False)())
    print(json.dumps({"machine": fingerprint(), "digest": digest, "cpuid_avx512": avx512}))


def measure(*, portable: bool = True, wrapper: list[str] | None = None,
            extra_env: dict[str, str] | None = None, timeout_s: float | None = None) -> dict:
    """Run :func:`reference_training` in a child process (under ``wrapper``, e.g. an emulator's
    command line, when given) with or without :data:`PORTABLE_ENV` (then with none of its
    settings, whatever this process's environment holds), plus ``extra_env``.

    Returns:
        ``{"machine": fingerprint, "digest": hex, "cpuid_avx512": bool}`` (the last: whether the
        CPU the child saw, emulated or not, has AVX-512).

    Raises:
        RuntimeError: the child failed, or ran past ``timeout_s`` seconds (the message says
            which, with its stderr's last lines).
    """
    env = child_env(portable)
    env.update(extra_env or {})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONWARNINGS"] = "ignore"
    cmd = [*(wrapper or []), os.path.realpath(sys.executable), str(Path(__file__).resolve()), "--child"]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(cmd)} ran past {timeout_s:g} s") from None
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}: {tail}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--native", action="store_true", help="the machine's own kernels instead of the portable ones")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child()
        return 0
    got = measure(portable=not args.native)
    m = got["machine"]
    print(f"machine: {m['cpu']} ({m['arch']}), torch {m['torch']}, numpy {m.get('numpy')}, ATen kernels "
          f"{m['cpu_capability']}, "
          f"{m['torch_threads']} torch thread(s), {m['numerics']} numerics")
    print(f"digest:  {got['digest']}")
    version = f"torch {m['torch']}, numpy {m.get('numpy')}"
    ref = REFERENCE.get(version)
    if ref is None:
        print(f"no reference digest for {version} (known: {', '.join(sorted(REFERENCE))})")
        return 1
    if got["digest"] == ref:
        print(f"the reference digest of {version}: grid records made with portable numerics re-run here to the "
              "same bits")
        return 0
    why = ""
    if args.native:
        why = " (native numerics: run without --native)"
    elif m["numerics"] != "portable":
        why = " (the portable settings cannot be applied here: Linux on an x86-64 CPU with AVX2 and FMA)"
    print(f"not the reference digest {ref} of {version}: re-runs here of records made with portable numerics differ in "
          f"their last bits{why}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
