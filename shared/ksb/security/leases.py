"""Lock leases: proof that the queue service granted a principal a conversation group's lock.

RECEIVE takes a group's lock in the queue service, never in the client; the service hands back a
lease, its claims sealed with an HMAC key that only the queue service and the dispatchers of the
instance hold. The client puts the lease in its commit record; the dispatcher opens it and applies
the commit only if the lease is sound, names the principal whose requests topic the commit came
from, and names the queue and group of the receipt (`ksb.dialog.receipts`), and it fences with
the token inside the lease, not one the client wrote. A client cannot forge a lease, take over
another principal's, or raise its own token: any change breaks the seal.

HMAC-SHA256 (the standard library's `hmac`), not a signature: both ends are services of the same
instance that already trust each other, and a commit is checked in microseconds. The claims also
carry what the RECEIVE saw (the group's level, the best other ready level, when), so the
dispatcher can write the receive's audit event in the transaction that applies the commit.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path
from typing import Literal

import msgspec

from ksb.errors import LeaseInvalid, SecurityError

__all__ = ["LeaseClaims", "LeaseSeal", "read_lease_key"]

MIN_KEY_BYTES = 32


class LeaseClaims(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What a lease says: this principal holds this group's lock under this fencing token."""

    instance: str
    queue: str
    group: str
    token: int
    principal: str
    holder: str
    """The queue service session that took the lock (the audit's reader)."""
    received_ms: int
    """When the RECEIVE locked the group."""
    level: int
    """The group's priority level at that RECEIVE."""
    ready_level: int | None = None
    """The highest level among the other groups ready and unlocked then (the ordering audit)."""
    targeted: bool = False
    """RECEIVE with WHERE: no ordering rule applies to it."""
    after: tuple[int, int] | None = None
    """(partition, offset) of the previous holder's commit outcome, when known: a rollback
    passes it on to the next holder."""
    v: Literal[1] = 1


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(LeaseClaims)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class LeaseSeal:
    """Seals and opens leases with one instance's key; without a key (a stack without security,
    where nobody's identity is checked either) leases travel unsealed and are taken as given."""

    def __init__(self, key: bytes | None) -> None:
        if key is not None and len(key) < MIN_KEY_BYTES:
            raise SecurityError(f"a lease key needs at least {MIN_KEY_BYTES} bytes")
        self._key = key

    @property
    def sealed(self) -> bool:
        return self._key is not None

    def seal(self, claims: LeaseClaims) -> str:
        payload = _ENCODER.encode(claims)
        return f"{_b64(payload)}.{_b64(self._mac(payload))}"

    def open(self, lease: str) -> LeaseClaims:
        """The claims of a lease this key sealed; `LeaseInvalid` for anything else."""
        head, dot, tail = lease.partition(".")
        try:
            payload, mac = _unb64(head), _unb64(tail)
        except ValueError:
            raise LeaseInvalid("a lease is two base64url parts joined by a dot") from None
        if not dot or not hmac.compare_digest(mac, self._mac(payload)):
            raise LeaseInvalid(
                "the lease's seal does not match: it was not issued by this instance"
            )
        try:
            return _DECODER.decode(payload)
        except msgspec.DecodeError as exc:  # sealed by us, yet unreadable: a newer version's
            raise LeaseInvalid(f"unreadable lease claims: {exc}") from None

    def _mac(self, payload: bytes) -> bytes:
        if self._key is None:
            return b""
        return hmac.new(self._key, payload, hashlib.sha256).digest()


def read_lease_key(path: str) -> LeaseSeal:
    """The seal of the key in `path` (unsealed when no path is set: a stack without security)."""
    if not path:
        return LeaseSeal(None)
    try:
        return LeaseSeal(Path(path).read_bytes().strip())
    except OSError as exc:
        raise SecurityError(f"cannot read the lease key {path}: {exc}") from exc
