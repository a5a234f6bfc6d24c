"""FedAvg client half: CPU fp32 regression against an independent SGD loop, tiny shards, RNG
independence, and the fp16 (CUDA autocast) path exercised through fakes."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edge_agent.algorithms import TrainConfig, get_client_algorithm
from edge_agent.algorithms import fedavg as fedavg_mod
from edge_agent.algorithms.fedavg import FedAvgClient, sgd_epochs, shuffle_generator
from edge_agent.models import build_model
from edge_agent.state import state_arrays

CPU = torch.device("cpu")
NUM_CLASSES = 3
SIZE = 8


def _model() -> torch.nn.Module:
    torch.manual_seed(1234)  # only the initial weights; training never reads the global RNG
    return build_model("lightcnn", in_channels=1, image_size=SIZE, num_classes=NUM_CLASSES, feature_dim=8)


def _shard(n: int, *, classes: tuple[int, ...] = tuple(range(NUM_CLASSES)), seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, SIZE, SIZE, generator=g)
    y = torch.tensor([classes[i % len(classes)] for i in range(n)], dtype=torch.int64)
    return x, y


def _reference(model: torch.nn.Module, global_tensors, x, y, cfg: TrainConfig, *, round: int, client_index: int):
    """The FedAvg client loop written out independently: the generator seed formula, randperm
    order, and SGD (PyTorch's documented update: g += wd·p; b = g (first step) or μ·b + g;
    p -= lr·b) by hand, without torch.optim or edge_agent's training code."""
    with torch.no_grad():
        for p, arr in zip(model.state_dict().values(), global_tensors):
            p.copy_(torch.from_numpy(arr))
    gen = torch.Generator(device="cpu")
    gen.manual_seed((cfg.seed * 1_000_003 + round * 10_007 + client_index) % (2**63 - 1))
    params = list(model.parameters())
    bufs: list[torch.Tensor | None] = [None] * len(params)
    n = len(y)
    loss_sum, correct = 0.0, 0
    for _ in range(max(1, cfg.local_epochs)):
        perm = torch.randperm(n, generator=gen)
        loss_sum, correct = 0.0, 0
        for s in range(0, n, cfg.batch_size):
            idx = perm[s:s + cfg.batch_size]
            for p in params:
                p.grad = None
            logits = model(x[idx])
            loss = F.cross_entropy(logits, y[idx])
            loss.backward()
            with torch.no_grad():
                for i, p in enumerate(params):
                    g = p.grad
                    if cfg.weight_decay != 0:
                        g = g.add(p, alpha=cfg.weight_decay)
                    if cfg.momentum != 0:
                        if bufs[i] is None:
                            bufs[i] = torch.clone(g).detach()
                        else:
                            bufs[i].mul_(cfg.momentum).add_(g, alpha=1)
                        g = bufs[i]
                    p.add_(g, alpha=-cfg.lr)
            loss_sum += float(loss.detach()) * len(idx)
            correct += int((logits.detach().argmax(1) == y[idx]).sum())
    return state_arrays(model), loss_sum / n, correct / n


def _run(x, y, cfg, *, round: int = 3, client_index: int = 2, precision: str = "fp32"):
    model = _model()
    global_tensors = state_arrays(model)
    result = FedAvgClient(precision=precision).local_round(model, global_tensors, x, y, cfg, round=round,
                                                           client_index=client_index, device=CPU)
    return global_tensors, result


def _assert_bit_identical(a, b) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert np.array_equal(u.view(np.uint32), v.view(np.uint32))  # bits, not just values


CONFIGS = [
    pytest.param(TrainConfig(local_epochs=1, batch_size=4, lr=0.1, seed=0), 12, id="plain"),
    pytest.param(TrainConfig(local_epochs=3, batch_size=5, lr=0.05, momentum=0.9, weight_decay=1e-3, seed=11),
                 23, id="momentum-wd-ragged-last-batch"),
    pytest.param(TrainConfig(local_epochs=2, batch_size=32, lr=0.05, seed=5), 7, id="batch-larger-than-shard"),
    pytest.param(TrainConfig(local_epochs=2, batch_size=1, lr=0.05, momentum=0.5, seed=3), 5, id="batch-of-one"),
    pytest.param(TrainConfig(local_epochs=0, batch_size=4, lr=0.05, seed=3), 9, id="zero-epochs-means-one"),
]


@pytest.mark.parametrize(("cfg", "n"), CONFIGS)
def test_cpu_fp32_is_bit_identical_to_the_reference_loop(cfg: TrainConfig, n: int) -> None:
    x, y = _shard(n)
    global_tensors, result = _run(x, y, cfg)
    ref_w, ref_loss, ref_acc = _reference(_model(), global_tensors, x, y, cfg, round=3, client_index=2)
    _assert_bit_identical(result.tensors, ref_w)
    assert result.train_loss == ref_loss
    assert result.metrics["train_accuracy"] == ref_acc
    assert result.num_samples == n
    assert not all(np.array_equal(a, b) for a, b in zip(result.tensors, global_tensors))  # it trained


def test_same_seed_same_result_and_seed_matters() -> None:
    cfg = TrainConfig(local_epochs=2, batch_size=4, lr=0.1, seed=1)
    x, y = _shard(16)
    _, a = _run(x, y, cfg)
    _, b = _run(x, y, cfg)
    _assert_bit_identical(a.tensors, b.tensors)
    _, c = _run(x, y, cfg, round=4)  # another round → another shuffle
    assert not all(np.array_equal(u, v) for u, v in zip(a.tensors, c.tensors))


def test_global_rng_does_not_change_the_result() -> None:
    cfg = TrainConfig(local_epochs=2, batch_size=3, lr=0.1, momentum=0.9, seed=9)
    x, y = _shard(14)
    model = _model()
    global_tensors = state_arrays(model)
    client = FedAvgClient()
    torch.manual_seed(0)
    first = client.local_round(model, global_tensors, x, y, cfg, round=1, client_index=0, device=CPU)
    torch.manual_seed(987654321)
    torch.rand(1000)
    torch.randperm(77)
    np.random.seed(5)
    second = client.local_round(model, global_tensors, x, y, cfg, round=1, client_index=0, device=CPU)
    _assert_bit_identical(first.tensors, second.tensors)
    assert first.train_loss == second.train_loss
    # and the round left the global RNG where it was: training draws nothing from it
    torch.manual_seed(42)
    client.local_round(model, global_tensors, x, y, cfg, round=2, client_index=0, device=CPU)
    after = torch.rand(3)
    torch.manual_seed(42)
    assert torch.equal(after, torch.rand(3))


def test_shard_of_one_sample() -> None:
    cfg = TrainConfig(local_epochs=2, batch_size=8, lr=0.1, seed=0)
    x, y = _shard(1)
    global_tensors, result = _run(x, y, cfg)
    assert result.num_samples == 1
    assert result.metrics["train_accuracy"] in (0.0, 1.0)
    assert all(np.isfinite(t).all() for t in result.tensors)
    ref_w, ref_loss, _ = _reference(_model(), global_tensors, x, y, cfg, round=3, client_index=2)
    _assert_bit_identical(result.tensors, ref_w)
    assert result.train_loss == ref_loss


def test_shard_with_missing_classes() -> None:
    cfg = TrainConfig(local_epochs=1, batch_size=4, lr=0.1, seed=0)
    x, y = _shard(10, classes=(2,))  # classes 0 and 1 absent
    global_tensors, result = _run(x, y, cfg)
    assert result.num_samples == 10
    assert np.isfinite(result.train_loss)
    ref_w, ref_loss, ref_acc = _reference(_model(), global_tensors, x, y, cfg, round=3, client_index=2)
    _assert_bit_identical(result.tensors, ref_w)
    assert (result.train_loss, result.metrics["train_accuracy"]) == (ref_loss, ref_acc)


def test_shard_of_zero_samples_returns_the_global_weights_and_zero_samples() -> None:
    cfg = TrainConfig(local_epochs=3, batch_size=4, lr=0.1, seed=0)
    x, y = torch.zeros(0, 1, SIZE, SIZE), torch.zeros(0, dtype=torch.int64)
    model = _model()
    global_tensors = tuple(t + 1.0 for t in state_arrays(model))  # differs from the model's own state
    result = FedAvgClient().local_round(model, global_tensors, x, y, cfg, round=1, client_index=0, device=CPU)
    assert result.num_samples == 0  # the caller must not send this (the protocol refuses 0)
    assert result.train_loss == 0.0
    assert result.metrics["train_accuracy"] == 0.0
    _assert_bit_identical(result.tensors, global_tensors)
    _assert_bit_identical(state_arrays(model), global_tensors)  # the model holds the global state


def test_sgd_epochs_on_zero_samples_leaves_the_model_alone() -> None:
    model = _model()
    before = state_arrays(model)
    out = sgd_epochs(model, torch.zeros(0, 1, SIZE, SIZE), torch.zeros(0, dtype=torch.int64),
                     TrainConfig(), shuffle_generator(0, 0, 0), CPU)
    assert out == (0.0, 0.0)
    _assert_bit_identical(state_arrays(model), before)


def test_batch_size_below_one_is_refused() -> None:
    x, y = _shard(4)
    with pytest.raises(ValueError, match="batch_size"):
        sgd_epochs(_model(), x, y, TrainConfig(batch_size=0), shuffle_generator(0, 0, 0), CPU)


# --------------------------------------------------------------------------------------------
# precision


def test_fp16_on_cpu_is_refused_before_the_model_is_touched() -> None:
    x, y = _shard(4)
    model = _model()
    before = state_arrays(model)
    global_tensors = tuple(t + 1.0 for t in before)
    with pytest.raises(ValueError, match="fp16 training needs a CUDA device"):
        FedAvgClient(precision="fp16").local_round(model, global_tensors, x, y, TrainConfig(), round=1,
                                                   client_index=0, device=CPU)
    _assert_bit_identical(state_arrays(model), before)
    with pytest.raises(ValueError, match="fp16"):
        sgd_epochs(model, x, y, TrainConfig(), shuffle_generator(0, 0, 0), CPU, precision="fp16")


@pytest.mark.parametrize("bad", ["bf16", "FP16", "float32", ""])
def test_unknown_precision_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="precision"):
        FedAvgClient(precision=bad)
    with pytest.raises(ValueError, match="precision"):
        sgd_epochs(_model(), *_shard(2), TrainConfig(), shuffle_generator(0, 0, 0), CPU, precision=bad)


def test_registry_passes_precision_keyword_only() -> None:
    assert get_client_algorithm("fedavg").precision == "fp32"
    assert get_client_algorithm("fedavg", precision="fp16").precision == "fp16"
    param = inspect.signature(FedAvgClient).parameters["precision"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default == "fp32"
    assert inspect.signature(sgd_epochs).parameters["precision"].kind is inspect.Parameter.KEYWORD_ONLY


class _Autocast:
    entered: list[tuple[str, torch.dtype]] = []

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        self.args = (device_type, dtype)

    def __enter__(self):
        _Autocast.entered.append(self.args)

    def __exit__(self, *exc):
        return False


class _Scaler:
    """GradScaler stand-in with scale 1: scale → backward, step → optimizer.step, update."""

    made: list[_Scaler] = []

    def __init__(self, device: str = "cuda") -> None:
        self.device = device
        self.calls: list[str] = []
        _Scaler.made.append(self)

    def scale(self, loss):
        self.calls.append("scale")
        return loss

    def step(self, opt):
        self.calls.append("step")
        opt.step()

    def update(self):
        self.calls.append("update")


def test_fp16_cuda_path_uses_autocast_and_grad_scaler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA fp16 branch without a GPU: a CUDA device is claimed, batches stay on the CPU,
    autocast and GradScaler are recording fakes. A scale-1 scaler and no-op autocast must then
    give exactly the fp32 result, and each batch must go autocast → scale → step → update."""
    _Autocast.entered, _Scaler.made = [], []
    monkeypatch.setattr(torch, "autocast", _Autocast)
    monkeypatch.setattr(torch.amp, "GradScaler", _Scaler)
    monkeypatch.setattr(fedavg_mod, "_to_device", lambda t, device: t)
    cfg = TrainConfig(local_epochs=2, batch_size=4, lr=0.1, momentum=0.9, seed=2)
    x, y = _shard(10)  # 3 batches per epoch
    model = _model()
    global_tensors = state_arrays(model)
    result = FedAvgClient(precision="fp16").local_round(model, global_tensors, x, y, cfg, round=1,
                                                        client_index=0, device=torch.device("cuda", 0))
    assert _Autocast.entered == [("cuda", torch.float16)] * 6
    assert len(_Scaler.made) == 1 and _Scaler.made[0].device == "cuda"
    assert _Scaler.made[0].calls == ["scale", "step", "update"] * 6
    fp32 = FedAvgClient().local_round(_model(), global_tensors, x, y, cfg, round=1, client_index=0, device=CPU)
    _assert_bit_identical(result.tensors, fp32.tensors)
    assert result.train_loss == fp32.train_loss


class _FakeBatch:
    def __init__(self, pinned: bool) -> None:
        self.device = CPU
        self.pinned = pinned
        self.to_calls: list[tuple[torch.device, bool]] = []

    def is_pinned(self) -> bool:
        return self.pinned

    def to(self, device, non_blocking=False):
        self.to_calls.append((device, non_blocking))
        return self


@pytest.mark.parametrize(
    ("target", "pinned", "non_blocking"),
    [(torch.device("cuda", 0), True, True), (torch.device("cuda", 0), False, False), (CPU, True, False),
     (CPU, False, False)],
    ids=["cuda-pinned", "cuda-pageable", "cpu-pinned", "cpu-pageable"],
)
def test_non_blocking_copies_only_from_pinned_memory_to_cuda(target, pinned: bool, non_blocking: bool) -> None:
    batch = _FakeBatch(pinned)
    fedavg_mod._to_device(batch, target)  # type: ignore[arg-type]
    assert batch.to_calls == [(target, non_blocking)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on a Jetson)")
def test_fp16_trains_on_a_real_cuda_device() -> None:
    cuda = torch.device("cuda", 0)
    x, y = _shard(64)
    model = _model().to(cuda)
    global_tensors = state_arrays(model)
    cfg = TrainConfig(local_epochs=2, batch_size=16, lr=0.05, seed=0)
    result = FedAvgClient(precision="fp16").local_round(model, global_tensors, x.pin_memory(), y, cfg, round=1,
                                                        client_index=0, device=cuda)
    assert result.num_samples == 64 and np.isfinite(result.train_loss)
    assert all(t.dtype == np.float32 and np.isfinite(t).all() for t in result.tensors)
    fp32 = FedAvgClient().local_round(model, global_tensors, x, y, cfg, round=1, client_index=0, device=cuda)
    for a, b in zip(result.tensors, fp32.tensors):
        np.testing.assert_allclose(a, b, atol=5e-2)
