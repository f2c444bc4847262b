"""Conversation endpoints and their state machine, named as Service Broker names them.

The transitions are pure functions over an `Endpoint` so the dispatcher's rules are unit-tested without
Kafka; the dispatcher persists each changed endpoint to the compacted endpoints topic.
"""

from __future__ import annotations

from enum import Enum

import msgspec

from ksb.errors import ConversationError, ProtocolError

__all__ = [
    "Endpoint",
    "State",
    "after_end",
    "after_peer_ended",
    "after_peer_error",
    "after_peer_received_end",
    "after_receive",
    "after_send",
    "check_can_send",
    "decode_endpoint",
    "encode_endpoint",
]


class State(str, Enum):
    """Service Broker's endpoint states, under the names its catalog views show."""

    STARTED_OUTBOUND = "STARTED_OUTBOUND"
    STARTED_INBOUND = "STARTED_INBOUND"
    CONVERSING = "CONVERSING"
    DISCONNECTED_INBOUND = "DISCONNECTED_INBOUND"
    DISCONNECTED_OUTBOUND = "DISCONNECTED_OUTBOUND"
    ERROR = "ERROR"
    CLOSED = "CLOSED"


_CAN_SEND = {State.STARTED_OUTBOUND, State.STARTED_INBOUND, State.CONVERSING}


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


def check_can_send(ep: Endpoint) -> None:
    if ep.state not in _CAN_SEND:
        raise ConversationError(
            f"cannot SEND on conversation {ep.handle}: it is {ep.state.name}",
            code="conversation_closed",
        )


def after_send(ep: Endpoint) -> State:
    """The first message makes a started conversation CONVERSING."""
    check_can_send(ep)
    return State.CONVERSING


def after_receive(ep: Endpoint) -> State:
    """A target is STARTED_INBOUND until its application has received its first message."""
    return State.CONVERSING if ep.state is State.STARTED_INBOUND else ep.state


def after_end(ep: Endpoint) -> State:
    """END CONVERSATION: closed if the far side already ended or failed, else waiting for it."""
    if ep.state is State.CLOSED:
        raise ConversationError(
            f"conversation {ep.handle} is already CLOSED", code="conversation_closed"
        )
    if ep.state in (State.DISCONNECTED_INBOUND, State.ERROR):
        return State.CLOSED
    return State.DISCONNECTED_OUTBOUND


def after_peer_ended(ep: Endpoint) -> State:
    """An EndDialog arrived: if we had ended too, the conversation is over."""
    if ep.state in (State.DISCONNECTED_OUTBOUND, State.CLOSED):
        return State.CLOSED
    return State.DISCONNECTED_INBOUND


def after_peer_received_end(ep: Endpoint) -> State:
    """The far side received our EndDialog or Error: the acknowledgement that closes us."""
    return State.CLOSED if ep.state is State.DISCONNECTED_OUTBOUND else ep.state


def after_peer_error(ep: Endpoint) -> State:
    return State.CLOSED if ep.state is State.CLOSED else State.ERROR


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
