"""Signed and encrypted messages, device keys and enrolment (sans-I/O except the key files).

Security (normative, protocol version 1)
----------------------------------------

When a federation runs with signing on, every payload is a **sealed envelope**: the envelope of
§2 with one more element, ``sec``, appended as its 8th (and last) element::

    [version, kind, round, sender, seq, timestamp_ms, body, sec]
    sec = [epoch, flags, body_bytes, check, signature]

===============  ==========  ===============================================================
field            msgpack     meaning
===============  ==========  ===============================================================
epoch            uint        the sender's session number, ≥ 1; strictly increasing across the
                             sender's restarts (a counter persisted in its key folder)
flags            uint        bit 0: ``body`` is encrypted (AES-256-GCM); other bits are 0
body_bytes       uint        length of ``body`` as sent (the ciphertext when encrypted)
check            bin8 (8)    SHA-256(topic)[0:4] ‖ SHA-256(body)[0:4], lets a receiver say *what*
                             changed when a signature fails (diagnostic only; it is signed)
signature        bin8 (64)   Ed25519 signature (RFC 8032), always the last 66 bytes of the payload
                             (``c4 40`` + 64 bytes)
===============  ==========  ===============================================================

Elements a later version adds to ``sec`` go between ``check`` and ``signature``; receivers
ignore them (they are signed). An unsigned envelope keeps its 7 elements and its exact bytes.

**What is signed.** With ``P0`` = the payload bytes before the body's content (array header,
header fields and the body's ``bin`` header), ``B`` = the body's content and ``P1`` = the bytes
between the body and the signature's ``bin`` header (the ``sec`` array header, ``epoch``,
``flags``, ``body_bytes``, ``check``)::

    TBS = "fedfleet/v1 signature" 00 ‖ u16be(len(topic)) ‖ topic (UTF-8) ‖ P0 ‖ SHA-256(B) ‖ P1
    signature = Ed25519-Sign(sender's signing key, TBS)

so the topic, every header field (round and seq included), the epoch, the flags and the body are
bound by one signature, and the receiver verifies it **before it parses the body** (hashing the
body is not parsing it). The body enters through its SHA-256 (FIPS 180-4), so a large body is
read once, not twice as pure Ed25519 would.

**Encryption** (uploads, optional): ``body`` is AES-256-GCM (NIST SP 800-38D) of the plaintext
body with a 16-byte tag appended; the key is per (device, epoch)::

    shared = X25519(device x25519 key, server x25519 key)                       (RFC 7748)
    key    = HKDF-SHA256(salt = "fedfleet/v1 hkdf salt", ikm = shared,          (RFC 5869)
                         info = "fedfleet/v1 upload key" 00 ‖ sender 00 ‖ u64be(epoch)
                                ‖ device x25519 public ‖ server x25519 public, L = 32)
    nonce  = 00 00 00 00 ‖ u64be(seq)          (unique: seq never repeats within an epoch)
    aad    = "fedfleet/v1 aead" 00 ‖ u16be(len(topic)) ‖ topic ‖ P0

Encryption comes first, then the signature covers the ciphertext (encrypt-then-sign), so a
receiver rejects a forged or altered message before it decrypts anything. Only the body is
encrypted: the broker and other subscribers see the topic, the header fields and the sizes.

**Chunked transfers.** A message larger than the chunk size is cut into ``chunk`` messages as in
§5b from its *unsealed* payload; each chunk is then sealed (signed, and its body encrypted on
uploads) like any other message. The whole is authenticated by its chunks (each carries the
SHA-256 of the whole and comes from the same verified sender); receipts carry the SHA-256 of the
unsealed whole.

**Receivers** check, in this order, and reject with the reason code in brackets: a sealed
envelope where one is required [``unsigned``]; the sender against the topic (``up``/``status``:
the topic's client id; ``down``: ``server``) [``sender_mismatch``]; a key for the sender (the
server: its allow-list of enrolled devices; a device: the pinned server key) [``unenrolled``];
the ``sec`` layout and flags [``bad_sec``]; ``check`` against the topic [``tampered_topic``];
``body_bytes`` against the body [``truncated_ciphertext`` / ``truncated_body`` /
``tampered_body``]; ``check`` against the body [``tampered_body``]; the signature
[``bad_signature``]; encryption where the server requires it [``unencrypted``]; then replay
protection: an epoch older than the newest seen from that sender [``stale_epoch``]; a
round-bound message (round > 0) more than one round behind the receiver's current round, or (at
the server) ahead of the round it opened [``wrong_round``]; a ``seq`` already seen in this epoch,
or older than the replay window (1,024 below the highest seen) [``replayed``]; finally the AEAD
tag [``decrypt_failed``]. Only then is the body decoded. ``seq`` 0 is the last will's, which the
broker may deliver once per lost connection: a ``status`` message with ``seq`` 0 is exempt from
the replay window, but is accepted only from the sender's newest session and once until the
sender sends another message [``replayed``] (a recorded will can still be replayed once after
each of the device's reconnections). No check uses a clock: ``timestamp_ms`` stays informational.

**Replay state survives restarts.** A receiver keeps each sender's newest epoch, the sequence
numbers seen in it and whether its will was taken in its key folder (``replay-state.json`` and
``replay-state.journal``, see :class:`ReplayStore`), so a restarted or resumed server still
refuses a device's messages from before its restart.

**Keys.** A node's key folder holds ``ed25519.key`` and ``x25519.key`` (PKCS #8 PEM, mode 0600),
``<id>.pub`` (the public identity, below), ``epoch`` (the session counter) and, once a channel
has run with signing on, ``replay-state.json`` and ``replay-state.journal``. A server's folder
also holds ``enrolled/<id>.pub``, its allow-list. A public identity is a text file::

    # fedfleet public identity v1
    id = "pi-07"
    ed25519 = "<base64 of the 32-byte Ed25519 public key>"
    x25519 = "<base64 of the 32-byte X25519 public key>"
    fingerprint = "<first 16 bytes of SHA-256(ed25519 ‖ x25519), hex>"
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import stat
import struct
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ._mpread import Reader, ReadError
from .errors import FieldError, MalformedMessage, SecurityConfigError, SecurityRejection, UnknownKind, UnsupportedVersion
from .messages import _BOUNDS, MAX_INT, PROTOCOL_VERSION, SERVER_ID, Kind, valid_id

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Constants of the format

SIGNATURE_BYTES = 64
"""Length of an Ed25519 signature (RFC 8032 §5.1.6)."""

CHECK_BYTES = 8
"""Length of ``sec.check``: 4 bytes of SHA-256(topic) and 4 of SHA-256(body)."""

TAG_BYTES = 16
"""Length of the AES-GCM authentication tag appended to an encrypted body (NIST SP 800-38D)."""

FLAG_ENCRYPTED = 0x01
"""``sec.flags`` bit: the body is AES-256-GCM ciphertext."""

MAX_SEAL_BYTES = 1 + 9 + 1 + 5 + (2 + CHECK_BYTES) + (2 + SIGNATURE_BYTES) + TAG_BYTES + 2
"""Most bytes sealing adds to a payload (110): the ``sec`` element at its widest (array header,
uint64 epoch, flags, uint32 body_bytes, check, signature) plus the GCM tag and a body ``bin``
header grown by 2 bytes. Used to decide chunking before sealing."""

DEFAULT_REPLAY_WINDOW = 1024
"""Sequence numbers remembered below the highest one seen per sender (RFC 4303 §3.4.3 style)."""

_SIG_CONTEXT = b"fedfleet/v1 signature\x00"
_AAD_CONTEXT = b"fedfleet/v1 aead\x00"
_HKDF_SALT = b"fedfleet/v1 hkdf salt"
_HKDF_INFO = b"fedfleet/v1 upload key\x00"
_SIG_BIN_HEADER = b"\xc4\x40"

#: Rejection reason codes (``Rejected.code``, the ledger ``reason`` prefix, ``metrics.jsonl``
#: ``rejected_by_reason``) with their help text. Codes are never reused or renamed.
REASONS: dict[str, str] = {
    "unsigned": "signing is on and the message carries no signature (a 7-element envelope)",
    "sender_mismatch": "the envelope's sender differs from the topic's client id (or, on a down topic, "
                       "is not the server): sender spoofing",
    "unenrolled": "no key for the sender: the device is not enrolled with the server (fedfleet keys enroll), "
                  "or was revoked",
    "bad_sec": "the security trailer is malformed: wrong element types, unknown flags, or the signature "
               "is not the last 66 bytes",
    "tampered_topic": "the message was signed for another topic (re-published elsewhere)",
    "truncated_ciphertext": "the encrypted body is shorter than the sender signed for",
    "truncated_body": "the body is shorter than the sender signed for",
    "tampered_body": "the body is not the one the sender signed (altered in transit)",
    "bad_signature": "the signature does not verify with the sender's key: forged, or the device's key does "
                     "not match the one enrolled",
    "unencrypted": "the server requires encrypted uploads and this one is plain",
    "stale_epoch": "from an older session (epoch) of the sender than one already seen: a replay from before "
                   "its restart",
    "wrong_round": "a round-bound message more than one round behind the receiver, or ahead of the round "
                   "the server opened: replayed from an earlier round, or forged for a later one",
    "replayed": "this sequence number of the sender's session was already received (or is older than the "
                "replay window)",
    "decrypt_failed": "the AES-GCM tag does not verify (wrong key, or a ciphertext the sender itself broke)",
}

#: Kinds that open a round: their ``round`` sets a receiver's current round.
_ROUND_OPENERS = (Kind.GLOBAL, Kind.ROUND_START)


def _reject(code: str, message: str, *, field: str | None = None) -> SecurityRejection:
    if code not in REASONS:  # pragma: no cover - programming error
        raise ValueError(f"unknown reason code {code!r}")
    return SecurityRejection(f"{code}: {message}", code=code, field=field)


# --------------------------------------------------------------------------------------------
# Identities and key files


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@dataclass(frozen=True, slots=True)
class PublicIdentity:
    """A node's public keys: what a server enrols and what a device pins.

    Attributes:
        id: the node id (a client id, or ``"server"``).
        ed25519: raw Ed25519 public key, 32 bytes (RFC 8032 §5.1.5).
        x25519: raw X25519 public key, 32 bytes (RFC 7748 §5).
    """

    id: str
    ed25519: bytes
    x25519: bytes

    @property
    def fingerprint(self) -> str:
        """First 16 bytes of SHA-256(ed25519 ‖ x25519) as 32 hex digits (safe to log and compare)."""
        return hashlib.sha256(self.ed25519 + self.x25519).hexdigest()[:32]

    def to_text(self) -> str:
        """The public identity file's text (see the module docstring)."""
        return (f"# fedfleet public identity v1\nid = \"{self.id}\"\ned25519 = \"{_b64(self.ed25519)}\"\n"
                f"x25519 = \"{_b64(self.x25519)}\"\nfingerprint = \"{self.fingerprint}\"\n")

    @classmethod
    def from_text(cls, text: str, source: str = "<text>") -> PublicIdentity:
        """Parse a public identity file.

        Raises:
            SecurityConfigError: a missing or malformed line, a key that is not 32 bytes or not a
                valid point, or a ``fingerprint`` line that does not match the keys.
        """
        values: dict[str, str] = {}
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            m = re.fullmatch(r'([a-z0-9_]+)\s*=\s*"([^"]*)"', line)
            if not m:
                raise SecurityConfigError(f"{source}:{n}: not a public identity line: {line[:60]!r}", path=source)
            values[m.group(1)] = m.group(2)
        for key in ("id", "ed25519", "x25519"):
            if key not in values:
                raise SecurityConfigError(f"{source}: no {key} = \"...\" line: not a fedfleet public identity file "
                                          f"(fedfleet keys gen writes <id>.pub)", path=source)
        if not valid_id(values["id"]):
            raise SecurityConfigError(f"{source}: id {values['id']!r} is not a valid node id", path=source)
        keys = {}
        for key in ("ed25519", "x25519"):
            try:
                raw = base64.b64decode(values[key], validate=True)
            except ValueError:
                raw = b""
            if len(raw) != 32:
                raise SecurityConfigError(f"{source}: {key} is not the base64 of 32 bytes", path=source)
            keys[key] = raw
        ident = cls(values["id"], keys["ed25519"], keys["x25519"])
        try:
            Ed25519PublicKey.from_public_bytes(ident.ed25519)
            X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(ident.x25519))
        except ValueError as exc:
            raise SecurityConfigError(f"{source}: not a usable public key ({exc})", path=source) from None
        if "fingerprint" in values and values["fingerprint"] != ident.fingerprint:
            raise SecurityConfigError(f"{source}: fingerprint {values['fingerprint']} does not match its keys "
                                      f"({ident.fingerprint}): the file was altered", path=source)
        return ident


def load_public(path: str | os.PathLike) -> PublicIdentity:
    """Read a public identity file (``<id>.pub``).

    Raises:
        SecurityConfigError: the file is missing, unreadable or malformed.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SecurityConfigError(f"public key file {p} does not exist", path=str(p)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SecurityConfigError(f"cannot read public key file {p}: {exc}", path=str(p)) from exc
    return PublicIdentity.from_text(text, str(p))


@dataclass(frozen=True)
class Identity:
    """A node's key pair: Ed25519 for signatures (RFC 8032), X25519 for key agreement (RFC 7748).

    The private keys never appear in ``repr()``, logs or error messages.

    Attributes:
        id: the node id.
        signing_key: the Ed25519 private key.
        exchange_key: the X25519 private key.
        key_dir: the folder it was loaded from (holds the ``epoch`` counter), or ``None``.
    """

    id: str
    signing_key: Ed25519PrivateKey = field(repr=False)
    exchange_key: X25519PrivateKey = field(repr=False)
    key_dir: Path | None = None

    @property
    def public(self) -> PublicIdentity:
        """The public half."""
        raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
        return PublicIdentity(self.id, self.signing_key.public_key().public_bytes(*raw),
                              self.exchange_key.public_key().public_bytes(*raw))


SIGNING_KEY_FILE = "ed25519.key"
EXCHANGE_KEY_FILE = "x25519.key"
EPOCH_FILE = "epoch"
ENROLLED_DIR = "enrolled"


def generate_identity(node_id: str) -> Identity:
    """Fresh random keys for ``node_id`` (from the operating system's CSPRNG via ``cryptography``).

    Raises:
        ValueError: ``node_id`` is not a valid id.
    """
    if not valid_id(node_id):
        raise ValueError(f"node id {node_id!r} must be 1-64 chars of A-Za-z0-9_.- (not starting with . - _)")
    return Identity(node_id, Ed25519PrivateKey.generate(), X25519PrivateKey.generate())


def _write_private(path: Path, data: bytes) -> None:
    """Create ``path`` with mode 0600 from the start (never readable by others, not even briefly)."""
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_key_dir(identity: Identity, directory: str | os.PathLike, *, force: bool = False) -> Path:
    """Write ``identity`` to a key folder: the two private keys (PKCS #8 PEM, mode 0600), the
    public identity ``<id>.pub`` (0644) and an ``epoch`` counter at 0; the folder is made 0700.

    Returns:
        The path of the public identity file.

    Raises:
        SecurityConfigError: keys already exist there (and ``force`` is false), or the folder
            cannot be written.
    """
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        if not force:
            for name in (SIGNING_KEY_FILE, EXCHANGE_KEY_FILE):
                if (d / name).exists():
                    raise SecurityConfigError(f"{d / name} already exists: keys are never overwritten silently "
                                              f"(use --force to replace them, then enrol the new public key)",
                                              path=str(d / name))
        if os.name == "posix":
            os.chmod(d, 0o700)
        pem = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        _write_private(d / SIGNING_KEY_FILE, identity.signing_key.private_bytes(*pem))
        _write_private(d / EXCHANGE_KEY_FILE, identity.exchange_key.private_bytes(*pem))
        _write_private(d / EPOCH_FILE, b"0\n")
        pub = d / f"{identity.id}.pub"
        pub.write_text(identity.public.to_text(), encoding="utf-8")
        if os.name == "posix":
            os.chmod(pub, 0o644)
    except OSError as exc:
        raise SecurityConfigError(f"cannot write keys to {d}: {exc}", path=str(d)) from exc
    return pub


def _read_private(path: Path) -> Any:
    if not path.is_file():
        raise SecurityConfigError(f"private key {path} does not exist; create the key folder with "
                                  f"`fedfleet keys gen --out {path.parent} --id ID`", path=str(path))
    if os.name == "posix":
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise SecurityConfigError(f"private key {path} has permissions {mode:04o}: others may read it. Run "
                                      f"`chmod 600 {path}` (and make sure nobody copied it)", path=str(path))
    try:
        return serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise SecurityConfigError(f"{path} is not an unencrypted PKCS #8 PEM private key ({type(exc).__name__})",
                                  path=str(path)) from None


def load_identity(directory: str | os.PathLike, *, expected_id: str | None = None) -> Identity:
    """Load the key folder written by :func:`write_key_dir`.

    Args:
        directory: the key folder.
        expected_id: the node id the keys must belong to (``--client-id``), or ``None``.

    Raises:
        SecurityConfigError: a missing key file, a private key readable by group/others, a file
            that is not the expected key type, no (or more than one) ``<id>.pub``, or keys of
            another node id.
    """
    d = Path(directory)
    if not d.is_dir():
        raise SecurityConfigError(f"key folder {d} does not exist; create it with `fedfleet keys gen --out {d}`",
                                  path=str(d))
    sk = _read_private(d / SIGNING_KEY_FILE)
    xk = _read_private(d / EXCHANGE_KEY_FILE)
    if not isinstance(sk, Ed25519PrivateKey):
        raise SecurityConfigError(f"{d / SIGNING_KEY_FILE} is not an Ed25519 key", path=str(d / SIGNING_KEY_FILE))
    if not isinstance(xk, X25519PrivateKey):
        raise SecurityConfigError(f"{d / EXCHANGE_KEY_FILE} is not an X25519 key", path=str(d / EXCHANGE_KEY_FILE))
    pubs = sorted(d.glob("*.pub"))
    if len(pubs) != 1:
        raise SecurityConfigError(f"{d}: expected exactly one <id>.pub file, found {len(pubs)}", path=str(d))
    pub = load_public(pubs[0])
    ident = Identity(pub.id, sk, xk, d)
    if ident.public != pub:
        raise SecurityConfigError(f"{pubs[0]} does not hold the public keys of the private keys in {d}", path=str(d))
    if expected_id is not None and ident.id != expected_id:
        raise SecurityConfigError(f"the keys in {d} belong to {ident.id!r}, not {expected_id!r}: use that folder's "
                                  f"device id, or generate keys for {expected_id!r}", path=str(d))
    return ident


def next_epoch(directory: str | os.PathLike) -> int:
    """Increment and return the session counter in ``directory/epoch`` (written and synced
    before it is used, so a restarted node never reuses an epoch, and no clock is needed).

    Raises:
        SecurityConfigError: the counter cannot be read or written.
    """
    path = Path(directory) / EPOCH_FILE
    try:
        text = path.read_text(encoding="ascii").strip() if path.exists() else "0"
        value = int(text or "0")
        if not 0 <= value < MAX_INT:
            raise ValueError(value)
        _write_private(path, f"{value + 1}\n".encode("ascii"))
    except (OSError, ValueError) as exc:
        raise SecurityConfigError(f"cannot advance the session counter {path}: {exc}. The key folder must be "
                                  f"writable", path=str(path)) from None
    return value + 1


def enroll(server_dir: str | os.PathLike, public: PublicIdentity | str | os.PathLike, *,
           replace: bool = False) -> tuple[PublicIdentity, Path]:
    """Add a device's public identity to the server's allow-list (``server_dir/enrolled/<id>.pub``).

    Raises:
        SecurityConfigError: the file is not a public identity, its id is ``server``, or another
            key is already enrolled under that id (and ``replace`` is false).
    """
    pub = public if isinstance(public, PublicIdentity) else load_public(public)
    if pub.id == SERVER_ID:
        raise SecurityConfigError("that is a server's public key: enrol device keys; devices pin the server's key "
                                  "with --server-pubkey")
    d = Path(server_dir) / ENROLLED_DIR
    target = d / f"{pub.id}.pub"
    try:
        d.mkdir(parents=True, exist_ok=True)
        if target.exists() and not replace:
            old = load_public(target)
            if old == pub:
                return pub, target
            raise SecurityConfigError(f"{pub.id} is already enrolled with another key ({old.fingerprint}); "
                                      f"use --replace to enrol the new one ({pub.fingerprint})", path=str(target))
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(pub.to_text(), encoding="utf-8")
        os.replace(tmp, target)
    except OSError as exc:
        raise SecurityConfigError(f"cannot enrol into {d}: {exc}", path=str(d)) from exc
    return pub, target


def revoke(server_dir: str | os.PathLike, node_id: str) -> bool:
    """Remove ``node_id`` from the allow-list; True when it was enrolled."""
    target = Path(server_dir) / ENROLLED_DIR / f"{node_id}.pub"
    if not valid_id(node_id) or not target.exists():
        return False
    target.unlink()
    return True


def list_enrolled(server_dir: str | os.PathLike) -> list[PublicIdentity]:
    """Every enrolled device, by id.

    Raises:
        SecurityConfigError: an enrolled file is malformed or named after another id.
    """
    out = []
    for p in sorted((Path(server_dir) / ENROLLED_DIR).glob("*.pub")):
        pub = load_public(p)
        if p.name != f"{pub.id}.pub":
            raise SecurityConfigError(f"{p} holds the key of {pub.id!r}: enrolled files are named <id>.pub",
                                      path=str(p))
        out.append(pub)
    return out


class AllowList:
    """The enrolled devices of a server, read from ``server_dir/enrolled/`` and re-read (at most
    once a second) when that folder changes, so ``fedfleet keys enroll`` / ``revoke`` take effect
    without a restart.

    Args:
        server_dir: the server's key folder, or ``None`` for a fixed set.
        extra: identities allowed besides the enrolled ones (virtual agents of a simulation).

    Raises:
        SecurityConfigError: from the first read.
    """

    def __init__(self, server_dir: str | os.PathLike | None, extra: Mapping[str, PublicIdentity] | None = None) -> None:
        self.dir = Path(server_dir) / ENROLLED_DIR if server_dir is not None else None
        self.extra = dict(extra or {})
        self._keys: dict[str, PublicIdentity] = {}
        self._mtime = None
        self._checked = 0.0
        self._lock = threading.Lock()
        self._reload(force=True)

    def _reload(self, force: bool = False) -> None:
        if self.dir is None:
            return
        now = time.monotonic()
        if not force and now - self._checked < 1.0:
            return
        self._checked = now
        try:
            mtime = self.dir.stat().st_mtime_ns
        except OSError:
            mtime = None
        if mtime == self._mtime and not force:
            return
        if force:  # the first read: a malformed file is the operator's to fix before start-up
            self._keys = {p.id: p for p in list_enrolled(self.dir.parent)} if mtime is not None else {}
            self._mtime = mtime
            return
        # a live re-read: one malformed or half-written file must not freeze the list (a revocation
        # or an enrolment made next to it would silently not apply): it is skipped, and the folder
        # is read again a second later until every file parses
        keys: dict[str, PublicIdentity] = {}
        clean = True
        for path in sorted(self.dir.glob("*.pub")) if mtime is not None else []:
            try:
                pub = load_public(path)
            except SecurityConfigError:
                clean = False
                continue
            if path.name != f"{pub.id}.pub":
                clean = False
                continue
            keys[pub.id] = pub
        self._keys = keys
        self._mtime = mtime if clean else None

    def get(self, node_id: str) -> PublicIdentity | None:
        """The enrolled identity of ``node_id``, or ``None``."""
        with self._lock:
            if node_id in self.extra:
                return self.extra[node_id]
            try:
                self._reload()  # at most one stat() a second: enrolments and revocations apply live
            except SecurityConfigError:
                pass  # a half-written file: keep the previous list
            return self._keys.get(node_id)

    def add(self, pub: PublicIdentity) -> None:
        """Allow ``pub`` for this process's lifetime (not written anywhere)."""
        with self._lock:
            self.extra[pub.id] = pub

    def ids(self) -> list[str]:
        """Every allowed id."""
        with self._lock:
            return sorted(set(self._keys) | set(self.extra))


# --------------------------------------------------------------------------------------------
# The sealed envelope (pure functions)


@dataclass(frozen=True, slots=True)
class EnvelopeParts:
    """A payload split at its body, without parsing the body.

    Attributes:
        version, kind, round, sender, seq, timestamp_ms: the header fields.
        body: the body's content (a view on the payload).
        body_header_start: offset of the body's ``bin`` header in the payload (bytes).
        body_start, body_end: offsets of the body's content in the payload (bytes).
        sec: the ``sec`` element as read (``None`` for an unsigned 7-element envelope).
        sec_start: offset of ``sec`` in the payload (``len(payload)`` when unsigned).
        elements: number of envelope elements.
    """

    version: int
    kind: int
    round: int
    sender: str
    seq: int
    timestamp_ms: int
    body: memoryview
    body_header_start: int
    body_start: int
    body_end: int
    sec: list | None
    sec_start: int
    elements: int


def _uint(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INT:
        raise FieldError(f"{name}: expected an unsigned integer, got {value!r}"[:200], field=name)
    return value


def split_envelope(payload: bytes | memoryview) -> EnvelopeParts:
    """Read an envelope's header and locate its body and ``sec`` without parsing the body.

    Checks version (first) and kind (second) like :func:`protocol.messages.decode`, and the
    header field types; the body is located, not decoded.

    Raises:
        MalformedMessage, UnsupportedVersion, UnknownKind, FieldError: a violation.
    """
    r = Reader(payload, **_BOUNDS)
    try:
        if r.n == 0:
            raise ReadError("empty payload")
        b = r.mv[r._take(1)]
        if 0x90 <= b <= 0x9F:
            n = b & 0x0F
        elif b == 0xDC:
            n = r._u(struct.Struct(">H"))
        else:
            raise ReadError("the envelope is not a short array")
        if n < 7:
            raise MalformedMessage(f"envelope: expected 7 fields, got {n}", field="envelope")
        head = [r.read(1) for _ in range(6)]
        version = head[0]
        if isinstance(version, bool) or not isinstance(version, int):
            raise MalformedMessage("envelope.version: expected int", field="envelope.version")
        if version != PROTOCOL_VERSION:
            raise UnsupportedVersion(f"protocol version {version} is not supported (this side speaks "
                                     f"{PROTOCOL_VERSION})", field="envelope.version")
        try:
            kind = Kind(_uint(head[1], "envelope.kind"))
        except ValueError:
            raise UnknownKind(f"unknown message kind {head[1]}", field="envelope.kind") from None
        rnd = _uint(head[2], "envelope.round")
        sender = head[3]
        if not isinstance(sender, str) or not valid_id(sender):
            raise FieldError(f"envelope.sender {str(sender)[:80]!r} is not a valid client id", field="envelope.sender")
        seq, ts = _uint(head[4], "envelope.seq"), _uint(head[5], "envelope.timestamp_ms")
        body_header_start = r.pos
        body = r.read(1)
        if not isinstance(body, memoryview):
            raise MalformedMessage("envelope.body: expected bin", field="envelope.body")
        body_end = r.pos
        sec, sec_start = None, r.n
        if n >= 8:
            sec_start = r.pos
            sec = r.read(1)
            for _ in range(n - 8):
                r.read(1)
        if r.pos != r.n:
            raise ReadError(f"{r.n - r.pos} bytes after the envelope")
    except ReadError as exc:
        raise MalformedMessage(f"envelope: not a valid msgpack value ({exc})", field="envelope") from None
    except MemoryError:
        raise FieldError("envelope: too large to decode in the memory available", field="envelope") from None
    return EnvelopeParts(version, int(kind), rnd, sender, seq, ts, body, body_header_start, body_end - len(body),
                         body_end, sec, sec_start, n)


def _bin_header(n: int) -> bytes:
    if n < 256:
        return b"\xc4" + bytes([n])
    if n < 65536:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _uint_bytes(v: int) -> bytes:
    if v < 128:
        return bytes([v])
    if v < 256:
        return b"\xcc" + bytes([v])
    if v < 65536:
        return b"\xcd" + v.to_bytes(2, "big")
    if v < 1 << 32:
        return b"\xce" + v.to_bytes(4, "big")
    return b"\xcf" + v.to_bytes(8, "big")


def _topic_bytes(topic: str) -> bytes:
    t = topic.encode("utf-8")
    if len(t) > 65535:
        raise FieldError("topic longer than 65,535 bytes", field="topic")
    return len(t).to_bytes(2, "big") + t


def signed_bytes(topic: str, p0: bytes | memoryview, body_sha256: bytes, p1: bytes | memoryview) -> bytes:
    """The to-be-signed string ``TBS`` (module docstring): context ‖ topic ‖ P0 ‖ SHA-256(B) ‖ P1."""
    return b"".join((_SIG_CONTEXT, _topic_bytes(topic), p0, body_sha256, p1))


def aead_nonce(seq: int) -> bytes:
    """The 96-bit AES-GCM nonce of message ``seq``: 4 zero bytes ‖ u64be(seq) (NIST SP 800-38D §8.2.1,
    deterministic construction; unique because ``seq`` never repeats within an epoch's key)."""
    return b"\x00\x00\x00\x00" + seq.to_bytes(8, "big")


def aead_aad(topic: str, p0: bytes | memoryview) -> bytes:
    """Associated data of an encrypted body: context ‖ u16be(len(topic)) ‖ topic ‖ P0."""
    return b"".join((_AAD_CONTEXT, _topic_bytes(topic), p0))


def upload_key(own: X25519PrivateKey, peer_x25519: bytes, *, sender: str, epoch: int, device_x25519: bytes,
               server_x25519: bytes) -> bytes:
    """The 32-byte AES-256-GCM key of ``sender``'s uploads in session ``epoch``.

    X25519 (RFC 7748) between the two static keys, then HKDF-SHA256 (RFC 5869) with the salt and
    info of the module docstring. Either side computes it: the device with its key and the
    server's public key, the server with its key and the device's public key.

    Raises:
        SecurityConfigError: the peer key is a low-order point (the shared secret would be 0).
    """
    try:
        shared = own.exchange(X25519PublicKey.from_public_bytes(peer_x25519))
    except ValueError as exc:
        raise SecurityConfigError(f"X25519 with the key of {sender!r} failed ({exc})") from None
    info = b"".join((_HKDF_INFO, sender.encode("utf-8"), b"\x00", epoch.to_bytes(8, "big"), device_x25519,
                     server_x25519))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=_HKDF_SALT, info=info).derive(shared)


@dataclass(frozen=True, slots=True)
class Sealed:
    """A sealed payload and what sealing added.

    Attributes:
        payload: the bytes to publish.
        sig_bytes: bytes of the ``sec`` element (signature, epoch, flags, length, check).
        enc_bytes: bytes encryption added (GCM tag + growth of the body's ``bin`` header); 0 when plain.
    """

    payload: bytes
    sig_bytes: int
    enc_bytes: int


def seal(payload: bytes, topic: str, *, signing_key: Ed25519PrivateKey, epoch: int,
         cipher: AESGCM | None = None) -> Sealed:
    """Seal an unsigned (7-element) payload for ``topic``: encrypt its body when ``cipher`` is
    given (AES-256-GCM, NIST SP 800-38D; nonce from ``seq``), then sign (Ed25519, RFC 8032).

    Args:
        payload: the output of :func:`protocol.messages.encode` (bytes).
        topic: the MQTT topic it will be published on.
        signing_key: the sender's Ed25519 key.
        epoch: the sender's session number (≥ 1; 0 only in tests).
        cipher: the sender's upload cipher (:func:`upload_key`), or ``None``: sign only.

    Returns:
        :class:`Sealed`; ``len(payload) + sig_bytes + enc_bytes`` = ``len(sealed.payload)``.

    Raises:
        MalformedMessage, FieldError: ``payload`` is not an unsigned envelope.
    """
    parts = split_envelope(payload)
    if parts.elements != 7:
        raise MalformedMessage("seal: the payload is already sealed (or has extra elements)", field="envelope")
    mv = memoryview(payload)
    body: bytes | memoryview = parts.body
    flags = 0
    enc_bytes = 0
    if cipher is not None:
        ct_len = len(body) + TAG_BYTES
        ct_header = _bin_header(ct_len)
        p0 = b"".join((b"\x98", mv[1:parts.body_header_start], ct_header))
        body = cipher.encrypt(aead_nonce(parts.seq), body, aead_aad(topic, p0))
        flags |= FLAG_ENCRYPTED
        enc_bytes = TAG_BYTES + len(ct_header) - (parts.body_start - parts.body_header_start)
    else:
        p0 = b"".join((b"\x98", mv[1:parts.body_start]))
    digest = hashlib.sha256(body).digest()
    check = hashlib.sha256(topic.encode("utf-8")).digest()[:4] + digest[:4]
    p1 = b"\x95" + _uint_bytes(epoch) + _uint_bytes(flags) + _uint_bytes(len(body)) + b"\xc4\x08" + check
    sig = signing_key.sign(signed_bytes(topic, p0, digest, p1))
    out = b"".join((p0, body, p1, _SIG_BIN_HEADER, sig))
    return Sealed(out, len(p1) + 2 + SIGNATURE_BYTES, enc_bytes)


@dataclass(frozen=True, slots=True)
class SecTrailer:
    """The ``sec`` element of a sealed envelope, checked for layout."""

    epoch: int
    flags: int
    body_bytes: int
    check: bytes
    signature: bytes


def read_sec(parts: EnvelopeParts, payload: bytes | memoryview) -> SecTrailer:
    """Validate the layout of ``parts.sec`` (module docstring).

    Raises:
        SecurityRejection: ``bad_sec``.
    """
    sec = parts.sec
    if parts.elements != 8 or not isinstance(sec, list) or len(sec) < 5:
        raise _reject("bad_sec", "the security trailer must be the 8th and last envelope element, an array of "
                                 "at least 5 elements", field="envelope.sec")
    epoch, flags, body_bytes, check, sig = sec[0], sec[1], sec[2], sec[3], sec[-1]
    for name, v in (("epoch", epoch), ("flags", flags), ("body_bytes", body_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_INT:
            raise _reject("bad_sec", f"sec.{name} is not an unsigned integer", field=f"envelope.sec.{name}")
    if flags & ~FLAG_ENCRYPTED:
        raise _reject("bad_sec", f"sec.flags {flags:#x} has bits this version does not know", field="envelope.sec.flags")
    if not isinstance(check, memoryview) or len(check) != CHECK_BYTES:
        raise _reject("bad_sec", "sec.check is not 8 bytes", field="envelope.sec.check")
    if (not isinstance(sig, memoryview) or len(sig) != SIGNATURE_BYTES
            or bytes(memoryview(payload)[-SIGNATURE_BYTES - 2:-SIGNATURE_BYTES]) != _SIG_BIN_HEADER):
        raise _reject("bad_sec", "the signature is not the last 66 bytes (c4 40 + 64)", field="envelope.sec.signature")
    return SecTrailer(epoch, flags, body_bytes, bytes(check), bytes(sig))


def verify_sealed(payload: bytes | memoryview, topic: str, parts: EnvelopeParts, sec: SecTrailer,
                  key: Ed25519PublicKey) -> bytes:
    """Check ``check``, ``body_bytes`` and the Ed25519 signature of a sealed payload, in the order
    of the module docstring. Returns SHA-256 of the body (32 bytes).

    Raises:
        SecurityRejection: ``tampered_topic``, ``truncated_ciphertext``, ``truncated_body``,
            ``tampered_body`` or ``bad_signature``.
    """
    mv = memoryview(payload)
    if hashlib.sha256(topic.encode("utf-8")).digest()[:4] != sec.check[:4]:
        raise _reject("tampered_topic", f"signed for another topic than {topic!r}", field="topic")
    n = len(parts.body)
    if n < sec.body_bytes:
        code = "truncated_ciphertext" if sec.flags & FLAG_ENCRYPTED else "truncated_body"
        raise _reject(code, f"body of {n} bytes, {sec.body_bytes} were signed", field="envelope.body")
    digest = hashlib.sha256(parts.body).digest()
    if n != sec.body_bytes or digest[:4] != sec.check[4:]:
        raise _reject("tampered_body", f"the body ({n} bytes) is not the one signed ({sec.body_bytes} bytes)",
                      field="envelope.body")
    tbs = signed_bytes(topic, mv[:parts.body_start], digest, mv[parts.body_end:len(mv) - SIGNATURE_BYTES - 2])
    try:
        key.verify(sec.signature, tbs)
    except InvalidSignature:
        raise _reject("bad_signature", f"the signature of {parts.sender!r} does not verify with its key",
                      field="envelope.sec.signature") from None
    return digest


def unsealed(payload: bytes | memoryview, parts: EnvelopeParts, body: bytes | memoryview) -> bytes:
    """The unsigned 7-element payload with ``body`` as its body (what the sender encoded)."""
    mv = memoryview(payload)
    return b"".join((b"\x97", mv[1:parts.body_header_start], _bin_header(len(body)), body))


# --------------------------------------------------------------------------------------------
# Replay state and the per-channel session


class ReplayWindow:
    """Sequence numbers seen in one sender's session: accepts each ``seq`` once; rejects those
    older than ``size`` below the highest seen (anti-replay window, RFC 4303 §3.4.3)."""

    __slots__ = ("size", "top", "bits")

    def __init__(self, size: int = DEFAULT_REPLAY_WINDOW) -> None:
        self.size = size
        self.top = -1
        self.bits = 0

    def seen(self, seq: int) -> bool:
        """Whether ``seq`` must be refused (already seen, or too old)."""
        if seq > self.top:
            return False
        d = self.top - seq
        return d >= self.size or bool(self.bits >> d & 1)

    def add(self, seq: int) -> None:
        """Record ``seq`` (after :meth:`seen` said False)."""
        if seq > self.top:
            self.bits = ((self.bits << (seq - self.top)) | 1) & ((1 << self.size) - 1) if self.top >= 0 else 1
            self.top = seq
        else:
            self.bits |= 1 << (self.top - seq)

    @classmethod
    def restored(cls, size: int, top: int, bits: int, saved_size: int) -> ReplayWindow:
        """A window of ``size`` from saved state (``top``, ``bits``, ``saved_size``): bits beyond
        the saved size were not kept, so when ``size`` is larger they count as seen (refused)."""
        w = cls(size)
        w.top = top
        if top >= 0:
            mask = (1 << size) - 1
            w.bits = (bits | (mask & ~((1 << saved_size) - 1))) & mask if size > saved_size else bits & mask
        return w


class Session:
    """Replay state of one sender's session (epoch) at a receiver.

    Attributes:
        epoch: the sender's newest session number seen.
        window: the sequence numbers seen in that session (:class:`ReplayWindow`).
        will_taken: a last will (``status``, ``seq`` 0) of this session was accepted and the sender
            has sent nothing since: the next one is refused as ``replayed``.
    """

    __slots__ = ("epoch", "window", "will_taken")

    def __init__(self, epoch: int, window: ReplayWindow, will_taken: bool = False) -> None:
        self.epoch = epoch
        self.window = window
        self.will_taken = will_taken


REPLAY_STATE_FILE = "replay-state.json"
"""Snapshot of a receiver's replay state in its key folder (see :class:`ReplayStore`)."""

REPLAY_JOURNAL_FILE = "replay-state.journal"
"""Messages accepted since the snapshot, one line each (see :class:`ReplayStore`)."""

REPLAY_SYNC_EVERY = 64
"""The journal is fsync'ed at least every this many records (and at every new session); also the
margin, in sequence numbers, refused above a session's saved highest ``seq`` when the journal's
tail may have been lost with the host (see :class:`ReplayStore`)."""

REPLAY_COMPACT_EVERY = 4096
"""Journal records after which the snapshot is rewritten and the journal started afresh."""

_STATE_FORMAT = "fedfleet replay state v1"
_STATE_KEYS = {"format", "owner", "generation", "boot_id", "window", "sessions"}
_JOURNAL_MAGIC = "fedfleet replay journal v1"
_boot_id_cache: list[str] = []


def _boot_id() -> str:
    """This boot of the operating system (Linux ``/proc/sys/kernel/random/boot_id``), or ``"-"``
    where there is none: files written in the same boot survive a process crash in the page cache."""
    if not _boot_id_cache:
        try:
            text = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
        except OSError:
            text = ""
        _boot_id_cache.append(text if re.fullmatch(r"[0-9A-Za-z-]{1,64}", text) else "-")
    return _boot_id_cache[0]


def _same_boot(boot_id: object) -> bool:
    """Whether a file written under ``boot_id`` was written in this boot (never when unknown)."""
    return boot_id != "-" and boot_id == _boot_id()


def _is_uint(value: object) -> bool:
    return type(value) is int and 0 <= value <= MAX_INT


def _fsync_dir(directory: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ReplayStore:
    """Durable replay state of one receiver, so that a restarted server (or device) still refuses
    the messages a sender sent before the restart: the newest epoch per (sender id, Ed25519 key),
    the sequence numbers seen in it (:class:`ReplayWindow`) and whether its last will was taken.

    Two files in the node's key folder (mode 0600, beside the ``epoch`` counter):

    * ``replay-state.json``, the snapshot, written atomically (temporary file, fsync, rename, fsync
      of the folder)::

          {"format": "fedfleet replay state v1", "owner": "<hex>", "generation": 3,
           "boot_id": "<id>", "window": 1024,
           "sessions": [{"id": "pi-07", "ed25519": "<hex>", "epoch": 2, "top": 57,
                         "bits": "<hex>", "will_taken": false}]}

    * ``replay-state.journal``: one text line per accepted message, appended (one ``write``,
      no fsync) before :meth:`ChannelSecurity.open` returns it::

          fedfleet replay journal v1 <owner> <generation> <boot_id>     header
          + <index> <id> <ed25519 hex>                                  a sender's first record
          <index> <epoch> <seq>                                         a message accepted
          <index> <epoch> w                                             a last will accepted
          end                                                           closed cleanly

    **Cost.** A record is 6-30 bytes (about 10 for seq < 10⁴) and one ``write(2)``; the journal is
    fsync'ed when a sender starts a new session (so a newest epoch is never forgotten, even with
    the host) and at least every :data:`REPLAY_SYNC_EVERY` records; the snapshot (about 400 bytes
    per sender with a full 1,024-message window) is rewritten every :data:`REPLAY_COMPACT_EVERY`
    records and when a process opens the store. Measured on the development machine (an fsync
    costs 2.3 ms there): 1.6 µs per record without fsync, 41 µs per record with the fsync every
    64 amortised (an Ed25519 verification is about as much), 29 ms per compaction of 1,000
    senders, 22 ms to open a store of 1,000 senders.

    **After a crash.** A killed process loses nothing: every accepted message was written before
    it was handed on, and the page cache outlives the process (detected by the same boot id). If
    the host itself went down (another boot id) and the journal was not closed cleanly, records
    after its last fsync may be lost; then, conservatively, every sender's saved session refuses
    ``seq`` up to its saved highest + :data:`REPLAY_SYNC_EVERY` and its next last will. A device
    that kept its session across that outage loses at most that many messages (typically part of
    one round); a device that restarts (a new epoch) is not affected.

    **Damaged files.** A missing snapshot starts empty (logged); an unreadable one is logged as a
    warning, kept as ``replay-state.json.corrupt`` and the state rebuilt from the journal alone;
    unreadable journal lines are skipped with a warning. Until a sender's next message, its
    forgotten older sessions could then be replayed. A write error (disk full, folder removed)
    is logged once and the state is kept in memory only from then on. Nothing here raises.

    **One receiver per folder.** The process that opens the store last owns it: it merges what
    it read and writes its own snapshot and journal; an earlier owner notices at its next
    compaction and stops writing (logged).

    Args:
        directory: the key folder.
        window_size: the receiver's replay window (sequence numbers).

    Attributes:
        sessions: ``{(sender id, Ed25519 public key bytes): Session}``, the state (read at
            construction; the receiver updates it and calls :meth:`record`).
        margin_applied: whether the crash margin was applied when it was read.
    """

    def __init__(self, directory: str | os.PathLike, *, window_size: int = DEFAULT_REPLAY_WINDOW) -> None:
        self.dir = Path(directory)
        self.state_path = self.dir / REPLAY_STATE_FILE
        self.journal_path = self.dir / REPLAY_JOURNAL_FILE
        self.window_size = window_size
        self.sessions: dict[tuple[str, bytes], Session] = {}
        self.margin_applied = False
        self._owner = os.urandom(8).hex()
        self._generation = 0
        self._index: dict[tuple[str, bytes], int] = {}
        self._fd: int | None = None
        self._records = 0
        self._unsynced = 0
        self._broken = False
        self._finalizer: weakref.finalize | None = None
        self._load()
        self._compact()

    # ---------------------------------------------------------------- reading

    def _load(self) -> None:
        snapshot = self._read_snapshot()
        owner, generation = (snapshot or {}).get("owner"), (snapshot or {}).get("generation")
        clean = snapshot is not None and _same_boot(snapshot.get("boot_id"))
        try:
            data = self.journal_path.read_bytes()
        except FileNotFoundError:
            data = None
        except OSError as exc:
            log.warning("replay state: cannot read %s (%s); using the snapshot alone", self.journal_path, exc)
            data = None
        if data is not None:
            applied, clean_j = self._apply_journal(data, owner, generation, snapshot is None)
            if applied:
                clean = clean_j
        if not clean and self.sessions:
            self.margin_applied = True
            for s in self.sessions.values():
                top = max(s.window.top, 0) + REPLAY_SYNC_EVERY
                s.window = ReplayWindow.restored(self.window_size, top, (1 << self.window_size) - 1, self.window_size)
                s.will_taken = True
            log.warning("replay state in %s: the host restarted (or cannot tell) since it was last synced, so up "
                        "to %d messages per sender may be missing from it; each sender's current session now refuses "
                        "seq up to %d above its last saved one (a device that restarts is not affected)", self.dir,
                        REPLAY_SYNC_EVERY, REPLAY_SYNC_EVERY)

    def _read_snapshot(self) -> dict | None:
        path = self.state_path
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            log.info("replay state: no %s yet, starting with no sender seen (first start with this key folder)",
                     path)
            return None
        except OSError as exc:
            log.warning("replay state: cannot read %s (%s); starting with no sender seen", path, exc)
            return None
        except UnicodeDecodeError:
            return self._corrupt("not UTF-8 text")
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or doc.get("format") != _STATE_FORMAT:
                raise ValueError(f"not a {_STATE_FORMAT!r} file")
            if set(doc) != _STATE_KEYS:
                raise ValueError(f"unexpected keys {sorted(set(doc) - _STATE_KEYS)}, missing keys "
                                 f"{sorted(_STATE_KEYS - set(doc))}")
            saved_size = doc["window"]
            if not (isinstance(doc["owner"], str) and isinstance(doc["generation"], int)
                    and isinstance(doc["boot_id"], str) and isinstance(saved_size, int) and saved_size > 0
                    and isinstance(doc["sessions"], list)):
                raise ValueError("a header field has the wrong type")
            sessions = {}
            for i, s in enumerate(doc["sessions"]):
                if not isinstance(s, dict) or set(s) != {"id", "ed25519", "epoch", "top", "bits", "will_taken"}:
                    raise ValueError(f"sessions[{i}] does not have the keys id, ed25519, epoch, top, bits, will_taken")
                key = bytes.fromhex(s["ed25519"])
                if (not isinstance(s["id"], str) or not valid_id(s["id"]) or len(key) != 32 or not _is_uint(s["epoch"])
                        or not (s["top"] == -1 or _is_uint(s["top"])) or type(s["will_taken"]) is not bool
                        or not isinstance(s["bits"], str) or not re.fullmatch(r"[0-9a-f]*", s["bits"])):
                    raise ValueError(f"sessions[{i}] has a field of the wrong type or range")
                w = ReplayWindow.restored(self.window_size, s["top"], int(s["bits"] or "0", 16), saved_size)
                sessions[(s["id"], key)] = Session(s["epoch"], w, s["will_taken"])
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            return self._corrupt(str(exc)[:200])
        self.sessions = sessions
        self._generation = doc["generation"]
        return doc

    def _corrupt(self, reason: str) -> None:
        keep = self.state_path.with_name(self.state_path.name + ".corrupt")
        try:
            os.replace(self.state_path, keep)
        except OSError:
            keep = self.state_path
        log.warning("replay state %s is damaged (%s): kept as %s; rebuilding from the journal, else starting with "
                    "no sender seen, so a message recorded from a device's earlier session may be accepted until "
                    "that device sends again", self.state_path, reason, keep)
        return None

    def _apply_journal(self, data: bytes, owner: str | None, generation: int | None,
                       orphan: bool) -> tuple[bool, bool]:
        """Apply the journal's records when it belongs to the snapshot read (same owner and
        generation), or to no snapshot at all. Returns (applied, closed cleanly or same boot)."""
        lines = data.split(b"\n")
        torn = lines.pop()  # b"" when the file ends with a newline; else a record cut by a crash
        if not lines:
            return False, True
        head = lines[0].decode("ascii", "replace").split()
        if len(head) != 7 or " ".join(head[:4]) != _JOURNAL_MAGIC or not head[5].isdigit():
            log.warning("replay state: %s has no valid header; ignored", self.journal_path)
            return False, True
        if not orphan and (head[4] != owner or int(head[5]) != generation):
            return False, True  # older than the snapshot (a crash while compacting): already in it
        index: dict[int, tuple[str, bytes]] = {}
        bad = 0
        ended = False
        for raw in lines[1:]:
            f = raw.decode("ascii", "replace").split()
            try:
                if f == ["end"]:
                    ended = True
                    continue
                ended = False
                if len(f) == 4 and f[0] == "+":
                    key = bytes.fromhex(f[3])
                    if not valid_id(f[2]) or len(key) != 32:
                        raise ValueError(raw)
                    index[int(f[1])] = (f[2], key)
                    continue
                if len(f) != 3:
                    raise ValueError(raw)
                peer, epoch = index[int(f[0])], int(f[1])
                seq = None if f[2] == "w" else int(f[2])
                if not _is_uint(epoch) or not (seq is None or _is_uint(seq)):
                    raise ValueError(raw)
                self._apply(peer, epoch, seq)
            except (ValueError, KeyError):
                bad += 1
        if bad:
            log.warning("replay state: skipped %d unreadable line(s) of %s", bad, self.journal_path)
        if torn:
            log.info("replay state: the last record of %s was cut short (a crash while writing it); ignored",
                     self.journal_path)
        return True, ended or _same_boot(head[6])

    def _apply(self, peer: tuple[str, bytes], epoch: int, seq: int | None) -> None:
        s = self.sessions.get(peer)
        if s is None or epoch > s.epoch:
            s = self.sessions[peer] = Session(epoch, ReplayWindow(self.window_size))
        elif epoch < s.epoch:
            return
        if seq is None:
            s.will_taken = True
        else:
            if not s.window.seen(seq):
                s.window.add(seq)
            s.will_taken = False

    # ---------------------------------------------------------------- writing

    def _snapshot_text(self) -> str:
        return json.dumps({
            "format": _STATE_FORMAT, "owner": self._owner, "generation": self._generation, "boot_id": _boot_id(),
            "window": self.window_size,
            "sessions": [{"id": sid, "ed25519": key.hex(), "epoch": s.epoch, "top": s.window.top,
                          "bits": format(s.window.bits, "x"), "will_taken": s.will_taken}
                         for (sid, key), s in sorted(self.sessions.items())],
        }, separators=(",", ":")) + "\n"

    def _compact(self) -> None:
        """Write the snapshot, then start an empty journal of the same generation."""
        if self._broken:
            return
        try:
            if self._fd is not None:  # compacting our own files: has another process taken them over?
                try:
                    owner = json.loads(self.state_path.read_text(encoding="utf-8")).get("owner")
                except (OSError, ValueError, AttributeError):
                    owner = None
                if owner != self._owner:
                    self._give_up(f"another process (or receiver) now keeps its replay state in {self.dir}")
                    return
            self._generation += 1
            _write_private(self.state_path, self._snapshot_text().encode("utf-8"))
            _write_private(self.journal_path, f"{_JOURNAL_MAGIC} {self._owner} {self._generation} {_boot_id()}\n"
                           .encode("ascii"))
            _fsync_dir(self.dir)
            self._close_fd()
            self._fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND)
            self._finalizer = weakref.finalize(self, os.close, self._fd)
            self._index.clear()
            self._records = self._unsynced = 0
        except OSError as exc:
            self._give_up(f"cannot write {self.dir}: {exc}")

    def _give_up(self, reason: str) -> None:
        self._broken = True
        self._close_fd()
        log.warning("replay state is no longer saved (%s): it is kept in memory only, so after the next restart "
                    "a device's messages from before it may be accepted", reason)

    def _close_fd(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # closes the descriptor once
            self._finalizer = None
        self._fd = None

    def record(self, peer: tuple[str, bytes], epoch: int, seq: int | None, *, new_session: bool) -> None:
        """Append one accepted message to the journal (``seq`` ``None``: a last will); fsync when
        ``new_session`` or every :data:`REPLAY_SYNC_EVERY` records; compact every
        :data:`REPLAY_COMPACT_EVERY`. ``sessions`` must already hold the result. Never raises."""
        if self._broken or self._fd is None:
            return
        parts = []
        idx = self._index.get(peer)
        if idx is None:
            idx = self._index[peer] = len(self._index)
            parts.append(f"+ {idx} {peer[0]} {peer[1].hex()}\n")
        parts.append(f"{idx} {epoch} {'w' if seq is None else seq}\n")
        try:
            os.write(self._fd, "".join(parts).encode("ascii"))
            self._records += 1
            self._unsynced += 1
            if new_session or self._unsynced >= REPLAY_SYNC_EVERY:
                os.fsync(self._fd)
                self._unsynced = 0
        except OSError as exc:
            self._give_up(f"cannot append to {self.journal_path}: {exc}")
            return
        if self._records >= REPLAY_COMPACT_EVERY:
            self._compact()

    def close(self) -> None:
        """Mark the journal closed cleanly and fsync it (idempotent; never raises)."""
        if self._fd is None:
            return
        try:
            if not self._broken:
                os.write(self._fd, b"end\n")
                os.fsync(self._fd)
        except OSError as exc:
            log.warning("replay state: cannot close %s cleanly: %s", self.journal_path, exc)
        self._close_fd()


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
            if new_session:
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
