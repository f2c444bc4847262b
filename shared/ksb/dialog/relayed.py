"""Work relayed from the owner of another shard, applied by the owner of this one.

The relay topic is written inside the sender's Kafka transaction and read in order, so a relayed
message arrives exactly once and in its conversation's order; the receiving side still checks the
sequence number, as a receive window would, and holds back what may not be queued yet:

* a message for an endpoint whose queue is disabled, and every later one of that direction, goes
  to the transmission queue addressed to this instance (as a local message behind a disabled queue
  does), and comes back through ``inbound`` in order once the queue is enabled;
* the first message from an initiator creates the target endpoint, in its own group, with the
  level this instance's priorities give it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ksb.catalog.model import ERROR
from ksb.dialog import endpoint as ep_rules
from ksb.dialog.delivery import accept, drop_queued
from ksb.dialog.endpoint import Endpoint, State
from ksb.dialog.stage import Stage
from ksb.dialog.system_messages import CONTRACT_REFUSED, error_body
from ksb.wire.protocol import ErrorRecord, InboundMessage, decode_body, new_id
from ksb.wire.relay import RelayAction, RelayClose, RelayMessage, RelayReceivedEnd, RelayRecord

if TYPE_CHECKING:
    from ksb.dialog.engine import Engine

__all__ = ["apply_relayed", "relay_key"]


def relay_key(record: RelayRecord) -> str:
    """The group a relay record is for: its key, so it lands in that group's shard."""
    if isinstance(record, RelayMessage):
        return record.to_group
    if isinstance(record, RelayReceivedEnd | RelayClose | RelayAction):
        return record.group
    return record.key


def apply_relayed(
    eng: Engine, stage: Stage, record: RelayMessage | RelayReceivedEnd | RelayClose, now: int
) -> None:
    """Apply a relayed message or state change to an endpoint this engine owns."""
    if isinstance(record, RelayMessage):
        _message(eng, stage, record, now)
        return
    ep = stage.maybe_endpoint(record.handle)
    if ep is None:
        return  # the endpoint is gone already: nothing left to change
    ep.updated_ms = now
    if isinstance(record, RelayReceivedEnd):
        ep.state = ep_rules.after_peer_received_end(ep)
        return
    ep.state = State.CLOSED
    drop_queued(eng, stage, ep)


def _message(eng: Engine, stage: Stage, msg: RelayMessage, now: int) -> None:
    receiver = stage.maybe_endpoint(msg.to_handle)
    if receiver is None:
        if not msg.from_initiator:
            return  # the conversation is over on this side: Service Broker drops it
        receiver = _new_target(eng, stage, msg, now)
        if receiver is None:
            return
    if msg.seq < receiver.recv_seq:
        return  # applied before (the relay is exactly-once; this only guards a replay)
    body = decode_body({"body": msg.body, "body_b64": msg.body_b64})
    if eng.queue_disabled(receiver.queue) or msg.seq > receiver.recv_seq:
        _hold(eng, stage, receiver, msg, now)
        return
    stage.sent_ms = msg.sent_ms
    accept(eng, stage, receiver, msg.message_type, body, msg.seq, now)
    receiver.recv_seq = msg.seq + 1
    receiver.updated_ms = now


def _new_target(eng: Engine, stage: Stage, msg: RelayMessage, now: int) -> Endpoint | None:
    """The target endpoint, made by its first message, as the local path makes it."""
    service = eng.catalog.services.get(msg.to_service)
    if service is None or msg.contract not in service.contracts:
        _refuse(eng, stage, msg, now)
        return None
    level = eng.catalog.priorities.level(msg.contract, service.name, msg.from_service)
    ep = Endpoint(
        handle=msg.to_handle,
        conversation_id=msg.conversation_id,
        is_initiator=False,
        state=State.STARTED_INBOUND,
        local_service=service.name,
        remote_service=msg.from_service,
        contract=msg.contract,
        queue=service.queue,
        group=msg.to_group,
        priority=level,
        far_handle=msg.conversation_id,
        far_group=msg.from_group if msg.from_group != msg.conversation_id else None,
        created_ms=now,
        updated_ms=now,
        lifetime_deadline_ms=msg.lifetime_deadline_ms,
    )
    stage.put(ep)
    return ep


def _refuse(eng: Engine, stage: Stage, msg: RelayMessage, now: int) -> None:
    """The catalog changed under the dialog: the target refuses it, as another instance would."""
    reason = f"service {msg.to_service!r} does not accept contract {msg.contract!r} here"
    stage.out.errors.append(
        ErrorRecord(request_id=None, code="dialog_refused", reason=reason, handle=msg.to_handle)
    )
    text = error_body(CONTRACT_REFUSED, reason).decode()
    stage.out.relays.append(
        RelayMessage(
            conversation_id=msg.conversation_id,
            from_initiator=False,
            seq=0,
            to_handle=msg.conversation_id,
            to_group=msg.from_group,
            from_group=msg.to_group,
            from_service=msg.to_service,
            to_service=msg.from_service,
            contract=msg.contract,
            message_type=ERROR,
            body=text,
        )
    )


def _hold(eng: Engine, stage: Stage, receiver: Endpoint, msg: RelayMessage, now: int) -> None:
    """Not queued yet (a disabled queue, or an earlier message of this direction is held): into
    the transmission queue addressed to this instance, in order; it comes back through
    ``inbound`` once the queue is enabled, and the receive window takes it from there."""
    stage.out.transmissions.append(
        InboundMessage(
            message_id=new_id(),
            conversation_id=msg.conversation_id,
            from_instance=eng.instance,
            to_instance=eng.instance,
            from_service=msg.from_service,
            to_service=msg.to_service,
            contract=msg.contract,
            message_type=msg.message_type,
            from_initiator=msg.from_initiator,
            seq=msg.seq,
            priority=receiver.priority,
            enqueued_ms=now,
            from_group=msg.from_group,
            to_group=receiver.group,
            body=msg.body,
            body_b64=msg.body_b64,
        )
    )
