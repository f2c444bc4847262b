"""The lease rule: a receipt is applied only under the lock the queue service granted its sender.

RECEIVE locks a conversation group in the queue service, which hands the client a lease sealed
with the instance's key (`ksb.security.leases`). On a secured stack (a key configured) a commit's
receipt must carry that lease, and the lease must name the principal whose requests topic the
commit arrived on, the receipt's queue and group, and this instance: a client cannot commit
under a lock it was not given, under another principal's, or on a group it did not lock. The
fencing token is the one inside the lease (`ksb.dialog.fences`), never one the client wrote.
Without a key (a stack without security, where no sender's identity is checked either) the
receipt's own token is taken, and a lease, when present, only adds what the RECEIVE saw.
"""

from __future__ import annotations

from ksb.errors import ConversationError, KsbError
from ksb.security.leases import LeaseClaims, LeaseSeal
from ksb.wire.protocol import Receipt

__all__ = ["leased"]


def leased(
    seal: LeaseSeal, instance: str, principal: str | None, r: Receipt
) -> tuple[int, LeaseClaims | None]:
    """The token a receipt fences with, and its lease's claims; `ConversationError` (code
    ``bad_lease``) when the lease does not grant this receipt."""
    if r.lease is None:
        if seal.sealed:
            raise ConversationError(
                f"receipt on group {r.group} without a lease: RECEIVE through the queue service",
                code="bad_lease",
            )
        return r.token, None
    try:
        claims = seal.open(r.lease)
    except KsbError as exc:
        raise ConversationError(exc.reason, code="bad_lease") from None
    wrong = _mismatch(claims, instance, principal, r)
    if wrong is not None:
        raise ConversationError(f"the lease does not grant this receipt: {wrong}", code="bad_lease")
    return claims.token, claims


def _mismatch(claims: LeaseClaims, instance: str, principal: str | None, r: Receipt) -> str | None:
    if claims.instance != instance:
        return f"it is instance {claims.instance!r}'s"
    if principal is not None and claims.principal != principal:
        return f"it was granted to principal {claims.principal!r}, not {principal!r}"
    if claims.queue != r.queue or claims.group != r.group:
        return f"it locks group {claims.group} of queue {claims.queue!r}"
    return None
