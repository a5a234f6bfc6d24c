"""Sealing (pure functions): the sealed envelope's layout, Ed25519 signing and verification of
topic ‖ header ‖ SHA-256(body) ‖ trailer, and X25519 + HKDF-SHA256 + AES-256-GCM encryption of
upload bodies. The constructions are normative (see :mod:`protocol.security`).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .._mpread import Reader, ReadError
from ..errors import FieldError, MalformedMessage, SecurityConfigError, UnknownKind, UnsupportedVersion
from ..messages import _BOUNDS, MAX_INT, PROTOCOL_VERSION, Kind, valid_id
from .reasons import _reject

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

_SIG_CONTEXT = b"fedfleet/v1 signature\x00"
_AAD_CONTEXT = b"fedfleet/v1 aead\x00"
_HKDF_SALT = b"fedfleet/v1 hkdf salt"
_HKDF_INFO = b"fedfleet/v1 upload key\x00"
_SIG_BIN_HEADER = b"\xc4\x40"



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
        raise _reject("bad_sec", f"sec.flags {flags:#x} has bits this version does not know",
                      field="envelope.sec.flags")
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
