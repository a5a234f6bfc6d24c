"""shapesfl: a fedfleet example project outside the fedfleet package.

* :mod:`shapesfl.data` — a generated data set of bar images (offline, seeded);
* :mod:`shapesfl.model` — a small CNN factory with fedfleet's model interface;
* :mod:`shapesfl.client` — the client half: SGD with label smoothing and gradient-norm clipping;
* :mod:`shapesfl.server` — the server half: a coordinate-wise trimmed mean, a learning-rate
  schedule, its own metric aggregation and a validation set of its own;
* :mod:`shapesfl.algorithm` — the two halves paired under one name.
"""
