"""SEND ON CONVERSATION: the sender's checks, then local delivery or transmission.

A SEND is refused (an error record, the dialog stays alive, as a failed SEND statement would) when
the body is too large, the message type is unknown or not in the contract, this side may not send
it, the endpoint cannot send, or the lifetime passed. A body that fails its message type's
validation is not refused: the receiving side rejects it and the dialog fails with an Error message
to the sender, as Service Broker's target would. A multi-handle SEND is all or nothing.
"""

from __future__ import annotations

from ksb.catalog.model import ERROR, MessageType
from ksb.dialog import endpoint as ep_rules
from ksb.dialog.begin import ensure_target
from ksb.dialog.delivery import drop_queued, enqueue, transmit
from ksb.dialog.stage import Stage
from ksb.dialog.state import DialogState
from ksb.dialog.system_messages import VALIDATION_CODE, VALIDATION_ERROR, error_body
from ksb.errors import ConversationError, ValidationFailed
from ksb.wire.endpoint import Endpoint, State
from ksb.wire.protocol import SendRequest

__all__ = ["fail_dialog", "must_park", "send"]


def send(state: DialogState, stage: Stage, req: SendRequest, now: int) -> None:
    body = req.body_bytes()
    if len(body) > state.max_body_bytes:
        raise ConversationError(
            f"message body is {len(body)} bytes, over the limit of {state.max_body_bytes}",
            code="body_too_large",
        )
    mtype = state.catalog.message_type(req.message_type)
    senders = [stage.endpoint(h) for h in dict.fromkeys(req.handles)]
    for sender in senders:
        _check_sender(state, sender, mtype, now)
    for sender in senders:
        _deliver(state, stage, sender, mtype, body, now)


def _check_sender(state: DialogState, sender: Endpoint, mtype: MessageType, now: int) -> None:
    ep_rules.check_can_send(sender)
    contract = state.catalog.contract(sender.contract)
    if not contract.knows(mtype.name):
        raise ConversationError(
            f"message type {mtype.name!r} is not in contract {contract.name!r}",
            code="message_type_not_in_contract",
        )
    if not contract.allows(mtype.name, from_initiator=sender.is_initiator):
        side = "initiator" if sender.is_initiator else "target"
        raise ConversationError(
            f"message type {mtype.name!r} may not be sent by the {side} "
            f"in contract {contract.name!r}",
            code="message_type_not_allowed",
        )
    if sender.lifetime_deadline_ms is not None and now >= sender.lifetime_deadline_ms:
        raise ConversationError(
            f"conversation {sender.handle} has passed its lifetime", code="lifetime_expired"
        )


def _deliver(
    state: DialogState, stage: Stage, sender: Endpoint, mtype: MessageType, body: bytes, now: int
) -> None:
    if sender.far_instance is not None:
        _deliver_remote(state, stage, sender, mtype, body, now)
        return
    receiver = _receiver(state, stage, sender, now)
    sender.state = ep_rules.after_send(sender)
    sender.updated_ms = now
    if receiver is None:
        # The far side ended WITH CLEANUP, which tells nobody: as in Service Broker this side
        # still sends, and the message has nowhere to go. Making a new endpoint for it would
        # bring back a conversation the far side removed, under a new group.
        return
    try:
        mtype.validate_body(body)
    except ValidationFailed as exc:
        # The receiving side refuses the message and fails the dialog, as a target would.
        fail_dialog(state, stage, sender, receiver, VALIDATION_ERROR, exc.reason, now)
        return
    if must_park(state, sender, receiver):
        transmit(state, stage, sender, mtype.name, body, now, to_instance=state.instance)
        return
    receiver.recv_seq = sender.send_seq + 1
    code = VALIDATION_CODE[mtype.validation.value]
    enqueue(state, stage, receiver, mtype.name, code, body, sender.send_seq, now)
    sender.send_seq += 1


def _receiver(state: DialogState, stage: Stage, sender: Endpoint, now: int) -> Endpoint | None:
    """The far endpoint of a local dialog, or None when it is gone (it ended WITH CLEANUP).

    The target comes into being with the initiator's first message; after that it exists until
    it closes, and a local target closes while its initiator can still send only by CLEANUP.
    """
    if sender.is_initiator and sender.send_seq == 0:
        return ensure_target(state, stage, sender, now)
    return stage.maybe_endpoint(sender.far_handle)


def _deliver_remote(
    state: DialogState, stage: Stage, sender: Endpoint, mtype: MessageType, body: bytes, now: int
) -> None:
    """Validate here (the target would refuse the same body), then hand to the transmitter."""
    sender.state = ep_rules.after_send(sender)
    sender.updated_ms = now
    try:
        mtype.validate_body(body)
    except ValidationFailed as exc:
        # As a remote target would: the dialog fails on both sides. Our side gets the Error
        # message now; the far side is told with an Error in the conversation's order.
        failure = error_body(VALIDATION_ERROR, exc.reason)
        enqueue(state, stage, sender, ERROR, "X", failure, -1, now)
        transmit(state, stage, sender, ERROR, failure, now)
        sender.state = ep_rules.after_peer_error(sender)
        sender.error_code, sender.error_description = VALIDATION_ERROR, exc.reason
        return
    transmit(state, stage, sender, mtype.name, body, now)


def must_park(state: DialogState, sender: Endpoint, receiver: Endpoint) -> bool:
    """Whether a local message goes through the transmission queue instead of straight in.

    Local delivery skips the transmission queue unless the target queue is disabled; and once
    one message of a direction waits there, every later one of that direction waits behind
    it (the receiver's `recv_seq` lags the sender's `send_seq`), so order is never broken.
    """
    return state.queue_disabled(receiver.queue) or receiver.recv_seq < sender.send_seq


def fail_dialog(
    state: DialogState,
    stage: Stage,
    sender: Endpoint,
    receiver: Endpoint,
    code: int,
    reason: str,
    now: int,
) -> None:
    """The receiver refuses the dialog: an Error goes back to the sender, the receiver closes."""
    enqueue(state, stage, sender, ERROR, "X", error_body(code, reason), -1, now)
    sender.state = ep_rules.after_peer_error(sender)
    sender.error_code, sender.error_description = code, reason
    receiver.state = State.CLOSED
    receiver.updated_ms = now
    drop_queued(state, stage, receiver)
