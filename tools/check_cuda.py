"""Check that the light CNN trains and runs on CUDA: torch AMP training and ONNX Runtime's CUDA EP.

Run on a GPU machine (a Jetson, a workstation) from the repository root::

    python tools/check_cuda.py [--steps 30] [--batch 256] [--seed 0]

Stages, each reported on its own lines:

1. **torch**: version, ``torch.cuda.is_available()``, device name and compute capability.
2. **train**: ``--steps`` SGD steps of :class:`edge_agent.models.LightCNN` (1×28×28, 10 classes)
   on one fixed random batch (N(0, 1) pixels, uniform labels), with ``torch.autocast`` float16 and
   ``torch.amp.GradScaler`` on CUDA. Prints the loss on that batch before and after (it should
   fall: the batch is memorised), the mean wall time per step in milliseconds (after one warm-up
   step, with ``torch.cuda.synchronize``), the parameter dtypes (float32: autocast keeps master
   weights in float32) and the dtype of the conv1 and logits activations inside autocast
   (float16). On CUDA, when :func:`edge_agent.algorithms.fedavg.sgd_epochs` takes a
   ``precision`` argument, one epoch of it with ``precision="fp16"`` also runs on a copy of the
   model (the project's own AMP path). Without CUDA the plain loop runs on the CPU in float32,
   without autocast, and that is recorded as a fallback.
3. **onnx**: :func:`edge_agent.onnx_runtime.export_onnx` of the trained model, then an
   :class:`edge_agent.onnx_runtime.OnnxModel` asking for ``CUDAExecutionProvider`` then
   ``CPUExecutionProvider``. Prints ``providers_used``, the fallbacks, and the max absolute
   difference of the logits against torch in float32 on the same device (TF32 turned off for
   the torch reference; the CUDA EP may still use TF32, hence the 1e-2 tolerance — on the CPU the
   two agree to ~1e-6).

Exit code: 0 when every stage ran on CUDA (torch CUDA available, training on ``cuda`` with
float16 activations, ONNX Runtime's first provider ``CUDAExecutionProvider``, logits within
tolerance); 1 otherwise, after a ``SUMMARY:`` line saying what fell back or failed. Errors are
caught per stage and reported in one line each (no traceback; ``--traceback`` prints them).
The last line of output is one JSON object holding every result (for a closing note).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make edge_agent/ importable
    sys.path.insert(0, str(REPO))

ONNX_TOLERANCE = 1e-2
"""Max |logits_onnx - logits_torch| accepted on CUDA (the CUDA EP may use TF32 convolutions)."""


def _stage_torch(results: dict[str, Any]) -> Any:
    import torch

    info: dict[str, Any] = {
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": bool(torch.cuda.is_available()),
        "device_name": None,
        "capability": None,
    }
    if info["cuda_available"]:
        info["device_name"] = torch.cuda.get_device_name(0)
        major, minor = torch.cuda.get_device_capability(0)
        info["capability"] = f"{major}.{minor}"
    results["torch"] = info
    print(f"torch {info['version']} (built for CUDA {info['cuda_build']}), "
          f"python {platform.python_version()}")
    print(f"CUDA available: {info['cuda_available']}"
          + (f"; device {info['device_name']}, capability {info['capability']}"
             if info["cuda_available"] else ""))
    return torch


def _stage_train(results: dict[str, Any], steps: int, batch: int, seed: int) -> Any:
    import torch
    import torch.nn.functional as F

    from edge_agent.models import build_model

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10).to(device)
    x = torch.randn(batch, 1, 28, 28, generator=generator).to(device)
    y = torch.randint(0, 10, (batch,), generator=generator).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type, enabled=cuda)

    seen: dict[str, str] = {}

    def record(name: str):
        def hook(_module, _inputs, output):
            seen[name] = str(output.dtype).removeprefix("torch.")
        return hook

    handles = [model.backbone.conv1.register_forward_hook(record("conv1")),
               model.classifier.register_forward_hook(record("logits"))]

    def loss_now() -> float:
        model.eval()
        with torch.no_grad():
            value = float(F.cross_entropy(model(x), y))
        model.train()
        return value

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=torch.float16, enabled=cuda):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    loss_before = loss_now()
    model.train()
    step()  # warm-up (cuDNN algorithm choice, allocator) and the activation-dtype probe
    sync()
    activation_dtypes = dict(seen)
    for handle in handles:
        handle.remove()
    start = time.perf_counter()
    for _ in range(max(1, steps - 1)):
        step()
    sync()
    step_ms = (time.perf_counter() - start) / max(1, steps - 1) * 1000.0
    loss_after = loss_now()
    param_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})

    project_loop = _project_fp16_loop(model, x, y, seed) if cuda else {
        "skipped": "no CUDA"}

    train = {
        "project_sgd_epochs_fp16": project_loop,
        "device": device.type,
        "autocast_fp16": cuda,
        "grad_scaler": cuda,
        "steps": max(1, steps - 1) + 1,
        "batch": batch,
        "loss_before": round(loss_before, 6),
        "loss_after": round(loss_after, 6),
        "step_ms": round(step_ms, 3),
        "param_dtypes": param_dtypes,
        "activation_dtypes": activation_dtypes,
        "grad_scale": float(scaler.get_scale()) if cuda else None,
    }
    results["train"] = train
    print(f"train: device={train['device']} autocast_fp16={cuda} grad_scaler={cuda} "
          f"steps={train['steps']} batch={batch}")
    print(f"train: loss before {loss_before:.4f} -> after {loss_after:.4f}; "
          f"{step_ms:.2f} ms/step")
    print(f"train: params {param_dtypes}; activations conv1={activation_dtypes.get('conv1')} "
          f"logits={activation_dtypes.get('logits')}")
    if cuda:
        print(f"train: edge_agent sgd_epochs(precision='fp16'): {project_loop}")
    return model


def _project_fp16_loop(model: Any, x: Any, y: Any, seed: int) -> dict[str, Any]:
    """One epoch of :func:`edge_agent.algorithms.fedavg.sgd_epochs` with ``precision="fp16"``
    on a copy of ``model`` (CUDA only), when that function takes a ``precision`` argument."""
    import copy
    import inspect

    import torch

    from edge_agent.algorithms._base import TrainConfig
    from edge_agent.algorithms.fedavg import sgd_epochs

    if "precision" not in inspect.signature(sgd_epochs).parameters:
        return {"skipped": "sgd_epochs has no precision argument"}
    clone = copy.deepcopy(model)
    device = next(clone.parameters()).device
    start = time.perf_counter()
    try:
        loss, accuracy = sgd_epochs(clone, x.cpu(), y.cpu(), TrainConfig(batch_size=64, lr=0.05),
                                    torch.Generator().manual_seed(seed), device,
                                    precision="fp16")
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - reported by main() as an error line
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"train_loss": round(loss, 6), "train_accuracy": round(accuracy, 6),
            "seconds": round(time.perf_counter() - start, 4),
            "param_dtypes": sorted({str(p.dtype).removeprefix("torch.")
                                    for p in clone.parameters()})}


def _stage_onnx(results: dict[str, Any], model: Any, folder: Path, seed: int) -> None:
    import numpy as np
    import onnxruntime as ort
    import torch

    from edge_agent.onnx_runtime import OnnxModel, export_onnx

    onnx_info: dict[str, Any] = {"onnxruntime": ort.__version__,
                                 "available_providers": list(ort.get_available_providers())}
    results["onnx"] = onnx_info
    if "CUDAExecutionProvider" in onnx_info["available_providers"] and hasattr(ort, "preload_dlls"):
        try:  # load CUDA/cuDNN from the pip nvidia-* packages torch brought (ORT >= 1.21)
            ort.preload_dlls()
        except Exception as exc:  # noqa: BLE001 - informational only
            onnx_info["preload_dlls_error"] = f"{type(exc).__name__}: {exc}"

    device = next(model.parameters()).device
    path = export_onnx(model, folder / "lightcnn.onnx", input_shape=(1, 28, 28))
    onnx_info["export_bytes"] = path.stat().st_size
    print(f"onnx: exported {path.name} ({onnx_info['export_bytes']} bytes, opset 17, "
          f"dynamic batch); onnxruntime {ort.__version__}, available providers "
          f"{onnx_info['available_providers']}")

    session = OnnxModel(path, providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
    onnx_info["providers_requested"] = list(session.providers_requested)
    onnx_info["providers_used"] = session.providers_used
    onnx_info["fallbacks"] = list(session.fallbacks)
    print(f"onnx: providers_used {session.providers_used}")
    for line in session.fallbacks:
        print(f"onnx: fallback: {line}")

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 1, 28, 28)).astype(np.float32)
    start = time.perf_counter()
    logits = session.predict_logits(x)
    onnx_info["run_ms_batch64"] = round((time.perf_counter() - start) * 1000.0, 3)
    model.eval()
    tf32 = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            reference = model(torch.from_numpy(x).to(device)).float().cpu().numpy()
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    diff = float(np.abs(logits - reference).max())
    onnx_info["reference_device"] = device.type
    onnx_info["max_abs_diff"] = diff
    print(f"onnx: max |logits_onnx - logits_torch({device.type}, fp32)| = {diff:.3e} "
          f"(tolerance {ONNX_TOLERANCE:g}); {onnx_info['run_ms_batch64']:.2f} ms for 64 images "
          "(first run, includes set-up)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (>= 2)")
    parser.add_argument("--batch", type=int, default=256, help="images per training step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--traceback", action="store_true", help="print tracebacks of errors")
    args = parser.parse_args(argv)

    results: dict[str, Any] = {"tool": "check_cuda", "host": platform.node()}
    fallbacks: list[str] = []
    errors: list[str] = []

    def attempt(stage: str, func, *fargs):
        try:
            return func(*fargs)
        except Exception as exc:  # noqa: BLE001 - every stage is reported, none aborts the rest
            errors.append(f"{stage}: {type(exc).__name__}: {exc}")
            print(f"{stage}: ERROR {type(exc).__name__}: {exc}")
            if args.traceback:
                traceback.print_exc()
            return None

    torch_mod = attempt("torch", _stage_torch, results)
    model = attempt("train", _stage_train, results, args.steps, args.batch, args.seed) \
        if torch_mod is not None else None
    if model is not None:
        with tempfile.TemporaryDirectory(prefix="fedfleet-check-cuda-") as tmp:
            attempt("onnx", _stage_onnx, results, model, Path(tmp), args.seed)

    info = results.get("torch", {})
    if info and not info.get("cuda_available"):
        fallbacks.append("torch: CUDA not available "
                         f"(torch {info.get('version')}, built for CUDA {info.get('cuda_build')})")
    train = results.get("train")
    if train:
        if train["device"] != "cuda":
            fallbacks.append("train: ran on cpu in float32 without autocast/GradScaler")
        else:
            if train["activation_dtypes"].get("conv1") != "float16":
                fallbacks.append(f"train: conv1 activations {train['activation_dtypes']} "
                                 "under autocast, expected float16")
            if train["param_dtypes"] != ["float32"]:
                fallbacks.append(f"train: parameters {train['param_dtypes']}, expected float32")
        project = train["project_sgd_epochs_fp16"]
        if "error" in project:
            errors.append(f"train: sgd_epochs(precision='fp16') failed: {project['error']}")
        if not train["loss_after"] < train["loss_before"]:
            errors.append(f"train: loss did not fall ({train['loss_before']} -> "
                          f"{train['loss_after']})")
    onnx_info = results.get("onnx")
    if onnx_info and "providers_used" in onnx_info:
        used = onnx_info["providers_used"]
        if not used or used[0] != "CUDAExecutionProvider":
            why = "; ".join(f for f in onnx_info["fallbacks"] if f.startswith("CUDA")) \
                or "not used"
            fallbacks.append(f"onnxruntime: ran on {used[0] if used else 'nothing'} ({why})")
        diff = onnx_info.get("max_abs_diff")
        if diff is not None and not diff <= ONNX_TOLERANCE:
            errors.append(f"onnx: logits differ from torch by {diff:.3e} > {ONNX_TOLERANCE:g}")

    ok = not fallbacks and not errors
    results.update({"fallbacks": fallbacks, "errors": errors, "all_cuda": ok})
    if ok:
        print("SUMMARY: OK - torch AMP training and ONNX Runtime inference both ran on CUDA")
    else:
        print("SUMMARY: NOT ALL ON CUDA - " + " | ".join(fallbacks + errors))
    print(json.dumps(results, sort_keys=True, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
