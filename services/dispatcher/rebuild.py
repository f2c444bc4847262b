"""Rebuilding a shard's state from Kafka: endpoints, waiting messages and fences.

A dispatcher's state is derived from compacted topics, so when it is given a shard (at start, or
when another dispatcher left) it reads that shard's part of them to their end and is exactly where
the shard's last committed transaction left it: endpoints from partition ``s`` of ``endpoints``,
the waiting messages and the groups' newest commit outcomes (with their fences) from the queue
topics' partitions of the shard. A queue whose partition count is a multiple of the shard count
has partitions that are wholly the shard's; another is read whole and filtered by group.

Only what the shard owns is read: rebuilding costs a dispatcher its share, not the instance.

A shard given while the dispatcher runs is rebuilt on a thread of its own (`ShardRebuild`), into
an engine of its own, and the loop adopts that engine between two transactions: the shards the
dispatcher already owns keep flowing meanwhile. Rebuilt inside the loop, a survivor's own shards
stood still for the 0.6-0.9 s its new shard took to read (the failover bench).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from ksb.catalog.model import CatalogView
from ksb.dialog.engine import Engine
from ksb.errors import ProtocolError
from ksb.names import Names
from ksb.runtime.kafka import watermarks
from ksb.wire.endpoint import decode_endpoint
from ksb.wire.partitioning import shard_of
from ksb.wire.protocol import CommitOutcome, parse_queue_record

__all__ = [
    "LOADER_CONF",
    "RebuildStopped",
    "ShardRebuild",
    "Spawn",
    "load_shard",
    "queue_partitions_of",
]

log = logging.getLogger("ksb.dispatcher")

REBUILD_TIMEOUT_S = 120

LOADER_CONF: dict[str, Any] = {"max.partition.fetch.bytes": 8 << 20, "fetch.max.bytes": 32 << 20}
"""The reading consumer's fetch sizes: a rebuild reads a shard's partitions from their start, and
librdkafka's 1 MB per partition made that one round trip per thousand 1 KB messages."""


def queue_partitions_of(shard: int, shards: int, partitions: int) -> list[int] | None:
    """The partitions of a queue topic that hold only `shard`'s groups (None: all must be read
    and filtered, the queue's partition count not being a multiple of the shard count)."""
    if partitions % shards:
        return None
    return list(range(shard, partitions, shards))


Spawn = Callable[[Callable[[], None]], None]
"""Runs a callable on a thread of its own (tests run it in place)."""


class RebuildStopped(Exception):
    """A rebuild on its own thread was told to stop (its shards were revoked meanwhile)."""


def load_shard(
    c: Consumer,
    names: Names,
    engine: Engine,
    view: CatalogView,
    shard: int,
    stop: threading.Event | None = None,
) -> int:
    """Fold shard `shard` of the instance's compacted topics into `engine`; returns records read.
    With `stop` set meanwhile, it ends early (`RebuildStopped`)."""
    shards = engine.ownership.shards
    # Endpoints first: a waiting message is kept compactly only once its endpoint is known.
    read = _read(c, [TopicPartition(names.endpoints, shard)], lambda m: _endpoint(engine, m), stop)
    # Then every queue's partitions of the shard at once, so they are fetched side by side.
    queues: dict[str, tuple[str, int | None]] = {}
    partitions: list[TopicPartition] = []
    for queue in view.queues.values():
        parts = queue_partitions_of(shard, shards, queue.partitions)
        topic = names.queue(queue.name)
        queues[topic] = (queue.name, shard if parts is None else None)
        parts = list(range(queue.partitions)) if parts is None else parts
        partitions += [TopicPartition(topic, p) for p in parts]

    def fold(m: Message) -> None:
        queue_name, filtered = queues[m.topic() or ""]
        _queue_record(engine, m, queue_name, filtered, shards)

    read += _read(c, partitions, fold, stop)
    engine.finish_load()
    return read


def _read(
    c: Consumer,
    partitions: list[TopicPartition],
    fold: Callable[[Message], None],
    stop: threading.Event | None = None,
) -> int:
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
        if stop is not None and stop.is_set():
            c.unassign()
            raise RebuildStopped(f"stopped reading {sorted(ends)}")
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


class ShardRebuild:
    """Shards being rebuilt on a thread of their own, into an engine made for them.

    The thread reads through a consumer of its own (closed when it ends) and, once the shards are
    read, asks `held` which shards the coordinator counts as this member's; the loop looks at
    `done` between its transactions and then takes `result`. Nothing the loop owns is touched
    from the thread, so no lock is needed: the rebuilt engine changes hands once, through the
    future.
    """

    def __init__(
        self,
        shards: list[int],
        engine: Engine,
        read: Callable[[Engine, list[int], threading.Event], int],
        held: Callable[[], set[int]],
        spawn: Spawn | None = None,
    ) -> None:
        """`read(engine, shards, stop)` folds the shards into `engine`; `spawn` runs a callable
        on another thread (tests run it in place)."""
        self.shards = shards
        self.started = time.monotonic()
        self.read_s = 0.0
        """How long reading took (the rest, to `done`, is the coordinator's answer)."""
        self._engine = engine
        self._read = read
        self._held = held
        self._stop = threading.Event()
        self._future: Future[tuple[Engine, int, set[int]]] = Future()
        (spawn or _daemon)(self._run)

    def _run(self) -> None:
        try:
            read = self._read(self._engine, self.shards, self._stop)
            self.read_s = time.monotonic() - self.started
            self._future.set_result((self._engine, read, self._held()))
        except BaseException as exc:  # handed to the loop, which decides
            self._future.set_exception(exc)

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> tuple[Engine, int, set[int]]:
        """The rebuilt engine, the records read, the shards the coordinator counted as this
        member's after the read (raises what the rebuild raised)."""
        return self._future.result()

    def stop(self) -> None:
        """Ask the thread to end without finishing; its result is never taken."""
        self._stop.set()


def _daemon(run: Callable[[], None]) -> None:
    threading.Thread(target=run, name="shard-rebuild", daemon=True).start()


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
