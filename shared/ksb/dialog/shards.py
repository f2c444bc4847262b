"""Shards: how an instance's conversation groups are split between its dispatchers.

A group belongs to shard ``crc32(group) mod shards`` (the same function that places a group in its
queue topic's partition, so a shard's queue partitions are its own when a queue's partition count
is a multiple of the shard count). Each shard is owned by exactly one dispatcher: Kafka's consumer
group gives each member the same partition numbers of every input topic (the requests topics, the
relay, ``inbound``), and the partition number is the shard. An engine applies rules only to
endpoints of the shards it owns; what crosses to another shard is relayed (`ksb.wire.relay`).
"""

from __future__ import annotations

from collections.abc import Iterable

from ksb.wire.partitioning import partition_for

__all__ = ["Ownership", "shard_of"]


def shard_of(group: str, shards: int) -> int:
    """The shard of a conversation group (also its partition of every co-partitioned topic)."""
    return partition_for(group, shards)


class Ownership:
    """The shards one dispatcher owns (all of them, when it is the only one)."""

    def __init__(self, shards: int, owned: Iterable[int] | None = None) -> None:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        self.shards = shards
        self.owned: set[int] = set(range(shards)) if owned is None else set(owned)

    def owns(self, group: str) -> bool:
        return shard_of(group, self.shards) in self.owned

    def shard(self, group: str) -> int:
        return shard_of(group, self.shards)

    def __repr__(self) -> str:
        return f"Ownership({self.shards}, owned={sorted(self.owned)})"
