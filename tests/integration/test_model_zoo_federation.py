"""Federations with zoo models, a user's factory and a model group, over the embedded MQTT broker
(examples/quickstart: scikit-learn's 8×8 digits, 4 Dirichlet(1.0) clients, 2 rounds)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch
from torch import nn

from broker_server import config as C
from broker_server.simulate import simulate
from edge_agent.models import make_model, manifest_hash, model_manifest

pytestmark = pytest.mark.slow

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"
HETERO = Path(__file__).resolve().parents[2] / "examples" / "hetero-fedproto.toml"
CHANCE = 0.1  # ten digit classes


class TinyNet(nn.Module):
    """A user's own model: two convs with BatchNorm, the fedfleet interface."""

    def __init__(self, in_channels: int, num_classes: int, feature_dim: int) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(in_channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, feature_dim), nn.ReLU())
        self.classifier = nn.Linear(feature_dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.classifier(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def factory(num_classes: int, in_channels: int, feature_dim: int) -> TinyNet:
    """The factory named in the configuration (it takes no image_size: it is not given one)."""
    return TinyNet(in_channels, num_classes, feature_dim)


def _config(tmp_path: Path, model: dict, algorithm: str = "fedavg", path: Path = QUICKSTART) -> C.Config:
    raw = C.tomllib.loads(path.read_text(encoding="utf-8"))
    raw["run"].update(rounds=2, out=str(tmp_path))
    raw["model"] = {**raw.get("model", {}), **model}
    raw["train"]["algorithm"] = algorithm
    return C.from_dict(raw, str(path))


def _final_state_manifest(run_dir: Path) -> str:
    state = torch.load(run_dir / "model_final.pt", map_location="cpu")
    return manifest_hash([(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()])


def test_fedavg_with_the_zoo_resnet8_learns_digits(tmp_path: Path) -> None:
    res = simulate(_config(tmp_path, {"name": "resnet8"}), run_dir=tmp_path / "run")
    assert res.rounds_completed == 2
    assert all(m["clients_reported"] == 4 for m in res.metrics)
    # measured 0.92 on this machine (seed 0); chance is 0.10
    assert res.final_accuracy > 0.6
    expected = make_model("resnet8", in_channels=1, image_size=8, num_classes=10)
    assert _final_state_manifest(res.run_dir) == manifest_hash(model_manifest(expected))


def test_fedavg_with_a_users_factory_learns_digits(tmp_path: Path) -> None:
    name = f"{__name__}:factory"  # this module, importable by that name in the simulating process
    res = simulate(_config(tmp_path, {"name": name, "feature_dim": 24}), run_dir=tmp_path / "run")
    assert res.rounds_completed == 2
    assert res.final_accuracy > 2 * CHANCE  # measured 0.35 (a shallow net, 2 rounds); chance 0.10
    state = torch.load(res.run_dir / "model_final.pt", map_location="cpu")
    assert state["classifier.weight"].shape == (10, 24)
    assert "backbone.1.running_mean" in state and "backbone.1.num_batches_tracked" not in state


def test_fedproto_with_three_architectures_sends_no_parameters(tmp_path: Path) -> None:
    cfg = C.load(HETERO, overrides={("run", "rounds"): 2, ("run", "out"): str(tmp_path)})
    assert cfg.model.group == ("lightcnn", "resnet8", "inception_small") and cfg.train.algorithm == "fedproto"
    agents = []
    res = simulate(cfg, run_dir=tmp_path / "run", agent_hook=lambda i, a: agents.append(a))
    assert res.rounds_completed == 2
    assert [a.info["model"] for a in agents] == ["lightcnn", "resnet8", "inception_small"]
    assert len({a.manifest_hash for a in agents}) == 3  # three architectures joined one federation
    assert all(m["clients_reported"] == 3 for m in res.metrics)
    with sqlite3.connect(res.run_dir / "ledger.sqlite") as db:
        rows = db.execute("SELECT kind, fields FROM messages WHERE kind IN ('update', 'global') AND fields != ''"
                          ).fetchall()
    updates = [json.loads(f) for k, f in rows if k == "update"]
    assert len(updates) >= 2 * 3 * 2  # every client's update of both rounds, as sent and as received
    for kind, text in rows:
        fields = json.loads(text)
        # the tensors field of every update and global is an empty msgpack array (0x90): one byte, no parameter
        assert fields["tensors"] == 1, (kind, fields)
    assert all(sum(v for k, v in u.items() if k.startswith("extras")) > 100 for u in updates)  # the prototypes


@pytest.mark.parametrize(("algorithm", "params"), [("fedocp", {"server_epochs": 5}), ("fedgh", {}),
                                                   ("fedtgp", {"server_epochs": 5}), ("fedproto", {}),
                                                   ("fedorgp", {})])
def test_a_four_architecture_group_sends_prototypes_only(tmp_path: Path, algorithm: str, params: dict) -> None:
    """htfe4-cpu (lightcnn, resnet8, mobilenet_v2_small, inception_small) on 4 digit clients, 2
    rounds: summing the tensor bytes of every update in the ledger finds no model parameter, and
    the audit's body-fields view says so."""
    from broker_server.audit import body_fields, open_ledger
    from broker_server.audit._format import field_notes

    cfg = C.load(HETERO, overrides={("run", "rounds"): 2, ("run", "out"): str(tmp_path), ("data", "clients"): 4,
                                    ("model", "group"): "htfe4-cpu", ("train", "algorithm"): algorithm,
                                    ("server", "quorum"): 4})
    raw = C.tomllib.loads(cfg.to_toml())
    raw["algorithm"] = params
    cfg = C.from_dict(raw, "test")
    agents = []
    res = simulate(cfg, run_dir=tmp_path / "run", agent_hook=lambda i, a: agents.append(a))
    assert res.rounds_completed == 2
    assert [a.info["model"] for a in agents] == ["lightcnn", "resnet8", "mobilenet_v2_small", "inception_small"]
    with sqlite3.connect(res.run_dir / "ledger.sqlite") as db:
        rows = [json.loads(f) for (f,) in db.execute(
            "SELECT fields FROM messages WHERE kind = 'update' AND side = 'agent' AND event = 'sent'")]
        assert len(rows) == 4 * 2  # every device, both rounds
        # an empty msgpack array (0x90) is 1 byte: what is above that is model parameters
        assert sum(f["tensors"] - 1 for f in rows) == 0
        assert all({k for k in f if k.startswith("extras.")} == {"extras.prototypes", "extras.proto_classes",
                                                                  "extras.proto_counts"} for f in rows)
    groups = {g["kind"]: g for g in body_fields(open_ledger(res.run_dir))}
    assert groups["update"]["parameter_bytes"] == 0 and groups["update"]["extras_bytes"] > 4 * 2 * 10 * 64
    notes = "\n".join(field_notes(list(groups.values())))
    assert ("update (up): no model parameter in any message (0 B of model tensors: every tensors field is an empty "
            "list); the body's arrays are extras only: prototypes, proto_classes, proto_counts") in notes
