"""The model zoo, users' factories, model groups and the frozen-aware train mode
(edge_agent.models): parameter counts against torchvision's own counts and hand counts, the
LightCNN interface on every net, the factory checks' errors."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from edge_agent import models
from edge_agent.errors import ModelError

ZOO_BN = ("resnet18", "resnet8", "mobilenet_v2", "mobilenet_v2_small", "inception_small")


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _conv_bn(cin: int, cout: int, k: int) -> int:
    """A bias-free k×k conv and its BatchNorm (weight + bias)."""
    return cin * cout * k * k + 2 * cout


def _head(width: int, d: int, classes: int) -> int:
    """Projection Linear(width, d) + classifier Linear(d, classes)."""
    return width * d + d + d * classes + classes


@pytest.mark.parametrize(("c", "d", "classes"), [(1, 64, 10), (3, 32, 7)])
def test_resnet18_count_is_torchvisions_with_the_small_image_stem(c: int, d: int, classes: int) -> None:
    import torchvision

    tv = _count(torchvision.models.resnet18(weights=None))
    assert tv == 11_689_512  # torchvision's documented resnet18 count
    expected = tv - 7 * 7 * 3 * 64 + 3 * 3 * c * 64 - (512 * 1000 + 1000) + _head(512, d, classes)
    model = models.build_model("resnet18", in_channels=c, image_size=32, num_classes=classes, feature_dim=d)
    assert _count(model) == expected
    assert model.state_dict()["backbone.conv1.weight"].shape == (64, c, 3, 3)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())


@pytest.mark.parametrize("c", [1, 3])
def test_mobilenet_v2_count_is_torchvisions_with_a_new_stem(c: int) -> None:
    import torchvision

    tv = _count(torchvision.models.mobilenet_v2(weights=None))
    assert tv == 3_504_872
    expected = tv - 3 * 3 * 3 * 32 + 3 * 3 * c * 32 - (1280 * 1000 + 1000) + _head(1280, 64, 10)
    assert _count(models.build_model("mobilenet_v2", in_channels=c, image_size=28)) == expected


@pytest.mark.parametrize("c", [1, 3])
def test_mobilenet_v2_small_count_is_torchvisions_half_width_without_the_last_conv(c: int) -> None:
    import torchvision

    tv = torchvision.models.mobilenet_v2(weights=None, width_mult=0.5)
    assert _count(tv) == 1_968_680  # torchvision's own count at width 0.5 (1280-channel last conv kept)
    last = _conv_bn(160, 1280, 1)  # the dropped final 1×1 conv 160 -> 1280 and its BatchNorm
    expected = _count(tv) - 3 * 3 * 3 * 16 + 3 * 3 * c * 16 - last - (1280 * 1000 + 1000) + _head(160, 64, 10)
    model = models.build_model("mobilenet_v2_small", in_channels=c, image_size=32)
    assert _count(model) == expected
    assert model.state_dict()["backbone.features.0.0.weight"].shape == (16, c, 3, 3)


def test_resnet8_count_by_hand() -> None:
    stem = _conv_bn(1, 16, 3)
    stage1 = 2 * _conv_bn(16, 16, 3)
    stage2 = _conv_bn(16, 32, 3) + _conv_bn(32, 32, 3) + _conv_bn(16, 32, 1)  # 1×1 shortcut
    stage3 = _conv_bn(32, 64, 3) + _conv_bn(64, 64, 3) + _conv_bn(32, 64, 1)
    assert stem + stage1 + stage2 + stage3 == 77_104  # the docstring's number
    model = models.build_model("resnet8", in_channels=1, image_size=28)
    assert _count(model) == 77_104 + _head(64, 64, 10) == 81_914
    convs = [m for m in model.backbone.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convs) == 7  # 7 convs + the projection = 8 weighted layers on the main path (shortcuts are 1×1)


def _inception(cin: int, b1: int, r3: int, c3: int, r5: int, c5: int, pp: int) -> int:
    return (_conv_bn(cin, b1, 1) + _conv_bn(cin, r3, 1) + _conv_bn(r3, c3, 3) + _conv_bn(cin, r5, 1)
            + _conv_bn(r5, c5, 3) + _conv_bn(cin, pp, 1))


def test_inception_small_count_by_hand() -> None:
    body = _conv_bn(3, 32, 3) + _inception(32, 16, 16, 24, 4, 8, 8) + _inception(56, 32, 32, 48, 8, 16, 16)
    model = models.build_model("inception_small", in_channels=3, image_size=32)
    assert _count(model) == body + _head(112, 64, 10)


@pytest.mark.parametrize("name", ("lightcnn", *ZOO_BN))
@pytest.mark.parametrize(("c", "s"), [(1, 8), (3, 32)])
def test_every_zoo_model_has_the_lightcnn_interface(name: str, c: int, s: int) -> None:
    model = models.make_model(name, in_channels=c, image_size=s, num_classes=7, feature_dim=16, seed=0).eval()
    x = torch.randn(3, c, s, s)
    with torch.no_grad():
        z = model.features(x)
        assert z.shape == (3, 16) and z.dtype == torch.float32
        assert torch.equal(model(x), model.head(z))
    state = model.state_dict()
    assert state["classifier.weight"].shape == (7, 16)
    assert all(k.startswith(("backbone.", "classifier.")) for k in state)
    assert {k for k in state if k.startswith("classifier.")} == {"classifier.weight", "classifier.bias"}
    has_bn = any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert has_bn == (name != "lightcnn")
    if has_bn:  # the running statistics are state entries, so part of the manifest; the counters are dropped
        assert any(k.endswith("running_mean") for k in state)
    assert not any(k.endswith("num_batches_tracked") for k in state)
    assert {t.dtype for t in state.values()} == {torch.float32}
    with pytest.raises(ModelError, match="expects input"):
        model.features(torch.zeros(1, c + 1, s, s))


@pytest.mark.parametrize("name", ZOO_BN)
def test_same_seed_same_weights_and_different_nets_different_manifests(name: str) -> None:
    a = models.make_model(name, in_channels=1, image_size=8, num_classes=10, seed=3)
    b = models.make_model(name, in_channels=1, image_size=8, num_classes=10, seed=3)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    light = models.make_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    assert models.manifest_hash(models.model_manifest(a)) != models.manifest_hash(models.model_manifest(light))


def test_lightcnn_manifest_hash_is_unchanged() -> None:
    # the hashes of main before the zoo: agents of older releases still join
    assert models.manifest_hash(models.model_manifest(models.LightCNN(in_channels=1, image_size=28))) == \
        "d734a3ea2446a984"
    assert models.manifest_hash(models.model_manifest(models.LightCNN(in_channels=3, image_size=32))) == \
        "7223673f79f8c10a"


# --------------------------------------------------------------------------- users' factories


class _Net(nn.Module):
    def __init__(self, c: int, s: int, classes: int, d: int) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Flatten(), nn.Linear(c * s * s, d))
        self.classifier = nn.Linear(d, classes)

    def features(self, x):
        return self.backbone(x)

    def head(self, z):
        return self.classifier(z)

    def forward(self, x):
        return self.head(self.features(x))


def good_factory(num_classes, in_channels, image_size, feature_dim=64):
    return _Net(in_channels, image_size, num_classes, feature_dim)


def narrow_factory(num_classes, in_channels, image_size):  # takes no feature_dim: always 8 wide
    return _Net(in_channels, image_size, num_classes, 8)


def no_features_factory(**kw):
    return nn.Linear(3, 3)


def wrong_logits_factory(num_classes, in_channels, image_size, feature_dim):
    return _Net(in_channels, image_size, num_classes + 1, feature_dim)


def raising_factory(**kw):
    raise RuntimeError("simulated: out of memory while building")


not_callable = 42
HERE = __name__


def test_a_factory_gets_the_keywords_it_accepts() -> None:
    model = models.make_model(f"{HERE}:good_factory", in_channels=1, image_size=8, num_classes=10, feature_dim=12)
    assert model.features(torch.zeros(2, 1, 8, 8)).shape == (2, 12)
    assert models.is_factory_path(f"{HERE}:good_factory") and not models.is_factory_path("lightcnn")


@pytest.mark.parametrize(("fn", "pattern"), [
    ("narrow_factory", r"features\(x\) gave \[2, 8\] \(feature width 8\).*expected \[2, 64\]"),
    ("no_features_factory", r"no features\(\) and no head\(\)"),
    ("wrong_logits_factory", r"gave \[2, 11\]; expected \[2, 10\]"),
    ("not_callable", "not callable"),
    ("missing", "has no attribute 'missing'"),
    ("raising_factory", "failed: RuntimeError: simulated: out of memory while building"),
])
def test_a_factory_that_does_not_fit_is_named(fn: str, pattern: str) -> None:
    with pytest.raises(ModelError, match=pattern) as info:
        models.make_model(f"{HERE}:{fn}", in_channels=1, image_size=8, num_classes=10, feature_dim=64)
    assert fn in str(info.value)


def test_unknown_names_and_modules() -> None:
    with pytest.raises(ModelError, match="the zoo has inception_small, lightcnn, mobilenet_v2, mobilenet_v2_small, "
                                         "resnet18, resnet8"):
        models.resolve_model("resnet1000")
    with pytest.raises(ModelError, match="cannot import module 'no_such_pkg.mod'"):
        models.resolve_model("no_such_pkg.mod:fn")
    with pytest.raises(ModelError, match="expected 'package.module:function'"):
        models.resolve_model(":fn")


@pytest.mark.parametrize(("source", "pattern"), [
    ('raise RuntimeError("simulated: no GPU at import")', "failed: RuntimeError: simulated: no GPU at import"),
    ("def make(:\n", "failed: SyntaxError"),
])
def test_a_factory_module_that_fails_at_import_is_a_model_error(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                               source: str, pattern: str) -> None:
    """A factory module whose import raises anything (not only ImportError) is refused with a
    ModelError naming it, so ``[model] name`` gives a configuration error, not a traceback."""
    (tmp_path / "broken_factory_mod.py").write_text(source, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_factory_mod", raising=False)
    with pytest.raises(ModelError, match=pattern) as info:
        models.resolve_model("broken_factory_mod:make")
    assert "broken_factory_mod" in str(info.value)


# --------------------------------------------------------------------------- groups, train mode


def test_model_groups() -> None:
    group = ["lightcnn", "resnet8", "inception_small"]
    assert [models.assign_model("lightcnn", group, shard=i, profile="rpi4") for i in range(5)] == \
        ["lightcnn", "resnet8", "inception_small", "lightcnn", "resnet8"]
    by_profile = {"rpi4": "lightcnn", "jetson-orin-nano": "resnet18"}
    assert models.assign_model("resnet8", by_profile, shard=0, profile="jetson-orin-nano") == "resnet18"
    assert models.assign_model("resnet8", by_profile, shard=0, profile="x86-cpu") == "resnet8"
    assert models.assign_model("resnet8", (), shard=9, profile="rpi4") == "resnet8"
    assert models.group_architectures("resnet8", by_profile) == ["resnet8", "lightcnn", "resnet18"]
    assert models.group_architectures("lightcnn", ["lightcnn", "lightcnn"]) == ["lightcnn"]


@pytest.mark.parametrize("name", ["htfe4-cpu", "htfe5-cpu", "htfe4"])
def test_named_groups_mix_four_architectures_of_one_prototype_width(name: str) -> None:
    group = models.get_group(name)
    assert isinstance(group, tuple) and len(set(group)) >= 4
    kinds = {"lightcnn": "cnn", "resnet8": "resnet", "resnet18": "resnet", "mobilenet_v2": "mobilenet",
             "mobilenet_v2_small": "mobilenet", "inception_small": "googlenet"}
    assert {kinds[a] for a in group} == {"cnn", "resnet", "mobilenet", "googlenet"}
    for arch in set(group):  # make_model checks features [N, 24] and classifier [10, 24]
        m = models.make_model(arch, in_channels=3, image_size=32, num_classes=10, feature_dim=24)
        assert m.state_dict()["classifier.weight"].shape == (10, 24)


def _macs(model: nn.Module, c: int, s: int) -> int:
    """Multiply-accumulates of one image through every Conv2d and Linear (forward hooks)."""
    total = 0

    def hook(m: nn.Module, inp: tuple, out: torch.Tensor) -> None:
        nonlocal total
        if isinstance(m, nn.Conv2d):
            total += out[0].numel() * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
        elif isinstance(m, nn.Linear):
            total += m.in_features * m.out_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model.eval()(torch.zeros(1, c, s, s))
    for h in handles:
        h.remove()
    return total


def test_the_fleet_group_gives_a_pi_the_cheapest_net_and_names_known_profiles() -> None:
    from edge_agent.profiles import get_profile

    group = models.get_group("fleet")
    assert isinstance(group, dict)
    macs = {a: _macs(models.build_model(a, in_channels=3, image_size=32), 3, 32) for a in set(group.values())}
    # the light CNN: 1,753,088 backbone MACs per 3×32×32 image (LightCNN docstring) + its head's 640
    assert macs["lightcnn"] == 1_753_088 + 640
    assert group["rpi4"] == min(macs, key=lambda a: macs[a])  # a Pi 4 gets the cheapest net
    assert group["jetson-orin-nano"] == max(macs, key=lambda a: macs[a])  # the Orin the largest (resnet18)
    order = [macs[group[p]] for p in ("rpi4", "rpi5", "jetson-nano", "jetson-xavier-nx", "jetson-orin-nano")]
    assert order == sorted(order)  # weaker boards get cheaper nets
    for profile in group:
        assert get_profile(profile).name == profile
    assert models.assign_model("lightcnn", group, shard=7, profile="rpi4") == "lightcnn"
    group["rpi4"] = "resnet18"  # a copy: the registry is unchanged
    assert models.get_group("fleet")["rpi4"] == "lightcnn"
    with pytest.raises(ModelError, match="unknown model group 'htfe99'.*fleet, htfe4"):
        models.get_group("htfe99")


def test_a_frozen_batchnorm_keeps_its_running_statistics_over_a_training_step() -> None:
    torch.manual_seed(0)
    model = models.make_model("resnet8", in_channels=1, image_size=8, num_classes=10)
    frozen, free = model.backbone.bn1, model.backbone.layer1.bn1
    for p in frozen.parameters():
        p.requires_grad_(False)
    before_frozen, before_free = frozen.running_mean.clone(), free.running_mean.clone()
    models.train_mode(model)
    assert model.training and not frozen.training and free.training
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x, y = torch.randn(16, 1, 8, 8) * 3 + 1, torch.randint(0, 10, (16,))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert torch.equal(frozen.running_mean, before_frozen)  # no drift
    assert not torch.equal(free.running_mean, before_free)  # the unfrozen one learns the batch statistics
    model.train()  # plain train mode would have let it drift
    assert frozen.training


def test_the_local_training_loop_leaves_a_frozen_batchnorm_alone() -> None:
    from edge_agent.algorithms import TrainConfig
    from edge_agent.algorithms.fedavg import sgd_epochs, shuffle_generator

    model = models.make_model("resnet8", in_channels=1, image_size=8, num_classes=10, seed=0)
    frozen, free = model.backbone.layer2.bn2, model.backbone.layer3.bn1
    for p in frozen.parameters():
        p.requires_grad_(False)
    model.eval()  # the loop must switch the free layers to training itself
    before_frozen, before_free = frozen.running_var.clone(), free.running_var.clone()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(20, 1, 8, 8, generator=g), torch.randint(0, 10, (20,), generator=g)
    sgd_epochs(model, x, y, TrainConfig(batch_size=10, lr=0.05), shuffle_generator(0, 1, 0), torch.device("cpu"))
    assert torch.equal(frozen.running_var, before_frozen)
    assert not torch.equal(free.running_var, before_free)


def test_batch_counters_are_dropped_only_where_unused() -> None:
    net = nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm2d(3, momentum=None))
    models.drop_batch_counters(net)
    assert list(net.state_dict()) == ["0.weight", "0.bias", "0.running_mean", "0.running_var",
                                      "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"]
    net.train()
    x = torch.randn(4, 3, 2, 2) + 5
    net(x)
    # momentum 0.1 still applies without the counter: 0.9·0 + 0.1·(batch mean)
    torch.testing.assert_close(net[0].running_mean, 0.1 * x.mean(dim=(0, 2, 3)))
    # a state dict without version metadata (a plain dict, as load_arrays builds) loads back
    from edge_agent.state import load_arrays, state_arrays

    other = nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm2d(3, momentum=None))
    models.drop_batch_counters(other)
    other.load_state_dict(dict(net.state_dict()))
    load_arrays(other, state_arrays(net))
    torch.testing.assert_close(other[0].running_mean, net[0].running_mean)
