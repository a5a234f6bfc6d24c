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

# One job per module (the names below are re-exported here; import them from ``protocol.security``):
#   reasons.py           REASONS, the rejection reason codes (and the one way to raise one)
#   keys.py              identities, key files, fingerprints, the epoch counter, enrolment, AllowList
#   sealing.py           the sealed envelope: split, seal (encrypt-then-sign), read_sec, verify, unseal
#   replay.py            ReplayWindow, Session, ReplayStore (journal + snapshot in the key folder)
#   channel_security.py  ChannelSecurity: one channel's seal/open, in the order of the text above
# The replay store reads its tuning constants (REPLAY_SYNC_EVERY, REPLAY_COMPACT_EVERY) from
# protocol.security.replay: patch them there, not here.

from __future__ import annotations

from .channel_security import ChannelSecurity, Opened
from .keys import (
    ENROLLED_DIR,
    EPOCH_FILE,
    EXCHANGE_KEY_FILE,
    SIGNING_KEY_FILE,
    AllowList,
    Identity,
    PublicIdentity,
    enroll,
    generate_identity,
    list_enrolled,
    load_identity,
    load_public,
    next_epoch,
    revoke,
    write_key_dir,
)
from .keys import _b64 as _b64
from .reasons import REASONS
from .replay import (
    DEFAULT_REPLAY_WINDOW,
    REPLAY_COMPACT_EVERY,
    REPLAY_JOURNAL_FILE,
    REPLAY_STATE_FILE,
    REPLAY_SYNC_EVERY,
    ReplayStore,
    ReplayWindow,
    Session,
)
from .sealing import (
    CHECK_BYTES,
    FLAG_ENCRYPTED,
    MAX_SEAL_BYTES,
    SIGNATURE_BYTES,
    TAG_BYTES,
    EnvelopeParts,
    Sealed,
    SecTrailer,
    aead_aad,
    aead_nonce,
    read_sec,
    seal,
    signed_bytes,
    split_envelope,
    unsealed,
    upload_key,
    verify_sealed,
)

__all__ = [
    "AllowList", "CHECK_BYTES", "ChannelSecurity", "DEFAULT_REPLAY_WINDOW", "ENROLLED_DIR", "EPOCH_FILE",
    "EXCHANGE_KEY_FILE", "EnvelopeParts", "FLAG_ENCRYPTED", "Identity", "MAX_SEAL_BYTES", "Opened", "PublicIdentity",
    "REASONS", "REPLAY_COMPACT_EVERY", "REPLAY_JOURNAL_FILE", "REPLAY_STATE_FILE", "REPLAY_SYNC_EVERY",
    "ReplayStore", "ReplayWindow", "SIGNATURE_BYTES", "SIGNING_KEY_FILE", "Sealed", "SecTrailer", "Session",
    "TAG_BYTES", "aead_aad", "aead_nonce", "enroll", "generate_identity", "list_enrolled", "load_identity",
    "load_public", "next_epoch", "read_sec", "revoke", "seal", "signed_bytes", "split_envelope", "unsealed",
    "upload_key", "verify_sealed", "write_key_dir",
]
