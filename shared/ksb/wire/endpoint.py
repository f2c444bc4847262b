"""The records of ``ksb.<instance>.endpoints``: conversation endpoints, as the dispatcher keeps them.

A compacted topic keyed by the endpoint's handle: each record is an endpoint's state after a
transaction that changed it, and a rebuild folds them (`services.dispatcher.rebuild`). The state
machine over them is `ksb.dialog.endpoint`'s.
"""

from __future__ import annotations

from enum import Enum

import msgspec

from ksb.errors import ProtocolError

__all__ = ["Endpoint", "State", "decode_endpoint", "encode_endpoint"]


class State(str, Enum):
    """Service Broker's endpoint states, under the names its catalog views show."""

    STARTED_OUTBOUND = "STARTED_OUTBOUND"
    STARTED_INBOUND = "STARTED_INBOUND"
    CONVERSING = "CONVERSING"
    DISCONNECTED_INBOUND = "DISCONNECTED_INBOUND"
    DISCONNECTED_OUTBOUND = "DISCONNECTED_OUTBOUND"
    ERROR = "ERROR"
    CLOSED = "CLOSED"


class Endpoint(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One side of a conversation, as the dispatcher keeps it and the endpoints topic records it.

    A msgspec struct: the engine copies an endpoint per request it touches and writes its record
    per transaction, and both are cheap this way.
    """

    handle: str
    conversation_id: str
    is_initiator: bool
    state: State
    local_service: str
    remote_service: str
    contract: str
    queue: str
    group: str
    priority: int
    far_handle: str | None
    created_ms: int
    updated_ms: int
    send_seq: int = 0
    lifetime_deadline_ms: int | None = None
    timer_deadline_ms: int | None = None
    outstanding: int = 0
    error_code: int | None = None
    error_description: str | None = None
    far_instance: str | None = None
    """The broker instance of the far side when it is not this one (None: a local dialog)."""
    recv_seq: int = 0
    """Remote dialogs: the next sequence number expected from the far side. Persisted with the
    endpoint so a restarted dispatcher still drops duplicates; early arrivals are not persisted
    (the sender retransmits them, as it never saw them acknowledged)."""
    enqueued: int = 0
    """How many messages this endpoint's queue has been given: the next one's id is
    ``<handle>:<enqueued>`` (`ksb.dialog.membership`)."""
    far_group: str | None = None
    """The far endpoint's conversation group, when it is not the far handle (the default): a
    local target's group chosen in the initiator's shard, or the group another instance's
    endpoint is in. Records for the far side are keyed by it, so they reach its owner."""

    def copy(self) -> Endpoint:
        return msgspec.structs.replace(self)


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Endpoint)


def encode_endpoint(ep: Endpoint) -> bytes:
    """The endpoint's record: ``{"v":1, ...}``, fields that are null or at their default left out."""
    return b'{"v":1,' + _ENCODER.encode(ep)[1:]


def decode_endpoint(raw: bytes) -> Endpoint:
    """An endpoint record; fields this version does not know are ignored (a newer writer's)."""
    try:
        return _DECODER.decode(raw)
    except (msgspec.DecodeError, ValueError) as exc:
        raise ProtocolError(f"malformed endpoint record: {exc}") from None
