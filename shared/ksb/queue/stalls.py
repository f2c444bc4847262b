"""Which queue partitions leave this reader's commits unanswered: RECEIVE passes them over.

A commit is applied by the dispatcher that owns its group's shard, and a queue co-partitioned
with the shards (the layout KSB creates) puts each group in the partition of its shard. When that
dispatcher dies, its commits wait until the consumer group has moved its shards (the session
timeout, then the new owner's rebuild): seconds. A reader that kept taking groups of that
partition would fill its commits in flight with ones that cannot be answered, and its
application would stop working on every other shard too (the failover bench saw the survivors'
deliveries stop for the whole failover that way).

So a reader remembers when it sent each commit still in flight, per queue partition, and the
latest send time among the commits that were answered. A partition is stalled when a commit it
holds was sent more than `ClientSettings.stalled_commit_ms` before one that another partition has
answered since (the owners answer in the order commits arrive, so only an owner that stopped falls
behind like that), or when it has waited ten times as long with no answer anywhere. RECEIVE then
tries the ready groups of its priority level on other partitions first. Priority still decides: a
stalled partition's group is taken before any group of a lower level, and when every candidate of
a level is on stalled partitions. Measuring against the other partitions' answers, not a fixed
time, makes the rule as quick as the commits are: under load, when every commit waits seconds,
no partition looks stalled for that alone, and a reader whose commits come back in milliseconds
stops taking a dead owner's groups after a few of them.

Pure: `ksb.sdk.reader` reports the commits and outcomes and asks which partitions are stalled;
`ksb.queue.index` puts their groups last in their levels.
"""

from __future__ import annotations

from collections import deque

__all__ = ["CommitStalls"]


class CommitStalls:
    """Per queue partition: when each commit in flight was sent; and the latest answered one."""

    def __init__(self, stalled_ms: int) -> None:
        self.stalled_ms = stalled_ms
        """How far behind the others' answers a partition may fall; 0 turns the rule off."""
        self._sent: dict[int, deque[int]] = {}
        self._answered_sent_ms: int | None = None

    def sent(self, partition: int, now_ms: int) -> None:
        """A commit of a group in `partition` now waits for its outcome."""
        self._sent.setdefault(partition, deque()).append(now_ms)

    def answered(self, partition: int) -> None:
        """An outcome came (or a commit was given up). A partition's outcomes come in the order
        its commits were sent: one requests partition, applied in offset order."""
        q = self._sent.get(partition)
        if not q:
            return
        sent = q.popleft()
        if not q:
            del self._sent[partition]
        if self._answered_sent_ms is None or sent > self._answered_sent_ms:
            self._answered_sent_ms = sent

    def stalled(self, now_ms: int) -> set[int]:
        if self.stalled_ms <= 0:
            return set()
        behind = -1 if self._answered_sent_ms is None else self._answered_sent_ms - self.stalled_ms
        alone = now_ms - 10 * self.stalled_ms
        return {p for p, q in self._sent.items() if q[0] < behind or q[0] <= alone}
