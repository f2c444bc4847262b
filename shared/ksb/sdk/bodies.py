"""Where RECEIVE gets message bodies from: a small cache of records, else Kafka by offset.

The queue index keeps no bodies (`ksb.sdk.queue_index`), so RECEIVE reads the records it returns.
Two sources, measured against each other on this machine when this module was written (the
later read-back runs: docs/benchmarks.md, "a reader behind its body cache"):

* reading the records back from the queue topic by partition and offset (`ksb.sdk.fetch`): a
  fetch after a seek costs a broker round trip, ~5 ms here (p90 ~10 ms), where a record in
  memory costs microseconds. A reader that keeps up would pay it on every RECEIVE;
* keeping every record in memory until it is received: what the reader did before, ~2 KB per
  waiting 1 KB message, so a backlog of a million needed more than 2 GB.

So the reader does both, bounded: a `BodyCache` of raw records, by default 32 MiB, holds the newest
records the follower read (a reader that keeps up finds every body there and never reads back)
and, on a read-back, the other ready records the read passed over (the next RECEIVEs of a backlog
drain want the neighbouring records: the fronts of the other groups). Only a record the cache no
longer has is read again, in offset order: a wanted record fewer than `MAX_GAP` records after
where the read is is reached by reading on (`read_on`), a farther one by a seek, since reading a
record costs ~0.03 ms and a seek ~5 ms.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from ksb.sdk.queue_index import Ready
from ksb.wire.protocol import QueueMessage, parse_queue_record

__all__ = ["ENTRY_OVERHEAD_BYTES", "MAX_GAP", "BodyCache", "messages_from", "read_on"]

log = logging.getLogger("ksb.sdk.bodies")

MAX_GAP = 100
"""Records between two wanted offsets of one partition below which they are read as one run."""
ENTRY_OVERHEAD_BYTES = 120
"""What a cached record costs beyond its bytes (the bytes object, its key, the map's node)."""


class BodyCache:
    """Raw records by position (`ksb.sdk.queue_index.pack_position`), at most ``budget_bytes``;
    the record admitted longest ago goes first. Not thread-safe: the reader guards it."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._records: OrderedDict[int, bytes] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def put(self, pos: int, raw: bytes) -> None:
        size = len(raw) + ENTRY_OVERHEAD_BYTES
        if pos < 0 or size > self.budget_bytes:
            return
        self.discard(pos)
        self._records[pos] = raw
        self.bytes += size
        while self.bytes > self.budget_bytes:
            _pos, old = self._records.popitem(last=False)
            self.bytes -= len(old) + ENTRY_OVERHEAD_BYTES

    def get(self, pos: int) -> bytes | None:
        return self._records.get(pos)

    def discard(self, pos: int) -> None:
        """The message left the queue: its record is no longer wanted."""
        old = self._records.pop(pos, None)
        if old is not None:
            self.bytes -= len(old) + ENTRY_OVERHEAD_BYTES


def read_on(at: int | None, wanted: int, max_gap: int = MAX_GAP) -> bool:
    """Is the record at offset `wanted` reached sooner by reading on from offset `at` (where a
    consumer is reading the same partition; None: nowhere) than by seeking to it?"""
    return at is not None and at <= wanted and wanted - at <= max_gap


def messages_from(refs: Sequence[Ready], records: Mapping[int, bytes]) -> list[QueueMessage]:
    """The messages `refs` name, in their order, decoded from their records (by position).

    A ref whose record is missing, or holds another message, is left out: its record was compacted
    away after a newer one with its key, so it has been received (or moved) meanwhile.
    """
    out: list[QueueMessage] = []
    for ref in refs:
        raw = records.get(ref.position)
        if raw is None:
            log.warning("message %s is no longer in its queue topic; skipped", ref.message_id)
            continue
        m = parse_queue_record(raw)
        if not isinstance(m, QueueMessage) or m.message_id != ref.message_id:
            log.warning("record at %s is not message %s; skipped", ref.position, ref.message_id)
            continue
        out.append(m)
    return out
