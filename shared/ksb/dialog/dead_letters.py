"""Dead letters: a message moved aside after too many rollbacks, and put back by a replay.

Beyond Service Broker (whose poison-message handling only disables the queue): with a dead-letter
policy on its queue, the reader that rolls a message back for the N-th time moves it to the queue's
dead-letter topic while it still holds the group lock, so the message is never delivered again,
and its conversation ends WITH ERROR. An operator can replay it into the queue (`ksb dlq replay`).
"""

from __future__ import annotations

from ksb.dialog.end import end
from ksb.dialog.outputs import Inflight, QueueWrite
from ksb.dialog.stage import Stage
from ksb.dialog.state import DialogState
from ksb.errors import ConversationError
from ksb.wire.endpoint import State
from ksb.wire.partitioning import partition_for
from ksb.wire.protocol import (
    DeadLetterRecord,
    DeadLetterRequest,
    EndRequest,
    ReplayRequest,
    replace,
)

__all__ = ["dead_letter", "replay"]


def dead_letter(state: DialogState, stage: Stage, req: DeadLetterRequest, now: int) -> None:
    m = req.message
    state.permissions.check_receive(stage.principal, m.queue, "dead-letter a message")
    info = state.waiting.get(m.message_id)
    if info is None or info.queue != m.queue:
        raise ConversationError(
            f"message {m.message_id} is not waiting in queue {m.queue!r}",
            code="already_received",
        )
    if (m.conversation_handle, m.conversation_group_id) != (info.handle, info.group):
        # Only the queue service sends these, with the record it stored; a copy that differs
        # from what is waiting is not that message, and is not stored as its dead letter.
        raise ConversationError(
            f"the dead letter of message {m.message_id} does not match the waiting message "
            "(its conversation or group)",
            code="dead_letter_mismatch",
        )
    stage.gone_inflight.add(m.message_id)
    stage.out.queue.append(QueueWrite(m.queue, info.partition, m.message_id, None))
    stage.out.dead_letters.append(
        DeadLetterRecord(message=m, reason=req.reason, dead_lettered_ms=now)
    )
    receiver = stage.maybe_endpoint(info.handle)
    if receiver is None:
        return
    receiver.outstanding = max(0, receiver.outstanding - 1)
    queue = state.catalog.queues.get(m.queue)
    code = queue.dead_letter.error_code if queue and queue.dead_letter else -1
    if receiver.state not in (State.DISCONNECTED_OUTBOUND, State.CLOSED):
        request = EndRequest(
            handle=receiver.handle,
            error_code=code,
            error_description=f"message dead-lettered: {req.reason}",
        )
        end(state, stage, request, now)


def replay(state: DialogState, stage: Stage, req: ReplayRequest) -> None:
    m = req.message
    state.permissions.check_receive(stage.principal, m.queue, "replay a dead letter")
    if m.message_id in state.waiting:
        raise ConversationError(
            f"message {m.message_id} is already in its queue", code="duplicate_message"
        )
    queue = state.catalog.queue(m.queue)
    part = partition_for(m.conversation_group_id, queue.partitions)
    again = replace(m, status=1, queuing_order=stage.next_order())
    stage.out.queue.append(QueueWrite(m.queue, part, m.message_id, again))
    stage.new_inflight[m.message_id] = Inflight(
        m.queue,
        part,
        m.conversation_group_id,
        m.conversation_handle,
        m.message_type_name,
        again if queue.retention == "ON" else None,
        priority=m.priority,
        enqueued_ms=m.enqueued_ms,
        message_id=m.message_id,
        service=m.service_name,
        sent_ms=m.sent_ms,
    )
