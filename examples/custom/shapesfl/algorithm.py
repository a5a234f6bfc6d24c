"""The algorithm's two halves under one name: ``[train] algorithm = "shapesfl.algorithm:trimmed"``.
Given as import paths, a device imports only the client half (and no server code)."""

from fedfleet import Algorithm

trimmed = Algorithm(client="shapesfl.client:ClippedSGD", strategy="shapesfl.server:TrimmedMean",
                    name="trimmed-mean")
