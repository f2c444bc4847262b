"""Placing messages: into a local queue, to another instance, and out of a queue again.

The ways a message moves, shared by every rule that sends one (SEND, END, a timer, a lifetime, a
message from another instance): `enqueue` makes it a queue record and remembers it as waiting,
`transmit` numbers it in its conversation direction for another instance (keyed by the receiving
group when it is known, so it reaches that group's dispatcher there), `accept` takes an in-order
message from another instance with the state change it implies, and `drop_queued` removes a closed
endpoint's messages from its queue. A local dialog's two ends are always in one shard
(`ksb.dialog.shards.colocated_group`), so no message between them crosses dispatchers.
"""

from __future__ import annotations

from ksb.catalog.model import END_DIALOG, ERROR
from ksb.dialog import endpoint as ep_rules
from ksb.dialog import membership
from ksb.dialog.outputs import Inflight, QueueWrite
from ksb.dialog.stage import Stage
from ksb.dialog.state import DialogState
from ksb.dialog.system_messages import VALIDATION_CODE, parse_error_body
from ksb.wire.endpoint import Endpoint, State
from ksb.wire.partitioning import partition_for
from ksb.wire.protocol import InboundMessage, QueueMessage, encode_body, new_id

__all__ = ["accept", "drop_queued", "enqueue", "transmit"]


def enqueue(
    state: DialogState,
    stage: Stage,
    receiver: Endpoint,
    message_type: str,
    validation: str,
    body: bytes,
    seq: int,
    now: int,
) -> None:
    """A message into `receiver`'s queue, in its group's partition, remembered as waiting."""
    queue = state.catalog.queue(receiver.queue)
    message_id = membership.message_id(receiver.handle, receiver.enqueued)
    receiver.enqueued += 1
    part = partition_for(receiver.group, queue.partitions)
    text, b64 = encode_body(body)
    msg = QueueMessage(
        message_id=message_id,
        queue=queue.name,
        status=1,
        priority=receiver.priority,
        queuing_order=stage.next_order(),
        conversation_group_id=receiver.group,
        conversation_handle=receiver.handle,
        conversation_id=receiver.conversation_id,
        message_sequence_number=seq,
        service_name=receiver.local_service,
        service_contract_name=receiver.contract,
        message_type_name=message_type,
        validation=validation,
        enqueued_ms=now,
        sent_ms=stage.sent_ms,
        body=text,
        body_b64=b64,
    )
    stage.out.queue.append(QueueWrite(queue.name, part, message_id, msg))
    stage.new_inflight[message_id] = Inflight(
        queue.name,
        part,
        receiver.group,
        receiver.handle,
        message_type,
        msg if queue.retention == "ON" else None,
        priority=receiver.priority,
        enqueued_ms=now,
        message_id=message_id,
        service=receiver.local_service,
        sent_ms=stage.sent_ms,
    )
    receiver.outstanding += 1
    receiver.updated_ms = now


def transmit(
    state: DialogState,
    stage: Stage,
    sender: Endpoint,
    message_type: str,
    body: bytes,
    now: int,
    *,
    to_instance: str | None = None,
) -> None:
    """One transmission record, numbered in the sender's direction of the conversation.

    `to_instance` is this instance for a local message held in the transmission queue.
    """
    destination = to_instance or sender.far_instance
    assert destination is not None
    text, b64 = encode_body(body)
    stage.out.transmissions.append(
        InboundMessage(
            message_id=new_id(),
            conversation_id=sender.conversation_id,
            from_instance=state.instance,
            to_instance=destination,
            from_service=sender.local_service,
            to_service=sender.remote_service,
            contract=sender.contract,
            message_type=message_type,
            from_initiator=sender.is_initiator,
            seq=sender.send_seq,
            priority=sender.priority,
            enqueued_ms=now,
            from_group=None if sender.group == sender.handle else sender.group,
            to_group=sender.far_group,
            body=text,
            body_b64=b64,
        )
    )
    sender.send_seq += 1
    sender.updated_ms = now
    # No queue record shows this number (it is in the transmission topic): write it down.
    stage.persist.add(sender.handle)


def drop_queued(state: DialogState, stage: Stage, ep: Endpoint) -> None:
    """A closed endpoint's messages leave its queue, retained ones included."""
    mine = [
        (mid, state.waiting.get(mid) or state.waiting.retained.get(mid))
        for mid in state.waiting.queued_for(ep.handle)
    ]
    mine += [(mid, i) for mid, i in stage.new_inflight.items() if i.handle == ep.handle]
    mine += [(mid, i) for mid, i in stage.new_retained.items() if i.handle == ep.handle]
    for mid, info in mine:
        if info is None:
            continue
        received_now = mid in stage.new_retained
        if mid in stage.gone_inflight and not received_now:
            continue
        if not received_now and (mid in state.waiting or mid in stage.new_inflight):
            stage.out.purged.append(info)
        stage.gone_inflight.add(mid)
        stage.new_inflight.pop(mid, None)
        stage.new_retained.pop(mid, None)
        stage.out.queue.append(QueueWrite(info.queue, info.partition, mid, None))
    ep.outstanding = 0


def accept(
    state: DialogState,
    stage: Stage,
    receiver: Endpoint,
    message_type: str,
    body: bytes,
    seq: int,
    now: int,
) -> None:
    """One in-order message from another instance: into the queue, and the state change it
    implies. The caller has checked the order."""
    if message_type == END_DIALOG:
        if receiver.state in (State.DISCONNECTED_OUTBOUND, State.ERROR):
            # We ended first (or failed): the far side's EndDialog closes us; nobody reads it.
            receiver.state = State.CLOSED
            drop_queued(state, stage, receiver)
            return
        enqueue(state, stage, receiver, END_DIALOG, "E", b"", seq, now)
        receiver.state = ep_rules.after_peer_ended(receiver)
        return
    if receiver.state in (State.DISCONNECTED_OUTBOUND, State.ERROR, State.CLOSED):
        return  # Service Broker drops messages for a conversation this side has given up
    if message_type == ERROR:
        enqueue(state, stage, receiver, ERROR, "X", body, seq, now)
        receiver.state = ep_rules.after_peer_error(receiver)
        receiver.error_code, receiver.error_description = parse_error_body(body)
        return
    mtype = state.catalog.message_types.get(message_type)
    validation = VALIDATION_CODE[mtype.validation.value] if mtype is not None else "N"
    enqueue(state, stage, receiver, message_type, validation, body, seq, now)
