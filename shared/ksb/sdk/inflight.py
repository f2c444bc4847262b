"""Which of a client's requests the dispatchers have not applied yet: the back-pressure rule.

A request is in flight from the moment the client hands it to its producer until the dispatchers'
consumer group has committed an offset past the one Kafka gave it. The dispatchers commit the
offsets they consumed inside the transaction that applies them, so a committed offset past a
request is the proof that it was applied (or relayed to its owner), exactly once. A client with
``limit`` requests in flight waits before it sends another, instead of queueing seconds of work
in front of everyone's requests; the committed offsets are asked for only while it waits, and at
most every ``query_every_ms``, whichever threads wait.

Pure: `ksb.sdk.backpressure` feeds it delivery reports and committed offsets and sleeps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

__all__ = ["InflightRequests", "TopicPartitionKey"]

TopicPartitionKey = tuple[str, int]
"""(topic, partition): requests topics may be several (one per principal)."""


class InflightRequests:
    """Requests sent and not yet applied, per partition of the requests topics."""

    def __init__(self, limit: int, *, query_every_ms: int = 20) -> None:
        self.limit = limit
        """At most this many in flight; 0 means no limit."""
        self.query_every_ms = query_every_ms
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

    def delivered(self, topic: str, partition: int, offset: int) -> None:
        self._unreported -= 1
        tp = (topic, partition)
        if offset < self._committed.get(tp, -1):
            return  # applied before its report reached us
        self._stored.setdefault(tp, deque()).append(offset)

    def failed(self) -> None:
        """Never stored in Kafka, so never applied: no longer in flight."""
        self._unreported -= 1

    def committed(self, offsets: Mapping[TopicPartitionKey, int]) -> None:
        """The dispatchers' committed offsets (the next offset each will read)."""
        for tp, offset in offsets.items():
            if offset <= self._committed.get(tp, -1):
                continue
            self._committed[tp] = offset
            stored = self._stored.get(tp)
            while stored and stored[0] < offset:
                stored.popleft()
            if stored is not None and not stored:
                del self._stored[tp]

    @property
    def inflight(self) -> int:
        return self._unreported + sum(len(d) for d in self._stored.values())

    # ----------------------------------------------------------------- the waiting rule
    def room(self) -> bool:
        """May one more request be sent now?"""
        return self.limit <= 0 or self.inflight < self.limit

    def query_due(self, now_ms: int) -> bool:
        """Ask Kafka for the committed offsets now? (Then say so with `queried`.)"""
        last = self._last_query_ms
        return last is None or now_ms - last >= self.query_every_ms

    def queried(self, now_ms: int) -> list[TopicPartitionKey]:
        """A query starts now: the partitions whose offsets it must ask for."""
        self._last_query_ms = now_ms
        return sorted(self._stored)
