"""ONNX export and ONNX Runtime inference (edge_agent.onnx_runtime), checked against torch."""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import onnx  # noqa: E402

from edge_agent.errors import DataError, ModelError  # noqa: E402
from edge_agent.models import build_model  # noqa: E402
from edge_agent.onnx_runtime import OnnxModel, export_onnx  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error")

TOL = 1e-4
BATCH_SIZES = (1, 2, 7, 64)
MODEL_KINDS = ("gray28", "rgb32", "digits")


def _random_model(channels: int, size: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("lightcnn", in_channels=channels, image_size=size, num_classes=10).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, digits_model):
    """kind -> (torch model, OnnxModel with logits and features, input shape (C, H, W))."""
    folder = tmp_path_factory.mktemp("onnx")
    models = {
        "gray28": (_random_model(1, 28, seed=1), (1, 28, 28)),
        "rgb32": (_random_model(3, 32, seed=2), (3, 32, 32)),
        "digits": (digits_model, (1, 8, 8)),
    }
    out = {}
    for kind, (model, shape) in models.items():
        path = export_onnx(model, folder / f"{kind}.onnx", outputs=("logits", "features"))
        out[kind] = (model, OnnxModel(path), shape)
    return out


def _images(shape: tuple[int, int, int], n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float32)


# --------------------------------------------------------------------------- torch parity


@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_outputs_match_torch(exported, kind, batch):
    model, onnx_model, shape = exported[kind]
    x = _images(shape, batch, seed=batch)
    out = onnx_model.run(x)
    with torch.no_grad():
        xt = torch.from_numpy(x)
        logits = model(xt).numpy()
        feats = model.features(xt).numpy()
    assert out["logits"].dtype == np.float32 and out["logits"].shape == (batch, 10)
    assert out["features"].dtype == np.float32 and out["features"].shape == (batch, 64)
    assert np.abs(out["logits"] - logits).max() <= TOL
    assert np.abs(out["features"] - feats).max() <= TOL


def test_graph_has_dynamic_batch_axis(exported):
    _, onnx_model, _ = exported["gray28"]
    proto = onnx.load(str(onnx_model.path))
    onnx.checker.check_model(proto)
    for value in (*proto.graph.input, *proto.graph.output):
        assert value.type.tensor_type.shape.dim[0].dim_param == "batch"
    assert [o.name for o in proto.graph.output] == ["logits", "features"]
    assert onnx_model.input_shape == (1, 28, 28)


def test_batching_does_not_change_results(exported):
    _, onnx_model, shape = exported["rgb32"]
    x = _images(shape, 37, seed=5)
    whole = onnx_model.run(x, batch_size=512)
    pieces = onnx_model.run(x, batch_size=5)
    for name in ("logits", "features"):
        np.testing.assert_allclose(pieces[name], whole[name], rtol=0, atol=1e-6)


def test_empty_input_gives_empty_outputs(exported):
    _, onnx_model, shape = exported["gray28"]
    out = onnx_model.run(np.zeros((0, *shape), dtype=np.float32))
    assert out["logits"].shape == (0, 10) and out["features"].shape == (0, 64)
    empty_x, empty_y = np.zeros((0, *shape), np.float32), np.zeros(0, np.int64)
    assert onnx_model.evaluate(empty_x, empty_y) == (0.0, 0.0)


def test_wrong_input_dtype_or_shape_is_refused(exported):
    _, onnx_model, shape = exported["gray28"]
    with pytest.raises(ModelError, match="float32"):
        onnx_model.run(_images(shape, 2, 0).astype(np.float64))
    with pytest.raises(ModelError, match=r"\[N, 1, 28, 28\]"):
        onnx_model.run(_images((3, 28, 28), 2, 0))
    with pytest.raises(ValueError, match="batch_size"):
        onnx_model.run(_images(shape, 2, 0), batch_size=0)


# --------------------------------------------------------------------- derived predictions


def test_soft_predictions_match_torch_softmax(exported):
    model, onnx_model, shape = exported["digits"]
    x = _images(shape, 50, seed=3)
    probs = onnx_model.soft_predictions(x, temperature=1.5)
    with torch.no_grad():
        expected = torch.softmax(model(torch.from_numpy(x)) / 1.5, dim=1).numpy()
    assert probs.dtype == np.float32 and probs.shape == (50, 10)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=0, atol=1e-6)
    np.testing.assert_allclose(probs, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_soft_predictions_refuse_bad_temperature(exported, temperature):
    _, onnx_model, shape = exported["digits"]
    with pytest.raises(ValueError, match="temperature"):
        onnx_model.soft_predictions(_images(shape, 2, 0), temperature=temperature)


def test_soft_predictions_are_stable_for_huge_logits(exported):
    # A tiny temperature makes logits / T ~ 1e6: exp would overflow without the max shift.
    _, onnx_model, shape = exported["digits"]
    probs = onnx_model.soft_predictions(_images(shape, 8, 1), temperature=1e-6)
    assert np.isfinite(probs).all()
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=0, atol=1e-6)


def test_evaluate_matches_torch(exported, digits):
    model, onnx_model, _ = exported["digits"]
    x, y = np.array(digits.test.x), np.array(digits.test.y)
    accuracy, loss = onnx_model.evaluate(x, y, batch_size=100)
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        torch_acc = float((logits.argmax(1) == torch.from_numpy(y)).double().mean())
        torch_loss = float(F.cross_entropy(logits.double(), torch.from_numpy(y)))
    assert accuracy == torch_acc
    assert accuracy > 0.8  # the few epochs of training did learn something
    assert loss == pytest.approx(torch_loss, abs=1e-5)


def test_evaluate_refuses_bad_labels(exported):
    _, onnx_model, shape = exported["digits"]
    x = _images(shape, 3, 0)
    with pytest.raises(DataError):
        onnx_model.evaluate(x, np.array([0, 1, 10], dtype=np.int64))
    with pytest.raises(DataError):
        onnx_model.evaluate(x, np.array([0, 1, 2], dtype=np.int32))
    with pytest.raises(DataError):
        onnx_model.evaluate(x, np.array([0, 1], dtype=np.int64))


def test_class_prototypes_match_torch_class_means(exported, digits):
    model, onnx_model, _ = exported["digits"]
    x, y = np.array(digits.test.x), np.array(digits.test.y)
    keep = y != 3  # class 3 absent
    x, y = x[keep], y[keep]
    protos, counts = onnx_model.class_prototypes(x, y, num_classes=10, batch_size=64)
    assert protos.dtype == np.float32 and protos.shape == (10, 64)
    assert counts.dtype == np.int64 and counts.shape == (10,)
    with torch.no_grad():
        feats = model.features(torch.from_numpy(x))
    for c in range(10):
        mask = torch.from_numpy(y == c)
        assert counts[c] == int(mask.sum())
        if counts[c]:
            np.testing.assert_allclose(protos[c], feats[mask].mean(0).numpy(), rtol=0, atol=1e-5)
    assert counts[3] == 0 and not protos[3].any()


def test_logits_only_export_has_no_features(tmp_path):
    model = _random_model(1, 28, seed=4)
    path = export_onnx(model, tmp_path / "logits.onnx")
    onnx_model = OnnxModel(path)
    assert onnx_model.output_names == ["logits"]
    x = _images((1, 28, 28), 3, 0)
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    assert np.abs(onnx_model.predict_logits(x) - expected).max() <= TOL
    with pytest.raises(ModelError, match="features"):
        onnx_model.class_prototypes(x, np.zeros(3, np.int64), num_classes=10)


# ------------------------------------------------------------------------------- export


def test_export_refuses_batch_of_one(tmp_path):
    model = _random_model(1, 28, seed=0)
    with pytest.raises(ModelError, match=">= 2"):
        export_onnx(model, tmp_path / "m.onnx", example=torch.zeros(1, 1, 28, 28))
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("axes", [("batch", "height"), ("channels",), ()])
def test_export_refuses_unknown_or_missing_axis_names(tmp_path, axes):
    model = _random_model(1, 28, seed=0)
    with pytest.raises(ModelError, match="batch"):
        export_onnx(model, tmp_path / "m.onnx", dynamic_axes_names=axes)


def test_export_refuses_unknown_output(tmp_path):
    with pytest.raises(ModelError, match="known outputs"):
        export_onnx(_random_model(1, 28, 0), tmp_path / "m.onnx", outputs=("logits", "probs"))


def test_export_with_example_and_input_shape(tmp_path):
    model = _random_model(3, 32, seed=0)
    model.train()
    export_onnx(model, tmp_path / "a.onnx", example=torch.randn(4, 3, 32, 32))
    export_onnx(model, tmp_path / "b.onnx", input_shape=(3, 32, 32))
    assert model.training  # mode restored
    with pytest.raises(ModelError, match="does not match"):
        export_onnx(model, tmp_path / "c.onnx", example=torch.randn(4, 3, 32, 32),
                    input_shape=(1, 28, 28))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.onnx", "b.onnx"]  # no temp files


def test_export_to_missing_folder_names_the_path(tmp_path):
    target = tmp_path / "nope" / "m.onnx"
    with pytest.raises(ModelError, match="nope"):
        export_onnx(_random_model(1, 28, 0), target)


# ---------------------------------------------------------------------- sessions, errors


def test_unavailable_provider_is_recorded_and_cpu_runs(exported):
    _, cpu_model, shape = exported["gray28"]
    missing = "NoSuchExecutionProvider"
    requested = [missing, "CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        requested.insert(0, "CUDAExecutionProvider")
    onnx_model = OnnxModel(cpu_model.path, providers=requested, threads=1)
    assert onnx_model.providers_requested == tuple(requested)
    assert onnx_model.providers_used == ["CPUExecutionProvider"]
    for name in requested[:-1]:
        assert any(f.startswith(f"{name} not available") for f in onnx_model.fallbacks)
    x = _images(shape, 4, 0)
    np.testing.assert_array_equal(onnx_model.run(x)["logits"], cpu_model.run(x)["logits"])


def test_no_available_provider_falls_back_to_cpu(exported):
    _, cpu_model, _ = exported["gray28"]
    onnx_model = OnnxModel(cpu_model.path, providers=("NoSuchExecutionProvider",))
    assert onnx_model.providers_used == ["CPUExecutionProvider"]
    assert any("using CPUExecutionProvider" in f for f in onnx_model.fallbacks)


def test_cpu_only_request_has_no_fallbacks(exported):
    assert exported["gray28"][1].fallbacks == []


def test_bad_constructor_arguments(exported):
    path = exported["gray28"][1].path
    with pytest.raises(TypeError):
        OnnxModel(path, providers="CPUExecutionProvider")
    with pytest.raises(ValueError, match="threads"):
        OnnxModel(path, threads=0)


def test_corrupt_file_raises_model_error_naming_path(tmp_path):
    path = tmp_path / "corrupt.onnx"
    path.write_bytes(b"\x08\x07this is not a protobuf\xff\xff\xff")
    with pytest.raises(ModelError, match="corrupt.onnx") as info:
        OnnxModel(path)
    assert info.value.__cause__ is not None


def test_truncated_file_raises_model_error(tmp_path, exported):
    data = exported["gray28"][1].path.read_bytes()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="truncated.onnx"):
        OnnxModel(path)


def test_missing_file_raises_model_error(tmp_path):
    with pytest.raises(ModelError, match="missing.onnx"):
        OnnxModel(tmp_path / "missing.onnx")


def test_repr_names_file_and_providers(exported):
    text = repr(exported["gray28"][1])
    assert "gray28.onnx" in text and "CPUExecutionProvider" in text


def test_model_file_is_path(exported):
    assert isinstance(exported["gray28"][1].path, Path)


def test_exports_from_concurrent_threads_all_succeed_and_match(tmp_path):
    """Devices of one simulation export at once: the TorchScript exporter's process-wide state
    would make an unserialised pair fail ('GLOBALS.in_onnx_export must be False'). Every export
    succeeds, and each file gives its own model's logits."""
    import threading

    models = [_random_model(1, 28, seed) for seed in range(4)]
    x = torch.randn(3, 1, 28, 28)
    errors: list[BaseException] = []
    paths: dict[int, Path] = {}
    start = threading.Barrier(len(models))

    def export(i: int) -> None:
        try:
            start.wait()
            for rep in range(3):
                paths[i] = export_onnx(models[i], tmp_path / f"m{i}-{rep}.onnx", example=torch.zeros(2, 1, 28, 28))
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=export, args=(i,)) for i in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i, m in enumerate(models):
        m.eval()
        with torch.no_grad():
            want = m(x).numpy()
        got = OnnxModel(paths[i]).predict_logits(x.numpy())
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_an_exported_model_has_the_mode_of_any_new_file_and_no_temporary_left(tmp_path):
    """The atomic write's temporary file is not left 0600: the model gets the mode a plain new file
    gets in the same folder (0666 less the umask), and nothing but the model is left there."""
    path = export_onnx(_random_model(1, 28, seed=4), tmp_path / "m.onnx")
    (tmp_path / "plain").write_bytes(b"")
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "plain"]
