"""Tests of edge_agent.models: SPECS §5.1 counts, shapes, an independent forward, manifests."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import torch.nn.functional as F

from edge_agent import models
from edge_agent.errors import EdgeAgentError, ModelError


def _backbone_params_by_hand(c: int, s: int, feature_dim: int = 64) -> int:
    conv1 = c * 16 * 3 * 3 + 16
    conv2 = 16 * 32 * 3 * 3 + 32
    fc = 32 * (s // 4) ** 2 * feature_dim + feature_dim
    return conv1 + conv2 + fc


@pytest.mark.parametrize(
    ("c", "s", "params", "macs"),
    [(1, 28, 105_216, 1_116_416), (3, 32, 136_224, 1_753_088)],
)
def test_specs_counts(c: int, s: int, params: int, macs: int) -> None:
    model = models.LightCNN(in_channels=c, image_size=s)
    assert _backbone_params_by_hand(c, s) == params  # the SPECS number, by formula
    assert model.backbone_parameter_count() == params
    named = model.named_parameters()
    assert sum(p.numel() for n, p in named if n.startswith("backbone.")) == params
    assert sum(p.numel() for p in model.classifier.parameters()) == 64 * 10 + 10 == 650
    assert model.backbone_macs() == macs
    # 4-byte floats: the "full model sync" sizes of SPECS §5.2.
    assert 4 * params == {105_216: 420_864, 136_224: 544_896}[params]


def test_shapes_and_forward_composition() -> None:
    torch.manual_seed(0)
    model = models.LightCNN(in_channels=3, image_size=32, num_classes=10).eval()
    x = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        z = model.features(x)
        logits = model.head(z)
        out = model(x)
    assert z.shape == (5, 64) and z.dtype == torch.float32
    assert bool((z >= 0).all())  # ends in ReLU
    assert logits.shape == (5, 10)
    assert torch.equal(out, logits)


def test_forward_matches_functional_reference() -> None:
    """Recompute the SPECS architecture with torch.nn.functional and the model's own weights."""
    torch.manual_seed(1)
    model = models.LightCNN(in_channels=1, image_size=28, num_classes=10).eval()
    sd = model.state_dict()
    x = torch.randn(4, 1, 28, 28)
    h = F.max_pool2d(F.relu(F.conv2d(x, sd["backbone.conv1.weight"], sd["backbone.conv1.bias"],
                                     padding=1)), 2)
    h = F.max_pool2d(F.relu(F.conv2d(h, sd["backbone.conv2.weight"], sd["backbone.conv2.bias"],
                                     padding=1)), 2)
    assert h.shape == (4, 32, 7, 7)
    z = F.relu(h.reshape(4, -1) @ sd["backbone.fc.weight"].T + sd["backbone.fc.bias"])
    ref = z @ sd["classifier.weight"].T + sd["classifier.bias"]
    with torch.no_grad():
        torch.testing.assert_close(model.features(x), z)
        torch.testing.assert_close(model(x), ref)


@pytest.mark.parametrize(("c", "s"), [(1, 16), (1, 8), (3, 28), (3, 4)])
def test_other_input_sizes(c: int, s: int) -> None:
    model = models.LightCNN(in_channels=c, image_size=s, num_classes=7)
    assert model(torch.zeros(2, c, s, s)).shape == (2, 7)
    assert model.backbone_parameter_count() == _backbone_params_by_hand(c, s)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"image_size": 30},
        {"image_size": 2},
        {"image_size": 0},
        {"in_channels": 0},
        {"num_classes": 0},
        {"feature_dim": 0},
        {"image_size": 28.0},
        {"in_channels": True},
    ],
)
def test_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(ModelError):
        models.LightCNN(**kwargs)  # type: ignore[arg-type]


def test_wrong_input_shape() -> None:
    model = models.LightCNN()
    with pytest.raises(ModelError):
        model(torch.zeros(2, 3, 28, 28))
    with pytest.raises(ModelError):
        model(torch.zeros(1, 28, 28))
    with pytest.raises(ModelError):
        model.head(torch.zeros(2, 32))


def test_registry() -> None:
    assert "lightcnn" in models.list_models()
    model = models.build_model("lightcnn", in_channels=3, image_size=32)
    assert isinstance(model, models.LightCNN)
    assert model.backbone_parameter_count() == 136_224
    assert isinstance(models.build_model(), models.LightCNN)
    with pytest.raises(ModelError) as info:
        models.build_model("no-such-net")
    assert "lightcnn" in str(info.value) and "resnet18" in str(info.value)
    assert isinstance(info.value, EdgeAgentError)
    with pytest.raises(ModelError):
        models.build_model("lightcnn", channels=3)
    with pytest.raises(ModelError):
        models.build_model("lightcnn", image_size=30)
    with pytest.raises(ModelError):
        models.register_model("lightcnn")(models.LightCNN)


def test_manifest_names_order_and_hash() -> None:
    man = models.model_manifest(models.LightCNN())
    assert man == [
        ("backbone.conv1.weight", (16, 1, 3, 3), "float32"),
        ("backbone.conv1.bias", (16,), "float32"),
        ("backbone.conv2.weight", (32, 16, 3, 3), "float32"),
        ("backbone.conv2.bias", (32,), "float32"),
        ("backbone.fc.weight", (64, 1568), "float32"),
        ("backbone.fc.bias", (64,), "float32"),
        ("classifier.weight", (10, 64), "float32"),
        ("classifier.bias", (10,), "float32"),
    ]
    digest = models.manifest_hash(man)
    canonical = json.dumps([[n, list(s), d] for n, s, d in man], separators=(",", ":"))
    assert digest == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert len(digest) == 16 and int(digest, 16) >= 0

    # Same architecture, different weights: same hash.
    torch.manual_seed(123)
    assert models.manifest_hash(models.model_manifest(models.LightCNN())) == digest
    # A different shape anywhere changes it.
    assert models.manifest_hash(models.model_manifest(models.LightCNN(image_size=32))) != digest
    changed = list(man)
    changed[-1] = ("classifier.bias", (11,), "float32")
    assert models.manifest_hash(changed) != digest
    half = models.model_manifest(models.LightCNN().half())
    assert half[0][2] == "float16" and models.manifest_hash(half) != digest
    with pytest.raises(ModelError):
        models.manifest_hash([("a", "not-a-shape", "float32")])
