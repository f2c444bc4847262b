"""One error tree for KSB.

Every error a user can meet derives from `KsbError` and carries a machine-readable `code`, so the
dispatcher can turn it into an Error message or an error-topic record without guessing.
"""

from __future__ import annotations

__all__ = [
    "BackpressureTimeout",
    "CatalogError",
    "CommitRefused",
    "ConversationError",
    "DdlError",
    "KsbError",
    "LeaseInvalid",
    "LockLost",
    "LockStoreUnavailable",
    "NotAuthorized",
    "ProtocolError",
    "QueueDisabled",
    "QueueServiceUnavailable",
    "SecurityError",
    "ValidationFailed",
]


class KsbError(Exception):
    """Root of every KSB error; `code` is stable and documented in docs/protocol.md."""

    code = "ksb_error"

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ProtocolError(KsbError):
    """A record that does not follow the wire protocol (not JSON, a missing or wrong field)."""

    code = "malformed_record"


class RequestFailed(KsbError):
    """A request a rule failed on (a defect, not the request's fault, or a record no rule foresaw):
    refused with the failure's text, so that one record never stops a dispatcher."""

    code = "request_failed"


class PoisonRecord(KsbError):
    """A record whose transaction Kafka refused twice, alone (an output it cannot write: a
    record past a topic's size limit, a topic that is gone or not writable): refused and
    skipped so the records behind it go on."""

    code = "poison_record"


class CatalogError(KsbError):
    """A catalog definition that is invalid, or a name the catalog does not know."""

    code = "catalog_error"

    def __init__(self, reason: str, *, code: str | None = None) -> None:
        super().__init__(reason)
        if code is not None:
            self.code = code


class ConversationError(KsbError):
    """A request that the conversation's state or contract does not allow."""

    code = "conversation_error"

    def __init__(self, reason: str, *, code: str | None = None) -> None:
        super().__init__(reason)
        if code is not None:
            self.code = code


class ValidationFailed(KsbError):
    """A message body that fails its message type's validation."""

    code = "validation_failed"


class LockLost(KsbError):
    """The reader no longer holds the conversation-group lock it received under."""

    code = "lock_lost"


class LockStoreUnavailable(KsbError):
    """Redis, where group locks live, did not answer or refused a command, so a RECEIVE could not
    lock a group: the transaction holds nothing and may RECEIVE again. (A commit that cannot
    confirm its lock fails with `LockLost` instead: its messages come back once the lock
    expires.)"""

    code = "lock_store_unavailable"


class CommitRefused(KsbError):
    """The dispatcher refused a commit (stale fencing token, or a message already received)."""

    code = "commit_refused"


class BackpressureTimeout(KsbError):
    """The dispatchers did not apply this client's earlier requests in time for it to send more
    (`ClientSettings.max_inflight_requests`, `ClientSettings.backpressure_timeout_s`)."""

    code = "backpressure_timeout"


class DdlError(KsbError):
    """A Service Broker DDL statement that does not parse; the reason points at the token."""

    code = "ddl_error"

    def __init__(self, reason: str, *, line: int = 0, column: int = 0) -> None:
        super().__init__(reason)
        self.line = line
        self.column = column


class QueueDisabled(KsbError):
    """RECEIVE on a queue whose STATUS is OFF (disabled by ALTER QUEUE or poison-message handling)."""

    code = "queue_disabled"


class SecurityError(KsbError):
    """Credentials that are missing or unreadable, or a principal name or plan that cannot be."""

    code = "security_error"


class NotAuthorized(KsbError):
    """A request its principal may not make: a BEGIN or SEND for a service it was not granted
    SEND on, a receipt on a queue it was not granted RECEIVE on (`ksb.dialog.permissions`), a
    record of a kind its source may not write (`ksb.dialog.sources`)."""

    code = "not_authorized"

    def __init__(self, reason: str, *, code: str | None = None) -> None:
        super().__init__(reason)
        if code is not None:
            self.code = code


class LeaseInvalid(KsbError):
    """A lock lease that the queue service did not issue, or not to this principal for this
    group: forged, altered, or someone else's (`ksb.security.leases`)."""

    code = "bad_lease"


class QueueServiceUnavailable(KsbError):
    """No replica of the queue service answered (RECEIVE, COMMIT's outcome, ROLLBACK): the
    transaction holds nothing it did not hold before, and its lock expires by its lease."""

    code = "queue_service_unavailable"
