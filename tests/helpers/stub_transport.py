"""A transport double's common part for channel tests (protocol.channel.Channel over no broker):
it keeps the channel's delivery listener and receives nothing; a test's subclass says what a
publish does and reports its outcomes by hand."""

from __future__ import annotations

import numpy as np

from protocol.messages import Update


class StubTransport:
    """The transport interface a Channel needs, doing nothing: ``publish`` is the subclass's."""

    client_id = "client-001"
    max_packet_bytes = 0

    def __init__(self) -> None:
        self.listener = None

    def set_delivery_listener(self, fn) -> None:
        self.listener = fn

    def subscribe(self, filters, qos=1) -> None: ...

    def get(self, timeout_s):
        return None

    def close(self) -> None: ...


def update_of(n_values: int) -> Update:
    """An update of one float32 tensor 0 … n_values − 1 (4·n_values bytes of tensor data)."""
    return Update(tensors=(np.arange(n_values, dtype=np.float32),), num_samples=10, train_loss=0.5, metrics={})
