"""Shards: how an instance's conversation groups are split between its dispatchers.

A group belongs to shard ``crc32(group) mod shards`` (the same function that places a group in its
queue topic's partition, so a shard's queue partitions are its own when a queue's partition count
is a multiple of the shard count). Each shard is owned by exactly one dispatcher: Kafka's consumer
group gives each member the same partition numbers of every input topic (the requests topics, the
relay, ``inbound``), and the partition number is the shard. An engine applies rules only to
endpoints of the shards it owns. A local dialog's target is created in its initiator's shard
(`colocated_group`), so a conversation's messages never cross owners; what does cross (a commit's
action on a conversation of another group) is relayed (`ksb.wire.relay`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from ksb.wire.partitioning import shard_of, target_handle

__all__ = ["Ownership", "colocated_group"]

_GROUP_NS = uuid.UUID("5d0c4a52-6f55-4f1e-9a67-2c1b0f3e8a41")


def colocated_group(conversation_id: str, shard: int, shards: int) -> str:
    """The group a local dialog's target is created in: new, as Service Broker gives a target a
    new group, and in `shard`, the initiator's, so both ends of a dialog have one owner and a
    message between them never leaves its dispatcher. With one shard it is the target's handle;
    otherwise the first of a fixed series of ids derived from the conversation that lands in the
    shard (about `shards` CRC-32s), so anyone can recompute it and it survives restarts."""
    group = target_handle(conversation_id)
    n = 0
    while shard_of(group, shards) != shard:
        n += 1
        group = str(uuid.uuid5(_GROUP_NS, f"{conversation_id}/{n}"))
    return group


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
