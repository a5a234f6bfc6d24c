"""Who is selected, by member index (``round_start.members``): a federation in memory where only the
selected devices train; devices joining mid-run, selected in the next round by their new index;
an agent that does not read member sets still named by id; member indices kept across a resume;
the broadcast priced in the ledger with its ``members`` field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from helpers.memory_federation import Device, run_federation, wire
from helpers.memory_server import incoming, memory_server, receipts_to, update_payload

from broker_server.registry import DeviceRegistry
from broker_server.strategies.fedavg import FedAvg
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol import topics
from protocol.ledger import Ledger
from protocol.membership import JOIN_INFO_KEY, decode_members
from protocol.messages import Envelope, Join, Kind, Receipt, RoundStart, Update, decode, encode


def test_only_the_devices_named_by_index_train(tmp_path: Path, digits, memory_hub) -> None:
    """Six real agents, FedAvg at participation 0.5 (three a round), three rounds: each broadcast
    names nobody by id and three devices by index; exactly those three send an update."""
    cids = [f"dev-{k}" for k in "abcdef"]
    devices = {cid: Device(FedAvgClient(), digits.train.x[20 * i:20 * i + 20], digits.train.y[20 * i:20 * i + 20])
               for i, cid in enumerate(cids)}
    server = run_federation(tmp_path, memory_hub, FedAvg(participation_rate=0.5, train_config={"lr": 0.05}),
                            devices, digits.test, rounds=3, quorum=3)
    msgs = wire(memory_hub)
    index = {t.split("/")[-2]: env.body.member_index for s, t, env in msgs
             if s == "server" and isinstance(env.body, Receipt) and env.body.ref_kind == Kind.JOIN}
    assert sorted(index.values()) == list(range(6))  # one index per device, in the order they joined
    by_index = {i: c for c, i in index.items()}
    for r in (1, 2, 3):
        starts = [env.body for s, t, env in msgs if s == "server" and env.round == r
                  and isinstance(env.body, RoundStart)]
        assert len(starts) == 1 and starts[0].selected == ()
        named = {by_index[i] for i in decode_members(starts[0].members)}
        trained = {s for s, t, env in msgs if env.round == r and isinstance(env.body, Update)}
        assert len(named) == 3 and trained == named
    assert server.totals["unsolicited"] == 0
    assert [m["clients_reported"] for m in server.metrics] == [3, 3, 3]


def _join(fed: str, cid: str, srv_hash: str, *, reads: bool, seq: int = 1) -> tuple[str, bytes]:
    info = {JOIN_INFO_KEY: True} if reads else {}
    body = Join(profile="x86-cpu", manifest_hash=srv_hash, num_samples=100, class_histogram=(100,) + (0,) * 9,
                info=info)
    return topics.up(fed, cid, Kind.JOIN), encode(Envelope(round=0, sender=cid, seq=seq, body=body)).payload


def test_devices_joining_mid_run_are_selected_by_their_new_index(tmp_path: Path) -> None:
    """``old-a`` (no member sets: named by id) starts alone; ``new-b`` and ``new-c`` join during
    round 1, ``new-d`` during round 2 (FedAvg selects every online device). By hand: indices
    0, 1, 2, 3 in join order; round 1 names old-a only; round 2 old-a by id and indices {1, 2}
    (bitmap ``00 06``); round 3 old-a and {1, 2, 3} (``00 0e``). Each device trains exactly the
    rounds whose round_start came after its join receipt and names it."""
    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    like = list(state_arrays(model))
    rng = np.random.default_rng(0)
    fed = "mem"
    ledger = Ledger(tmp_path / "ledger.sqlite")
    state = {"cursor": 0, "seq": {"old-a": 1}, "index": {}, "ready": {"old-a"}}
    trained: dict[int, set[str]] = {}
    holder: dict = {}

    def feed():
        tr = holder["srv"].channel.transport
        out = []
        while state["cursor"] < len(tr.sent):
            topic, payload = tr.sent[state["cursor"]]
            state["cursor"] += 1
            env = decode(payload).envelope
            body = env.body
            if isinstance(body, Receipt) and body.ref_kind == Kind.JOIN and body.accepted:
                cid = topic.split("/")[-2]
                state["ready"].add(cid)
                if body.member_index is not None:
                    state["index"][cid] = body.member_index
            elif isinstance(body, RoundStart) and topic == topics.down(fed, Kind.ROUND_START):
                members = set(decode_members(body.members)) if body.members else set()
                if env.round == 1:  # two devices join while round 1 is open
                    for cid in ("new-b", "new-c"):
                        state["seq"][cid] = 1
                        out.append(incoming(*_join(fed, cid, holder["srv"].manifest_hash, reads=True)))
                if env.round == 2:
                    state["seq"]["new-d"] = 1
                    out.append(incoming(*_join(fed, "new-d", holder["srv"].manifest_hash, reads=True)))
                for cid in sorted(state["ready"]):
                    if cid in body.selected or state["index"].get(cid, -1) in members:
                        trained.setdefault(env.round, set()).add(cid)
                        state["seq"][cid] += 1
                        out.append(incoming(*update_payload(fed, cid, env.round, state["seq"][cid], like, rng)))
        return out or None

    srv = holder["srv"] = memory_server(tmp_path, model=model, clients=["old-a"], rounds=3, feed=feed, fed=fed,
                                        ledger=ledger)
    srv.run()
    assert trained == {1: {"old-a"}, 2: {"old-a", "new-b", "new-c"}, 3: {"old-a", "new-b", "new-c", "new-d"}}
    assert [m["clients_reported"] for m in srv.metrics] == [1, 3, 4]
    assert state["index"] == {"new-b": 1, "new-c": 2, "new-d": 3}
    assert receipts_to(srv.channel.transport, "old-a")[0][1].member_index is None  # it never asked for one
    starts = {decode(p).envelope.round: decode(p).envelope.body for t, p in srv.channel.transport.sent
              if t == topics.down(fed, Kind.ROUND_START)}
    assert [starts[r].selected for r in (1, 2, 3)] == [("old-a",)] * 3
    assert [starts[r].members.hex() for r in (1, 2, 3)] == ["", "0006", "000e"]
    # the ledger prices each broadcast once, with the members field (bin8 header + 2 bytes)
    rows = ledger.rows("side = 'server' AND kind = 'round_start' AND event = 'sent'")
    assert [(r.round, r.client) for r in rows] == [(1, "*"), (2, "*"), (3, "*")]
    assert [json.loads(r.fields).get("members") for r in rows] == [None, 4, 4]
    sizes = {decode(p).envelope.round: len(p) for t, p in srv.channel.transport.sent
             if t == topics.down(fed, Kind.ROUND_START)}
    assert [r.payload_bytes for r in rows] == [sizes[1], sizes[2], sizes[3]]
    ledger.close()

    # a resumed server keeps every index: a device joining again gets its own back, a new one the next
    rows_saved = srv.devices.rows()
    srv2 = memory_server(tmp_path / "resumed", model=model, clients=[], rounds=1, fed=fed)
    srv2.devices.restore(rows_saved)
    broker = srv2.channel.transport.broker
    for cid, seq in (("new-c", 5), ("new-e", 1)):
        t, p = _join(fed, cid, srv2.manifest_hash, reads=True, seq=seq)
        broker.connect(cid).publish(t, p)
        srv2._handle(srv2.channel.receive(1.0))
    assert [receipts_to(srv2.channel.transport, c)[-1][1].member_index for c in ("new-c", "new-e")] == [2, 4]


def test_registry_indices_survive_restore_and_fill_in_old_checkpoints() -> None:
    reg = DeviceRegistry()
    join = Join(profile="x86-cpu", manifest_hash="0" * 16, num_samples=1)
    for cid in ("a", "b", "c"):
        reg.admit(cid, join, round=0, now=0.0)
    reg.admit("b", join, round=4, now=1.0)  # joining again keeps the index
    assert [reg.index_of(c) for c in ("a", "b", "c", "zz")] == [0, 1, 2, -1]
    rows = reg.rows()
    again = DeviceRegistry()
    again.restore(rows)
    again.admit("d", join, round=5, now=2.0)
    assert [again.index_of(c) for c in ("a", "b", "c", "d")] == [0, 1, 2, 3]
    # a checkpoint written before member indices: its devices take indices in its order
    old = DeviceRegistry()
    old.restore([{k: v for k, v in row.items() if k != "index"} for row in reversed(rows)])
    assert [old.index_of(c) for c in ("c", "b", "a")] == [0, 1, 2]
