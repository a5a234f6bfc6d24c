"""A generated data set: 12×12 grey images of one bar each, in one of four orientations (the
class): horizontal, vertical, diagonal ``\\``, anti-diagonal ``/``; random position and length,
Gaussian pixel noise. Seeded: the same arrays on the server and on every device, no download."""

from __future__ import annotations

import numpy as np

from fedfleet.client import dataset_factory

SIZE = 12
CLASSES = 4
NOISE = 70.0  # standard deviation of the pixel noise, on the 0–255 scale


def generate(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images and labels: uint8 ``[n, 12, 12]``, int64 ``[n]`` (balanced classes, shuffled)."""
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.arange(n) % CLASSES).astype(np.int64)
    x = np.zeros((n, SIZE, SIZE), dtype=np.float64)
    for i, c in enumerate(y):
        length = int(rng.integers(5, SIZE + 1))
        start = int(rng.integers(0, SIZE - length + 1))
        line = int(rng.integers(1, SIZE - 1))
        steps = np.arange(start, start + length)
        if c == 0:
            x[i, line, steps] = 255
        elif c == 1:
            x[i, steps, line] = 255
        else:
            shift = int(rng.integers(-3, 4))
            cols = np.clip(steps + shift, 0, SIZE - 1) if c == 2 else np.clip(SIZE - 1 - steps + shift, 0, SIZE - 1)
            x[i, steps, cols] = 255
    x += rng.normal(0.0, NOISE, size=x.shape)
    return np.clip(np.rint(x), 0, 255).astype(np.uint8), y


@dataset_factory(num_classes=CLASSES, channels=1, image_size=SIZE)
def shapes(data_dir):
    """fedfleet's factory contract: ``(x_train, y_train, x_test, y_test)``; 1,200 training and
    400 test images (``data_dir`` is not needed: the images are generated)."""
    x_tr, y_tr = generate(1200, seed=1)
    x_te, y_te = generate(400, seed=2)
    return x_tr, y_tr, x_te, y_te


def validation_set(n: int, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """A held-out set of the server's own (not the test split): float32 ``[n, 1, 12, 12]`` in
    [-1, 1] (fedfleet's conversion, ``(v / 255 - 0.5) / 0.5``) and int64 ``[n]``."""
    x, y = generate(n, seed)
    return ((x.astype(np.float32) / 255.0 - 0.5) / 0.5)[:, None], y
