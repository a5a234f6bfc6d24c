"""FedMCP++ (SPECS.md §5): client losses, prototypes, the teacher, the wire, and a federation.

Every value is checked against an independent calculation: numpy formulas written out on tiny
batches, weights worked out by hand, autograd on the full graph, msgpack packed by hand, and the
ONNX Runtime path against the torch path.
"""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch

from broker_server.strategies._base import ClientResult, apply_update
from broker_server.strategies.fedmcp import FedMCP, TeacherAccumulator, proxy_accuracy, teacher_weights
from edge_agent.algorithms._base import TrainConfig
from edge_agent.algorithms.fedmcp import (
    FedMCPClient,
    FedMCPParams,
    class_prototypes,
    distillation_loss,
    info_nce_loss,
    prototype_alignment_backward,
    proxy_digest,
    proxy_sets,
)
from edge_agent.data import ArraySplit, Dataset, load_dataset, proxy_split
from edge_agent.errors import DataError, ModelError
from edge_agent.models import build_model
from protocol.messages import Envelope, Update, decode, encode
from protocol.tensors import Codec

CPU = torch.device("cpu")


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(digits_model) -> torch.nn.Module:
    """test_onnx's LightCNN (1×8×8) trained two epochs on digits (≈ 0.9): real, confident predictions."""
    return digits_model


def _client(split: ArraySplit, size: int) -> FedMCPClient:
    proxy, _ = proxy_split(split, size, seed=3)
    return FedMCPClient(proxy_x=proxy.x, proxy_y=proxy.y)


# --------------------------------------------------------------------------- the losses


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_distillation_loss_matches_numpy(direction: str) -> None:
    rng = np.random.default_rng(0)
    z = rng.normal(size=(3, 4))
    teacher = np.array([[0.7, 0.1, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25], [0.05, 0.05, 0.1, 0.8]])
    t = 1.5
    p = _softmax(z / t)
    if direction == "forward":  # KL(p_T || p_i), with 0·log 0 = 0
        kl = [sum(q * np.log(q / s) for q, s in zip(qr, sr) if q > 0) for qr, sr in zip(teacher, p)]
    else:  # KL(p_i || p_T), teacher clamped at 1e-12 inside the log
        kl = [sum(s * (np.log(s) - np.log(max(q, 1e-12))) for q, s in zip(qr, sr)) for qr, sr in zip(teacher, p)]
    expected = t * t * np.mean(kl)
    got = distillation_loss(torch.tensor(z), torch.tensor(teacher), t, direction)
    assert float(got) == pytest.approx(expected, rel=1e-10)
    # the student equal to the teacher: zero in both directions
    same = torch.tensor(np.log(teacher[1:2]) * t)
    assert float(distillation_loss(same, torch.tensor(teacher[1:2]), t, direction)) == pytest.approx(0.0, abs=1e-12)


def test_distillation_loss_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="direction"):
        distillation_loss(torch.zeros(2, 3), torch.full((2, 3), 1 / 3), 1.5, "sideways")
    with pytest.raises(ValueError, match=r"\[B, C\]"):
        distillation_loss(torch.zeros(2, 3), torch.full((2, 4), 0.25), 1.5)


def test_info_nce_matches_numpy() -> None:
    rng = np.random.default_rng(1)
    u, v = rng.normal(size=(4, 3)), rng.normal(size=(4, 3))
    tau = 1.5
    cos = np.array([[a @ b / np.linalg.norm(a) / np.linalg.norm(b) for b in v] for a in u])
    expected = np.mean([-np.log(np.exp(cos[b, b] / tau) / np.exp(cos[b] / tau).sum()) for b in range(4)])
    assert float(info_nce_loss(torch.tensor(u), torch.tensor(v), tau)) == pytest.approx(expected, rel=1e-10)
    # a batch of one has no negatives: −log 1 = 0
    assert float(info_nce_loss(torch.tensor(u[:1]), torch.tensor(v[:1]), tau)) == 0.0
    # scale invariance (cosine): scaling anchors changes nothing
    assert float(info_nce_loss(torch.tensor(3 * u), torch.tensor(v), tau)) == pytest.approx(expected, rel=1e-10)


def test_class_prototypes_match_numpy_with_an_empty_class() -> None:
    rng = np.random.default_rng(2)
    feats = rng.normal(size=(7, 5))
    labels = np.array([0, 2, 2, 0, 3, 2, 0])  # class 1 absent
    protos, counts = class_prototypes(torch.tensor(feats), torch.tensor(labels), 4)
    for c in range(4):
        rows = feats[labels == c]
        np.testing.assert_allclose(protos[c].numpy(), rows.mean(0) if len(rows) else np.zeros(5), rtol=1e-12)
    assert counts.tolist() == [3, 0, 3, 1]


def test_prototype_step_gradient_equals_full_graph_autograd(digits) -> None:
    """The two-pass, batch-by-batch gradient equals autograd through all proxy features at once."""
    torch.manual_seed(4)
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    x = torch.from_numpy(np.array(digits.test.x[:50]))
    y = torch.from_numpy(np.array(digits.test.y[:50]))
    y[y == 9] = 8  # leave class 9 out of the proxy set: its teacher row must not count
    teacher = torch.randn(10, 64, generator=torch.Generator().manual_seed(5))
    alpha = 0.7

    model.zero_grad()
    loss = prototype_alignment_backward(model.features, x, y, teacher, alpha, batch_size=16, device=CPU)
    got = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    assert got[-1] is None and got[0] is not None  # the head is not involved; the backbone is

    model.zero_grad()
    feats = model.features(x)
    present = [c for c in range(10) if (y == c).any()]
    ref = alpha * sum(((feats[y == c].mean(0) - teacher[c]) ** 2).sum() for c in present)
    ref.backward()
    assert loss == pytest.approx(float(ref.detach()), rel=1e-5)
    for g, p in zip(got, model.parameters()):
        if g is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- the proxy set


def _indexed_split(n: int) -> ArraySplit:
    """A split whose sample i is the constant image i (so a subset's indices can be read back)."""
    x = np.repeat(np.arange(n, dtype=np.float32), 4).reshape(n, 1, 2, 2)
    return ArraySplit(x=x, y=(np.arange(n) % 10).astype(np.int64), num_classes=10)


def test_proxy_split_is_disjoint_from_the_evaluation_split() -> None:
    test = _indexed_split(300)
    ds = Dataset(name="t", train=test, test=test, num_classes=10, channels=1, image_size=2, source="test")
    proxy, rest = proxy_sets(ds, {"proxy_size": 120}, seed=7)
    ip, ir = proxy.x[:, 0, 0, 0].astype(int), rest.x[:, 0, 0, 0].astype(int)
    assert len(ip) == 120 and len(ir) == 180
    assert not set(ip) & set(ir) and sorted([*ip, *ir]) == list(range(300))
    assert list(ip) == sorted(ip) and list(ir) == sorted(ir)  # file order kept
    np.testing.assert_array_equal(proxy.y, ip % 10)
    # the draw is the documented one: the first P entries of default_rng(seed).permutation(N)
    assert list(ip) == sorted(np.random.default_rng(7).permutation(300)[:120])
    # what a device evaluates on (client_eval) is that rest; what it gets as proxy, that proxy
    ev = FedMCPClient.eval_split(ds, {"proxy_size": 120}, 7)
    np.testing.assert_array_equal(ev.x, rest.x)
    kw = FedMCPClient.setup_kwargs(ds, {"proxy_size": 120}, 7)
    np.testing.assert_array_equal(kw["proxy_x"], proxy.x)
    assert FedMCP.setup_kwargs(ds, {"proxy_size": 120}, 7)["proxy_y"] is proxy.y  # one cached copy
    assert not proxy.x.flags.writeable
    # proxy_seed overrides the run seed
    other, _ = proxy_sets(ds, {"proxy_size": 120, "proxy_seed": 8}, seed=7)
    assert not np.array_equal(other.x, proxy.x)


@pytest.mark.parametrize("size", [0, 300, 301])
def test_proxy_split_refuses_sizes_that_leave_nothing(size: int) -> None:
    with pytest.raises(DataError, match="size"):
        proxy_split(_indexed_split(300), size, 0)


# --------------------------------------------------------------------------- the teacher


def _result(cid: str, soft: np.ndarray, proto_value: float) -> ClientResult:
    return ClientResult(cid, (), 10, 0.1, extras={"soft_predictions": soft.astype(np.float32),
                                                   "prototypes": np.full((3, 2), proto_value, np.float32)})


LABELS = np.array([0, 1, 2, 0], np.int64)
ONE_HOT = np.eye(3)[LABELS]


def _three_clients() -> list[ClientResult]:
    """Proxy accuracies by construction: A 4/4, B 2/4, C 1/4."""
    b = ONE_HOT.copy()
    b[[2, 3]] = [[1, 0, 0], [0, 1, 0]]  # samples 2, 3 wrong
    c = np.full((4, 3), 0.2)
    c[np.arange(4), [0, 2, 0, 1]] = 0.6  # only sample 0 right
    return [_result("A", ONE_HOT, 1.0), _result("B", b, 2.0), _result("C", c, 3.0)]


def _strategy(**kw) -> FedMCP:
    return FedMCP(proxy_y=LABELS, num_classes=3, proxy_size=4, **kw)


def test_teacher_weights_by_hand() -> None:
    clients = _three_clients()
    assert [proxy_accuracy(r.extras["soft_predictions"], LABELS) for r in clients] == [1.0, 0.5, 0.25]
    np.testing.assert_allclose(teacher_weights([1.0, 0.5, 0.25]), [4 / 7, 2 / 7, 1 / 7])
    s = _strategy()
    assert s.global_extras() == {}
    assert s.step(1, [], clients) is None  # the model never changes
    ex = s.global_extras()
    # P_T = (4·1 + 2·2 + 1·3) / 7 = 11/7 in every entry
    np.testing.assert_allclose(ex["teacher_prototypes"], np.full((3, 2), 11 / 7), rtol=1e-6)
    # p_T row 0: A [1,0,0], B [1,0,0], C [.6,.2,.2] -> [(4+2+.6)/7, .2/7, .2/7]
    np.testing.assert_allclose(ex["teacher_soft_predictions"][0], [6.6 / 7, 0.2 / 7, 0.2 / 7], rtol=1e-6)
    expected = sum(w * r.extras["soft_predictions"] for w, r in zip([4 / 7, 2 / 7, 1 / 7], clients))
    np.testing.assert_allclose(ex["teacher_soft_predictions"], expected, rtol=1e-6)
    assert ex["teacher_soft_predictions"].dtype == np.float32
    m = s.committed_metrics
    assert m["teacher_weights"] == pytest.approx({"A": 4 / 7, "B": 2 / 7, "C": 1 / 7})
    assert m["client_proxy_accuracy"] == {"A": 1.0, "B": 0.5, "C": 0.25}
    assert m["teacher_proxy_accuracy"] == 1.0  # argmax of p_T is right on all four samples


def test_uniform_weighting_is_enskd_and_zero_accuracy_falls_back_to_uniform() -> None:
    clients = _three_clients()
    s = _strategy(weighting="uniform")
    s.step(1, [], clients)
    np.testing.assert_allclose(s.global_extras()["teacher_prototypes"], np.full((3, 2), 2.0), rtol=1e-6)
    assert s.committed_metrics["teacher_weights"] == pytest.approx({"A": 1 / 3, "B": 1 / 3, "C": 1 / 3})

    class EnsKDLike(FedMCP):  # what the EnsKD baseline needs to change
        default_weighting = "uniform"

    e = EnsKDLike(proxy_y=LABELS, num_classes=3, proxy_size=4)
    e.step(1, [], clients)
    np.testing.assert_array_equal(e.global_extras()["teacher_prototypes"], s.global_extras()["teacher_prototypes"])

    wrong = np.eye(3)[[1, 2, 0, 1]]  # every sample wrong: a_i = 0 for both
    z = _strategy()
    z.step(1, [], [_result("A", wrong, 1.0), _result("B", wrong, 3.0)])
    np.testing.assert_allclose(z.global_extras()["teacher_prototypes"], np.full((3, 2), 2.0))
    assert z.committed_metrics["teacher_weights"] == {"A": 0.5, "B": 0.5}


def test_streaming_accumulator_state_and_empty_round() -> None:
    s = _strategy()
    acc = s.accumulator(1, [])
    assert isinstance(acc, TeacherAccumulator)
    for r in _three_clients():
        acc.add(r)
    assert apply_update(s, 1, acc.result()) is None
    saved = s.state_dict()
    fresh = _strategy()
    fresh.load_state_dict(saved)
    for k, v in s.global_extras().items():
        np.testing.assert_array_equal(fresh.global_extras()[k], v)
    # a round where nobody reported keeps the teacher and reports no weights
    s.configure_round(2, ["A"], np.random.default_rng(0))
    assert s.step(2, [], []) is None and s.round_metrics() == {}
    np.testing.assert_array_equal(s.global_extras()["teacher_prototypes"], saved["teacher_prototypes"])
    fresh.load_state_dict({})
    assert fresh.global_extras() == {}


def test_configure_round_sends_hyperparameters_and_the_proxy_fingerprint() -> None:
    s = _strategy(alpha_proto=0.5, infonce=False, train_config={"lr": 0.1})
    plan = s.configure_round(1, ["b", "a"], np.random.default_rng(0))
    assert plan.selected == ("a", "b")
    assert plan.config["lr"] == 0.1 and plan.config["alpha_proto"] == 0.5 and plan.config["infonce"] is False
    assert plan.config["temperature"] == 1.5 and plan.config["tau_nce"] == 1.5 and plan.config["kd"] is True
    assert plan.config["proxy_size"] == 4 and plan.config["proxy_digest"] == proxy_digest(LABELS)
    assert FedMCPParams.from_mapping(plan.config) == dataclasses.replace(FedMCPParams(), alpha_proto=0.5, infonce=False)
    with pytest.raises(TypeError, match="alpha_prot"):
        _strategy(alpha_prot=0.5)
    with pytest.raises(ValueError, match="tau_nce"):
        _strategy(tau_nce=0)
    with pytest.raises(ValueError, match="weighting"):
        _strategy(weighting="median")
    with pytest.raises(ValueError, match="proxy_size"):
        FedMCP(proxy_y=LABELS, num_classes=3)  # default proxy_size 1000 ≠ 4 labels


def test_validate_refuses_malformed_uploads() -> None:
    s = _strategy()
    good = _three_clients()[2]
    assert s.validate(good) is None

    def with_extras(**ex) -> ClientResult:
        return dataclasses.replace(good, extras={**good.extras, **ex})

    soft = good.extras["soft_predictions"]
    assert "exactly" in s.validate(dataclasses.replace(good, extras={"soft_predictions": soft}))
    assert "exactly" in s.validate(with_extras(extra=np.zeros(1, np.float32)))
    assert "[4, 3]" in s.validate(with_extras(soft_predictions=soft[:3]))
    assert "[0, 1]" in s.validate(with_extras(soft_predictions=np.where(soft > 0.5, 1.2, -0.1).astype(np.float32)))
    assert "sum to 1" in s.validate(with_extras(soft_predictions=soft * 0.9))
    assert s.validate(with_extras(soft_predictions=soft * 0.96)) is None  # within int8 rounding
    assert "prototypes" in s.validate(with_extras(prototypes=np.zeros((2, 2), np.float32)))
    assert "shares no model tensors" in s.validate(dataclasses.replace(good, tensors=(np.zeros(1, np.float32),)))
    s.step(1, [], [good])
    assert "[3, 2]" in s.validate(with_extras(prototypes=np.zeros((3, 5), np.float32)))  # d fixed by the teacher


# --------------------------------------------------------------------------- the client


def test_onnx_and_torch_soft_predictions_agree(digits, trained) -> None:
    pytest.importorskip("onnxruntime")
    client = _client(digits.test, 200)
    soft_o, protos_o, b_o = client.proxy_outputs(trained, 1.5, use_onnx=True)
    soft_t, protos_t, b_t = client.proxy_outputs(trained, 1.5, use_onnx=False)
    assert (b_o, b_t) == ("onnxruntime", "torch")
    np.testing.assert_allclose(soft_o, soft_t, atol=1e-5, rtol=0)
    np.testing.assert_allclose(protos_o, protos_t, atol=1e-5, rtol=1e-5)
    # and both are the formulas: softmax(logits / T) and class means, from the model directly
    with torch.no_grad():
        z = trained.features(client.proxy_x)
        logits = trained.head(z).double().numpy()
    np.testing.assert_allclose(soft_t, _softmax(logits / 1.5), atol=1e-6)
    for c in range(10):
        np.testing.assert_allclose(protos_t[c], z.numpy()[client.proxy_y_np == c].mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(soft_t.sum(1), 1.0, atol=1e-6)


def test_onnx_failure_falls_back_to_torch(digits, trained, monkeypatch) -> None:
    import edge_agent.onnx_runtime as onnx_runtime

    def broken(*a, **k):
        raise ModelError("exporter broke")

    monkeypatch.setattr(onnx_runtime, "export_onnx", broken)
    soft, _, backend = _client(digits.test, 50).proxy_outputs(trained, 1.5, use_onnx=True)
    assert backend == "torch" and soft.shape == (50, 10)


def _round(client, model, digits, rnd, params=None, extras=None):
    return client.local_round(model, (), torch.from_numpy(np.array(digits.train.x[:120])),
                              torch.from_numpy(np.array(digits.train.y[:120])),
                              TrainConfig(batch_size=16, lr=0.05, momentum=0.9, seed=1), round=rnd, client_index=0,
                              device=CPU, params={"onnx_soft_predictions": False, **(params or {})},
                              global_extras=extras or {})


def test_local_round_stages(digits) -> None:
    torch.manual_seed(6)
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    client = _client(digits.test, 100)
    r1 = _round(client, model, digits, 1)
    assert r1.tensors == () and r1.num_samples == 120
    assert r1.extras["soft_predictions"].shape == (100, 10) and r1.extras["prototypes"].shape == (10, 64)
    assert r1.extras["soft_predictions"].dtype == r1.extras["prototypes"].dtype == np.float32
    assert not {"kd_loss", "infonce_loss", "proto_loss"} & set(r1.metrics)  # no teacher in round 1
    assert r1.metrics["soft_predictions_backend"] == "torch"
    assert r1.metrics["proxy_accuracy"] == pytest.approx(
        float(np.mean(r1.extras["soft_predictions"].argmax(1) == client.proxy_y_np)))

    s = FedMCP(proxy_y=client.proxy_y_np, num_classes=10, proxy_size=100)
    res = ClientResult("c", (), r1.num_samples, r1.train_loss, extras=r1.extras)
    assert s.validate(res) is None
    s.step(1, [], [res])
    teacher = s.global_extras()
    config = s.configure_round(2, ["c"], np.random.default_rng(0)).config
    r2 = _round(client, model, digits, 2, config, teacher)
    assert {"kd_loss", "infonce_loss", "proto_loss"} <= set(r2.metrics)
    # one teacher = this client's own last predictions: KD starts at 0, prototypes start aligned
    assert r2.metrics["proto_loss"] >= 0 and np.isfinite(r2.metrics["infonce_loss"])
    assert client.proj_s.weight.shape == (32, 64) and client.proj_t.weight.shape == (32, 10)

    r3 = _round(client, model, digits, 3, {**config, "kd": False, "infonce": False, "proto_align": False}, teacher)
    assert not {"kd_loss", "infonce_loss", "proto_loss"} & set(r3.metrics)
    with pytest.raises(ModelError, match="proxy set"):
        _round(client, model, digits, 4, {**config, "proxy_digest": "0" * 16}, teacher)
    with pytest.raises(ModelError, match="teacher_soft_predictions"):
        _round(client, model, digits, 4, config, {**teacher, "teacher_soft_predictions": np.zeros((5, 10), np.float32)})


def test_alignment_follows_the_formulas_for_one_batch(digits) -> None:
    """With one proxy batch, lr 0.1 and no momentum, the KD stage is one SGD step on the
    T²·KL of :func:`distillation_loss`, recomputed here by hand on a copy of the model."""
    torch.manual_seed(8)
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    ref = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    ref.load_state_dict(model.state_dict())
    client = _client(digits.test, 40)
    teacher_soft = np.random.default_rng(9).dirichlet(np.ones(10), 40).astype(np.float32)
    extras = {"teacher_soft_predictions": teacher_soft, "teacher_prototypes": np.zeros((10, 64), np.float32)}
    cfg = TrainConfig(batch_size=16, lr=0.1, momentum=0.0, seed=1)
    params = {"infonce": False, "proto_align": False, "proxy_batch_size": 64, "kd_weight": 2.0}
    # the KD stage alone: no local data (an empty shard trains nothing)
    out = client.local_round(model, (), torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.int64), cfg, round=2,
                             client_index=0, device=CPU, params={**params, "onnx_soft_predictions": False},
                             global_extras=extras)
    x = client.proxy_x
    p_i = torch.softmax(ref(x) / 1.5, 1)
    t = torch.from_numpy(teacher_soft)
    loss = 2.0 * 1.5 ** 2 * (t * (t.log() - p_i.log())).sum(1).mean()
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    assert out.metrics["kd_loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- the wire


def _upload(client: FedMCPClient, model) -> Update:
    soft, protos, _ = client.proxy_outputs(model, 1.5, use_onnx=False)
    return Update(tensors=(), num_samples=100, train_loss=0.3, metrics={"train_accuracy": 0.9},
                  extras={"soft_predictions": soft, "prototypes": protos})


def test_fp32_upload_is_exactly_42560_tensor_bytes(digits, trained) -> None:
    """SPECS §5.2: 1000 × 10 × 4 + 10 × 64 × 4 = 42,560 bytes of tensor data per upload; each
    extras entry costs its key and tensor header beyond that (msgpack packed by hand)."""
    client = _client(digits.train, 1000)  # digits' test split has only 360 samples
    up = _upload(client, trained)
    enc = encode(Envelope(round=3, sender="client-000", seq=4, body=up))
    assert enc.raw_tensor_bytes == 42_560
    fb = dict(enc.field_bytes)
    for name, shape in (("soft_predictions", [1000, 10]), ("prototypes", [10, 64])):
        arr = up.extras[name]
        hand = msgpack.packb(name) + msgpack.packb([0, 1, shape, arr.astype("<f4").tobytes()], use_bin_type=True)
        assert fb[f"extras.{name}"] == len(hand)
    # (key + tensor header) per entry
    assert fb["extras.soft_predictions"] + fb["extras.prototypes"] == 42_560 + (17 + 11) + (11 + 9)
    assert fb["tensors"] == 1  # an empty array: no model parameter travels
    got = decode(enc.payload).envelope.body
    np.testing.assert_array_equal(got.extras["soft_predictions"], up.extras["soft_predictions"])


def test_compact_codecs_fit_11000_bytes_on_real_predictions(digits, trained) -> None:
    from edge_agent.agent import extras_codecs

    client = _client(digits.train, 1000)
    up = _upload(client, trained)
    assert float(np.mean(up.extras["soft_predictions"].argmax(1) == client.proxy_y_np)) > 0.8  # trained-ish
    codecs = extras_codecs("soft_predictions=int8+zstd,prototypes=fp16+zstd", up.extras, Codec.parse("fp32"))
    enc = encode(Envelope(round=3, sender="client-000", seq=4, body=up), None, codecs)
    assert len(enc.payload) <= 11_000
    got = decode(enc.payload).envelope.body.extras
    s = FedMCP(proxy_y=client.proxy_y_np, num_classes=10)  # the decoded upload is still accepted
    assert s.validate(ClientResult("c", (), 100, 0.3, extras=got)) is None
    np.testing.assert_allclose(got["soft_predictions"], up.extras["soft_predictions"], atol=1 / 254 + 1e-6)


# --------------------------------------------------------------------------- a federation


@pytest.mark.slow
def test_fedmcp_federation_over_a_broker(tmp_path) -> None:
    """3 digits clients, 2 rounds over the embedded broker: updates carry only the two extras
    (6,560 tensor bytes for a 100-sample proxy set), round 2's global carries the teacher the
    spied round-1 uploads give by hand, devices evaluate on the test split minus the proxy."""
    import json
    import sqlite3
    import time

    from helpers.federation import Spy, small_config

    from broker_server.embedded_broker import EmbeddedBroker
    from broker_server.simulate import simulate
    from protocol.messages import Global

    cfg = small_config(train={"algorithm": "fedmcp"}, server={"client_eval": True},
                       algorithm={"proxy_size": 100, "alpha_proto": 0.5})
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        spy = Spy(broker.host, broker.port)
        try:
            res = simulate(cfg, broker_url=broker.url, run_dir=tmp_path / "run")
            time.sleep(0.3)
        finally:
            spy.close()
    assert res.rounds_completed == 2
    metrics = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["clients_reported"] for m in metrics] == [3, 3] and all(m["share"] == "none" for m in metrics)

    updates, globals_ = {}, {}
    for _, payload, _ in spy.messages:
        env = decode(payload).envelope if payload else None
        if env is not None and isinstance(env.body, Update):
            updates.setdefault(env.round, {})[env.sender] = env.body
        elif env is not None and isinstance(env.body, Global):
            globals_[env.round] = env.body
    assert globals_[1].extras == {} and globals_[1].tensors == ()
    assert all(u.tensors == () and set(u.extras) == {"soft_predictions", "prototypes"}
               for r in updates.values() for u in r.values())
    n_eval = len(load_dataset("digits").test) - 100
    assert all(u.metrics["eval_samples"] == n_eval for r in updates.values() for u in r.values())
    assert {u.metrics["soft_predictions_backend"] for u in updates[2].values()} <= {"onnxruntime", "torch"}
    assert all("kd_loss" in u.metrics for u in updates[2].values())
    assert not any("kd_loss" in u.metrics for u in updates[1].values())

    # the teacher of round 2, by hand from round 1's uploads and the proxy labels
    proxy, _ = proxy_split(load_dataset("digits").test, 100, seed=1)  # proxy_seed = the run seed
    ups = [updates[1][c] for c in sorted(updates[1])]
    acc = np.array([np.mean(u.extras["soft_predictions"].argmax(1) == proxy.y) for u in ups])
    for name, teacher in (("soft_predictions", "teacher_soft_predictions"), ("prototypes", "teacher_prototypes")):
        want = np.average(np.stack([u.extras[name] for u in ups]), axis=0, weights=acc)
        np.testing.assert_allclose(globals_[2].extras[teacher], want, rtol=1e-5, atol=1e-7)
    assert metrics[0]["teacher_weights"] == pytest.approx(dict(zip(sorted(updates[1]), acc / acc.sum())))
    assert metrics[0]["client_proxy_accuracy"] == pytest.approx(dict(zip(sorted(updates[1]), acc)))

    # the devices' ledger: update rows whose tensor bytes are the extras only
    con = sqlite3.connect(res.run_dir / "ledger.sqlite")
    rows = con.execute("select raw_bytes, fields from messages where side='agent' and kind='update' "
                       "and event='sent'").fetchall()
    con.close()
    assert len(rows) == 6 and {r for r, _ in rows} == {100 * 10 * 4 + 10 * 64 * 4}
    for _, fields in rows:
        fb = json.loads(fields)
        assert fb["tensors"] == 1  # the empty array header
        assert fb["extras.soft_predictions"] > 4_000 and fb["extras.prototypes"] > 2_560
        assert not [k for k in fb if k.startswith("tensors.")]
