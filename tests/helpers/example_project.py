"""The example project of ``examples/custom`` (``shapesfl``) for the tests: where it is, how a
test or a process imports it, and its centrally trained reference.

``central_accuracy`` trains the example's model on the union of all clients' training data (the
same data set, model, initial seed, batch size, momentum and learning-rate schedule as
``shapes.toml``) for one epoch per federated round and returns its test accuracy: the bound the
federated runs are held to comes from it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "custom"
TOML = EXAMPLE / "shapes.toml"
#: the example's schedule (shapes.toml): lr_r = 0.1 · 0.8^(r − 1), 6 rounds
LR, DECAY, ROUNDS = 0.1, 0.8, 6


def on_path() -> None:
    """Put the example project's folder first on ``sys.path`` (what PYTHONPATH does for processes)."""
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))


def process_env() -> dict[str, str]:
    """The environment of a server or agent process that must import both fedfleet (this
    checkout) and the example project: PYTHONPATH = repository, example folder."""
    return {**os.environ, "FEDFLEET_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(EXAMPLE)])}


def central_accuracy() -> float:
    """Test accuracy of the example's model trained centrally on all the training data: ROUNDS
    epochs, epoch e at lr 0.1 · 0.8^e, batch 16, momentum 0.5, plain cross-entropy, model seed 0."""
    import numpy as np
    import torch

    from edge_agent.algorithms import TrainConfig
    from edge_agent.algorithms.fedavg import sgd_epochs, shuffle_generator
    from edge_agent.data import load_dataset
    from edge_agent.models import make_model

    on_path()
    ds = load_dataset("shapesfl.data:shapes")
    model = make_model("shapesfl.model:make", in_channels=1, image_size=12, num_classes=4, feature_dim=32, seed=0)
    x, y = torch.from_numpy(np.array(ds.train.x)), torch.from_numpy(np.array(ds.train.y))
    for e in range(ROUNDS):
        sgd_epochs(model, x, y, TrainConfig(lr=LR * DECAY ** e, batch_size=16, momentum=0.5),
                   shuffle_generator(0, e, 0), torch.device("cpu"))
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(np.array(ds.test.x))).argmax(1).numpy()
    return float((pred == np.asarray(ds.test.y)).mean())
