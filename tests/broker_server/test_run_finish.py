"""A run's end when its ``finish`` does not go out as it should: the server's wait for the broker's
acknowledgement of the broadcast ``finish`` (10 s) ends first (a slow or stalled link: the MQTT
client keeps it queued), or the transport does not take it at all (closed). The rounds are done:
the final files are written all the same, and the unconfirmed finish is said (a WARNING, and
``RunSummary.finish_unconfirmed`` for ``summary.json``).

One device, one round, on the in-process broker (``helpers.memory_server``); the server's
transport raises on the ``finish`` topic as :class:`protocol.transport.MqttTransport` does."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from helpers.memory_server import incoming, memory_server, update_payload

from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol import topics
from protocol.errors import PublishTimeout, TransportError
from protocol.ledger import Ledger
from protocol.messages import Kind, RoundStart, decode

FED = "mem"
FINISH = topics.down(FED, Kind.FINISH)  # fedfleet/v1/mem/down/finish


@pytest.mark.parametrize("how", ["wait ends", "not taken"])
def test_a_finish_not_confirmed_by_the_broker_still_gets_the_final_files_and_is_said(tmp_path: Path, caplog,
                                                                                     how: str) -> None:
    """``wait ends``: the finish is handed over (the broker delivers it), then its wait ends
    (PublishTimeout, its handle set): its ledger row is ``sent``, and it is said queued.
    ``not taken``: the transport is closed under it (TransportError, no handle): its row is a
    ``message`` row, delivery ``dropped``. Either way ``run()`` returns round 1's summary, writes
    ``model_final.pt``, closes the run store, and says in a WARNING and in
    ``finish_unconfirmed`` that the finish of round 1 was not confirmed, naming the device that
    waited for it (client-a) and the transport's error. Before, ``run()`` raised the error and
    the final files were never written."""
    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    like = list(state_arrays(model))
    rng = np.random.default_rng(0)
    sent_update: list[int] = []

    def feed():
        started = [t for t, p in srv.channel.transport.sent if isinstance(decode(p).envelope.body, RoundStart)]
        if started and not sent_update:
            sent_update.append(1)
            return incoming(*update_payload(FED, "client-a", 1, 2, like, rng))
        return None

    ledger = Ledger(tmp_path / "ledger.sqlite")
    srv = memory_server(tmp_path, model=model, clients=["client-a"], rounds=1, feed=feed, fed=FED, ledger=ledger)
    tr = srv.channel.transport
    publish = tr.publish
    error = ""

    def stalling(topic: str, payload: bytes, **kwargs) -> None:
        nonlocal error
        if topic != FINISH:
            return publish(topic, payload, **kwargs)
        if how == "wait ends":
            publish(topic, payload, **kwargs)  # the broker has it
            error = (f"server: PUBLISH to {topic} not acknowledged within 10 s (it stays queued: its outcome comes "
                     "later)")
            raise PublishTimeout(error, topic=topic, handle=object())
        error = f"server: PUBLISH to {topic} ({len(payload):,} bytes) not sent: the transport is closed"
        raise TransportError(error, topic=topic)

    tr.publish = stalling  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="broker_server.server"):
        summary = srv.run()
    assert summary.rounds_completed == 1 and [m["round"] for m in summary.metrics] == [1]
    assert (tmp_path / "model_final.pt").is_file()
    queued = how == "wait ends"
    assert summary.finish_unconfirmed == srv.finish_unconfirmed == {
        "round": 1, "queued": queued, "devices": ["client-a"], "error": error}
    warned = [r.getMessage() for r in caplog.records
              if r.name == "broker_server.server" and r.levelno == logging.WARNING and "finish" in r.getMessage()]
    assert warned == [
        "the finish of round 1 was not confirmed by the broker ("
        + ("its wait for the acknowledgement ended after 10 s; it stays queued in the MQTT client and may yet go out"
           if queued else "the MQTT client did not take it: never sent")
        + f": {error}); client-a, online at the end, stops at its --idle-timeout-s if it never gets it; the final "
          "files are written all the same"], warned
    ledger.flush()
    rows = [(r.event, r.delivery) for r in ledger.rows() if r.kind == "finish"]
    assert rows == ([("sent", "handed")] if queued else [("message", "dropped")])
    ledger.close()
