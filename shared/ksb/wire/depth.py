"""How deep each queue is, shard by shard: the records of the ``depth`` topic.

The dispatcher that owns a shard is the authority for how many messages wait, unreceived, in each
queue's groups of that shard (`ksb.dialog.membership`). In every transaction that changes one, it
writes the new count to ``ksb.<instance>.depth`` (compacted, one partition per shard, keyed by the
queue), so the topic's last record of a queue in a partition is the committed count. SDK senders
read it to slow down before a target queue outgrows what its readers keep up with
(`ksb.sdk.depth`); operators may read it too. Only the instance's dispatchers may write it.
"""

from __future__ import annotations

from ksb.wire.protocol import NonNegative, Wire, parse_record

__all__ = ["QueueDepth", "parse_depth"]


class QueueDepth(Wire, tag="queue_depth"):
    """Unreceived messages of `queue` in `shard` after the transaction that wrote this record,
    and the services whose messages go to that queue (a sender knows its target's service, not
    its queue)."""

    queue: str
    shard: NonNegative
    depth: NonNegative
    services: tuple[str, ...]


def parse_depth(raw: bytes | None) -> QueueDepth:
    """Decode a ``depth`` topic record, or raise ProtocolError naming what is wrong."""
    return parse_record(QueueDepth, raw, "queue depth record")
