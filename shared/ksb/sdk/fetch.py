"""Reading queue records back from Kafka by partition and offset (the I/O half of `ksb.sdk.bodies`).

One consumer, never in a group, read_committed, assigned where the records are: a wanted offset
close enough after where it is already reading (`ksb.sdk.bodies.read_on`) is reached by reading
on, a farther one by a new assignment (a seek). One RECEIVE's messages are of one group, so of one
partition: its fetch is one pass over that partition, in offset order. Records passed over on the
way are handed to the caller (the reader keeps the ready ones for the next RECEIVEs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import KafkaError, Message, TopicPartition

from ksb.errors import KsbError
from ksb.runtime import kafka
from ksb.sdk.bodies import MAX_GAP, read_on
from ksb.settings import KsbSettings

__all__ = ["RecordFetcher"]

_BATCH = 500
_CONSUMER: dict[str, Any] = {
    # librdkafka's read-ahead per fetcher (its default is 64 MiB): a fetcher idles between
    # RECEIVEs. (Over it, the next fetch waits `ksb.runtime.kafka.FETCH_QUEUE_BACKOFF_MS`.)
    "queued.max.messages.kbytes": 4096,
    # A read-back wants records already written: nothing to wait for at the broker, and a fetch
    # still waiting there delays the fetch after a seek by as long (13 ms a read-back at the
    # default 10 ms, 5 ms at 1, measured 20,000 records in).
    "fetch.wait.max.ms": 1,
    # What the broker sends per partition per fetch (librdkafka's default is 1 MiB). After a seek
    # the fetcher wants one record or a few, and a whole MiB read, sent and parsed for each was
    # most of a falling-behind reader's cost: 40,000 messages through the scaling bench (past the
    # 32 MiB body cache) ran at 4,105-4,196 msg/s with 64 KiB against 2,834-2,945 with 1 MiB, the
    # SDK's CPU per message 0.144 ms against 0.243 and the broker's 0.219 against 0.292
    # (2026-11-27); reading on goes a fetch per ~60 records instead.
    "max.partition.fetch.bytes": 65536,
}


class RecordFetcher:
    """Records of one topic, by (partition, offset), for one caller at a time."""

    def __init__(self, settings: KsbSettings, topic: str, *, max_gap: int = MAX_GAP) -> None:
        self.topic = topic
        self.max_gap = max_gap
        self._consumer = kafka.consumer(settings, **_CONSUMER)
        self._lock = threading.Lock()
        self._at: tuple[int, int] | None = None
        """(partition, next offset) the consumer is reading from, if any."""
        self.seeks = 0
        self.records_read = 0

    def fetch(
        self,
        positions: Iterable[tuple[int, int]],
        passed: Callable[[list[Message]], None] | None = None,
        *,
        timeout_s: float = 30.0,
    ) -> dict[tuple[int, int], Message]:
        """The records at `positions`; one missing from the result is no longer in the topic
        (compacted away after a newer record with its key). `passed` gets the other records read
        on the way, a batch at a time. Fails when Kafka gives no record for `timeout_s` (a long
        read-back on a busy machine is slow, not stuck)."""
        wanted: dict[int, set[int]] = {}
        for p, off in positions:
            wanted.setdefault(p, set()).add(off)
        out: dict[tuple[int, int], Message] = {}
        with self._lock:
            for p in sorted(wanted):
                self._read_partition(p, wanted[p], out, passed, timeout_s)
        return out

    def _read_partition(
        self,
        p: int,
        offsets: set[int],
        out: dict[tuple[int, int], Message],
        passed: Callable[[list[Message]], None] | None,
        stall_s: float,
    ) -> None:
        todo = sorted(offsets, reverse=True)  # the next wanted offset is todo[-1]
        deadline = time.monotonic() + stall_s
        while todo:
            self._position(p, todo[-1])
            if time.monotonic() > deadline:
                raise KsbError(
                    f"could not read {len(todo)} messages back from {self.topic} in time"
                )
            others: list[Message] = []
            # Never past the last wanted offset: what is taken off the consumer is gone, and a
            # later read-back that wants it would have to seek back.
            at = self._at[1] if self._at is not None else todo[-1]
            for m in kafka.consume_batch(self._consumer, min(_BATCH, todo[0] - at + 1), 0.2):
                err = m.error()
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        raise KsbError(f"reading {self.topic} back failed: {err}")
                    if m.partition() == p and todo and (m.offset() or 0) <= todo[-1]:
                        todo.clear()  # the end is before them: gone (an end seen earlier is not)
                    continue
                off = m.offset() or 0
                if m.partition() != p or self._at is None or off < self._at[1]:
                    continue  # read ahead for an earlier assignment
                self._at = (p, off + 1)
                self.records_read += 1
                deadline = time.monotonic() + stall_s  # progress
                while todo and todo[-1] < off:
                    todo.pop()  # compacted away: a newer record with its key exists
                if todo and todo[-1] == off:
                    todo.pop()
                    out[(p, off)] = m
                else:
                    others.append(m)
            if others and passed is not None:
                passed(others)

    def _position(self, p: int, offset: int) -> None:
        """Read on to `offset` if it is close after where the consumer reads, else seek to it."""
        at = self._at[1] if self._at is not None and self._at[0] == p else None
        if read_on(at, offset, self.max_gap):
            return
        self._consumer.assign([TopicPartition(self.topic, p, offset)])
        self._at = (p, offset)
        self.seeks += 1

    def close(self) -> None:
        self._consumer.close()
