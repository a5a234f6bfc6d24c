"""Which refusals a receiver may answer: :class:`protocol.channel.Rejected` carries the refused
message's header (kind, round, sender, seq, payload hash) only when the header is as
trustworthy as an accepted message's — past the security checks, naming the topic's client and
the topic's kind — and ``read_header`` reads that header without decoding the body."""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from protocol import security as S
from protocol import topics
from protocol.channel import Channel, Rejected
from protocol.memory_transport import MemoryBroker
from protocol.messages import Kind, read_header
from protocol.transport_base import Incoming

FED = "fed-hdr"
UP = topics.up(FED, "client-007", Kind.UPDATE)


def _garbage(sender: str = "client-007", seq: int = 9, kind: int = 4, rnd: int = 2) -> bytes:
    """An envelope with a valid header and a body that is no msgpack array (``0xc1`` is never valid)."""
    return msgpack.packb([1, kind, rnd, sender, seq, 0, b"\xc1"], use_bin_type=True)


def _channel(security=None) -> Channel:
    return Channel(MemoryBroker().connect("server"), node_id="server", side="server", federation=FED, ledger=None,
                   security=security)


def _accept(ch: Channel, topic: str, payload: bytes) -> Rejected:
    item = ch.accept(Incoming(topic, payload, 1, False, 0.0))
    assert isinstance(item, Rejected)
    return item


def test_read_header_reads_the_five_header_fields_and_nothing_else() -> None:
    """The header of a payload whose body is garbage is read; a payload that is no envelope, of
    another version, or with a bad sender id has none."""
    assert read_header(_garbage()) == (Kind.UPDATE, 2, "client-007", 9)
    assert read_header(b"\xc1") is None
    assert read_header(msgpack.packb([2, 4, 2, "client-007", 9, 0, b""])) is None
    assert read_header(msgpack.packb([1, 4, 2, "bad/id", 9, 0, b""])) is None
    assert read_header(msgpack.packb([1, 4, 2, "client-007", 9])) is None


def test_unsigned_refusal_naming_the_topic_client_is_answerable() -> None:
    """Signing off: garbage body, header sender = topic client, kind = topic kind: answerable, with
    the header's round and seq and the SHA-256 of the bytes."""
    payload = _garbage()
    rej = _accept(_channel(), UP, payload)
    assert rej.answerable
    assert (rej.kind, rej.round, rej.sender, rej.seq) == (Kind.UPDATE, 2, "client-007", 9)
    assert rej.sha256 == hashlib.sha256(payload).digest()


@pytest.mark.parametrize("payload", [_garbage(sender="client-008"), _garbage(kind=1), b"", b"\xc1"],
                         ids=["other-sender", "other-kind", "empty", "no-envelope"])
def test_refusal_whose_header_does_not_fit_the_topic_is_not_answerable(payload: bytes) -> None:
    """A header naming another sender or another kind than the topic, or no header at all: no answer."""
    rej = _accept(_channel(), UP, payload)
    assert not rej.answerable and rej.sender is None and rej.seq is None


def test_signed_refusals_are_answerable_only_past_the_signature_check() -> None:
    """Signing on. The enrolled device's correctly signed payload with a garbage body: answerable.
    The same bytes signed by a key that is not enrolled for client-007 (a forger using its id):
    refused ``bad_signature`` and not answerable; unsigned bytes: refused ``unsigned``, not
    answerable."""
    dev, rogue, srv = (S.generate_identity(n) for n in ("client-007", "client-007", "server"))
    server = S.ChannelSecurity(srv, side="server", peers=S.AllowList(None, {"client-007": dev.public}), epoch=1,
                               replay_state=None)
    agent = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public}, epoch=3, replay_state=None)
    forger = S.ChannelSecurity(rogue, side="agent", peers={"server": srv.public}, epoch=3, replay_state=None)
    ch = _channel(server)
    server.note_sent(Kind.ROUND_START, 2)  # round 2 is open: a round-2 update is not "wrong_round"
    good = _accept(ch, UP, agent.seal(UP, _garbage(seq=9)).payload)
    assert good.answerable and (good.sender, good.seq) == ("client-007", 9)
    forged = _accept(ch, UP, forger.seal(UP, _garbage(seq=10)).payload)
    assert forged.code == "bad_signature" and not forged.answerable
    plain = _accept(ch, UP, _garbage(seq=11))
    assert plain.code == "unsigned" and not plain.answerable
