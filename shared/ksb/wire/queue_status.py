"""The records of ``ksb.<instance>.queue-status``: a queue disabled outside the catalog.

Poison-message handling disables a queue (SQL Server: STATUS = OFF and BROKER_QUEUE_DISABLED).
The activation service notices it, but it may not write the catalog (nobody but the catalog's
writers may, `ksb.security.governance`), so the fact has a record of its own: one per queue,
keyed by the queue's name in a compacted topic, written by the activation service (disabled)
and by a catalog writer enabling the queue again (``ALTER QUEUE ... WITH STATUS = ON``). Every
service that follows the catalog reads it with the catalog (`ksb.runtime.catalog_store`) and
sees the queue OFF while its newest record says so (`ksb.catalog.queue_status`).
"""

from __future__ import annotations

from ksb.wire.protocol import Name, Wire, dumps, parse_record

__all__ = ["QueueStatus", "encode_queue_status", "parse_queue_status"]


class QueueStatus(Wire, tag="queue_status"):
    """`queue` disabled (or enabled again) outside the catalog, by `by`, for `reason`."""

    instance: str
    queue: Name
    disabled: bool
    reason: str
    event_ms: int
    by: str = ""
    """The principal that wrote it (its writer's claim; only the activation service and the
    catalog's writers may write the topic)."""


def encode_queue_status(status: QueueStatus) -> bytes:
    return dumps(status)


def parse_queue_status(raw: bytes | None) -> QueueStatus:
    """Decode a record, or raise `ProtocolError` naming what is wrong with it."""
    return parse_record(QueueStatus, raw, "queue status")
