"""A simulated run whose server's ``finish`` is not acknowledged by the broker in its 10 s (a
slow or stalled link): the run ends as usual, with every final file, and ``summary.json`` says the
finish was not confirmed. A real broker (amqtt) and real agents; only the server's transport is
made to end its wait for the ``finish``'s PUBACK at once, after handing the PUBLISH over, as
:class:`protocol.transport.MqttTransport` raises it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import broker_server.simulate as simulate_mod
from broker_server import config as config_mod
from protocol import topics
from protocol.errors import PublishTimeout
from protocol.ledger import ledger_closed_cleanly, read_rows
from protocol.messages import Kind

pytestmark = pytest.mark.slow


def _config() -> config_mod.Config:
    return config_mod.from_dict({
        "run": {"name": "t", "seed": 1, "rounds": 1},
        "data": {"dataset": "digits", "partition": "iid", "clients": 2},
        "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "server": {"quorum": 2, "round_deadline_s": 60.0, "join_timeout_s": 60.0},
        "broker": {"kind": "amqtt"},
    }, "<test>")


def test_a_finish_whose_wait_ends_still_writes_the_final_files_and_says_so(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's finish (round 1) is handed to paho, then its wait ends (PublishTimeout, its
    handle set). ``simulate`` returns round 1's result; ``model_final.pt``, ``summary.json`` and
    ``metrics.jsonl`` are written and the ledger is closed cleanly; ``summary.json`` holds
    ``finish_unconfirmed``: round 1, queued, both devices (online at the end) and the error. The
    devices got the finish all the same (the broker had it): both agents finished. Before,
    ``simulate`` raised the PublishTimeout and wrote none of the final files."""
    errors: list[str] = []
    real_make_server = simulate_mod.make_server

    def make_server(*args, **kwargs):
        server = real_make_server(*args, **kwargs)
        tr = server.channel.transport
        publish, finish = tr.publish, topics.down(server.fed, Kind.FINISH)

        def stalling(topic, payload, *, qos=1, retain=False, wait_s=None):
            if topic != finish:
                return publish(topic, payload, qos=qos, retain=retain, wait_s=wait_s)
            info = publish(topic, payload, qos=qos, retain=retain)
            errors.append(f"{tr.client_id}: PUBLISH to {topic} not acknowledged within {wait_s:g} s (it stays "
                          "queued: its outcome comes later)")
            raise PublishTimeout(errors[-1], client_id=tr.client_id, topic=topic, handle=info)

        tr.publish = stalling
        return server

    monkeypatch.setattr(simulate_mod, "make_server", make_server)
    run = tmp_path / "run"
    result = simulate_mod.simulate(_config(), run_dir=run)
    assert result.rounds_completed == 1 and [a.finished for a in result.agents] == [True, True]
    assert all((run / name).is_file() for name in ("model_final.pt", "summary.json", "metrics.jsonl"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds_completed"] == 1 and len(errors) == 1
    assert summary["finish_unconfirmed"] == {"round": 1, "queued": True,
                                             "devices": sorted(a.client_id for a in result.agents),
                                             "error": errors[0]}
    assert ledger_closed_cleanly(run / "ledger.sqlite")
    finish_rows = [(r["side"], r["event"]) for r in read_rows(run / "ledger.sqlite") if r["kind"] == "finish"]
    # handed over: its row kept beside the two agents' received ones (in either order: the server writes its row
    # once the publish call returned, and the broker may deliver the finish to the agents before that)
    assert sorted(finish_rows) == [("agent", "received"), ("agent", "received"), ("server", "sent")]
