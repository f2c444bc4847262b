"""Where records go: which partition holds a group, which shard owns it, and how a target's
handle is derived.

These rules are part of the wire protocol (docs/protocol.md), because a client in another language
must compute the same answers: it reads a group's messages from one partition of the queue topic,
and it finds the target endpoint of a conversation without a round trip.
"""

from __future__ import annotations

import uuid
import zlib

__all__ = ["partition_for", "shard_of", "target_handle"]

_TARGET_NS = uuid.UUID("6b7a1c2e-5f44-4f0e-9a51-0c1b7d1e3a10")


def partition_for(group: str, partitions: int) -> int:
    """A group's messages all live in one partition of its queue topic, in send order."""
    return zlib.crc32(group.encode()) % partitions


def shard_of(group: str, shards: int) -> int:
    """The shard of a conversation group: its partition of every co-partitioned topic (the
    requests topics, ``relay``, ``inbound``), so a client keys a request by the group it acts on
    and the request reaches the dispatcher that owns the group (`ksb.dialog.shards`)."""
    return partition_for(group, shards)


def target_handle(conversation_id: str) -> str:
    """The target endpoint's handle, derived so both sides can be found from the conversation id."""
    return str(uuid.uuid5(_TARGET_NS, conversation_id))
