"""Folding a queue topic: what its records do to the index, the store and the commits waiting.

The queue service reads every queue topic of the instance from the beginning, in offset order per
partition. A message record that is ready goes into the queue's index (`ksb.queue.index`) and its
record into the store (`ksb.queue.bodies`); a receipt (a tombstone, or a RETENTION queue's
``received`` rewrite) takes it out of both; a commit outcome answers the commit that waits for it
and frees its group's lock. Pure: the caller reads Kafka and writes the store in one batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ksb.errors import ProtocolError
from ksb.queue.bodies import store_key
from ksb.queue.index import QueueIndex, pack_position
from ksb.wire.protocol import CommitOutcome, parse_queue_record

__all__ = ["Folded", "Outcome", "QueueFold"]

log = logging.getLogger("ksb.queue")


@dataclass(frozen=True)
class Outcome:
    """A commit outcome as it was read: where, so the next holder of the group reads as far."""

    queue: str
    record: CommitOutcome
    partition: int
    offset: int


@dataclass
class Folded:
    """What one batch of records changed: the store's writes, and the outcomes read."""

    puts: list[tuple[bytes, bytes]] = field(default_factory=list)
    deletes: list[bytes] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)


class QueueFold:
    """One queue as its topic has been read so far."""

    def __init__(self, queue: str, queue_id: int, partitions: int) -> None:
        self.queue = queue
        self.queue_id = queue_id
        """The queue's number in the store's keys."""
        self.partitions = partitions
        self.index = QueueIndex(queue)
        self.read_to: dict[int, int] = {}
        """Partition -> the next offset to read: everything before it is folded."""
        self.ends_seen: set[int] = set()
        """Partitions whose end this fold has reached at least once."""
        self.drained = 0
        """Messages that left the index (received, or purged with their conversation, or
        dead-lettered) since this fold began, those read at start-up included: how fast the
        queue drains."""

    def fold(
        self, key: bytes | None, value: bytes | None, partition: int, offset: int, out: Folded
    ) -> None:
        """One record of the queue topic."""
        self.read_to[partition] = max(self.read_to.get(partition, 0), offset + 1)
        try:
            record = parse_queue_record(value)
        except ProtocolError as exc:
            log.warning(
                "%s: skipping bad queue record at %d/%d: %s", self.queue, partition, offset, exc
            )
            return
        if isinstance(record, CommitOutcome):
            out.outcomes.append(Outcome(self.queue, record, partition, offset))
            return
        text = (key or b"").decode(errors="replace")
        if text.startswith("commit/"):
            return  # an emptied group's outcome, tombstoned
        gone = self.index.apply(text, record, partition, offset)
        if gone is not None:
            self.drained += 1
            out.deletes.append(store_key(self.queue_id, gone.position))
        elif record is not None and record.status == 1 and value is not None:
            out.puts.append((store_key(self.queue_id, pack_position(partition, offset)), value))

    def end_of(self, partition: int, offset: int) -> None:
        """The consumer reached the partition's end at `offset`."""
        self.read_to[partition] = max(self.read_to.get(partition, 0), offset)
        self.ends_seen.add(partition)

    @property
    def caught_up(self) -> bool:
        """Whether every partition has been read to its end at least once since the start."""
        return len(self.ends_seen) >= self.partitions
