"""Which record kinds each sender may write: a record is believed only from the source allowed
to send its kind.

Kafka's ACLs bind each requests topic to one principal, so the dispatcher knows who wrote a
record; this rule says what that writer may write. An application may begin, send, end, set
timers and commit; it may not pose as another instance (``inbound``), move a message to the dead
letters or put one back, or fence a lock. The queue service alone dead-letters (the record it
stored, after the rollbacks a policy allows) and fences (the locks it releases); only the
operator (or an owner) replays a dead letter; only peers' transports and forwarders write
``inbound``, on the topic only they may write. A record of a kind its source may not send is
refused with ``kind_not_allowed`` before any rule sees it.
"""

from __future__ import annotations

from enum import Enum

from ksb.errors import NotAuthorized

__all__ = ["KINDS", "Source", "check_kind"]


class Source(str, Enum):
    """Who wrote a record, as far as its topic says."""

    SHARED = "shared"
    """The unsuffixed requests topic of a stack without security: nobody's identity is known."""
    APPLICATION = "application"
    SERVICE = "service"
    """The activation service and the external activator: their tasks and readers do an
    application's work under their login."""
    OPERATOR = "operator"
    """The operator's CLI, and the deployment's owners."""
    QUEUE_SERVICE = "queue_service"
    PEER = "peer"
    """``inbound``: another instance's transport or forwarder."""
    NONE = "none"
    """A service principal that sends no request (the dispatcher, the transport, ...)."""


_WORK = frozenset({"begin", "send", "end", "timer", "commit"})
KINDS: dict[Source, frozenset[str]] = {
    Source.SHARED: _WORK | {"dead_letter", "fence", "replay", "inbound"},
    Source.APPLICATION: _WORK,
    Source.SERVICE: _WORK,
    Source.OPERATOR: _WORK | {"replay"},
    Source.QUEUE_SERVICE: frozenset({"dead_letter", "fence"}),
    Source.PEER: frozenset({"inbound"}),
    Source.NONE: frozenset(),
}
"""The record kinds each source may write."""


def check_kind(source: Source, kind: str) -> None:
    """Refuse a record of `kind` from `source` unless `source` may send it."""
    if kind not in KINDS[source]:
        raise NotAuthorized(
            f"a {kind!r} record may not come from {source.value} (it sends only "
            f"{', '.join(sorted(KINDS[source])) or 'nothing'})",
            code="kind_not_allowed",
        )
