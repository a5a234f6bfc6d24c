"""The rejection reason codes of the security checks (protocol version 1, §5c) and the one way
to raise one.

A code is the prefix of :class:`~protocol.errors.SecurityRejection`'s message, ``Rejected.code``,
the ledger ``reason`` column's prefix and a key of ``metrics.jsonl``'s ``rejected_by_reason``.
"""

from __future__ import annotations

from ..errors import SecurityRejection

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


def _reject(code: str, message: str, *, field: str | None = None) -> SecurityRejection:
    if code not in REASONS:  # pragma: no cover - programming error
        raise ValueError(f"unknown reason code {code!r}")
    return SecurityRejection(f"{code}: {message}", code=code, field=field)
