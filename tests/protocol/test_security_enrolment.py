"""protocol.security beyond the primitives: the server's allow list follows the enrolled/ folder
while it runs (stray and half-written files, revocation, re-keying), replay epochs survive device
and server restarts, and one enrolled device's valid signature cannot speak for another."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from protocol import security as S
from protocol import topics
from protocol.errors import SecurityRejection
from protocol.messages import Envelope, Kind, Update, encode


def _sec_upd(seq: int, rnd: int = 1, sender: str = "pi-07") -> bytes:
    return encode(Envelope(round=rnd, sender=sender, seq=seq,
                           body=Update((np.zeros(3, np.float32),), 10, 0.5))).payload


def _sec_open(server, topic: str, payload: bytes):
    info = topics.parse(topic)
    return server.open(topic, info.client_id, info.direction, payload)


def test_a_stray_file_in_enrolled_does_not_freeze_the_live_allow_list(tmp_path: Path) -> None:
    """The running server's AllowList follows enrolled/ with a malformed file in it: the stray
    file costs nobody their enrolment, and a later revocation and a later enrolment both apply."""
    srv = S.generate_identity("server")
    S.write_key_dir(srv, tmp_path / "server")
    a, b = S.generate_identity("pi-a"), S.generate_identity("pi-b")
    S.enroll(tmp_path / "server", a.public)
    allow = S.AllowList(tmp_path / "server")
    assert allow.get("pi-a") is not None
    (tmp_path / "server" / "enrolled" / "notes.pub").write_text("not a key")
    time.sleep(1.05)
    assert allow.get("pi-a") is not None  # the stray file costs nobody their enrolment
    assert S.revoke(tmp_path / "server", "pi-a")
    S.enroll(tmp_path / "server", b.public)
    time.sleep(1.05)
    assert allow.get("pi-a") is None and allow.get("pi-b") is not None


def test_a_file_written_after_a_failed_read_is_picked_up(tmp_path: Path) -> None:
    """A half-written <id>.pub (cp into enrolled/) is not loaded; once complete it is, although
    the folder's mtime did not change."""
    srv = S.generate_identity("server")
    S.write_key_dir(srv, tmp_path / "server")
    (tmp_path / "server" / "enrolled").mkdir(exist_ok=True)
    allow = S.AllowList(tmp_path / "server")
    c = S.generate_identity("pi-c")
    target = tmp_path / "server" / "enrolled" / "pi-c.pub"
    target.write_text(c.public.to_text()[:20])  # the copy has begun
    time.sleep(1.05)
    assert allow.get("pi-c") is None
    target.write_text(c.public.to_text())  # ... and finished (the folder's mtime does not change)
    time.sleep(1.05)
    assert allow.get("pi-c") is not None


def test_a_device_re_keyed_under_its_id_is_not_locked_out_by_its_old_epoch(tmp_path: Path) -> None:
    """A device re-provisioned under its id (new keys, `fedfleet keys enroll --replace`, epoch
    counter from 1 again) is accepted by the running server at once: replay state belongs to a
    key, not to the id. Messages of the old key are refused (``bad_signature``)."""
    srv = S.generate_identity("server")
    S.write_key_dir(srv, tmp_path / "server")
    old = S.generate_identity("pi-07")
    S.enroll(tmp_path / "server", old.public)
    server = S.ChannelSecurity(srv, side="server", peers=S.AllowList(tmp_path / "server"), epoch=1)
    up = topics.up("fed", "pi-07", Kind.UPDATE)
    dev_old = S.ChannelSecurity(old, side="agent", peers={"server": srv.public}, epoch=5)
    old_msg = dev_old.seal(up, _sec_upd(1)).payload
    _sec_open(server, up, old_msg)
    new = S.generate_identity("pi-07")
    S.enroll(tmp_path / "server", new.public, replace=True)
    time.sleep(1.05)
    dev_new = S.ChannelSecurity(new, side="agent", peers={"server": srv.public}, epoch=1)
    assert _sec_open(server, up, dev_new.seal(up, _sec_upd(1)).payload).epoch == 1
    with pytest.raises(SecurityRejection) as err:
        _sec_open(server, up, dev_old.seal(up, _sec_upd(2)).payload)
    assert err.value.code == "bad_signature"


def test_a_device_message_from_before_its_restart_is_refused_by_a_restarted_server(tmp_path: Path) -> None:
    """README: "a restarted device is accepted while its old messages are not", across a server
    restart too: a recorded message of the device's previous session (epoch 1), replayed to a
    restarted server before the device speaks again, is refused."""
    srv = S.generate_identity("server")
    S.write_key_dir(srv, tmp_path / "server")
    srv = S.load_identity(tmp_path / "server")
    dev = S.generate_identity("pi-07")
    S.write_key_dir(dev, tmp_path / "dev")
    dev = S.load_identity(tmp_path / "dev")
    S.enroll(tmp_path / "server", dev.public)
    up = topics.up("fed", "pi-07", Kind.UPDATE)
    server1 = S.ChannelSecurity(srv, side="server", peers=S.AllowList(tmp_path / "server"))
    boot1 = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public})
    recorded = boot1.seal(up, _sec_upd(1)).payload
    _sec_open(server1, up, recorded)
    boot2 = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public})  # the device restarts
    _sec_open(server1, up, boot2.seal(up, _sec_upd(1)).payload)
    server2 = S.ChannelSecurity(srv, side="server", peers=S.AllowList(tmp_path / "server"))  # the server restarts
    with pytest.raises(SecurityRejection):
        _sec_open(server2, up, recorded)


def test_another_enrolled_devices_valid_signature_cannot_speak_for_a_device(tmp_path: Path) -> None:
    """pi-a (enrolled) cannot speak for pi-b: an update naming pi-b as sender on pi-b's topic is
    ``bad_signature``, one naming itself on pi-b's topic ``sender_mismatch``."""
    srv = S.generate_identity("server")
    a, b = S.generate_identity("pi-a"), S.generate_identity("pi-b")
    server = S.ChannelSecurity(srv, side="server", peers=S.AllowList(None, {"pi-a": a.public, "pi-b": b.public}),
                               epoch=1)
    dev_a = S.ChannelSecurity(a, side="agent", peers={"server": srv.public}, epoch=1)
    up_b = topics.up("fed", "pi-b", Kind.UPDATE)
    codes = []
    for payload in (dev_a.seal(up_b, _sec_upd(1, sender="pi-b")).payload,
                    dev_a.seal(up_b, _sec_upd(2, sender="pi-a")).payload):
        with pytest.raises(SecurityRejection) as err:
            _sec_open(server, up_b, payload)
        codes.append(err.value.code)
    assert codes == ["bad_signature", "sender_mismatch"]
