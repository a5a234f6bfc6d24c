"""Reproducers (tester): the server's chunked-transfer reassembly is exhausted by a few tiny
forged messages.

``Reassembler`` admits a transfer on its first chunk, reserving the *declared* ``total_bytes``
(up to 256 MiB, allocated at once) and one of 64 transfer slots for ``ttl_s`` = 120 s (each new
chunk refreshes it). The server channel checks a chunk's sender only against the topic level
(``max_sender_transfers = 4`` per id), and any valid id may publish on ``up/<id>/update`` - no
join needed - so, fed through the server's own ``Channel.accept``:

* 64 chunk messages of ~150 bytes from 64 made-up ids fill every slot: every legitimate chunked
  update is refused for two minutes (or as long as the attacker refreshes them);
* 2 chunk messages of 1 MiB declaring 256 MiB each make the server allocate 512 MiB (observed
  RSS 42 → 556 MiB) and refuse every other transfer (``max_bytes``).
"""

from __future__ import annotations

import os
import time

import pytest

from protocol.channel import Channel, Received, Rejected
from protocol.chunking import split
from protocol.messages import Chunk, Envelope, Update, encode
from protocol.transport import Incoming

import numpy as np

FED = "brk-chunks"


class _NoTransport:
    client_id = "server"

    def subscribe(self, filters, qos=1):
        pass

    def publish(self, topic, payload, *, qos=1, retain=False, wait_s=None):
        pass

    def get(self, timeout_s):
        return None

    def close(self):
        pass


def _server_channel() -> Channel:
    """A channel configured as the aggregation server configures its own: transfers only from
    joined clients (here client-000), and a per-transfer bound from the model size."""
    from protocol.chunking import Reassembler

    return Channel(_NoTransport(), node_id="server", side="server", federation=FED, ledger=None,
                   transfer_filter=lambda sender: sender == "client-000",
                   reassembler=Reassembler(max_transfer_bytes=16 * 1024 * 1024, max_sender_transfers=4))


def _incoming(sender: str, body, seq: int = 1) -> Incoming:
    payload = encode(Envelope(round=1, sender=sender, seq=seq, body=body)).payload
    return Incoming(f"fedfleet/v1/{FED}/up/{sender}/update", payload, 1, False, time.monotonic())


def _legit_update_arrives(ch: Channel) -> bool:
    upd = Update(tensors=(np.ones(800_000, np.float32),), num_samples=10, train_loss=0.1)  # 3.2 MB: chunked
    whole = encode(Envelope(round=1, sender="client-000", seq=1, body=upd)).payload
    result = None
    for i, c in enumerate(split(whole, chunk_bytes=1024 * 1024)):
        result = ch.accept(_incoming("client-000", c, seq=2 + i))
        if isinstance(result, Rejected):
            return False
    return isinstance(result, Received)


def test_control_a_legitimate_chunked_update_is_reassembled() -> None:
    assert _legit_update_arrives(_server_channel())


def test_tiny_forged_chunks_do_not_block_a_legitimate_update() -> None:
    ch = _server_channel()
    for i in range(64):
        forged = Chunk(transfer_id=os.urandom(16), index=0, count=2, offset=0, total_bytes=2, sha256=bytes(32),
                       data=b"x")
        assert isinstance(ch.accept(_incoming(f"made-up-{i}", forged)), Rejected)  # not a member
    assert _legit_update_arrives(ch)


def test_declared_sizes_do_not_pin_memory_before_the_bytes_arrive() -> None:
    ch = _server_channel()
    for s in ("made-up-1", "made-up-2"):
        forged = Chunk(transfer_id=os.urandom(16), index=0, count=256, offset=0, total_bytes=256 * 1024 * 1024,
                       sha256=bytes(32), data=b"x" * (1024 * 1024))
        ch.accept(_incoming(s, forged))
    assert ch.reassembler.buffered_bytes <= 64 * 1024 * 1024
    assert _legit_update_arrives(ch)
