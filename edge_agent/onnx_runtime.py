"""Export the device model to ONNX and run it with ONNX Runtime.

Two halves:

* :func:`export_onnx` writes a ``torch.nn.Module`` (the light CNN of :mod:`edge_agent.models`)
  as an ONNX file whose batch axis is dynamic (named ``"batch"``), with one or two outputs:
  ``logits`` float32 ``[N, num_classes]`` and optionally ``features`` float32
  ``[N, feature_dim]`` (the backbone output, so proxy-set code can compute class prototypes
  from the same run).
* :class:`OnnxModel` wraps an ``onnxruntime.InferenceSession`` over such a file: batched
  inference, temperature-softened predictions, accuracy / cross-entropy, and class prototypes,
  all on NumPy arrays. It records which execution providers were asked for and which ran, so a
  device that silently fell back from CUDA to the CPU is visible (``fallbacks``).

Exporter choice: the TorchScript-based exporter, ``torch.onnx.export(..., dynamo=False)``. The
``torch.export``-based exporter (the default since torch 2.9) needs the ``onnxscript`` package,
which the edge images do not carry; the TorchScript exporter needs only ``onnx`` and works
offline, and the light CNN (Conv, ReLU, MaxPool, Flatten, Gemm; no control flow) traces
exactly. Torch marks that exporter deprecated; its ``DeprecationWarning`` and the
``TracerWarning`` raised by :class:`~edge_agent.models.LightCNN`'s input-shape checks (they test
the static C, H, W only, so the trace stays valid for every batch size) are silenced during the
export. The graph is traced with a batch of at least 2: tracing with a batch of 1 lets the
tracer fold the batch size into reshape constants, which would then fail or silently mis-shape
other batch sizes.

ONNX Runtime exceptions (and ``OSError`` when reading the file) are converted once, here, into
:class:`~edge_agent.errors.ModelError` with ``raise ... from exc``; the message names the file
and the providers in use.

Requires the ``onnx`` and ``onnxruntime`` packages (``pip install onnx onnxruntime``; on a
Jetson, NVIDIA's ``onnxruntime-gpu`` wheel). Both are optional native extensions: before they are
imported here, :func:`edge_agent.optional_runtime.require` checks (once per process, in a child
process) that they import without raising or killing the interpreter; otherwise importing this
module raises ``ImportError`` with the reason, which every caller treats as "use torch".
"""

from __future__ import annotations

import io
import math
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import nn

from edge_agent.errors import DataError, ModelError
from edge_agent.optional_runtime import require
from protocol.files import write_atomically

require("onnx", "onnxruntime")  # ImportError with the reason: a broken install must not kill this process

import onnx  # noqa: E402  (only once the probe said it imports)
import onnxruntime as ort  # noqa: E402

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "INPUT_NAME",
    "KNOWN_OUTPUTS",
    "OnnxModel",
    "export_onnx",
]

INPUT_NAME = "input"
"""Name of the single graph input of an exported model: float32 ``[batch, C, H, W]``."""

KNOWN_OUTPUTS = ("logits", "features")
"""Outputs :func:`export_onnx` can write: ``logits`` ``[batch, num_classes]``, ``features``
``[batch, feature_dim]`` (both float32)."""

_KNOWN_AXES = ("batch",)
# Axis name -> dimension index in the input and in every output. Only the batch can be dynamic.
_AXIS_INDEX = {"batch": 0}

DEFAULT_BATCH_SIZE = 512
"""Samples per ONNX Runtime call in :meth:`OnnxModel.run` and the methods built on it."""


def _ort_exceptions() -> tuple[type[BaseException], ...]:
    """The exception classes ONNX Runtime's Python binding raises (they derive from Exception
    directly, not from RuntimeError), plus the built-in ones its Python wrapper raises."""
    found: list[type[BaseException]] = [RuntimeError, ValueError, OSError]
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as state
    except ImportError:  # pragma: no cover - layout of a future onnxruntime
        return tuple(found)
    for value in vars(state).values():
        if isinstance(value, type) and issubclass(value, Exception) and value not in found:
            found.append(value)
    return tuple(found)


_ORT_ERRORS = _ort_exceptions()


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


class _LogitsAndFeatures(nn.Module):
    """Export wrapper returning the requested subset of ``(head(features(x)), features(x))``.

    The backbone runs once; ``outputs`` fixes the order of the returned tensors.
    """

    def __init__(self, model: nn.Module, outputs: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.outputs = outputs

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # nn.Module's __getattr__ types submodule attributes as Tensor | Module; check_model
        # established that both are callables Tensor -> Tensor
        z = cast(Callable[[torch.Tensor], torch.Tensor], self.model.features)(x)
        values = {"features": z}
        if "logits" in self.outputs:
            values["logits"] = cast(Callable[[torch.Tensor], torch.Tensor], self.model.head)(z)
        return tuple(values[name] for name in self.outputs)


_EXPORT_LOCK = threading.Lock()
"""Serialises :func:`torch.onnx.export` within a process: the TorchScript exporter keeps
process-wide state (``GLOBALS.in_onnx_export``), so two devices of one simulation exporting at
once would break each other's export."""


def export_onnx(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    example: torch.Tensor | None = None,
    input_shape: tuple[int, int, int] | None = None,
    outputs: Sequence[str] = ("logits",),
    dynamic_axes_names: Sequence[str] = ("batch",),
    opset: int = 17,
) -> Path:
    """Export ``model`` to an ONNX file with a dynamic batch axis.

    The graph has one input, ``"input"`` float32 ``[batch, C, H, W]``, and the outputs named in
    ``outputs`` (in that order), each float32 with a leading ``batch`` axis. The model is traced
    in eval mode; its training flag is restored afterwards and nothing else about it changes.
    The file is checked with ``onnx.checker.check_model`` before it is written, and written
    atomically (a temporary file in the same folder, then a rename), so ``path`` never holds a
    half-written model.

    Args:
        model: the device model, float32. For ``outputs=("logits",)`` any module mapping
            ``[N, C, H, W]`` to logits ``[N, num_classes]``; an output ``"features"`` needs
            ``model.features(x)`` (``[N, feature_dim]``) and, with ``"logits"`` too,
            ``model.head(z)`` (``[N, num_classes]``), as :class:`~edge_agent.models.LightCNN` has.
        path: the ``.onnx`` file to write (overwritten if present); its folder must exist.
        example: a float32 batch ``[N, C, H, W]`` to trace with, N >= 2; moved to the model's
            device. None: use ``input_shape``.
        input_shape: ``(C, H, W)``, used when ``example`` is None to trace a seeded random batch
            of 2. None (and no ``example``): read ``model.in_channels`` and ``model.image_size``
            (as :class:`~edge_agent.models.LightCNN` has them).
        outputs: non-empty, no repeats, each in :data:`KNOWN_OUTPUTS`; ``("logits",)``
            (default) or ``("logits", "features")`` for proxy-set code that needs prototypes.
        dynamic_axes_names: names of the dynamic axes; only ``"batch"`` exists and it must be
            present (the batched :class:`OnnxModel` relies on it). The parameter is a sequence
            so that other dynamic axes can be added later without changing the signature.
        opset: ONNX opset version (default 17; ONNX Runtime >= 1.14 runs it).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ModelError: the example batch has fewer than 2 samples, is not 4-D float32, or does
            not match ``input_shape``; no input shape can be found; an unknown or missing axis
            name; an unknown or repeated output name, or ``"features"`` asked of a model
            without ``features``/``head``; the exporter or the ONNX checker failed; the file
            cannot be written (each with the path in the message).
    """
    out_path = Path(path)
    names = _check_outputs(outputs)
    axes = _check_axes(dynamic_axes_names)
    x = _example_batch(model, example, input_shape)

    if names == ("logits",):
        module: nn.Module = model
    else:
        for method in ("features", "head") if "logits" in names else ("features",):
            if not callable(getattr(model, method, None)):
                raise ModelError(
                    f"cannot export outputs {names}: {type(model).__name__} has no "
                    f"{method}() method"
                )
        module = _LogitsAndFeatures(model, names)

    dynamic_axes = {
        tensor: {_AXIS_INDEX[axis]: axis for axis in axes} for tensor in (INPUT_NAME, *names)
    }
    buffer = io.BytesIO()
    was_training = model.training
    model.eval()
    try:
        with _EXPORT_LOCK, warnings.catch_warnings(), torch.no_grad():
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            # "legacy TorchScript-based ONNX export" and its logging helper; scoped to this call.
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            torch.onnx.export(
                module,
                (x,),
                # the TorchScript exporter (dynamo=False) writes to a file-like object too; the
                # annotation names paths only
                buffer,  # type: ignore[arg-type]
                dynamo=False,
                input_names=[INPUT_NAME],
                output_names=list(names),
                dynamic_axes=dynamic_axes,
                opset_version=opset,
                do_constant_folding=True,
            )
    except ModelError:
        raise
    except Exception as exc:  # the TorchScript exporter raises many unrelated types
        raise ModelError(f"ONNX export to {out_path} failed: {exc}") from exc
    finally:
        model.train(was_training)

    try:
        proto = onnx.load_model_from_string(buffer.getvalue())
        onnx.checker.check_model(proto)
    except (onnx.checker.ValidationError, ValueError, RuntimeError) as exc:
        raise ModelError(f"exported ONNX model for {out_path} failed the checker: {exc}") from exc

    _write_atomically(out_path, buffer.getvalue())
    return out_path


def _check_outputs(outputs: Sequence[str]) -> tuple[str, ...]:
    if isinstance(outputs, str):
        raise ModelError(
            f"outputs must be a sequence of names such as ('logits',), got {outputs!r}"
        )
    names = tuple(outputs)
    if not names:
        raise ModelError(f"outputs must name at least one of {KNOWN_OUTPUTS}")
    unknown = [n for n in names if n not in KNOWN_OUTPUTS]
    if unknown:
        raise ModelError(f"unknown output name(s) {unknown}; known outputs: {KNOWN_OUTPUTS}")
    if len(set(names)) != len(names):
        raise ModelError(f"output names repeat: {names}")
    return names


def _check_axes(dynamic_axes_names: Sequence[str]) -> tuple[str, ...]:
    if isinstance(dynamic_axes_names, str):
        raise ModelError(
            f"dynamic_axes_names must be a sequence of names such as ('batch',), "
            f"got {dynamic_axes_names!r}"
        )
    axes = tuple(dynamic_axes_names)
    unknown = [a for a in axes if a not in _KNOWN_AXES]
    if unknown:
        raise ModelError(
            f"unknown dynamic axis name(s) {unknown}; only {_KNOWN_AXES} can be dynamic "
            "(the batch axis, dimension 0 of the input and of every output)"
        )
    if "batch" not in axes:
        raise ModelError(
            f"dynamic_axes_names must include 'batch' (got {axes}): a fixed batch size "
            "would break batched inference"
        )
    return tuple(dict.fromkeys(axes))


def _example_batch(
    model: nn.Module,
    example: torch.Tensor | None,
    input_shape: tuple[int, int, int] | None,
) -> torch.Tensor:
    """The float32 batch ``[N >= 2, C, H, W]`` to trace with, on the model's device."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if example is not None:
        if not isinstance(example, torch.Tensor):
            raise ModelError(f"example must be a torch.Tensor, got {type(example).__name__}")
        if example.dim() != 4 or example.dtype != torch.float32:
            raise ModelError(
                f"example must be a float32 tensor [N, C, H, W], got {example.dtype} "
                f"{list(example.shape)}"
            )
        if example.shape[0] < 2:
            raise ModelError(
                f"example batch has {example.shape[0]} sample(s); trace with a batch of >= 2 "
                "(a batch of 1 can bake the batch size into the graph's reshapes)"
            )
        if input_shape is not None and tuple(example.shape[1:]) != tuple(input_shape):
            raise ModelError(
                f"example shape {list(example.shape)} does not match input_shape {input_shape}"
            )
        return example.detach().to(device)
    if input_shape is None:
        channels = getattr(model, "in_channels", None)
        size = getattr(model, "image_size", None)
        if not isinstance(channels, int) or not isinstance(size, int):
            raise ModelError(
                f"cannot tell the input shape of {type(model).__name__}: pass example= or "
                "input_shape=(C, H, W)"
            )
        input_shape = (channels, size, size)
    shape = tuple(input_shape)
    if len(shape) != 3 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1
                                  for d in shape):
        raise ModelError(f"input_shape must be three positive ints (C, H, W), got {input_shape!r}")
    generator = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn((2, *shape), generator=generator, dtype=torch.float32).to(device)


def _write_atomically(path: Path, data: bytes) -> None:
    """:func:`protocol.files.write_atomically` (the model as readable as the run folder's other
    files), its OSError as a ModelError naming the file."""
    try:
        write_atomically(path, data)
    except OSError as exc:
        raise ModelError(f"cannot write ONNX model to {path}: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Inference
# --------------------------------------------------------------------------------------------


class OnnxModel:
    """An exported model under ONNX Runtime, on NumPy arrays.

    Args:
        path: an ``.onnx`` file written by :func:`export_onnx` (one input ``[batch, C, H, W]``
            float32 with a dynamic batch; outputs ``logits`` and/or ``features``).
        providers: ONNX Runtime execution providers in order of preference, e.g.
            ``("CUDAExecutionProvider", "CPUExecutionProvider")``. Those not in
            ``onnxruntime.get_available_providers()`` are dropped (and recorded in
            ``fallbacks``); if none is left the session uses ``CPUExecutionProvider``.
        threads: intra-op threads (``SessionOptions.intra_op_num_threads``), >= 1; inter-op
            threads are then set to 1. None: ONNX Runtime's default (one per physical core).

    Attributes:
        path: the model file (:class:`~pathlib.Path`).
        providers_requested: ``providers`` as given (tuple of str).
        providers_used: what the session runs on, ``session.get_providers()`` (list of str,
            in priority order).
        fallbacks: one readable line per requested provider that is not in use, e.g.
            ``"CUDAExecutionProvider not available (available: ...)"``; empty when every
            requested provider is in use.
        input_name: the graph's input name (``"input"`` for :func:`export_onnx` files).
        input_shape: ``(C, H, W)`` the model takes, in channels and pixels.
        output_names: the graph's outputs in order (e.g. ``["logits", "features"]``).

    Raises:
        ModelError: the file does not exist, is not a valid ONNX model, or ONNX Runtime cannot
            create a session for it (the message names the path and the providers), or the
            graph is not one input ``[batch, C, H, W]``.
        TypeError: ``providers`` is a single string rather than a sequence of strings.
        ValueError: ``threads`` is not None or an int >= 1.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        threads: int | None = None,
    ) -> None:
        self.path = Path(path)
        if isinstance(providers, str) or not all(isinstance(p, str) for p in providers):
            raise TypeError(
                f"providers must be a sequence of provider names, got {providers!r}"
            )
        if threads is not None and (
            isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
        ):
            raise ValueError(f"threads must be None or an int >= 1, got {threads!r}")
        self.providers_requested: tuple[str, ...] = tuple(providers)
        self.fallbacks: list[str] = []

        available = list(ort.get_available_providers())
        chosen = [p for p in dict.fromkeys(self.providers_requested) if p in available]
        for name in self.providers_requested:
            if name not in available:
                self.fallbacks.append(
                    f"{name} not available (available: {', '.join(available)})"
                )
        if not chosen:
            chosen = ["CPUExecutionProvider"]
            self.fallbacks.append(
                "no requested provider is available; using CPUExecutionProvider"
            )

        if not self.path.is_file():
            raise ModelError(f"ONNX model file not found: {self.path}")
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only; fallbacks are recorded, not logged
        if threads is not None:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        try:
            self._session = ort.InferenceSession(
                str(self.path), sess_options=options, providers=chosen
            )
        except _ORT_ERRORS as exc:
            raise ModelError(
                f"ONNX Runtime cannot load {self.path} with providers {chosen}: {exc}"
            ) from exc

        self.providers_used: list[str] = list(self._session.get_providers())
        for name in chosen:
            if name not in self.providers_used:
                # Available in the wheel but failed to initialise (e.g. CUDA/cuDNN libraries
                # missing); ONNX Runtime then drops it silently.
                self.fallbacks.append(
                    f"{name} available but not used by the session (failed to initialise)"
                )

        inputs = self._session.get_inputs()
        if len(inputs) != 1 or len(inputs[0].shape) != 4:
            raise ModelError(
                f"{self.path}: expected one input [batch, C, H, W], got "
                f"{[(i.name, i.shape) for i in inputs]}"
            )
        dims = inputs[0].shape[1:]
        if not all(isinstance(d, int) for d in dims):
            raise ModelError(f"{self.path}: input C, H, W must be fixed, got {inputs[0].shape}")
        self.input_name: str = inputs[0].name
        self.input_shape: tuple[int, int, int] = (int(dims[0]), int(dims[1]), int(dims[2]))
        self._outputs = self._session.get_outputs()
        self.output_names: list[str] = [o.name for o in self._outputs]

    def __repr__(self) -> str:
        return (
            f"OnnxModel({str(self.path)!r}, input_shape={self.input_shape}, "
            f"outputs={self.output_names}, providers_used={self.providers_used})"
        )

    # ---------------------------------------------------------------------------- raw run

    def run(self, x: np.ndarray, batch_size: int = DEFAULT_BATCH_SIZE) -> dict[str, np.ndarray]:
        """Run the graph on ``x`` in batches of at most ``batch_size`` samples.

        Args:
            x: images, float32 ``[N, C, H, W]`` matching :attr:`input_shape` (normalised as
                in :mod:`edge_agent.data`); N may be 0. Not modified.
            batch_size: samples per ONNX Runtime call, >= 1 (bounds peak memory).

        Returns:
            ``{output name: array}`` for every output, each float32 ``[N, ...]`` in the order
            of ``x`` (``logits`` ``[N, num_classes]``, ``features`` ``[N, feature_dim]``).

        Raises:
            ModelError: ``x`` is not a float32 ndarray ``[N, C, H, W]`` of :attr:`input_shape`
                (no silent casting), or ONNX Runtime failed (message names path and providers).
            ValueError: ``batch_size`` < 1.
        """
        self._check_input(x)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        n = int(x.shape[0])
        if n == 0:
            return {o.name: np.zeros((0, *self._static_tail(o)), dtype=np.float32)
                    for o in self._outputs}
        chunks: dict[str, list[np.ndarray]] = {name: [] for name in self.output_names}
        for start in range(0, n, batch_size):
            batch = np.ascontiguousarray(x[start:start + batch_size])
            try:
                values = self._session.run(self.output_names, {self.input_name: batch})
            except _ORT_ERRORS as exc:
                raise ModelError(
                    f"ONNX Runtime failed on {self.path} (providers {self.providers_used}) "
                    f"for a batch of shape {list(batch.shape)}: {exc}"
                ) from exc
            for name, value in zip(self.output_names, values, strict=True):
                chunks[name].append(value)
        return {name: np.concatenate(parts, axis=0) for name, parts in chunks.items()}

    def _check_input(self, x: np.ndarray) -> None:
        if not isinstance(x, np.ndarray):
            raise ModelError(f"input must be a numpy.ndarray, got {type(x).__name__}")
        if x.dtype != np.float32 or x.ndim != 4 or tuple(x.shape[1:]) != self.input_shape:
            c, h, w = self.input_shape
            raise ModelError(
                f"{self.path.name} expects float32 [N, {c}, {h}, {w}], got {x.dtype} "
                f"{list(x.shape)}"
            )

    def _static_tail(self, output: ort.NodeArg) -> tuple[int, ...]:
        dims = output.shape[1:]
        if not all(isinstance(d, int) for d in dims):
            raise ModelError(f"{self.path}: output {output.name} has non-static dims {dims}")
        return tuple(int(d) for d in dims)

    def _output(self, x: np.ndarray, name: str, batch_size: int) -> np.ndarray:
        if name not in self.output_names:
            raise ModelError(
                f"{self.path} has no {name!r} output (outputs: {self.output_names}); export "
                f"with outputs=('logits', 'features')"
            )
        return self.run(x, batch_size)[name]

    # ---------------------------------------------------------------------- predictions

    def predict_logits(self, x: np.ndarray, batch_size: int = DEFAULT_BATCH_SIZE) -> np.ndarray:
        """Logits, float32 ``[N, num_classes]`` (unnormalised).

        Raises:
            ModelError: as :meth:`run`, or the model has no ``logits`` output.
        """
        return self._output(x, "logits", batch_size)

    def features(self, x: np.ndarray, batch_size: int = DEFAULT_BATCH_SIZE) -> np.ndarray:
        """Backbone features, float32 ``[N, feature_dim]``.

        Raises:
            ModelError: as :meth:`run`, or the model has no ``features`` output.
        """
        return self._output(x, "features", batch_size)

    def soft_predictions(
        self, x: np.ndarray, temperature: float, batch_size: int = DEFAULT_BATCH_SIZE
    ) -> np.ndarray:
        """Temperature-softened class probabilities ``softmax(logits / T)``.

        Computed in float64 with the row maximum subtracted before ``exp`` (so large logits or
        a small T cannot overflow), then cast to float32.

        Args:
            x: images, float32 ``[N, C, H, W]``.
            temperature: T > 0 (finite); T = 1 is the plain softmax, larger T is softer
                (Hinton et al., "Distilling the Knowledge in a Neural Network", 2015, eq. 1).
            batch_size: as :meth:`run`.

        Returns:
            float32 ``[N, num_classes]``, each row non-negative and summing to 1 (within
            float32 rounding).

        Raises:
            ValueError: T is not a finite number > 0.
            ModelError: as :meth:`predict_logits`.
        """
        t = _check_temperature(temperature)
        logits = self.predict_logits(x, batch_size).astype(np.float64) / t
        logits -= logits.max(axis=1, keepdims=True)
        weights = np.exp(logits)
        return (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)

    def evaluate(
        self, x: np.ndarray, y: np.ndarray, batch_size: int = DEFAULT_BATCH_SIZE
    ) -> tuple[float, float]:
        """Top-1 accuracy and mean cross-entropy on ``(x, y)``.

        Args:
            x: images, float32 ``[N, C, H, W]``.
            y: labels, int64 ``[N]``, each in ``[0, num_classes)``.
            batch_size: as :meth:`run`.

        Returns:
            ``(accuracy, loss)``: accuracy a fraction in [0, 1] (argmax ties go to the lowest
            class index, as ``numpy.argmax`` and ``torch.argmax`` do); loss the mean over the N
            samples of ``-log softmax(logits)[y]`` in nats (log-sum-exp in float64). N = 0
            gives ``(0.0, 0.0)``, as :func:`edge_agent.algorithms.fedavg.sgd_epochs` does for
            an empty shard.

        Raises:
            DataError: ``y`` is not int64 ``[N]`` or holds a label out of range.
            ModelError: as :meth:`predict_logits`.
        """
        logits = self.predict_logits(x, batch_size).astype(np.float64)
        num_classes = int(logits.shape[1])
        _check_labels(y, int(x.shape[0]), num_classes)
        n = int(y.shape[0])
        if n == 0:
            return 0.0, 0.0
        peak = logits.max(axis=1, keepdims=True)
        log_norm = peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=1))
        nll = log_norm - logits[np.arange(n), y]
        accuracy = float(np.count_nonzero(logits.argmax(axis=1) == y)) / n
        return accuracy, float(nll.mean())

    def class_prototypes(
        self,
        x: np.ndarray,
        y: np.ndarray,
        num_classes: int,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Mean backbone feature per class (the class prototypes of FedProto, Tan et al.,
        AAAI 2022, eq. 5: ``c_k = (1/|D_k|) Σ_{(x, y) ∈ D_k} f(x)``).

        Args:
            x: images, float32 ``[N, C, H, W]``.
            y: labels, int64 ``[N]``, each in ``[0, num_classes)``.
            num_classes: C, >= 1 (rows of the result; not read from the model so that a
                feature-only export works too).
            batch_size: as :meth:`run`.

        Returns:
            ``(protos, counts)``: ``protos`` float32 ``[num_classes, feature_dim]`` (sums in
            float64, then cast); ``counts`` int64 ``[num_classes]``, samples per class. A class
            with no samples gets a **zero row and count 0**: callers must leave such classes
            out (use ``counts > 0``), not treat the zero row as a prototype.

        Raises:
            ValueError: ``num_classes`` is not an int >= 1.
            DataError: ``y`` is not int64 ``[N]`` or holds a label out of range.
            ModelError: as :meth:`run`, or the model has no ``features`` output.
        """
        if isinstance(num_classes, bool) or not isinstance(num_classes, int | np.integer) \
                or num_classes < 1:
            raise ValueError(f"num_classes must be an int >= 1, got {num_classes!r}")
        num_classes = int(num_classes)
        feats = self.features(x, batch_size)
        _check_labels(y, int(x.shape[0]), num_classes)
        counts = np.bincount(y, minlength=num_classes).astype(np.int64)
        sums = np.zeros((num_classes, feats.shape[1]), dtype=np.float64)
        np.add.at(sums, y, feats.astype(np.float64))
        present = counts > 0
        sums[present] /= counts[present, None]
        return sums.astype(np.float32), counts


def _check_temperature(temperature: float) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, int | float | np.floating):
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    t = float(temperature)
    if not math.isfinite(t) or t <= 0.0:
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
    return t


def _check_labels(y: np.ndarray, n: int, num_classes: int) -> None:
    if not isinstance(y, np.ndarray) or y.dtype != np.int64 or y.ndim != 1:
        got = f"{y.dtype} {list(y.shape)}" if isinstance(y, np.ndarray) else type(y).__name__
        raise DataError(f"labels must be an int64 array [N], got {got}", field="y")
    if y.shape[0] != n:
        raise DataError(f"{n} images but {y.shape[0]} labels", field="y")
    if y.size and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DataError(
            f"labels must be in [0, {num_classes}), got min {int(y.min())} max {int(y.max())}",
            field="y",
        )
