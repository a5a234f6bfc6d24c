"""What the server says and records when it refuses an update, message by message on the
in-process broker (``helpers.memory_server``) with a byte ledger: an update refused while it was
decoded is answered once and not waited for; a tensor of the wrong shape is named with both
shapes; every refused message is a ``rejected`` ledger row with its reason; ``invalid`` equals
the sum of ``rejected_by_reason`` per metrics line and over the run."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import msgpack
import numpy as np
import pytest
from helpers.memory_server import incoming, memory_server, receipts_to, update_payload

from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol import topics
from protocol.ledger import Ledger
from protocol.messages import Envelope, Kind, Status, Update, decode, encode

FED = "mem"
UP_A = topics.up(FED, "client-a", Kind.UPDATE)


def _model():
    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    return model, list(state_arrays(model))


def _garbage_body(sender: str, rnd: int, seq: int) -> bytes:
    """A valid envelope header (version 1, kind 4 = update) around a body that is no msgpack array."""
    return msgpack.packb([1, 4, rnd, sender, seq, 0, b"\xc1\xc1\xc1"], use_bin_type=True)


def _update(cid: str, rnd: int, seq: int, tensors, **kw) -> tuple[str, bytes]:
    body = Update(tensors=tuple(tensors), num_samples=kw.pop("num_samples", 100), train_loss=0.5, **kw)
    return topics.up(FED, cid, Kind.UPDATE), encode(Envelope(round=rnd, sender=cid, seq=seq, body=body)).payload


def _server(tmp_path: Path, feed_items: list, *, rounds: int = 1):
    model, like = _model()
    steps = deque(feed_items)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b"], rounds=rounds, fed=FED,
                        feed=lambda: steps.popleft() if steps else None, ledger=ledger)
    return srv, ledger, steps


def _withdrawal(cid: str, rnd: int, seq: int, why: str) -> tuple[str, bytes]:
    """(topic, payload) of the ``idle`` status carrying round ``rnd`` by which a device says it
    will not contribute to that round (``EdgeAgent._withdraw``)."""
    return topics.status(FED, cid), encode(Envelope(round=rnd, sender=cid, seq=seq,
                                                    body=Status("idle", f"round {rnd}: {why}"))).payload


def test_update_refused_while_decoding_gets_one_refusal_and_the_device_may_withdraw(tmp_path: Path) -> None:
    """A's update for round 1 has a valid header (seq 7) and an undecodable body. A gets exactly
    one receipt for seq 7, refused, saying it was refused while decoding. Signing is off, so the
    server cannot tell A's own refused update from one forged in A's name: the round keeps
    waiting for A until A itself withdraws (its idle status for round 1, as the agent sends on a
    refusal of its own seq), then closes on B's update (600 s deadline): withdrawn 1. The
    ledger's row of those bytes is ``rejected``, carries A, round 1, seq 7 and kind ``update``;
    ``invalid`` = 1 = ``rejected_by_reason["invalid"]``."""
    model, like = _model()
    rng = np.random.default_rng(0)
    srv, ledger, _ = _server(tmp_path, [incoming(UP_A, _garbage_body("client-a", 1, 7)),
                                        incoming(*update_payload(FED, "client-b", 1, 2, like, rng)),
                                        incoming(*_withdrawal("client-a", 1, 8, "its update was refused"))])
    m = srv.run_round(1)
    answers = [(r, b.ref_seq, b.accepted) for r, b in receipts_to(srv.channel.transport, "client-a")
               if b.ref_kind == Kind.UPDATE]
    assert answers == [(1, 7, False)]
    reason = next(b.reason for _, b in receipts_to(srv.channel.transport, "client-a") if b.ref_kind == Kind.UPDATE)
    assert reason.startswith("refused while decoding: ") and "body" in reason
    assert (m["clients_reported"], m["skipped"], m["unreported"], m["withdrawn"]) == (1, False, [], 1)
    assert (m["invalid"], m["rejected_by_reason"]) == (1, {"invalid": 1})
    rows = [r for r in ledger.rows("side = 'server' AND topic = ?", (UP_A,))]
    assert [(r.event, r.kind, r.round, r.sender, r.seq) for r in rows] == [("rejected", "update", 1, "client-a", 7)]
    assert "body" in rows[0].reason
    ledger.close()


def test_an_unsigned_refused_update_does_not_knock_its_named_device_out_of_the_round(tmp_path: Path) -> None:
    """Signing off: a malformed update on A's topic (seq 99, as a forger would send it) is refused
    and answered, but the round still waits for A, whose real update (seq 3) arrives after B's
    and is aggregated: 2 reported, nothing withdrawn, the aggregate is the mean of A's and B's
    tensors (equal sample counts)."""
    model, like = _model()
    rng = np.random.default_rng(3)
    b_topic, b_payload = update_payload(FED, "client-b", 1, 2, like, rng)
    a_topic, a_payload = update_payload(FED, "client-a", 1, 3, like, rng)
    srv, ledger, _ = _server(tmp_path, [incoming(UP_A, _garbage_body("client-a", 1, 99)),
                                        incoming(b_topic, b_payload), incoming(a_topic, a_payload)])
    m = srv.run_round(1)
    assert (m["clients_reported"], m["withdrawn"], m["invalid"]) == (2, 0, 1)
    assert [(b.ref_seq, b.accepted) for _, b in receipts_to(srv.channel.transport, "client-a")
            if b.ref_kind == Kind.UPDATE] == [(99, False), (3, True)]
    mean = [(np.asarray(x, np.float64) + np.asarray(y, np.float64)) / 2 for x, y in zip(
        decode(a_payload).envelope.body.tensors, decode(b_payload).envelope.body.tensors, strict=True)]
    got = list(srv.model.state_dict().values())
    floats = [(g, e) for g, e in zip(got, mean, strict=True) if g.is_floating_point()]
    assert floats and all(np.allclose(g.numpy(), e, atol=1e-6) for g, e in floats)
    ledger.close()


def test_refused_payload_whose_header_names_another_sender_is_not_answered(tmp_path: Path) -> None:
    """Bytes on A's update topic whose header claims B as sender (and whose body is garbage): no
    receipt to A or B (the header cannot be trusted), the round keeps waiting for both, which
    then report; ``invalid`` = 1."""
    model, like = _model()
    rng = np.random.default_rng(1)
    srv, ledger, _ = _server(tmp_path, [incoming(UP_A, _garbage_body("client-b", 1, 7)),
                                        incoming(*update_payload(FED, "client-a", 1, 2, like, rng)),
                                        incoming(*update_payload(FED, "client-b", 1, 2, like, rng))])
    m = srv.run_round(1)
    tr = srv.channel.transport
    assert [b.ref_seq for c in ("client-a", "client-b") for _, b in receipts_to(tr, c)
            if b.ref_kind == Kind.UPDATE and not b.accepted] == []
    assert (m["clients_reported"], m["invalid"], m["rejected_by_reason"]) == (2, 1, {"invalid": 1})
    (row,) = ledger.rows("side = 'server' AND event = 'rejected'")
    assert (row.kind, row.sender, row.seq) == ("invalid", None, None)
    ledger.close()


def test_tensor_shape_refusal_names_the_tensor_and_both_shapes(tmp_path: Path) -> None:
    """A sends 8 tensors, the first (``conv1.weight`` or whatever the model's first state-dict
    entry is) with one more output channel. The receipt's reason names the position, the
    manifest name and index, and both shapes and dtypes, worked out from the model's own
    state dict; the update's ledger row is ``rejected`` with that reason;
    ``rejected_by_reason`` = {"manifest_mismatch": 1}."""
    model, like = _model()
    name, first = next(iter(model.state_dict().items()))
    wrong = np.zeros((first.shape[0] + 1, *first.shape[1:]), np.float32)
    dims = ", ".join(str(d) for d in first.shape)
    wrong_dims = ", ".join(str(d) for d in wrong.shape)
    expected = (f"tensors[0] ({name!r}, manifest entry 0): [{dims}] float32 expected, "
                f"[{wrong_dims}] float32 received")
    rng = np.random.default_rng(2)
    srv, ledger, _ = _server(tmp_path, [incoming(*_update("client-a", 1, 5, [wrong, *like[1:]])),
                                        incoming(*update_payload(FED, "client-b", 1, 2, like, rng)),
                                        incoming(*_withdrawal("client-a", 1, 6, "its update was refused"))])
    m = srv.run_round(1)
    (refusal,) = [b for _, b in receipts_to(srv.channel.transport, "client-a") if b.ref_kind == Kind.UPDATE]
    assert (refusal.accepted, refusal.reason) == (False, expected)
    (row,) = ledger.rows("side = 'server' AND sender = 'client-a' AND seq = 5")
    assert (row.event, row.reason) == ("rejected", expected)
    assert (m["invalid"], m["rejected_by_reason"], m["clients_reported"]) == (1, {"manifest_mismatch": 1}, 1)
    ledger.close()


def test_empty_payload_on_an_update_topic_is_a_rejected_row(tmp_path: Path) -> None:
    """Zero bytes on A's update topic: a ``rejected`` ledger row whose reason says the payload was
    empty, counted ``invalid`` under ``invalid``; A and B then report."""
    model, like = _model()
    rng = np.random.default_rng(3)
    srv, ledger, _ = _server(tmp_path, [incoming(UP_A, b""),
                                        incoming(*update_payload(FED, "client-a", 1, 2, like, rng)),
                                        incoming(*update_payload(FED, "client-b", 1, 2, like, rng))])
    m = srv.run_round(1)
    (row,) = ledger.rows("side = 'server' AND event = 'rejected'")
    assert (row.topic, row.payload_bytes) == (UP_A, 0) and "empty payload" in row.reason
    assert (m["invalid"], m["rejected_by_reason"], m["clients_reported"]) == (1, {"invalid": 1}, 2)
    ledger.close()


@pytest.mark.parametrize("change, code", [
    (lambda like: {"tensors": like[:-1]}, "manifest_mismatch"),
    (lambda like: {"tensors": like, "num_samples": 101}, "num_samples"),
    (lambda like: {"tensors": like, "metrics": {"eval_accuracy": 7.0}}, "metric_range"),
], ids=["count", "num_samples", "metric"])
def test_each_refusal_counts_once_under_its_reason(tmp_path: Path, change, code: str) -> None:
    """One refused update from A (a tensor missing, more samples than announced at join, an
    evaluation metric outside [0, 1]) and a garbage message from B between the two rounds:
    round 1's line has ``invalid`` 1 under ``code``, round 2's line counts the garbage
    (``invalid`` 1 under ``invalid``), and each line's and the run's per-reason counts add up
    to its ``invalid``. The refused update's ledger row is ``rejected``; A, told so, withdraws
    (signing off: the server takes the device's word for it, not the refused update's)."""
    model, like = _model()
    rng = np.random.default_rng(4)
    kw = change(like)
    bad = _update("client-a", 1, 5, kw.pop("tensors"), **kw)
    items = [incoming(*bad), incoming(*update_payload(FED, "client-b", 1, 2, like, rng)),
             incoming(*_withdrawal("client-a", 1, 6, "its update was refused"))]
    srv, ledger, steps = _server(tmp_path, items, rounds=2)
    m1 = srv.run_round(1)
    srv.channel.transport.deliver(incoming(topics.up(FED, "client-b", Kind.UPDATE), b"\x91"))  # between rounds
    steps.extend([incoming(*update_payload(FED, c, 2, 3, like, rng)) for c in ("client-a", "client-b")])
    m2 = srv.run_round(2)
    assert (m1["invalid"], m1["rejected_by_reason"], m1["clients_reported"]) == (1, {code: 1}, 1)
    assert (m2["invalid"], m2["rejected_by_reason"], m2["clients_reported"]) == (1, {"invalid": 1}, 2)
    totals = srv.refusal_totals()
    assert totals["invalid"] == sum(totals["rejected_by_reason"].values()) == 2
    (row,) = ledger.rows("side = 'server' AND sender = 'client-a' AND seq = 5")
    assert row.event == "rejected" and row.reason
    ledger.close()
