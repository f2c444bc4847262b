"""The conversation endpoint's state machine, named as Service Broker names its states.

The transitions are pure functions over an `Endpoint` (the record, `ksb.wire.endpoint`) so the
dispatcher's rules are unit-tested without Kafka; the dispatcher persists each changed endpoint
to the compacted endpoints topic.
"""

from __future__ import annotations

from ksb.errors import ConversationError
from ksb.wire.endpoint import Endpoint, State

__all__ = [
    "after_end",
    "after_peer_ended",
    "after_peer_error",
    "after_peer_received_end",
    "after_receive",
    "after_send",
    "check_can_send",
]


_CAN_SEND = {State.STARTED_OUTBOUND, State.STARTED_INBOUND, State.CONVERSING}


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
    """END CONVERSATION: closed if the far side already ended or failed, else waiting for it.

    Ending twice is refused: a second END would tell the far side a second time."""
    if ep.state in (State.CLOSED, State.DISCONNECTED_OUTBOUND):
        raise ConversationError(
            f"conversation {ep.handle} has already ended: it is {ep.state.name}",
            code="conversation_closed",
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
