"""How a round's ``global`` reaches the devices (``[server] global_delivery``).

* The rule by hand: per device iff 2·Σ G_c < (N + 1)·G (:func:`choose_delivery`).
* Eight real agents in memory, two selected a round: delivered per device (forced, or chosen by
  ``auto``), the unselected devices' ledger has no ``global`` row, ``global_receipts`` is 2 (a
  broadcast: all 8 devices confirm it, those in before the round closes are counted), and
  the devices' download bytes are those of the broadcast run's ledger with its eight global rows
  replaced by two copies, each the broadcast row plus the longer topic (``/{client}``).
* Every device selected: ``auto`` broadcasts, and the round's ``global`` and ``round_start`` are
  the broadcast setting's, byte for byte (the envelope's wall-clock timestamp aside).
* Message by message: each copy sized for its own device (its announced chunk size), a
  strategy's own copy for a device (``device_global``), every copy sent again in smaller packets
  when none is confirmed, and a device that comes back gets its own copy again.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import pytest
from helpers.memory_federation import Device, run_federation
from helpers.memory_server import incoming, memory_server, sent_on, status_payload, update_payload

from broker_server.errors import RunError
from broker_server.server import GLOBAL_RESENDS, choose_delivery
from broker_server.strategies import RoundPlan
from broker_server.strategies.fedavg import FedAvg
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol import topics
from protocol.ledger import Ledger
from protocol.memory_transport import MemoryBroker
from protocol.messages import Chunk, Envelope, Global, Kind, Receipt, Resend, RoundStart, decode, encode

FED = "mem"
CIDS = [f"dev-{k}" for k in "abcdefgh"]


def test_the_rule_by_hand() -> None:
    g = 1000
    # N = 8 online: a broadcast moves 9·G; k copies 2k·G
    assert choose_delivery("auto", 8, g, [g] * 2) == "per_device"  # 4000 < 9000
    assert choose_delivery("auto", 8, g, [g] * 4) == "per_device"  # 8000 < 9000
    assert choose_delivery("auto", 8, g, [g] * 5) == "broadcast"  # 10000 > 9000
    assert choose_delivery("auto", 8, g, [g] * 8) == "broadcast"  # every device selected
    assert choose_delivery("auto", 1, g, [g]) == "broadcast"  # 2000 = 2000: a tie broadcasts
    # FedCross-like copies (one model each, the broadcast M + 1 = 5 models): 2·8·1 < 9·5
    assert choose_delivery("auto", 8, 5 * g, [g] * 8) == "per_device"
    assert choose_delivery("broadcast", 8, g, [g]) == "broadcast"
    assert choose_delivery("per_device", 2, g, [g] * 2) == "per_device"  # 4000 > 3000, but asked for
    with pytest.raises(ValueError, match="multicast"):
        choose_delivery("multicast", 8, g, [g])


def _run(tmp: Path, digits, delivery: str, *, rate: float, cids: list[str], rounds: int):
    """A FedAvg federation of ``cids`` (20 digits each) at participation ``rate``; returns
    (server, agent-side download rows, server-side sent rows, the hub)."""
    devices = {cid: Device(FedAvgClient(), digits.train.x[20 * i:20 * i + 20], digits.train.y[20 * i:20 * i + 20])
               for i, cid in enumerate(cids)}
    ledger = Ledger(tmp / f"{delivery}.sqlite")
    hub = MemoryBroker()
    server = run_federation(tmp / delivery, hub, FedAvg(participation_rate=rate, train_config={"lr": 0.05}),
                            devices, digits.test, rounds=rounds, quorum=1, global_delivery=delivery,
                            server_ledger=ledger, agent_ledger=ledger)
    ledger.flush()
    down = ledger.rows("side = 'agent' AND event = 'received' AND direction = 'down' AND reason != 'control'")
    sent = ledger.rows("side = 'server' AND event = 'sent'")
    ledger.close()
    return server, down, sent, hub


def test_per_device_delivery_reaches_only_the_selected(tmp_path: Path, digits) -> None:
    runs = {d: _run(tmp_path, digits, d, rate=0.25, cids=CIDS, rounds=2) for d in ("broadcast", "per_device", "auto")}
    b_srv, b_down, _, _ = runs["broadcast"]
    assert [m["global_delivery"] for m in b_srv.metrics] == ["broadcast"] * 2
    b_hub = runs["broadcast"][3]
    for r, m in enumerate(b_srv.metrics, start=1):
        # every online device took the broadcast and confirmed it, 2 of them to train; the metric
        # counts the receipts in before the round closed: the 2 trained devices' (each sent before
        # its update, on the same link) and any of the 6 others' that beat the last update
        confirmed = {env.sender for env in (decode(x.payload).envelope for x in b_hub.published)
                     if env.round == r and env.kind is Kind.RECEIPT and env.body.ref_kind == Kind.GLOBAL}
        assert confirmed == set(CIDS)
        assert 2 <= m["global_receipts"] <= 8
    for delivery in ("per_device", "auto"):
        srv, down, sent, hub = runs[delivery]
        assert [m["global_delivery"] for m in srv.metrics] == ["per_device"] * 2
        assert [m["global_receipts"] for m in srv.metrics] == [2, 2]
        for r in (1, 2):
            selected = {env.sender for env in (decode(m.payload).envelope for m in hub.published)
                        if env.round == r and env.kind is Kind.UPDATE}
            assert len(selected) == 2
            b_glob = [x for x in b_down if x.kind == "global" and x.round == r]
            assert sorted(x.client for x in b_glob) == CIDS
            (b_wire,) = {x.wire_bytes for x in b_glob}  # one broadcast, the same PUBLISH at every device
            (b_payload,) = {x.payload_bytes for x in b_glob}
            glob = [x for x in down if x.kind == "global" and x.round == r]
            assert sorted(x.client for x in glob) == sorted(selected)  # none at an unselected device
            for x in glob:  # the same payload, on a topic longer by "/{client}"
                assert x.topic == topics.down_to(FED, x.client, Kind.GLOBAL)
                assert (x.payload_bytes, x.wire_bytes) == (b_payload, b_wire + 1 + len(x.client))
            assert sorted(x.client for x in sent if x.kind == "global" and x.round == r) == sorted(selected)
            # every other download is the broadcast run's: the devices' bytes differ by the globals alone
            b_total = sum(x.wire_bytes for x in b_down if x.round == r)
            total = sum(x.wire_bytes for x in down if x.round == r)
            assert total == b_total - 8 * b_wire + sum(b_wire + 1 + len(c) for c in selected)
        unselected_ever = set(CIDS) - {x.client for x in down if x.kind == "global"}
        assert unselected_ever  # 4 picks of 8: some device never got a model
        assert not [x for x in down if x.kind == "global" and x.client in unselected_ever]


def _canonical(payload: bytes) -> bytes:
    """``payload`` re-encoded with its envelope's timestamp set to 0 (checked to re-encode exactly)."""
    env = decode(payload).envelope
    assert encode(env).payload == payload
    return encode(dataclasses.replace(env, timestamp_ms=0)).payload


def test_with_every_device_selected_auto_is_the_broadcast_byte_for_byte(tmp_path: Path, digits) -> None:
    cids = CIDS[:4]
    wire = {}
    for delivery in ("broadcast", "auto"):
        srv, _, _, hub = _run(tmp_path, digits, delivery, rate=1.0, cids=cids, rounds=1)
        assert [m["global_delivery"] for m in srv.metrics] == ["broadcast"]
        assert [m["global_receipts"] for m in srv.metrics] == [4]
        wire[delivery] = [(m.topic, _canonical(m.payload)) for m in hub.published
                          if m.sender == "server" and m.topic.split("/")[-1] in ("global", "round_start")]
    assert [t for t, _ in wire["auto"]] == [topics.down(FED, Kind.GLOBAL), topics.down(FED, Kind.ROUND_START)]
    assert wire["auto"] == wire["broadcast"]


class TwoOfThree(FedAvg):
    """FedAvg asking ``client-a`` and ``client-b``; ``client-b``'s own global is all zeros."""

    def configure_round(self, round, available, rng):
        return RoundPlan(selected=("client-a", "client-b"))

    def device_global(self, round, client_id, tensors, extras):
        if client_id != "client-b":
            return None
        return [np.zeros_like(t) for t in tensors], {}


def _reassembled(sent: list[tuple[str, bytes]], topic: str) -> list[bytes]:
    """Every whole payload sent on ``topic``: single PUBLISHes, and chunked transfers put together."""
    out, parts = [], {}
    for t, p in sent:
        if t != topic:
            continue
        env = decode(p).envelope
        if isinstance(env.body, Chunk):
            parts.setdefault(env.body.transfer_id, []).append(env.body)
            c = parts[env.body.transfer_id]
            if len(c) == c[0].count:
                out.append(b"".join(bytes(x.data) for x in sorted(c, key=lambda x: x.index)))
        else:
            out.append(p)
    return out


def test_copies_are_sized_per_device_sent_again_unconfirmed_and_to_a_returning_device(tmp_path: Path) -> None:
    """Round 1 asks A and B of three devices; B announced 4,096-byte chunks, B's own global is
    zeros (``device_global``). By hand: A's copy (the round's global, ~55 kB) goes as one
    PUBLISH, B's as chunks of at most 4,096 data bytes; C gets no global; the round_start is the
    usual broadcast. Nobody confirms within ``global_confirm_s`` = 0: each copy is sent again
    :data:`GLOBAL_RESENDS` times in packets of at most half its size. A then drops and comes back:
    it alone is sent its copy once more. Both updates count."""
    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    like = list(state_arrays(model))
    initial = [np.array(t) for t in like]
    rng = np.random.default_rng(0)
    a_topic, b_topic = topics.down_to(FED, "client-a", Kind.GLOBAL), topics.down_to(FED, "client-b", Kind.GLOBAL)
    state = {"back": False, "done": False}

    def feed():
        sent = srv.channel.transport.sent
        if len(_reassembled(sent, a_topic)) < 1 + GLOBAL_RESENDS:
            return None  # the copies are still being sent again
        if not state["back"]:
            state["back"] = True
            return [incoming(*status_payload(FED, "client-a", "offline", "connection lost")),
                    incoming(*status_payload(FED, "client-a", "online", "reconnected", seq=2))]
        if state["done"] or len(_reassembled(sent, a_topic)) < 2 + GLOBAL_RESENDS:
            return None
        state["done"] = True
        a_copy = _reassembled(sent, a_topic)[-1]
        receipt = Receipt(ref_kind=int(Kind.GLOBAL), ref_seq=decode(a_copy).envelope.seq, accepted=True,
                          sha256=hashlib.sha256(a_copy).digest())
        return [incoming(topics.up(FED, "client-a", Kind.RECEIPT),
                         encode(Envelope(round=1, sender="client-a", seq=3, body=receipt)).payload),
                incoming(*update_payload(FED, "client-a", 1, 4, like, rng)),
                incoming(*update_payload(FED, "client-b", 1, 2, like, rng))]

    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b", "client-c"], rounds=1, feed=feed,
                        fed=FED, strategy=TwoOfThree(min_clients=1))
    srv.settings = dataclasses.replace(srv.settings, global_delivery="per_device", global_confirm_s=0.0)
    srv.devices.records["client-b"].info["chunk_bytes"] = 4096
    m = srv.run_round(1)
    tr = srv.channel.transport
    assert (m["global_delivery"], m["clients_reported"], m["global_receipts"]) == ("per_device", 2, 1)
    assert (m["global_resends"], m["resent_to"]) == (GLOBAL_RESENDS, ["client-a"])
    assert sent_on(tr, "/down/global") == [] and sent_on(tr, "/client-c/global") == []
    (start,) = sent_on(tr, "/down/round_start")
    assert isinstance(start.body, RoundStart)
    a_pubs = [p for t, p in tr.sent if t == a_topic]
    a_copies = _reassembled(tr.sent, a_topic)
    assert len(a_copies) == 2 + GLOBAL_RESENDS  # first, the re-sends, the returning device's
    whole = len(a_copies[0])
    assert isinstance(decode(a_pubs[0]).envelope.body, Global) and len(a_pubs[0]) == whole  # one PUBLISH
    resent = [p for p in a_pubs[1:] if isinstance(decode(p).envelope.body, Chunk)]
    assert resent and all(len(decode(p).envelope.body.data) <= whole // 2 for p in resent)
    b_pubs = [decode(p).envelope.body for t, p in tr.sent if t == b_topic]
    assert b_pubs and all(isinstance(c, Chunk) and len(c.data) <= 4096 for c in b_pubs)
    b_copies = _reassembled(tr.sent, b_topic)
    assert len(b_copies) == 1 + GLOBAL_RESENDS
    for payload in b_copies:
        body = decode(payload).envelope.body
        assert isinstance(body, Global) and all(not np.asarray(t).any() for t in body.tensors)
    for payload in a_copies:  # the round's global: the initial model
        body = decode(payload).envelope.body
        assert isinstance(body, Global)
        assert all(np.array_equal(t, g) for t, g in zip(body.tensors, initial, strict=True))


def test_a_device_global_of_another_shape_stops_the_run(tmp_path: Path) -> None:
    class Wrong(TwoOfThree):
        def device_global(self, round, client_id, tensors, extras):
            return [t[..., :1] for t in tensors], {}

    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b"], rounds=1, fed=FED,
                        strategy=Wrong(min_clients=1))
    srv.settings = dataclasses.replace(srv.settings, global_delivery="per_device")
    with pytest.raises(RunError, match=r"device_global for 'client-a': tensors\[0\]"):
        srv.run_round(1)


def test_a_device_global_with_nan_stops_the_run(tmp_path: Path) -> None:
    """A copy with NaN would be refused by the device's channel (``contains NaN or Inf``) and the
    device would sit out every round to its deadline: the server stops at once instead, as it
    does for a copy of the wrong shape. ``client-a`` gets the round's global (``None``), so the
    error names ``client-b`` and its first tensor."""
    class NaNCopy(TwoOfThree):
        def device_global(self, round, client_id, tensors, extras):
            if client_id != "client-b":
                return None
            return [np.full_like(t, np.nan) for t in tensors], {}

    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b"], rounds=1, fed=FED,
                        strategy=NaNCopy(min_clients=1))
    srv.settings = dataclasses.replace(srv.settings, global_delivery="per_device")
    with pytest.raises(RunError, match=r"device_global for 'client-b': tensors\[0\], .* contain NaN or Inf"):
        srv.run_round(1)


def test_a_chunked_broadcast_leaves_room_for_the_longest_joined_devices_own_topic(tmp_path: Path) -> None:
    """Three devices joined with the rpi4 profile's limits (max_packet_bytes = chunk_bytes =
    131,072), ids of 1, 18 and 20 characters. The round's global (the light CNN, fp32) is broadcast
    in chunks cut with room for the longest id's ``down/{id}/global`` (48 bytes, 21 more than
    ``down/global``). By hand (the chunk budget formula, PROTOCOL.md §5: sender "server", round 1,
    data ≥ 65,536 bytes; MQTT 5 framing under a device's limit, QoS 1): packet(D) = D + 121 +
    len(topic), so D = 131,072 − 121 − 48 = 130,903 data bytes per full chunk (130,924 cut for
    ``down/global`` alone). The 20-character device asks for all 4 chunks: each goes to it alone,
    on its own topic, within the limit; none on the broadcast topic."""
    limit, longest = 131_072, "rpi4-field-unit-0001"
    cids = ["a", "rpi4-field-unit-07", longest]
    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    like = list(state_arrays(model))
    rng = np.random.default_rng(0)
    bcast, own = topics.down(FED, Kind.GLOBAL), topics.down_to(FED, longest, Kind.GLOBAL)
    assert (len(bcast), len(own)) == (27, 48)
    d = limit - 121 - len(own)
    state = {"asked": False, "done": False}

    def feed():
        sent = srv.channel.transport.sent
        chunks = [decode(p).envelope.body for t, p in sent if t == bcast]
        if not chunks or len(chunks) < chunks[0].count or state["done"]:
            return None
        if not state["asked"]:
            state["asked"] = True
            req = Resend(chunks[0].transfer_id, tuple(range(chunks[0].count)))
            return incoming(topics.up(FED, longest, Kind.RESEND),
                            encode(Envelope(round=0, sender=longest, seq=2, body=req)).payload)
        state["done"] = True
        return [incoming(*update_payload(FED, c, 1, 3, like, rng)) for c in cids]

    srv = memory_server(tmp_path, model=model, clients=cids, rounds=1, feed=feed, fed=FED)
    srv.settings = dataclasses.replace(srv.settings, global_delivery="broadcast")
    for c in cids:
        srv.devices.records[c].info.update(max_packet_bytes=limit, chunk_bytes=limit)
    m = srv.run_round(1)
    assert (m["global_delivery"], m["clients_reported"]) == ("broadcast", 3)
    tr = srv.channel.transport
    first = [decode(p).envelope.body for t, p in tr.sent if t == bcast]
    total = first[0].total_bytes
    assert len(first) == first[0].count == -(-total // d) == 4  # no chunk went on down/global again
    assert [len(c.data) for c in first] == [d, d, d, total - 3 * d]
    again = [(decode(p).envelope.body, len(p)) for t, p in tr.sent if t == own]
    assert [(c.index, len(c.data)) for c, _ in again] == [(0, d), (1, d), (2, d), (3, total - 3 * d)]
    for _, payload in again:  # MQTT 5, QoS 1: 1 + remaining length (3 bytes) + 2 + topic + 2 + 1 + payload
        assert 1 + 3 + 2 + len(own) + 2 + 1 + payload <= limit
    assert (srv.channel.resent_chunks, srv.channel.resent_on_broadcast) == (4, 0)
