"""Rebuilding a shard's state from Kafka: endpoints, waiting messages and fences.

A dispatcher's state is derived from compacted topics, so when it is given a shard (at start, or
when another dispatcher left) it reads that shard's part of them to their end and is exactly where
the shard's last committed transaction left it: endpoints from partition ``s`` of ``endpoints``,
the waiting messages and the groups' newest commit outcomes (with their fences) from the queue
topics' partitions of the shard. A queue whose partition count is a multiple of the shard count
has partitions that are wholly the shard's; another is read whole and filtered by group.

Only what the shard owns is read: rebuilding costs a dispatcher its share, not the instance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from ksb.catalog.model import CatalogView
from ksb.dialog.endpoint import decode_endpoint
from ksb.dialog.engine import Engine
from ksb.dialog.shards import shard_of
from ksb.errors import ProtocolError
from ksb.names import Names
from ksb.runtime.kafka import watermarks
from ksb.wire.protocol import CommitOutcome, parse_queue_record

__all__ = ["load_shard", "queue_partitions_of"]

log = logging.getLogger("ksb.dispatcher")

REBUILD_TIMEOUT_S = 120


def queue_partitions_of(shard: int, shards: int, partitions: int) -> list[int] | None:
    """The partitions of a queue topic that hold only `shard`'s groups (None: all must be read
    and filtered, the queue's partition count not being a multiple of the shard count)."""
    if partitions % shards:
        return None
    return list(range(shard, partitions, shards))


def load_shard(c: Consumer, names: Names, engine: Engine, view: CatalogView, shard: int) -> int:
    """Fold shard `shard` of the instance's compacted topics into `engine`; returns records read."""
    shards = engine.ownership.shards
    read = _read(c, [TopicPartition(names.endpoints, shard)], lambda m: _endpoint(engine, m))
    for queue in view.queues.values():
        parts = queue_partitions_of(shard, shards, queue.partitions)
        every = parts is None
        if parts is None:
            parts = list(range(queue.partitions))
        topic = names.queue(queue.name)

        def fold(m: Message, queue_name: str = queue.name, filtered: bool = every) -> None:
            _queue_record(engine, m, queue_name, shard if filtered else None, shards)

        read += _read(c, [TopicPartition(topic, p) for p in parts], fold)
    return read


def _read(c: Consumer, partitions: list[TopicPartition], fold: Callable[[Message], None]) -> int:
    """Fold partitions from their beginning until each reaches the end it had when asked.

    The end is the high watermark, not the first end-of-partition event: a transaction of the
    shard's previous owner that was committed a moment ago may still be getting its markers
    written, and the state must include it."""
    ends: dict[tuple[str, int], int] = {}
    for tp in partitions:
        low, high = watermarks(c, tp, REBUILD_TIMEOUT_S)
        if high > low:
            ends[(tp.topic, tp.partition)] = high
    if not ends:
        return 0
    c.assign([TopicPartition(t, p, -2) for t, p in ends])
    read = 0
    deadline = time.monotonic() + REBUILD_TIMEOUT_S
    while ends:
        if time.monotonic() > deadline:
            raise TimeoutError(f"could not read {sorted(ends)} to their ends")
        for m in c.consume(1000, 0.2):
            err = m.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    raise KafkaException(err)
                continue
            read += 1
            fold(m)
        for tp in c.position([TopicPartition(t, p) for t, p in ends]):
            if tp.offset >= ends[(tp.topic, tp.partition)]:
                del ends[(tp.topic, tp.partition)]
    c.unassign()
    return read


def _endpoint(engine: Engine, m: Message) -> None:
    value = m.value()
    if value is not None:
        engine.load_endpoint(decode_endpoint(value))


def _queue_record(engine: Engine, m: Message, queue: str, shard: int | None, shards: int) -> None:
    """One queue record; with `shard` given, records of other shards' groups are skipped."""
    key = (m.key() or b"").decode()
    try:
        value = parse_queue_record(m.value())
    except ProtocolError:
        return
    if value is None:
        if not key.startswith("commit/"):  # an outcome's tombstone has nothing to undo
            engine.load_queue_record(key, None, m.partition() or 0)
        return
    group = value.group if isinstance(value, CommitOutcome) else value.conversation_group_id
    if shard is not None and shard_of(group, shards) != shard:
        return
    if isinstance(value, CommitOutcome):
        # The newest outcome of each group survives compaction and carries the group's fence;
        # an outcome written before outcomes carried it gives its token if it applied.
        engine.fences.applied(
            queue, value.group, value.fence or (value.token if value.applied else 0)
        )
        return
    engine.load_queue_record(key, value, m.partition() or 0)
