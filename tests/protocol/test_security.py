"""Unit tests of protocol.security: the primitives against independent computations (cryptography
called directly with the constructions of PROTOCOL.md §5c), the test vectors, every rejection
reason, replay windows across restarts, key files, the ledger migration, and signed + encrypted
chunked transfers through a channel (no broker)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import stat
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import serialization as ser
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from broker_server.cli import main as fedfleet_main
from broker_server.errors import ConfigError
from protocol import security as S
from protocol import topics
from protocol.channel import Channel, Received, Rejected
from protocol.errors import SecurityConfigError, SecurityRejection
from protocol.ledger import SCHEMA_VERSION, Ledger, LedgerRow
from protocol.memory_transport import MemoryBroker
from protocol.messages import Envelope, Kind, Receipt, RoundStart, Status, Update, decode, encode
from protocol.security import replay as replay_mod
from protocol.test_vectors import MESSAGE_VECTORS, SECURITY_VECTOR_UPLOAD_KEY, SECURITY_VECTORS, security_vector_keys
from protocol.transport import Incoming, tls_context

ROOT = Path(__file__).resolve().parents[2]
RAW = (ser.Encoding.Raw, ser.PublicFormat.Raw)
FED = "fed-sec"


def _keys():
    k = security_vector_keys()
    return (Ed25519PrivateKey.from_private_bytes(k["device_ed25519"]),
            X25519PrivateKey.from_private_bytes(k["device_x25519"]),
            Ed25519PrivateKey.from_private_bytes(k["server_ed25519"]),
            X25519PrivateKey.from_private_bytes(k["server_x25519"]))


def _independent_tbs(topic: str, sealed: bytes, body: bytes) -> bytes:
    """TBS of PROTOCOL.md §5c computed from the bytes alone: P0 = everything before the body,
    P1 = everything between the body and the signature's c4 40 header."""
    p0 = sealed[:sealed.index(body)]
    p1 = sealed[len(p0) + len(body):-66]
    t = topic.encode()
    return b"fedfleet/v1 signature\x00" + len(t).to_bytes(2, "big") + t + p0 + hashlib.sha256(body).digest() + p1


# ------------------------------------------------------------------------------------------ vectors


@pytest.mark.parametrize("name", sorted(SECURITY_VECTORS))
def test_security_vectors_are_reproduced_byte_for_byte_and_in_the_spec(name):
    base, topic, epoch, encrypted, hx = SECURITY_VECTORS[name]
    dev_ed, dev_x, srv_ed, srv_x = _keys()
    signer = srv_ed if "/down/" in topic else dev_ed
    cipher = AESGCM(bytes.fromhex(SECURITY_VECTOR_UPLOAD_KEY)) if encrypted else None
    sealed = S.seal(bytes.fromhex(MESSAGE_VECTORS[base][1]), topic, signing_key=signer, epoch=epoch, cipher=cipher)
    assert sealed.payload.hex() == hx
    assert hx in (ROOT / "protocol" / "PROTOCOL.md").read_text(encoding="utf-8")
    assert len(sealed.payload) == len(bytes.fromhex(MESSAGE_VECTORS[base][1])) + sealed.sig_bytes + sealed.enc_bytes


def test_signed_vector_verifies_with_cryptography_directly():
    _, topic, _, _, hx = SECURITY_VECTORS["update-signed"]
    sealed = bytes.fromhex(hx)
    body = msgpack.unpackb(bytes.fromhex(MESSAGE_VECTORS["update"][1]))[6]
    dev_ed = _keys()[0]
    dev_ed.public_key().verify(sealed[-64:], _independent_tbs(topic, sealed, body))  # raises if wrong
    assert sealed[-66:-64] == b"\xc4\x40" and sealed[0] == 0x98
    env = msgpack.unpackb(sealed)
    assert env[:6] == msgpack.unpackb(bytes.fromhex(MESSAGE_VECTORS["update"][1]))[:6]
    epoch, flags, body_bytes, check, sig = env[7]
    assert (epoch, flags, body_bytes) == (2, 0, len(body))
    assert check == hashlib.sha256(topic.encode()).digest()[:4] + hashlib.sha256(body).digest()[:4]
    # the unsigned envelope inside is byte-identical to the unsigned vector
    a, b = decode(sealed).envelope, decode(bytes.fromhex(MESSAGE_VECTORS["update"][1])).envelope
    assert (a.round, a.sender, a.seq, a.body.num_samples) == (b.round, b.sender, b.seq, b.body.num_samples)
    np.testing.assert_array_equal(a.body.tensors[0], b.body.tensors[0])


def test_encrypted_vector_decrypts_with_a_separately_derived_key():
    _, topic, epoch, _, hx = SECURITY_VECTORS["update-encrypted"]
    sealed = bytes.fromhex(hx)
    dev_ed, dev_x, _, srv_x = _keys()
    dx, sx = dev_x.public_key().public_bytes(*RAW), srv_x.public_key().public_bytes(*RAW)
    # the server's side of X25519 (RFC 7748), then HKDF-SHA256 (RFC 5869) as PROTOCOL.md says
    shared = srv_x.exchange(X25519PublicKey.from_public_bytes(dx))
    info = b"fedfleet/v1 upload key\x00" + b"client-007" + b"\x00" + epoch.to_bytes(8, "big") + dx + sx
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"fedfleet/v1 hkdf salt", info=info).derive(shared)
    assert key.hex() == SECURITY_VECTOR_UPLOAD_KEY
    env = msgpack.unpackb(sealed)
    ct, seq = env[6], env[4]
    p0 = sealed[:sealed.index(ct)]
    aad = b"fedfleet/v1 aead\x00" + len(topic).to_bytes(2, "big") + topic.encode() + p0
    plain = AESGCM(key).decrypt(b"\x00" * 4 + seq.to_bytes(8, "big"), ct, aad)
    assert plain == msgpack.unpackb(bytes.fromhex(MESSAGE_VECTORS["update"][1]))[6]
    assert env[7][1] == S.FLAG_ENCRYPTED and len(ct) == len(plain) + 16
    dev_ed.public_key().verify(sealed[-64:], _independent_tbs(topic, sealed, ct))


def test_every_reason_code_has_help_text_and_is_unique():
    assert len(S.REASONS) == len(set(S.REASONS)) >= 14
    for code, text in S.REASONS.items():
        assert code.isidentifier() and len(text) > 20
        assert f"`{code}`" in (ROOT / "protocol" / "PROTOCOL.md").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------ open()


def _pair(encrypt=True, require_encrypted=None, window=S.DEFAULT_REPLAY_WINDOW):
    dev = S.generate_identity("client-007")
    srv = S.generate_identity("server")
    allow = S.AllowList(None, {"client-007": dev.public})
    server = S.ChannelSecurity(srv, side="server", peers=allow, epoch=1, replay_window=window,
                               require_encrypted=encrypt if require_encrypted is None else require_encrypted)
    agent = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public}, encrypt=encrypt, epoch=5,
                              replay_window=window)
    return dev, srv, agent, server


UP = topics.up(FED, "client-007", Kind.UPDATE)


def _upd(seq=3, rnd=1, sender="client-007"):
    body = Update((np.arange(12, dtype=np.float32).reshape(3, 4),), 10, 0.5)
    return encode(Envelope(round=rnd, sender=sender, seq=seq, body=body)).payload


def _open(server, topic, payload):
    info = topics.parse(topic)
    return server.open(topic, info.client_id, info.direction, payload)


def _code(server, topic, payload):
    with pytest.raises(SecurityRejection) as err:
        _open(server, topic, payload)
    assert str(err.value).startswith(err.value.code + ":")
    return err.value.code


def test_seal_then_open_gives_back_the_exact_unsigned_payload():
    _, _, agent, server = _pair()
    v1 = _upd()
    sealed = agent.seal(UP, v1)
    opened = _open(server, UP, sealed.payload)
    assert opened.payload == v1 and opened.encrypted and opened.epoch == 5
    assert (opened.sig_bytes, opened.enc_bytes) == (sealed.sig_bytes, sealed.enc_bytes)
    assert len(sealed.payload) == len(v1) + sealed.sig_bytes + sealed.enc_bytes
    assert sealed.sig_bytes + sealed.enc_bytes <= S.MAX_SEAL_BYTES
    np.testing.assert_array_equal(decode(opened.payload).envelope.body.tensors[0], np.arange(12).reshape(3, 4))


@pytest.mark.parametrize("case", ["unsigned", "sender_mismatch", "unenrolled", "bad_sec", "tampered_topic",
                                  "truncated_ciphertext", "truncated_body", "tampered_body", "bad_signature",
                                  "unencrypted", "stale_epoch", "wrong_round", "replayed", "decrypt_failed"])
def test_each_rejection_has_its_own_reason(case):
    dev, srv, agent, server = _pair()
    sealed = agent.seal(UP, _upd()).payload
    other = S.generate_identity("client-009")
    topic, payload = UP, sealed
    if case == "unsigned":
        payload = _upd()
    elif case == "sender_mismatch":
        topic = topics.up(FED, "client-009", Kind.UPDATE)
    elif case == "unenrolled":
        rogue = S.ChannelSecurity(other, side="agent", peers={"server": srv.public}, epoch=1)
        topic = topics.up(FED, "client-009", Kind.UPDATE)
        payload = rogue.seal(topic, _upd(sender="client-009")).payload
    elif case == "bad_sec":
        payload = sealed[:-66] + b"\xc5\x00\x40" + sealed[-64:]  # signature not in bin8 form
        payload = payload[:-67] + sealed[-66:]  # keep the length; spoil the flags instead
        env = msgpack.unpackb(sealed)
        env[7][1] = 0x80
        payload = msgpack.packb(env, use_bin_type=True)
    elif case == "tampered_topic":
        topic = topics.up(FED, "client-007", Kind.JOIN)
    elif case in ("truncated_ciphertext", "truncated_body"):
        if case == "truncated_body":
            plain = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public}, epoch=6)
            sealed = plain.seal(UP, _upd()).payload
            server.require_encrypted = False
        env = msgpack.unpackb(sealed)
        env[6] = env[6][:-10]
        payload = msgpack.packb(env, use_bin_type=True)
    elif case == "tampered_body":
        i = sealed.index(msgpack.unpackb(sealed)[6]) + 5
        payload = sealed[:i] + bytes([sealed[i] ^ 1]) + sealed[i + 1:]
        # keep the check prefix right so only the signature can tell: tampered check → tampered_body anyway
    elif case == "bad_signature":
        payload = sealed[:-1] + bytes([sealed[-1] ^ 0x55])
    elif case == "unencrypted":
        plain = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public}, epoch=6)
        payload = plain.seal(UP, _upd()).payload
    elif case == "stale_epoch":
        newer = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public}, encrypt=True, epoch=9)
        _open(server, UP, newer.seal(UP, _upd(seq=1)).payload)
    elif case == "wrong_round":
        server.note_sent(Kind.ROUND_START, 3)
        payload = agent.seal(UP, _upd(seq=4, rnd=1)).payload
    elif case == "replayed":
        _open(server, UP, sealed)
    elif case == "decrypt_failed":
        # signed correctly, encrypted under another key: only the AES-GCM tag can tell
        payload = S.seal(_upd(), UP, signing_key=dev.signing_key, epoch=5, cipher=AESGCM(os.urandom(32))).payload
    assert _code(server, topic, payload) == case
    assert server.rejections[case] == 1


def test_forged_signature_of_a_fresh_message_is_bad_signature_not_replay():
    dev, srv, agent, server = _pair()
    rogue_key = Ed25519PrivateKey.generate()
    forged = S.seal(_upd(seq=50), UP, signing_key=rogue_key, epoch=5, cipher=agent.cipher)
    assert _code(server, UP, forged.payload) == "bad_signature"
    assert _open(server, UP, agent.seal(UP, _upd(seq=50)).payload).payload == _upd(seq=50)


def test_restarted_agent_is_accepted_and_its_old_session_refused(tmp_path):
    dev = S.generate_identity("client-007")
    srv = S.generate_identity("server")
    S.write_key_dir(dev, tmp_path / "dev")
    dev = S.load_identity(tmp_path / "dev")
    server = S.ChannelSecurity(srv, side="server", peers=S.AllowList(None, {dev.id: dev.public}), epoch=1)
    boot1 = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public})
    old = [boot1.seal(UP, _upd(seq=s)).payload for s in (1, 2, 3)]
    _open(server, UP, old[0])
    boot2 = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public})  # a restart: seq from 1 again
    assert boot2.epoch == boot1.epoch + 1 == 2
    assert _open(server, UP, boot2.seal(UP, _upd(seq=1)).payload).epoch == 2
    assert _code(server, UP, old[1]) == "stale_epoch"  # replayed from before the restart
    assert _code(server, UP, boot2.seal(UP, _upd(seq=1)).payload) == "replayed"
    assert (tmp_path / "dev" / "epoch").read_text().strip() == "2"


def test_replay_window_accepts_reordering_and_refuses_the_too_old():
    w = S.ReplayWindow(64)
    for s in (5, 3, 4, 10, 1):
        assert not w.seen(s)
        w.add(s)
    assert all(w.seen(s) for s in (1, 3, 4, 5, 10))
    assert not w.seen(2) and not w.seen(11)
    w.add(200)
    assert w.seen(136) and not w.seen(137) and w.seen(10)


def _will(agent, sender="client-007"):
    st = topics.status(FED, sender)
    return agent.seal(st, encode(Envelope(round=0, sender=sender, seq=0, body=Status("offline"))).payload).payload


def _online(agent, seq, sender="client-007"):
    st = topics.status(FED, sender)
    return agent.seal(st, encode(Envelope(round=0, sender=sender, seq=seq, body=Status("online"))).payload).payload


def test_last_will_at_seq_0_is_taken_once_per_lost_connection_of_the_newest_session():
    dev, srv, agent, server = _pair(encrypt=False)
    st = topics.status(FED, "client-007")
    will = _will(agent)
    _open(server, st, will)  # the connection dropped: the broker delivers the will
    assert _code(server, st, will) == "replayed"  # replayed while the device has said nothing since
    online = _online(agent, 7)
    _open(server, st, online)  # it reconnected and said so ...
    _open(server, st, will)  # ... and dropped again: the same will, legitimately
    assert _code(server, st, online) == "replayed"
    assert _code(server, st, will) == "replayed"
    # a will of a newer session (restarted, dropped before saying anything) is taken, once; the
    # older session's will is now stale
    newer = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public}, epoch=6)
    _open(server, st, _will(newer))
    assert _code(server, st, _will(newer)) == "replayed"
    assert _code(server, st, will) == "stale_epoch"
    assert server.rejections == {"replayed": 4, "stale_epoch": 1}


# ------------------------------------------------------------------------------------------ replay state on disk


def _fleet(tmp_path):
    """A server and a device, each with a key folder (so each keeps its replay state there)."""
    S.write_key_dir(S.generate_identity("server"), tmp_path / "server")
    S.write_key_dir(S.generate_identity("client-007"), tmp_path / "dev")
    srv, dev = S.load_identity(tmp_path / "server"), S.load_identity(tmp_path / "dev")
    S.enroll(tmp_path / "server", dev.public)
    return srv, dev


def _server(tmp_path, srv, **kw):
    return S.ChannelSecurity(srv, side="server", peers=S.AllowList(tmp_path / "server"), **kw)


def _state(tmp_path, node="server"):
    return json.loads((tmp_path / node / S.REPLAY_STATE_FILE).read_text())


def test_a_restarted_server_refuses_replays_and_accepts_the_continuing_and_the_restarted_device(tmp_path):
    srv, dev = _fleet(tmp_path)
    server1 = _server(tmp_path, srv)
    boot1 = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public})
    st = topics.status(FED, "client-007")
    sent = {s: boot1.seal(UP, _upd(seq=s)).payload for s in (1, 2, 3, 5)}
    for s in (1, 2, 3, 5):
        _open(server1, UP, sent[s])
    will = _will(boot1)
    _open(server1, st, will)
    # what the journal says, line by line (PROTOCOL of ReplayStore): the header, the sender's
    # index line, one line per accepted message, "w" for the will
    lines = (tmp_path / "server" / S.REPLAY_JOURNAL_FILE).read_text().splitlines()
    assert lines[0].split()[:4] == ["fedfleet", "replay", "journal", "v1"]
    assert lines[1:] == [f"+ 0 client-007 {dev.public.ed25519.hex()}", "0 1 1", "0 1 2", "0 1 3", "0 1 5", "0 1 w"]

    server2 = _server(tmp_path, srv)  # the server restarts (same host: nothing may be lost)
    assert not server2.replay_store.margin_applied
    doc = _state(tmp_path)
    # seen {1, 2, 3, 5}: top 5, bit d set for seq 5 - d → d = 0, 2, 3, 4 → 0b11101 = 0x1d
    assert doc["sessions"] == [{"id": "client-007", "ed25519": dev.public.ed25519.hex(), "epoch": 1, "top": 5,
                                "bits": "1d", "will_taken": True}]
    assert (tmp_path / "server" / S.REPLAY_JOURNAL_FILE).read_text().count("\n") == 1  # compacted: header only
    assert [_code(server2, UP, sent[s]) for s in (1, 2, 3, 5)] == ["replayed"] * 4
    assert _code(server2, st, will) == "replayed"
    assert _open(server2, UP, boot1.seal(UP, _upd(seq=4)).payload).epoch == 1  # not seen before: the device goes on
    _open(server2, st, will)  # it said something since, so its will may come again
    boot2 = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public})  # the device restarts
    assert _open(server2, UP, boot2.seal(UP, _upd(seq=1)).payload).epoch == 2
    server3 = _server(tmp_path, srv)  # and the server again
    assert _code(server3, UP, sent[5]) == "stale_epoch"
    assert _code(server3, st, will) == "stale_epoch"
    assert _code(server3, UP, boot2.seal(UP, _upd(seq=1)).payload) == "replayed"
    assert _open(server3, UP, boot2.seal(UP, _upd(seq=2)).payload).epoch == 2


def test_a_restarted_device_refuses_the_servers_old_messages(tmp_path):
    srv, dev = _fleet(tmp_path)
    server = _server(tmp_path, srv)
    down = topics.down(FED, Kind.ROUND_START)
    rs = server.seal(down, encode(Envelope(round=1, sender="server", seq=1,
                                           body=RoundStart(("client-007",), 30.0))).payload).payload
    _open(S.ChannelSecurity(dev, side="agent", peers={"server": srv.public}), down, rs)
    again = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public})  # the device restarts
    assert _code(again, down, rs) == "replayed"
    assert _state(tmp_path, "dev")["sessions"][0]["id"] == "server"


def test_journal_is_synced_at_new_sessions_and_every_n_records_and_compacted(tmp_path, monkeypatch):
    srv, dev = _fleet(tmp_path)
    monkeypatch.setattr(replay_mod, "REPLAY_SYNC_EVERY", 4)
    monkeypatch.setattr(replay_mod, "REPLAY_COMPACT_EVERY", 10)
    server = _server(tmp_path, srv, epoch=1)
    agent = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public}, epoch=3, replay_state=None)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    _open(server, UP, agent.seal(UP, _upd(seq=1)).payload)  # record 1: a new session → synced
    assert len(synced) == 1
    for s in range(2, 6):  # records 2..5: the 4th record since the last sync is synced
        _open(server, UP, agent.seal(UP, _upd(seq=s)).payload)
    assert len(synced) == 2
    gen = _state(tmp_path)["generation"]
    for s in range(6, 11):  # records 6..10: the 10th compacts (snapshot + fresh journal)
        _open(server, UP, agent.seal(UP, _upd(seq=s)).payload)
    assert _state(tmp_path)["generation"] == gen + 1 and _state(tmp_path)["sessions"][0]["top"] == 10
    assert (tmp_path / "server" / S.REPLAY_JOURNAL_FILE).read_text().count("\n") == 1
    _open(server, UP, agent.seal(UP, _upd(seq=11)).payload)
    again = _server(tmp_path, srv, epoch=2)
    assert [_code(again, UP, agent.seal(UP, _upd(seq=s)).payload) for s in (1, 10, 11)] == ["replayed"] * 3


@pytest.mark.parametrize(("boot", "closed"), [("another-boot", False), ("another-boot", True), ("-", False)])
def test_after_a_host_restart_an_unclosed_journal_refuses_a_margin_above_the_saved_seq(tmp_path, monkeypatch,
                                                                                      boot, closed, caplog):
    """Another boot id, or none to compare ("-": not Linux), and no clean close: the journal's
    unsynced tail may be lost, so seq ≤ saved top + REPLAY_SYNC_EVERY is refused."""
    srv, dev = _fleet(tmp_path)
    server = _server(tmp_path, srv, epoch=1)
    agent = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public}, epoch=3, replay_state=None)
    for s in (1, 2, 3):
        _open(server, UP, agent.seal(UP, _upd(seq=s)).payload)
    if closed:
        server.close()
    if boot == "-":
        monkeypatch.setattr(replay_mod, "_boot_id_cache", ["-"])
        server.replay_store._compact()  # files written where the boot cannot be told
        _open(server, UP, agent.seal(UP, _upd(seq=0)).payload)  # (a journal record after it)
    else:
        monkeypatch.setattr(replay_mod, "_boot_id_cache", [boot])  # the host restarted
    with caplog.at_level(logging.WARNING, logger="protocol.security"):
        again = _server(tmp_path, srv, epoch=2)
    assert again.replay_store.margin_applied is not closed
    first_ok = 3 + 1 if closed else 3 + S.REPLAY_SYNC_EVERY + 1
    if not closed:
        assert "host restarted" in caplog.text
        assert _code(again, UP, agent.seal(UP, _upd(seq=first_ok - 1)).payload) == "replayed"
    assert _code(again, UP, agent.seal(UP, _upd(seq=3)).payload) == "replayed"
    assert _open(again, UP, agent.seal(UP, _upd(seq=first_ok)).payload).epoch == 3
    restarted = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public}, epoch=4, replay_state=None)
    assert _open(again, UP, restarted.seal(UP, _upd(seq=1)).payload).epoch == 4  # a new session: never affected


@pytest.mark.parametrize("damage", ["garbage-state", "unknown-key", "both-garbage", "bad-journal-line", "torn-tail",
                                    "missing"])
def test_damaged_or_missing_replay_state_is_logged_never_a_crash(tmp_path, caplog, damage):
    srv, dev = _fleet(tmp_path)
    server = _server(tmp_path, srv, epoch=1)
    agent = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public}, epoch=3, replay_state=None)
    old = [agent.seal(UP, _upd(seq=s)).payload for s in (1, 2)]
    for p in old:
        _open(server, UP, p)
    d = tmp_path / "server"
    state, journal = d / S.REPLAY_STATE_FILE, d / S.REPLAY_JOURNAL_FILE
    if damage == "garbage-state":
        state.write_bytes(b"\x00not json")
    elif damage == "unknown-key":
        doc = _state(tmp_path)
        doc["extra"] = 1
        state.write_text(json.dumps(doc))
    elif damage == "both-garbage":
        state.write_text("{")
        journal.write_bytes(b"\xff\xfe garbage\n")
    elif damage == "bad-journal-line":
        journal.write_text(journal.read_text().replace("0 3 1\n", "0 three 1\n"))
    elif damage == "torn-tail":
        with open(journal, "a") as f:
            f.write("0 3 99")  # no newline: cut by a crash; never handed on, so it is not replayed
    else:
        state.unlink()
        journal.unlink()
    with caplog.at_level(logging.INFO, logger="protocol.security"):
        again = _server(tmp_path, srv, epoch=2)
    expect = {"garbage-state": "is damaged", "unknown-key": "unexpected keys ['extra'], missing keys []",
              "both-garbage": "no valid header", "bad-journal-line": "skipped 1 unreadable line",
              "torn-tail": "cut short", "missing": "first start"}[damage]
    assert expect in caplog.text and str(d) in caplog.text
    if damage in ("garbage-state", "unknown-key", "both-garbage"):
        assert (d / (S.REPLAY_STATE_FILE + ".corrupt")).exists()
    # what is still known is still refused; what was lost is accepted (and recorded afresh)
    refused = {"garbage-state": [1, 2], "unknown-key": [1, 2], "both-garbage": [], "bad-journal-line": [2],
               "torn-tail": [1, 2], "missing": []}[damage]
    for s, p in zip((1, 2), old, strict=True):
        if s in refused:
            assert _code(again, UP, p) == "replayed"
        else:
            assert _open(again, UP, p).epoch == 3
    later = _server(tmp_path, srv, epoch=4)  # sound files again: the next restart refuses both
    assert [_code(later, UP, p) for p in old] == ["replayed", "replayed"]
    assert _state(tmp_path)["sessions"][0]["top"] == 2


def test_an_unwritable_replay_folder_falls_back_to_memory_with_one_warning(tmp_path, caplog):
    srv, dev = _fleet(tmp_path)
    (tmp_path / "not-a-folder").write_text("x")
    with caplog.at_level(logging.WARNING, logger="protocol.security"):
        server = _server(tmp_path, srv, epoch=1, replay_state=tmp_path / "not-a-folder")
        agent = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public}, epoch=3, replay_state=None)
        sealed = agent.seal(UP, _upd(seq=1)).payload
        _open(server, UP, sealed)
    assert _code(server, UP, sealed) == "replayed"  # still refused in memory
    assert caplog.text.count("no longer saved") == 1


def test_a_second_receiver_on_the_same_folder_takes_the_state_over(tmp_path, caplog, monkeypatch):
    srv, dev = _fleet(tmp_path)
    monkeypatch.setattr(replay_mod, "REPLAY_COMPACT_EVERY", 3)
    first = _server(tmp_path, srv, epoch=1)
    agent = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public}, epoch=3, replay_state=None)
    _open(first, UP, agent.seal(UP, _upd(seq=1)).payload)
    second = _server(tmp_path, srv, epoch=2)
    assert _code(second, UP, agent.seal(UP, _upd(seq=1)).payload) == "replayed"
    with caplog.at_level(logging.WARNING, logger="protocol.security"):
        for s in (2, 3):  # the first one's compaction notices it lost the folder and stops writing
            _open(first, UP, agent.seal(UP, _upd(seq=s)).payload)
    assert "another process" in caplog.text
    _open(second, UP, agent.seal(UP, _upd(seq=9)).payload)
    assert _state(tmp_path)["owner"] == second.replay_store._owner
    assert _code(_server(tmp_path, srv, epoch=3), UP, agent.seal(UP, _upd(seq=9)).payload) == "replayed"


def test_restored_window_counts_bits_it_did_not_keep_as_seen():
    # saved with a window of 8: seen 10 (bit 0) and 8 (bit 2); restored into a window of 16
    w = S.ReplayWindow.restored(16, 10, 0b101, 8)
    assert w.bits == 0xFF05
    # the 8 kept (seq 3..10) as they were; seq 0..2 (beyond them, inside the new window) refused
    assert [s for s in range(0, 12) if not w.seen(s)] == [3, 4, 5, 6, 7, 9, 11]
    narrow = S.ReplayWindow.restored(2, 10, 0b101, 8)
    assert narrow.bits == 0b01 and not narrow.seen(11) and narrow.seen(8) and not narrow.seen(9)


def test_agent_verifies_the_pinned_server_key_and_tracks_rounds():
    dev, srv, agent, server = _pair()
    down = topics.down(FED, Kind.ROUND_START)
    rs = lambda r, s: server.seal(down, encode(Envelope(round=r, sender="server", seq=s,  # noqa: E731
                                                        body=RoundStart(("client-007",), 30.0))).payload).payload
    old = rs(1, 1)
    _open(agent, down, old)
    _open(agent, down, rs(3, 2))
    assert agent.current_round == 3
    impostor = S.ChannelSecurity(S.generate_identity("server"), side="server", peers=S.AllowList(None), epoch=9)
    fake = impostor.seal(down, encode(Envelope(round=4, sender="server", seq=1, body=RoundStart(("x",), 1.0))).payload)
    assert _code(agent, down, fake.payload) == "bad_signature"
    to7 = topics.down_to(FED, "client-007", Kind.RECEIPT)
    receipt = server.seal(to7, encode(Envelope(round=3, sender="server", seq=3, body=Receipt(4, 1, True))).payload)
    assert _code(agent, topics.down_to(FED, "client-008", Kind.RECEIPT), receipt.payload) == "tampered_topic"
    assert _code(agent, down, rs(1, 9)) == "wrong_round"


def test_unsigned_messages_stay_byte_identical_without_security():
    for _, hx in MESSAGE_VECTORS.values():
        assert S.split_envelope(bytes.fromhex(hx)).elements == 7
    dev, srv, agent, server = _pair(encrypt=False)
    sealed = agent.seal(UP, _upd()).payload
    assert decode(sealed).payload_bytes == len(sealed)  # a receiver without security ignores the trailer


# ------------------------------------------------------------------------------------------ keys


def test_key_folder_modes_roundtrip_and_no_private_bytes_in_repr(tmp_path, capsys):
    ident = S.generate_identity("pi-07")
    pub = S.write_key_dir(ident, tmp_path / "k")
    for name in ("ed25519.key", "x25519.key", "epoch"):
        assert stat.S_IMODE((tmp_path / "k" / name).stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o700
    back = S.load_identity(tmp_path / "k", expected_id="pi-07")
    assert back.public == ident.public == S.load_public(pub)
    raw = ident.signing_key.private_bytes(ser.Encoding.Raw, ser.PrivateFormat.Raw, ser.NoEncryption())
    assert raw.hex() not in repr(back) and "PRIVATE" not in repr(back)
    with pytest.raises(SecurityConfigError, match="already exists"):
        S.write_key_dir(ident, tmp_path / "k")
    assert fedfleet_main(["keys", "gen", "--out", str(tmp_path / "cli"), "--id", "pi-08"]) == 0
    out = capsys.readouterr().out
    key_pem = (tmp_path / "cli" / "ed25519.key").read_text()
    assert key_pem.splitlines()[1] not in out and "fingerprint" in out


@pytest.mark.parametrize("problem", ["missing", "mode", "wrong-id", "altered-pub", "not-a-key"])
def test_key_folder_problems_are_clear_config_errors(tmp_path, problem):
    d = tmp_path / "k"
    S.write_key_dir(S.generate_identity("pi-07"), d)
    expected = {"missing": "does not exist", "mode": "permissions 0644", "wrong-id": "belong to 'pi-07', not 'pi-09'",
                "altered-pub": "does not match its keys", "not-a-key": "not an unencrypted PKCS #8"}[problem]
    if problem == "missing":
        (d / "x25519.key").unlink()
    elif problem == "mode":
        os.chmod(d / "ed25519.key", 0o644)
    elif problem == "altered-pub":
        text = (d / "pi-07.pub").read_text()
        other = S.generate_identity("pi-07").public
        mine = S._b64(S.load_public(d / "pi-07.pub").ed25519)
        (d / "pi-07.pub").write_text(text.replace(mine, S._b64(other.ed25519)))
    elif problem == "not-a-key":
        (d / "ed25519.key").write_text("hello\n")
    with pytest.raises(SecurityConfigError, match=expected):
        S.load_identity(d, expected_id="pi-09" if problem == "wrong-id" else "pi-07")


def test_enroll_revoke_and_a_running_allow_list_sees_them(tmp_path):
    srv_dir = tmp_path / "server"
    S.write_key_dir(S.generate_identity("server"), srv_dir)
    allow = S.AllowList(srv_dir)
    dev = S.generate_identity("pi-07")
    S.write_key_dir(dev, tmp_path / "pi")
    assert allow.get("pi-07") is None
    assert fedfleet_main(["keys", "enroll", str(tmp_path / "pi" / "pi-07.pub"), "--server-dir", str(srv_dir)]) == 0
    allow._checked = 0.0
    assert allow.get("pi-07") == dev.public
    other = S.generate_identity("pi-07")
    with pytest.raises(SecurityConfigError, match="already enrolled with another key"):
        S.enroll(srv_dir, other.public)
    S.enroll(srv_dir, other.public, replace=True)
    with pytest.raises(SecurityConfigError, match="server's public key"):
        S.enroll(srv_dir, tmp_path / "server" / "server.pub")
    assert fedfleet_main(["keys", "revoke", "pi-07", "--server-dir", str(srv_dir)]) == 0
    time.sleep(0.01)
    allow._checked = 0.0
    allow._mtime = None
    assert allow.get("pi-07") is None
    assert fedfleet_main(["keys", "revoke", "pi-07", "--server-dir", str(srv_dir)]) == 2


def test_agent_without_pinned_server_key_is_refused(tmp_path):
    with pytest.raises(SecurityConfigError, match="not pinned"):
        S.ChannelSecurity(S.generate_identity("pi-07"), side="agent", peers={}, epoch=1)


def test_config_security_section_is_validated():
    from helpers.federation import small_config

    cfg = small_config(security={"sign": True, "encrypt": True})
    assert cfg.security.sign and "[security]" in cfg.to_toml()
    with pytest.raises(ConfigError, match="encrypt = true needs sign"):
        small_config(security={"encrypt": True})
    with pytest.raises(ConfigError, match="unknown key \\[security\\] signing"):
        small_config(security={"signing": True})
    with pytest.raises(ConfigError, match="cert_file and key_file go together"):
        small_config(broker={"cert_file": "c.pem"})
    from broker_server.runtime import server_security

    with pytest.raises(ConfigError, match="needs key_dir"):
        server_security(small_config(security={"sign": True}))


# ------------------------------------------------------------------------------------------ ledger


def _v3_ledger(path: Path, version: int) -> None:
    with Ledger(path) as led:
        led.record(LedgerRow(federation="f", side="agent", node="a", event="sent", direction="up", kind="update",
                             round=1, client="a", sender="a", seq=1, topic="t", topic_bytes=1, mqtt_header_bytes=4,
                             envelope_bytes=20, body_bytes=100, payload_bytes=120, qos=1))
    db = sqlite3.connect(path)
    drop = ["unsent_bytes"] + {5: [], 4: ["delivery"], 3: ["delivery", "sig_bytes", "enc_bytes"],
                               2: ["delivery", "sig_bytes", "enc_bytes", "link_s"]}[version]
    for col in drop:
        db.execute(f"ALTER TABLE messages DROP COLUMN {col}")
    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(version),))
    db.commit()
    db.close()


@pytest.mark.parametrize("version", [2, 3, 4, 5])
def test_older_ledgers_are_migrated_in_place(tmp_path, version):
    """A ledger of schema ``version`` (its newer columns dropped) opened for writing gains every
    column in place: its row reads the defaults (``sig_bytes`` 0, ``delivery`` '', ``unsent_bytes``
    0: an older fedfleet counted a cut packet whole), a new row keeps what it is given, and the
    audit reads the file as before with the new columns (before the migration too, by default)."""
    from broker_server.audit._load import open_ledger
    from broker_server.audit._queries import totals

    path = tmp_path / "ledger.sqlite"
    _v3_ledger(path, version)
    db = open_ledger(tmp_path)  # read-only, unmigrated: the missing columns read 0
    assert totals(db, "device")["up"]["wire_bytes"] == 125
    db.close()
    with Ledger(path) as led:
        rows = led.rows()
        assert len(rows) == 1 and rows[0].sig_bytes == 0 and rows[0].body_bytes == 100 and rows[0].unsent_bytes == 0
        led.record(LedgerRow(federation="f", side="agent", node="a", event="sent", direction="up", kind="update",
                             round=2, client="a", sender="a", seq=2, topic="t", topic_bytes=1, mqtt_header_bytes=4,
                             envelope_bytes=20, body_bytes=100, payload_bytes=220, qos=1, sig_bytes=80, enc_bytes=20,
                             unsent_bytes=25))
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION) == "6"
    assert db.execute("SELECT value FROM meta WHERE key='migrated_from'").fetchone()[0] == str(version)
    assert db.execute("SELECT sum(sig_bytes), sum(enc_bytes) FROM messages").fetchone() == (80, 20)
    assert [r[0] for r in db.execute("SELECT delivery FROM messages ORDER BY id")] == ["", ""]  # old rows read ''
    assert [r[0] for r in db.execute("SELECT unsent_bytes FROM messages ORDER BY id")] == [0, 25]  # old rows read 0
    db.close()
    db = open_ledger(tmp_path)
    assert totals(db, "device")["up"]["wire_bytes"] == 125 + (4 + 1 + 220 - 25)  # whole packets less unsent
    db.close()



def test_schema_1_ledger_is_rebuilt_and_a_newer_one_refused(tmp_path):
    path = tmp_path / "v1.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, federation TEXT NOT NULL,
          side TEXT NOT NULL, node TEXT NOT NULL,
          event TEXT NOT NULL CHECK (event IN ('sent', 'received', 'rejected')), direction TEXT NOT NULL,
          kind TEXT NOT NULL, round INTEGER, client TEXT NOT NULL, sender TEXT, seq INTEGER, topic TEXT NOT NULL,
          topic_bytes INTEGER NOT NULL, mqtt_header_bytes INTEGER NOT NULL, envelope_bytes INTEGER NOT NULL,
          body_bytes INTEGER NOT NULL, payload_bytes INTEGER NOT NULL, qos INTEGER NOT NULL,
          retained INTEGER NOT NULL DEFAULT 0, codec TEXT NOT NULL DEFAULT '', reason TEXT NOT NULL DEFAULT '');
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '1');
        INSERT INTO messages (ts, federation, side, node, event, direction, kind, client, topic, topic_bytes,
          mqtt_header_bytes, envelope_bytes, body_bytes, payload_bytes, qos)
          VALUES (1.0, 'f', 'server', 's', 'sent', 'down', 'global', '*', 't', 1, 4, 10, 90, 100, 1);
    """)
    db.close()
    with Ledger(path) as led:
        led.record(LedgerRow(federation="f", side="agent", node="a", event="message", direction="up", kind="update",
                             round=1, client="a", sender="a", seq=1, topic="t", topic_bytes=1, mqtt_header_bytes=4,
                             envelope_bytes=20, body_bytes=100, payload_bytes=120, qos=1))
        assert [r.event for r in led.rows()] == ["sent", "message"]
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    db.commit()
    db.close()
    from protocol.errors import LedgerError

    with pytest.raises(LedgerError, match="newer"):
        Ledger(path)


# ------------------------------------------------------------------------------------------ channel


def test_chunked_transfer_signed_and_encrypted_through_channels(tmp_path):
    dev, srv, agent_sec, server_sec = _pair()
    broker = MemoryBroker()
    a, s = broker.connect("client-007"), broker.connect("server")
    a.subscribe(topics.agent_filters(FED, "client-007"))
    s.subscribe(topics.server_filters(FED))
    ledger = Ledger(tmp_path / "ledger.sqlite")
    agent = Channel(a, node_id="client-007", side="agent", federation=FED, ledger=ledger, chunk_bytes=256 * 1024,
                    security=agent_sec)
    server = Channel(s, node_id="server", side="server", federation=FED, ledger=ledger, security=server_sec)
    rng = np.random.default_rng(1)
    big = Update((rng.standard_normal(300_000).astype(np.float32),), 10, 0.25)  # 1.2 MB: 5 chunks
    enc = agent.send(topics.up(FED, "client-007", Kind.UPDATE), big, round=0)
    got = [server.accept(inc) for inc in iter(lambda: s.get(0), None)]
    whole = [g for g in got if isinstance(g, Received)]
    assert len(whole) == 1 and not [g for g in got if isinstance(g, Rejected)]
    np.testing.assert_array_equal(whole[0].envelope.body.tensors[0], big.tensors[0])
    assert whole[0].sha256 == hashlib.sha256(enc.payload).digest()
    # every chunk on the wire is sealed and its body encrypted: no float of the model in clear
    probe = big.tensors[0][1000:1004].tobytes()
    assert all(p[0] == 0x98 and probe not in p for _, p in a.sent)
    rows = ledger.rows("side='agent' AND event='sent'")
    assert len(rows) == 5 and all(r.sig_bytes > 60 and r.enc_bytes == 16 for r in rows)
    assert all(r.payload_bytes == r.envelope_bytes + r.body_bytes + r.sig_bytes + r.enc_bytes for r in rows)
    # the same chunks again: each one is a replay
    replays = [server.accept(Incoming(t, p, 1, False, time.monotonic())) for t, p in a.sent]
    assert [r.code for r in replays] == ["replayed"] * 5
    assert server.ledger.rows("event='rejected'")[0].reason.startswith("replayed:")
    # a small message to the agent: signed by the server, verified by the agent
    server.send(topics.down_to(FED, "client-007", Kind.RECEIPT), Receipt(4, enc.seq, True), round=0)
    assert isinstance(agent.accept(a.get(0)), Received)
    ledger.close()


# ------------------------------------------------------------------------------------------ TLS files


def _cert(key, subject, issuer_key=None, issuer=None, days=(-1, 30)):
    from datetime import datetime, timedelta, timezone

    from cryptography import x509
    from cryptography.x509.oid import NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.now(timezone.utc)
    b = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now + timedelta(days=days[0]))
         .not_valid_after(now + timedelta(days=days[1])))
    return b.sign(issuer_key or key, hashes.SHA256())


def test_tls_files_are_checked_at_start_up(tmp_path):
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_key, cl_key, other_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = _cert(ca_key, "test-ca")
    pem = lambda c: c.public_bytes(ser.Encoding.PEM)  # noqa: E731
    kpem = lambda k: k.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())  # noqa: E731
    (tmp_path / "ca.pem").write_bytes(pem(ca))
    (tmp_path / "client.pem").write_bytes(pem(_cert(cl_key, "dev", ca_key, ca.subject)))
    (tmp_path / "client.key").write_bytes(kpem(cl_key))
    (tmp_path / "other.key").write_bytes(kpem(other_key))
    (tmp_path / "old.pem").write_bytes(pem(_cert(cl_key, "dev", ca_key, ca.subject, days=(-60, -2))))
    tls_context(ca_file=str(tmp_path / "ca.pem"), cert_file=str(tmp_path / "client.pem"),
                key_file=str(tmp_path / "client.key"))
    with pytest.raises(SecurityConfigError, match="CA file .*missing.pem"):
        tls_context(ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(SecurityConfigError, match="key does not belong to the certificate"):
        tls_context(ca_file=str(tmp_path / "ca.pem"), cert_file=str(tmp_path / "client.pem"),
                    key_file=str(tmp_path / "other.key"))
    with pytest.raises(SecurityConfigError, match="expired on .*300 s of skew"):
        tls_context(ca_file=str(tmp_path / "ca.pem"), cert_file=str(tmp_path / "old.pem"),
                    key_file=str(tmp_path / "client.key"))
    # a device without a clock: periods unchecked; a generous skew accepts a 2-day-old expiry
    tls_context(ca_file=str(tmp_path / "ca.pem"), cert_file=str(tmp_path / "old.pem"),
                key_file=str(tmp_path / "client.key"), check_time=False)
    tls_context(ca_file=str(tmp_path / "ca.pem"), cert_file=str(tmp_path / "old.pem"),
                key_file=str(tmp_path / "client.key"), clock_skew_s=3 * 86400)
    with pytest.raises(SecurityConfigError, match="holds no PEM certificate"):
        tls_context(ca_file=str(tmp_path / "client.key"))
