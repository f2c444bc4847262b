"""Which of a client's requests the dispatchers have not applied yet: the back-pressure rule.

A request is in flight from the moment the client hands it to its producer until the dispatchers'
consumer group has committed an offset past the one Kafka gave it. The dispatchers commit the
offsets they consumed inside the transaction that applies them, so a committed offset past a
request is the proof that it was applied (or relayed to its owner), exactly once. A client with
``limit`` requests in flight waits before it sends another, instead of queueing seconds of work
in front of everyone's requests; the committed offsets are asked for only while it waits, and at
most every ``query_every_ms``, whichever threads wait.

One partition's requests do not hold the others' back when its dispatcher is gone: a partition
whose committed offset stood still with requests of this client waiting, while another
partition's moved more than ``stalled_ms`` later, is stalled, and its requests are counted apart.
Waiting would not shorten that queue (nobody applies it until the consumer group moves the shard,
seconds later), and counting it would stop a client that sends to every shard in turn on all of
them. They still count against a bound ten times the limit, so a client whose every dispatcher
is gone still waits and then fails (``stalled`` needs another partition that moves).

Pure: `ksb.sdk.backpressure` feeds it delivery reports and committed offsets and sleeps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping

__all__ = ["InflightRequests", "TopicPartitionKey"]

TopicPartitionKey = tuple[str, int]
"""(topic, partition): requests topics may be several (one per principal)."""


class InflightRequests:
    """Requests sent and not yet applied, per partition of the requests topics."""

    def __init__(self, limit: int, *, query_every_ms: int = 20, stalled_ms: int = 0) -> None:
        self.limit = limit
        """At most this many in flight; 0 means no limit."""
        self.query_every_ms = query_every_ms
        self.stalled_ms = stalled_ms
        """How far behind the others a partition may fall before it is counted apart; 0: never."""
        self._moved_ms: dict[TopicPartitionKey, int] = {}
        """When each partition with requests waiting last moved (or began to wait)."""
        self._latest_move_ms: int | None = None
        self._unreported = 0
        """Handed to the producer, no delivery report yet (not in Kafka yet, so not applied)."""
        self._stored: dict[TopicPartitionKey, deque[int]] = {}
        """Offsets Kafka gave the requests, ascending per partition (one producer reports a
        partition's deliveries in order)."""
        self._committed: dict[TopicPartitionKey, int] = {}
        self._last_query_ms: int | None = None

    # ----------------------------------------------------------------- accounting
    def sent(self) -> None:
        self._unreported += 1

    def delivered(self, topic: str, partition: int, offset: int, now_ms: int = 0) -> None:
        self._unreported -= 1
        tp = (topic, partition)
        if offset < self._committed.get(tp, -1):
            return  # applied before its report reached us
        self._stored.setdefault(tp, deque()).append(offset)
        self._moved_ms.setdefault(tp, now_ms)

    def failed(self) -> None:
        """Never stored in Kafka, so never applied: no longer in flight."""
        self._unreported -= 1

    def committed(self, offsets: Mapping[TopicPartitionKey, int], now_ms: int = 0) -> None:
        """The dispatchers' committed offsets (the next offset each will read)."""
        for tp, offset in offsets.items():
            if offset <= self._committed.get(tp, -1):
                continue
            self._committed[tp] = offset
            stored = self._stored.get(tp)
            if stored is None:
                continue
            while stored and stored[0] < offset:
                stored.popleft()
            self._moved_ms[tp] = now_ms
            if self._latest_move_ms is None or now_ms > self._latest_move_ms:
                self._latest_move_ms = now_ms
            if not stored:
                del self._stored[tp], self._moved_ms[tp]

    @property
    def inflight(self) -> int:
        return self._unreported + sum(len(d) for d in self._stored.values())

    def stalled(self) -> list[TopicPartitionKey]:
        """Partitions whose requests wait while another partition moved `stalled_ms` later."""
        return sorted(self._stalled())

    def _stalled(self) -> Iterator[TopicPartitionKey]:
        if self.stalled_ms <= 0 or self._latest_move_ms is None:
            return
        behind = self._latest_move_ms - self.stalled_ms
        yield from (tp for tp, t in self._moved_ms.items() if t < behind)

    # ----------------------------------------------------------------- the waiting rule
    def room(self) -> bool:
        """May one more request be sent now? (Requests on stalled partitions count apart.)"""
        if self.limit <= 0:
            return True
        total = self.inflight
        if total >= 10 * self.limit:
            return False
        apart = sum(len(self._stored[tp]) for tp in self._stalled())
        return total - apart < self.limit

    def query_due(self, now_ms: int) -> bool:
        """Ask Kafka for the committed offsets now? (Then say so with `queried`.)"""
        last = self._last_query_ms
        return last is None or now_ms - last >= self.query_every_ms

    def queried(self, now_ms: int) -> list[TopicPartitionKey]:
        """A query starts now: the partitions whose offsets it must ask for."""
        self._last_query_ms = now_ms
        return sorted(self._stored)
