"""How deep each queue is, shard by shard: the records of the ``depth`` topic.

The dispatcher that owns a shard is the authority for how many messages wait, unreceived, in each
queue's groups of that shard (`ksb.dialog.membership`). In every transaction that changes one, it
writes the new count to ``ksb.<instance>.depth`` (compacted, keyed ``<queue>/<shard>``), so the
topic's last record of a key is the committed count. One partition: every partition a transaction
writes costs the broker a verification and a commit marker, so a partition per shard would have
added as many to each of the dispatcher's transactions. SDK senders
read it to slow down before a target queue outgrows what its readers keep up with
(`ksb.sdk.depth`); operators may read it too. Only the instance's dispatchers may write it.
"""

from __future__ import annotations

from ksb.wire.protocol import NonNegative, Wire, parse_record

__all__ = ["QueueDepth", "depth_key", "parse_depth"]


class QueueDepth(Wire, tag="queue_depth"):
    """Unreceived messages of `queue` in `shard` after the transaction that wrote this record,
    and the services whose messages go to that queue (a sender knows its target's service, not
    its queue)."""

    queue: str
    shard: NonNegative
    depth: NonNegative
    services: tuple[str, ...]


def depth_key(record: QueueDepth) -> str:
    """The record's key: one count per queue and shard survives compaction."""
    return f"{record.queue}/{record.shard}"


def parse_depth(raw: bytes | None) -> QueueDepth:
    """Decode a ``depth`` topic record, or raise ProtocolError naming what is wrong."""
    return parse_record(QueueDepth, raw, "queue depth record")
