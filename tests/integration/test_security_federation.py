"""Signed and encrypted federations over real brokers.

* A rogue paho client on the broker watches a signed + encrypted federation and publishes every
  kind of bad message (forged signature, tampered body, tampered topic, unenrolled device,
  unsigned message, replay, replay from an earlier round, sender spoofing, truncated ciphertext,
  a forged broadcast to the devices); each is refused with its own reason, counted in the
  ledger and in metrics.jsonl, and every round completes with the three honest clients.
* The same federation (same seed) over a test-started Mosquitto with TLS (its own CA, a client
  certificate) and username/password, signed and encrypted, reaches exactly the accuracy of the
  plain run; wrong TLS files, passwords and keys fail at start-up with a clear message.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import sqlite3
import threading
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from ipaddress import IPv4Address
from pathlib import Path

import msgpack
import paho.mqtt.client as mqtt
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import serialization as ser
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from helpers.brokers import password_file, require_mosquitto
from helpers.federation import small_config
from helpers.waiting import wait_for

from broker_server.audit import audit_report, render_text
from broker_server.embedded_broker import EmbeddedBroker
from broker_server.simulate import simulate
from edge_agent.cli import main as agent_main
from protocol import security as S
from protocol import topics
from protocol.errors import ConnectError
from protocol.messages import Envelope, Join, Kind, RoundStart, encode
from protocol.transport import MqttTransport

pytestmark = pytest.mark.slow

EXPECTED_SERVER = {"replayed", "bad_signature", "tampered_body", "tampered_topic", "sender_mismatch",
                   "truncated_ciphertext", "unenrolled", "unsigned", "wrong_round"}


def _reason_codes(db_path: Path, side: str) -> list[tuple[str, str]]:
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    rows = db.execute("SELECT node, reason FROM messages WHERE event='rejected' AND side=?", (side,)).fetchall()
    db.close()
    return [(node, reason.split(":", 1)[0]) for node, reason in rows]


class Rogue:
    """A paho client that records the federation's traffic and attacks it on cue."""

    def __init__(self, port: int, fed: str) -> None:
        self.fed = fed
        self.events: queue.Queue = queue.Queue()
        self.done = threading.Event()
        self.sent: list[str] = []
        c = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=f"rogue-{time.time_ns()}")
        c.on_connect = lambda cl, *_: cl.subscribe(f"fedfleet/v1/{fed}/#", qos=1)
        c.on_message = lambda cl, ud, msg: self.events.put((msg.topic, bytes(msg.payload)))
        c.connect("127.0.0.1", port)
        c.loop_start()
        self.client = c
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def pub(self, name: str, topic: str, payload: bytes) -> None:
        # until the broker's PUBACK (a bound, not a delay; paho's wait returns silently at it):
        # a test that waits on ``sent`` then knows the broker has the message
        self.client.publish(topic, payload, qos=1).wait_for_publish(30)
        self.sent.append(name)

    def _run(self) -> None:
        fed = self.fed
        upd_topic = topics.up(fed, "client-000", Kind.UPDATE)
        captured = None
        attacked_round1 = attacked_round3 = attacked_receipt = False
        rogue_ident = S.generate_identity("rogue-01")
        while not self.done.is_set():
            try:
                topic, payload = self.events.get(timeout=0.2)
            except queue.Empty:
                continue
            if not payload:
                continue
            env = msgpack.unpackb(payload)
            if topic == upd_topic and env[2] == 1 and captured is None:
                captured = payload
            if captured is not None and not attacked_round1:
                attacked_round1 = True
                env = msgpack.unpackb(captured)
                body = env[6]
                i = captured.index(body) + len(body) // 2
                self.pub("replayed", upd_topic, captured)
                self.pub("bad_signature", upd_topic, captured[:-1] + bytes([captured[-1] ^ 0x5A]))
                self.pub("tampered_body", upd_topic, captured[:i] + bytes([captured[i] ^ 1]) + captured[i + 1:])
                self.pub("tampered_topic", topics.up(fed, "client-000", Kind.JOIN), captured)
                self.pub("sender_mismatch", topics.up(fed, "client-001", Kind.UPDATE), captured)
                self.pub("truncated_ciphertext", upd_topic,
                         msgpack.packb(env[:6] + [body[:-100]] + env[7:], use_bin_type=True))
                join = Join("x86-cpu", "0" * 16, 10, (), {})
                jt = topics.up(fed, "rogue-01", Kind.JOIN)
                mine = S.ChannelSecurity(rogue_ident, side="agent", peers={"server": rogue_ident.public}, epoch=1)
                self.pub("unenrolled", jt, mine.seal(jt, encode(Envelope(0, "rogue-01", 1, join)).payload).payload)
                ut = topics.up(fed, "rogue-02", Kind.JOIN)
                self.pub("unsigned", ut, encode(Envelope(0, "rogue-02", 1, join)).payload)
                # to the devices: a round_start signed by a key that is not the pinned server key
                rt = topics.down(fed, Kind.ROUND_START)
                fake = encode(Envelope(1, "server", 10_000, RoundStart(("client-000",), 5.0))).payload
                self.pub("forged_broadcast", rt, mine.seal(rt, fake).payload)
            if topic == topics.down_to(fed, "client-000", Kind.RECEIPT) and not attacked_receipt:
                attacked_receipt = True  # the server's receipt to client-000, re-addressed to client-001
                self.pub("receipt_elsewhere", topics.down_to(fed, "client-001", Kind.RECEIPT), payload)
            if topic == topics.down(fed, Kind.ROUND_START) and env[2] == 3 and env[3] == "server" \
                    and captured is not None and not attacked_round3:
                attacked_round3 = True
                self.pub("wrong_round", upd_topic, captured)  # round 1's update, replayed in round 3

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.client.disconnect()
        self.client.loop_stop()


def test_rogue_client_is_refused_with_one_reason_per_attack_and_rounds_complete(tmp_path):
    cfg = small_config(run={"rounds": 3}, security={"sign": True, "encrypt": True},
                       server={"round_deadline_s": 30.0})
    with EmbeddedBroker(kind="auto", workdir=tmp_path / "broker") as broker:
        rogue = Rogue(broker.port, "secfed")

        def hook(i, agent):
            """The honest devices train round 3 only once the rogue's round-1 replay has reached the
            broker (its PUBACK): the server then sees it while round 3 is still open."""
            original = agent.algorithm.local_round

            def after_the_replay(*args, **kwargs):
                if kwargs.get("round") == 3:
                    wait_for(lambda: "wrong_round" in rogue.sent, bound_s=30.0)
                return original(*args, **kwargs)

            agent.algorithm.local_round = after_the_replay

        try:
            res = simulate(cfg, broker_url=broker.url, run_dir=tmp_path / "secfed", agent_hook=hook)
        finally:
            time.sleep(0.5)
            rogue.close()
    assert set(rogue.sent) == EXPECTED_SERVER | {"forged_broadcast", "receipt_elsewhere"}
    assert res.rounds_completed == 3
    assert [m["clients_reported"] for m in res.metrics] == [3, 3, 3]
    assert all(a.finished and a.rounds_trained == 3 for a in res.agents)
    ledger = tmp_path / "secfed" / "ledger.sqlite"
    server = Counter(code for _, code in _reason_codes(ledger, "server"))
    assert server == Counter({code: 1 for code in EXPECTED_SERVER}), server
    by_reason = Counter()
    for m in res.metrics:
        by_reason.update(m["rejected_by_reason"])
    assert by_reason == server
    agents = _reason_codes(ledger, "agent")
    assert Counter(code for _, code in agents) == Counter({"bad_signature": 3, "tampered_topic": 1})
    assert ("client-001", "tampered_topic") in agents
    # the ledger prices signing and encryption separately; the audit shows both
    rep = audit_report(tmp_path / "secfed")
    dev = rep["totals"]["device"]["all"]
    assert dev["sig_bytes"] > 0 and dev["enc_bytes"] > 0
    assert dev["wire_bytes"] == (dev["body_bytes"] + dev["envelope_bytes"] + dev["sig_bytes"] + dev["enc_bytes"]
                                 + dev["mqtt_bytes"] + dev["control_bytes"])
    assert "signature B" in render_text(rep)


# ------------------------------------------------------------------------------------------ TLS


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(key, cn: str, ca_key=None, ca_cert=None, *, server: bool = False, ca: bool = False,
           days: tuple[int, int] = (-1, 30)) -> x509.Certificate:
    now = datetime.now(timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject if ca_cert else _name(cn))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now + timedelta(days=days[0])).not_valid_after(now + timedelta(days=days[1])))
    if ca:
        b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        b = b.add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(IPv4Address("127.0.0.1")),
                                                         x509.DNSName("localhost")]), critical=False)
    return b.sign(ca_key or key, hashes.SHA256())


def _pem(obj) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(ser.Encoding.PEM)
    return obj.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())


def make_pki(d: Path) -> dict[str, Path]:
    """A CA, a broker certificate for 127.0.0.1, a client certificate, and a second CA (PEM files)."""
    d.mkdir(parents=True, exist_ok=True)
    ca_key, srv_key, cl_key, other_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(4))
    ca = _issue(ca_key, "fedfleet-test-ca", ca=True)
    files = {"ca": ca, "server_cert": _issue(srv_key, "127.0.0.1", ca_key, ca, server=True), "server_key": srv_key,
             "client_cert": _issue(cl_key, "client", ca_key, ca), "client_key": cl_key,
             "other_ca": _issue(other_key, "another-ca", ca=True)}
    out = {}
    for name, obj in files.items():
        out[name] = d / f"{name}.pem"
        out[name].write_bytes(_pem(obj))
        os.chmod(out[name], 0o600 if name.endswith("key") else 0o644)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tls_broker(tmp_path):
    """Mosquitto with a plain listener and a TLS listener (client certificate required), both
    with username/password (``alice`` / the password in ``secret.txt``)."""
    require_mosquitto()
    pki = make_pki(tmp_path / "pki")
    (tmp_path / "secret.txt").write_text("s3cret-pw\n")
    pw = password_file(tmp_path / "passwd", "alice", "s3cret-pw")
    tls_port = _free_port()
    extra = [f"password_file {pw}", "allow_anonymous false", f"listener {tls_port} 127.0.0.1",
             f"cafile {pki['ca']}", f"certfile {pki['server_cert']}", f"keyfile {pki['server_key']}",
             "require_certificate true", "tls_version tlsv1.2"]
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "broker", extra_config=extra) as broker:
        yield broker, tls_port, pki, tmp_path / "secret.txt"


def test_signed_encrypted_run_over_tls_with_password_matches_the_plain_run(tls_broker, tmp_path):
    broker, tls_port, pki, secret = tls_broker
    login = {"username": "alice", "password_file": str(secret)}
    plain = simulate(small_config(broker=login), broker_url=f"mqtt://127.0.0.1:{broker.port}",
                     run_dir=tmp_path / "plain")
    secure_cfg = small_config(broker={**login, "ca_file": str(pki["ca"]), "cert_file": str(pki["client_cert"]),
                                      "key_file": str(pki["client_key"])},
                              security={"sign": True, "encrypt": True})
    secure = simulate(secure_cfg, broker_url=f"mqtts://127.0.0.1:{tls_port}", run_dir=tmp_path / "secure")
    assert secure.rounds_completed == plain.rounds_completed == 2
    assert [m["accuracy"] for m in secure.metrics] == [m["accuracy"] for m in plain.metrics]
    assert secure.final_accuracy == plain.final_accuracy
    a = torch.load(tmp_path / "plain" / "model_final.pt")
    b = torch.load(tmp_path / "secure" / "model_final.pt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    assert all(m["rejected_by_reason"] == {} for m in secure.metrics)
    rs, rp = audit_report(tmp_path / "secure"), audit_report(tmp_path / "plain")
    s_all, p_all = rs["totals"]["device"]["all"], rp["totals"]["device"]["all"]
    assert s_all["sig_bytes"] > 0 and s_all["enc_bytes"] > 0 and p_all["sig_bytes"] == p_all["enc_bytes"] == 0
    assert s_all["body_bytes"] == p_all["body_bytes"]  # the same messages, plus their signatures and tags
    assert json.loads(json.dumps(rs))["totals"]["server"]["all"]["sig_bytes"] > 0
    # what the broker saw: TLS on the wire; in the broker's log the logins of the TLS listener
    assert "alice" in broker.log_path.read_text(errors="replace")


def test_tls_and_login_failures_are_clear_at_start_up(tls_broker, tmp_path):
    broker, tls_port, pki, secret = tls_broker

    def connect(**kw):
        t = MqttTransport(f"probe-{time.time_ns()}", "127.0.0.1", kw.pop("port", tls_port), **kw)
        try:
            t.connect(timeout_s=5)
        finally:
            t.close()

    ok = dict(tls=True, tls_ca=str(pki["ca"]), tls_cert=str(pki["client_cert"]), tls_key=str(pki["client_key"]),
              username="alice", password="s3cret-pw")
    connect(**ok)
    refused = "certificate of the broker .* was refused: .*(self-signed|unable to get local issuer)"
    with pytest.raises(ConnectError, match=refused):
        connect(**{**ok, "tls_ca": str(pki["other_ca"])})
    login = r"(?i)refused the login of '[^']+': (not authori[sz]ed|bad user name or password) \(MQTT [0-9.]+ CONNACK"
    with pytest.raises(ConnectError, match=login):
        connect(**{**ok, "password": "wrong"})
    with pytest.raises(ConnectError, match="TLS|did not accept"):
        connect(**{k: v for k, v in ok.items() if k not in ("tls_cert", "tls_key")})
    # the configuration path: a missing CA file is a configuration error before anything connects
    from broker_server.errors import ConfigError
    from broker_server.runtime import open_transport

    cfg = small_config(broker={"ca_file": str(tmp_path / "nope.pem")})
    with pytest.raises(ConfigError, match="TLS: CA file .*nope.pem"):
        open_transport("x", cfg, f"mqtts://127.0.0.1:{tls_port}")
    with pytest.raises(ConfigError, match="plain mqtt://"):
        open_transport("x", small_config(broker={"ca_file": str(pki["ca"])}), f"mqtt://127.0.0.1:{broker.port}")


def test_agent_cli_refuses_unusable_keys_at_start_up(tmp_path, capsys):
    S.write_key_dir(S.generate_identity("pi-07"), tmp_path / "pi")
    S.write_key_dir(S.generate_identity("server"), tmp_path / "server")
    base = ["--broker", "mqtt://127.0.0.1:1", "--federation", "f", "--client-id", "pi-07", "--dataset", "digits"]
    cases = [
        (["--key-dir", str(tmp_path / "pi")], "not pinned"),
        (["--key-dir", str(tmp_path / "nowhere"), "--server-pubkey", str(tmp_path / "server" / "server.pub")],
         "does not exist"),
        (["--key-dir", str(tmp_path / "pi"), "--server-pubkey", str(tmp_path / "pi" / "pi-07.pub")],
         "not the server's"),
        (["--ca", str(tmp_path / "ca.pem")], "use mqtts://"),
    ]
    for extra, message in cases:
        assert agent_main(base + extra) == 2
        assert message in capsys.readouterr().err
    os.chmod(tmp_path / "pi" / "x25519.key", 0o640)
    assert agent_main(base + ["--key-dir", str(tmp_path / "pi"), "--server-pubkey",
                              str(tmp_path / "server" / "server.pub")]) == 2
    assert "chmod 600" in capsys.readouterr().err


def test_signed_encrypted_per_device_globals_reach_the_plain_broadcast_model(tmp_path):
    """Four devices, two selected a round (participation 0.5), over the embedded broker: signed
    and encrypted with each global sent per device, and plain with broadcast globals. Each copy
    is signed for its own topic and verified by its device; the unselected devices receive no
    global; the same seeded run reaches the same model."""
    plain = simulate(small_config(data={"clients": 4},
                                  server={"participation_rate": 0.5, "global_delivery": "broadcast"}),
                     run_dir=tmp_path / "plain")
    secure = simulate(small_config(data={"clients": 4},
                                   server={"participation_rate": 0.5, "global_delivery": "per_device"},
                                   security={"sign": True, "encrypt": True}), run_dir=tmp_path / "secure")
    assert secure.rounds_completed == plain.rounds_completed == 2
    assert [m["global_delivery"] for m in secure.metrics] == ["per_device"] * 2
    assert [m["global_receipts"] for m in secure.metrics] == [2, 2]
    assert [m["global_receipts"] for m in plain.metrics] == [4, 4]
    assert all(m["rejected_by_reason"] == {} for m in secure.metrics)
    db = sqlite3.connect(f"file:{tmp_path / 'secure' / 'ledger.sqlite'}?mode=ro", uri=True)
    got = db.execute("SELECT round, client, topic, sig_bytes FROM messages WHERE side = 'agent' AND kind = 'global' "
                     "AND event = 'received'").fetchall()
    trained = db.execute("SELECT DISTINCT round, client FROM messages WHERE side = 'agent' AND kind = 'update' "
                         "AND event = 'sent'").fetchall()
    db.close()
    assert sorted((r, c) for r, c, _, _ in got) == sorted(trained) and len(trained) == 4
    assert all(t.endswith(f"/down/{c}/global") and sig > 0 for _, c, t, sig in got)
    a = torch.load(tmp_path / "plain" / "model_final.pt")
    b = torch.load(tmp_path / "secure" / "model_final.pt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
