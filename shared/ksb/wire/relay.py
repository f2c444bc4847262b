"""Work one dispatcher hands to another: the records of the ``relay`` topic.

An instance's conversation groups are split into shards (``crc32(group) mod shards``), each owned
by one dispatcher, and every rule runs on the owner of the group it changes. Work that crosses
owners travels on ``ksb.<instance>.relay``, keyed by the group it is for, so it lands in the
partition of that group's shard: a commit's action on a conversation of a group another dispatcher
owns, and a record a client wrote to a partition that is not its key's. (Both ends of a local
dialog are in one shard, so messages between them never cross: `ksb.dialog.shards`.) The relay is written inside the sender's Kafka transaction
and read by the owner in order, so relayed work is applied exactly once, in the order it was done.

Operators may read it (it is JSON like every KSB topic); no client writes it: only the instance's
dispatchers may (Kafka ACLs).
"""

from __future__ import annotations

from typing import Literal

from ksb.wire.protocol import (
    BeginRequest,
    EndRequest,
    SendRequest,
    TimerRequest,
    Wire,
    parse_record,
)

__all__ = [
    "RelayAction",
    "RelayRecord",
    "RelayRequest",
    "parse_relay",
    "relay_key",
]


class RelayAction(Wire, tag="relay_action"):
    """A commit's action on a conversation of a group another dispatcher owns, carried out after
    the commit; ``request_id`` is the commit's, so a refusal is reported under it."""

    action: BeginRequest | SendRequest | EndRequest | TimerRequest
    group: str
    request_id: str
    principal: str | None = None


class RelayRequest(Wire, tag="relay_request"):
    """A record read from a partition that is not its key's shard (a client whose partitioner is
    not CRC-32; an ``inbound`` record keyed the old way), passed unchanged to the owner of its
    key's shard."""

    key: str
    raw: bytes
    """The record's value as its writer wrote it."""
    source: Literal["requests", "inbound"] = "requests"
    principal: str | None = None
    sent_ms: int | None = None


RelayRecord = RelayAction | RelayRequest


def relay_key(record: RelayRecord) -> str:
    """The group a relay record is for: its key, so it lands in that group's shard."""
    return record.group if isinstance(record, RelayAction) else record.key


def parse_relay(raw: bytes | None) -> RelayRecord:
    """Decode a relay record, or raise ProtocolError naming what is wrong."""
    return parse_record(RelayRecord, raw, "relay record")  # type: ignore[arg-type]
