"""Keys and enrolment: public identities and their files, key generation, fingerprints, key
folders, the session (epoch) counter, the server's allow-list (re-read live), enrol and revoke.

The file formats are normative (see :mod:`protocol.security`, "Keys").
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from ..errors import SecurityConfigError
from ..files import write_atomically, write_private
from ..messages import MAX_INT, SERVER_ID, valid_id


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
        write_private(d / SIGNING_KEY_FILE, identity.signing_key.private_bytes(*pem))
        write_private(d / EXCHANGE_KEY_FILE, identity.exchange_key.private_bytes(*pem))
        write_private(d / EPOCH_FILE, b"0\n")
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
        write_private(path, f"{value + 1}\n".encode("ascii"))
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
        write_atomically(target, pub.to_text().encode("utf-8"))
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
        self._mtime: int | None = None
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
