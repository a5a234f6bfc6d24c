"""The security of one channel: signs (and encrypts) what a side sends, and verifies, decrypts
and checks for replay what it receives, in the order of the normative text (:mod:`protocol.security`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import SecurityConfigError, SecurityRejection
from ..messages import SERVER_ID, Kind
from .keys import AllowList, Identity, PublicIdentity, next_epoch
from .reasons import _reject
from .replay import DEFAULT_REPLAY_WINDOW, ReplayStore, ReplayWindow, Session
from .sealing import (
    FLAG_ENCRYPTED,
    MAX_SEAL_BYTES,
    Sealed,
    aead_aad,
    aead_nonce,
    read_sec,
    seal,
    split_envelope,
    unsealed,
    upload_key,
    verify_sealed,
)

#: Kinds that open a round: their ``round`` sets a receiver's current round.
_ROUND_OPENERS = (Kind.GLOBAL, Kind.ROUND_START)



@dataclass(frozen=True, slots=True)
class Opened:
    """A verified payload.

    Attributes:
        payload: what to decode: the received payload itself, or the unsealed payload with the
            decrypted body.
        sig_bytes: bytes of the ``sec`` element; 0 for an unsigned payload.
        enc_bytes: bytes encryption added; 0 when plain.
        epoch: the sender's session number (0 when unsigned).
        encrypted: whether the body was encrypted.
    """

    payload: bytes
    sig_bytes: int = 0
    enc_bytes: int = 0
    epoch: int = 0
    encrypted: bool = False


class ChannelSecurity:
    """Signing, verification, encryption and replay state of one channel (one side's connection).

    A server passes its identity and an :class:`AllowList`; a device passes its identity and the
    pinned server identity. One instance per channel: its ``epoch`` (from the key folder's
    counter) and the channel's sequence numbers make every (epoch, seq) unique.

    Args:
        identity: this node's keys.
        side: ``"server"`` or ``"agent"``.
        peers: who may send to this side: an :class:`AllowList` (server) or a mapping
            ``{"server": pinned identity}`` (device).
        encrypt: encrypt the bodies this side sends (devices only; uploads).
        require_encrypted: refuse plain uploads (server only).
        require_signed: refuse unsigned payloads (normally True).
        epoch: this side's session number; ``None``: advance the counter in ``identity.key_dir``.
        replay_window: see :class:`ReplayWindow`.
        replay_state: where the replay state (each sender's newest epoch, seen sequence numbers
            and last will) survives a restart: a folder for a :class:`ReplayStore`; ``"key_dir"``
            (the default): ``identity.key_dir``, or memory only when the identity has none;
            ``None``: memory only.

    Raises:
        SecurityConfigError: a device without a pinned server key, encryption on a server, or
            the epoch counter cannot be advanced.
    """

    def __init__(self, identity: Identity, *, side: str, peers: AllowList | Mapping[str, PublicIdentity],
                 encrypt: bool = False, require_encrypted: bool = False, require_signed: bool = True,
                 epoch: int | None = None, replay_window: int = DEFAULT_REPLAY_WINDOW,
                 replay_state: str | os.PathLike | None = "key_dir") -> None:
        if side not in ("server", "agent"):
            raise ValueError(f"side must be 'server' or 'agent', not {side!r}")
        self.identity = identity
        self.side = side
        self.peers = peers
        self.require_signed = require_signed
        self.require_encrypted = require_encrypted and side == "server"
        self.replay_window = replay_window
        if epoch is None:
            if identity.key_dir is None:
                raise SecurityConfigError(f"{identity.id}: no key folder to keep the session counter in")
            epoch = next_epoch(identity.key_dir)
        self.epoch = epoch
        self._verifiers: dict[bytes, Ed25519PublicKey] = {}
        self._ciphers: dict[tuple[str, int, bytes], AESGCM] = {}
        # replay state per (sender, its Ed25519 key): a device re-keyed under the same id
        # (fedfleet keys enroll --replace) starts its sessions at epoch 1 again
        folder = identity.key_dir if isinstance(replay_state, str) and replay_state == "key_dir" else replay_state
        self.replay_store = ReplayStore(folder, window_size=replay_window) if folder is not None else None
        self._state: dict[tuple[str, bytes], Session] = self.replay_store.sessions if self.replay_store else {}
        self._round = 0
        self._lock = threading.Lock()
        self.rejections: dict[str, int] = {}
        self.cipher: AESGCM | None = None
        if side == "agent":
            server = self._peer(SERVER_ID)
            if server is None:
                raise SecurityConfigError(f"{identity.id}: signing is on but the server's public key is not pinned "
                                          f"(--server-pubkey FILE)")
            if encrypt:
                me = identity.public
                self.cipher = AESGCM(upload_key(identity.exchange_key, server.x25519, sender=identity.id,
                                                epoch=epoch, device_x25519=me.x25519, server_x25519=server.x25519))
        elif encrypt:
            raise SecurityConfigError("the server does not encrypt its messages (downloads are signed only)")

    def close(self) -> None:
        """Close the replay state's journal cleanly (idempotent). Not calling it loses nothing
        unless the host goes down too (see :class:`ReplayStore`)."""
        if self.replay_store is not None:
            with self._lock:
                self.replay_store.close()

    # ------------------------------------------------------------------ sending

    @property
    def max_overhead(self) -> int:
        """Most bytes :meth:`seal` adds (see :data:`MAX_SEAL_BYTES`)."""
        return MAX_SEAL_BYTES

    def seal(self, topic: str, payload: bytes) -> Sealed:
        """Sign (and on a device with encryption on, encrypt) one unsigned payload for ``topic``.

        Raises:
            MalformedMessage: ``payload`` is not an unsigned envelope.
        """
        return seal(payload, topic, signing_key=self.identity.signing_key, epoch=self.epoch, cipher=self.cipher)

    def note_sent(self, kind: Kind, round: int) -> None:
        """A server that opens round ``round`` (sends ``global``/``round_start``) moves its current round."""
        if self.side == "server" and kind in _ROUND_OPENERS:
            with self._lock:
                self._round = max(self._round, round)

    @property
    def current_round(self) -> int:
        """The round the receiver judges round-bound messages against (0: none yet)."""
        return self._round

    # ------------------------------------------------------------------ receiving

    def _peer(self, sender: str) -> PublicIdentity | None:
        return self.peers.get(sender)

    def _verifier(self, pub: PublicIdentity) -> Ed25519PublicKey:
        v = self._verifiers.get(pub.ed25519)
        if v is None:
            if len(self._verifiers) > 100_000:
                self._verifiers.clear()
            v = self._verifiers[pub.ed25519] = Ed25519PublicKey.from_public_bytes(pub.ed25519)
        return v

    def _upload_cipher(self, pub: PublicIdentity, epoch: int) -> AESGCM:
        key = (pub.id, epoch, pub.x25519)
        c = self._ciphers.get(key)
        if c is None:
            me = self.identity.public
            for k in [k for k in self._ciphers if k[0] == pub.id]:
                del self._ciphers[k]
            c = self._ciphers[key] = AESGCM(upload_key(self.identity.exchange_key, pub.x25519, sender=pub.id,
                                                       epoch=epoch, device_x25519=pub.x25519,
                                                       server_x25519=me.x25519))
        return c

    def open(self, topic: str, topic_client: str | None, direction: str, payload: bytes) -> Opened:
        """Verify (and decrypt) one received payload before its body is decoded.

        Args:
            topic: where it arrived.
            topic_client: the topic's client id (``None`` on broadcast topics).
            direction: ``"up"``, ``"status"`` or ``"down"`` (the topic's).
            payload: the PUBLISH payload.

        Returns:
            :class:`Opened` (its ``payload`` is what :func:`protocol.messages.decode` takes).

        Raises:
            SecurityRejection: with one of the :data:`REASONS` codes.
            MalformedMessage, UnsupportedVersion, UnknownKind, FieldError: a malformed header.
        """
        try:
            return self._open(topic, topic_client, direction, payload)
        except SecurityRejection as exc:
            with self._lock:
                self.rejections[exc.code] = self.rejections.get(exc.code, 0) + 1
            raise

    def _open(self, topic: str, topic_client: str | None, direction: str, payload: bytes) -> Opened:
        parts = split_envelope(payload)
        if parts.elements == 7:
            if self.require_signed:
                raise _reject("unsigned", f"{Kind(parts.kind).label} from {parts.sender!r} carries no signature")
            return Opened(payload)
        expected = SERVER_ID if direction == "down" else topic_client
        if parts.sender != expected:
            raise _reject("sender_mismatch", f"envelope sender {parts.sender!r} on a topic of {expected!r}",
                          field="envelope.sender")
        pub = self._peer(parts.sender)
        if pub is None:
            raise _reject("unenrolled", f"{parts.sender!r} is not enrolled with this server"
                          if self.side == "server" else f"no pinned key for {parts.sender!r}", field="envelope.sender")
        sec = read_sec(parts, payload)
        verify_sealed(payload, topic, parts, sec, self._verifier(pub))
        encrypted = bool(sec.flags & FLAG_ENCRYPTED)
        kind = Kind(parts.kind)
        if self.require_encrypted and not encrypted:
            raise _reject("unencrypted", f"{kind.label} from {parts.sender!r} is not encrypted")
        with self._lock:
            peer = (parts.sender, pub.ed25519)
            state = self._state.get(peer)
            if state is not None and sec.epoch < state.epoch:
                raise _reject("stale_epoch", f"{parts.sender!r} session {sec.epoch}, session {state.epoch} already "
                                             f"seen", field="envelope.sec.epoch")
            cur = self._round
            if parts.round > 0 and cur > 0 and (parts.round < cur - 1 or (self.side == "server" and parts.round > cur)):
                raise _reject("wrong_round", f"{kind.label} of round {parts.round} from {parts.sender!r}; the current "
                                             f"round is {cur}", field="envelope.round")
            session = state if state is not None and state.epoch == sec.epoch else None
            window = session.window if session is not None else ReplayWindow(self.replay_window)
            will = parts.seq == 0 and kind is Kind.STATUS
            if will and session is not None and session.will_taken:
                raise _reject("replayed", f"last will of {parts.sender!r} (session {sec.epoch}) already received, and "
                                          f"nothing from it since", field="envelope.seq")
            if not will and window.seen(parts.seq):
                raise _reject("replayed", f"{kind.label} seq {parts.seq} of {parts.sender!r} (session {sec.epoch}) "
                                          f"was already received", field="envelope.seq")
            if encrypted:
                if self.side != "server":
                    raise _reject("decrypt_failed", "encrypted downloads are not part of protocol v1")
                p0 = memoryview(payload)[:parts.body_start]
                try:
                    plain = self._upload_cipher(pub, sec.epoch).decrypt(aead_nonce(parts.seq), parts.body,
                                                                        aead_aad(topic, p0))
                except InvalidTag:
                    raise _reject("decrypt_failed", f"the AES-GCM tag of {parts.sender!r}'s body does not verify",
                                  field="envelope.body") from None
                except SecurityConfigError as exc:
                    raise _reject("decrypt_failed", str(exc)) from None
            new_session = session is None
            if session is None:
                session = self._state[peer] = Session(sec.epoch, window)
            if will:
                session.will_taken = True
            else:
                window.add(parts.seq)
                session.will_taken = False
            if self.replay_store is not None:  # before the message is handed on (see ReplayStore)
                self.replay_store.record(peer, sec.epoch, None if will else parts.seq, new_session=new_session)
            if self.side == "agent" and kind in _ROUND_OPENERS:
                self._round = max(self._round, parts.round)
        sig_bytes = len(payload) - parts.body_end
        if not encrypted:
            return Opened(payload, sig_bytes, 0, sec.epoch, False)
        inner = unsealed(payload, parts, plain)
        return Opened(inner, sig_bytes, len(payload) - len(inner) - sig_bytes, sec.epoch, True)
