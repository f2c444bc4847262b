"""Work one dispatcher hands to another: the records of the ``relay`` topic.

An instance's conversation groups are split into shards (``crc32(group) mod shards``), each owned
by one dispatcher, and every rule runs on the owner of the group it changes. Work that crosses
owners travels on ``ksb.<instance>.relay``, keyed by the group it is for, so it lands in the
partition of that group's shard: a message for an endpoint another dispatcher owns, the news that
a far side received our EndDialog, a commit's action on a conversation of another group, a request
a client wrote to the wrong partition. The relay is written inside the sender's Kafka transaction
and read by the owner in order, so relayed work is applied exactly once, in the order it was done.

Operators may read it (it is JSON like every KSB topic); no client writes it: only the instance's
dispatchers may (Kafka ACLs).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

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
    "RelayClose",
    "RelayMessage",
    "RelayReceivedEnd",
    "RelayRecord",
    "RelayRequest",
    "RelayWork",
    "parse_relay",
]


class RelayMessage(Wire, tag="relay_message"):
    """A message (or an EndDialog or Error ending the dialog) for an endpoint another dispatcher
    owns; the first one from an initiator creates the target endpoint there."""

    conversation_id: str
    from_initiator: bool
    seq: Annotated[int, msgspec.Meta(ge=0)]
    """The sender's sequence number in this direction: the receiver applies them in order."""
    to_handle: str
    to_group: str
    from_group: str
    from_service: str
    to_service: str
    contract: str
    message_type: str
    sent_ms: int | None = None
    lifetime_deadline_ms: int | None = None
    body: str | None = None
    body_b64: str | None = None


class RelayReceivedEnd(Wire, tag="relay_received_end"):
    """The far side received our EndDialog or Error: what closes an endpoint that ended first."""

    handle: str
    group: str


class RelayClose(Wire, tag="relay_close"):
    """The far side refused the dialog (a body failed validation): close without a message."""

    handle: str
    group: str


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


RelayWork = RelayMessage | RelayReceivedEnd | RelayClose | RelayAction
"""Work on a conversation that its shard's owner applies (`ksb.dialog.relayed`)."""
RelayRecord = RelayWork | RelayRequest


def parse_relay(raw: bytes | None) -> RelayRecord:
    """Decode a relay record, or raise ProtocolError naming what is wrong."""
    return parse_record(RelayRecord, raw, "relay record")  # type: ignore[arg-type]
