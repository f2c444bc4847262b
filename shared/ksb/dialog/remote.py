"""Messages from other broker instances: dedupe and order per direction, enqueue, acknowledge.

Each direction of a dialog is numbered from 0 by its sender (`ksb.dialog.delivery.transmit`). The
receiving side keeps a `ReceiveWindow` per local endpoint: it accepts only the next number, holds
early arrivals until the gap fills, drops every copy it has seen, and acknowledges the highest
number it delivered, in the same transaction as the queue writes of what it acknowledges. Only the
endpoint's next number (`Endpoint.recv_seq`) is durable; a window is rebuilt from it on demand.

Early arrivals are buffered in memory only. The dispatcher's every-tick task drops those not
picked up within the stale age (10 s by default, `DispatcherSettings.inbound_stale_ms`,
`RemoteWindows.purge`): safe, because nothing unacknowledged is lost, the sender retransmits it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ksb.catalog.model import END_DIALOG, ERROR
from ksb.dialog.delivery import accept, drop_queued, transmit
from ksb.dialog.sequencing import ReceiveWindow
from ksb.dialog.stage import Stage
from ksb.dialog.state import DialogState
from ksb.dialog.system_messages import CONTRACT_REFUSED, VALIDATION_ERROR, error_body
from ksb.errors import NotAuthorized, ValidationFailed
from ksb.wire.endpoint import Endpoint, State
from ksb.wire.partitioning import target_handle
from ksb.wire.protocol import AckRecord, ErrorRecord, InboundMessage

__all__ = ["RemoteWindows", "inbound"]


class RemoteWindows:
    """One receive window per local endpoint whose far side sends from another instance, and the
    remote endpoints that were CLOSED (a late retransmission must not begin them again)."""

    def __init__(self) -> None:
        self.windows: dict[str, ReceiveWindow[InboundMessage]] = {}
        self.closed: dict[str, str] = {}
        """Handle -> conversation group of each closed endpoint of a remote dialog."""

    def copy_of(self, receiver: Endpoint) -> ReceiveWindow[InboundMessage]:
        """A copy of `receiver`'s window for a request to move (`keep` takes it back)."""
        window = self.windows.get(receiver.handle)
        if window is None or window.next_seq != receiver.recv_seq:
            # (A local dialog also moves `recv_seq` on direct deliveries, so a kept window can
            # be behind it; the durable number wins.)
            return ReceiveWindow(next_seq=receiver.recv_seq)
        return window.copy()

    def keep(self, moved: Mapping[str, ReceiveWindow[InboundMessage]]) -> None:
        """The windows a merged request moved."""
        self.windows.update(moved)

    def closed_endpoint(self, ep: Endpoint) -> None:
        self.windows.pop(ep.handle, None)
        if ep.far_instance is not None:
            self.closed[ep.handle] = ep.group

    def drop(self, gone: Callable[[str], bool]) -> None:
        """Forget the closed endpoints of the groups `gone` names (a shard given up, or rebuilt
        after an aborted transaction: what it closed may not have been committed, and the
        rebuild knows again what was; found by the chaos harness, where remembering them kept
        a redelivered EndDialog from closing endpoints whose CLOSED records were aborted)."""
        for handle in [h for h, group in self.closed.items() if gone(group)]:
            del self.closed[handle]

    def purge(self, now_ms: int, max_age_ms: int) -> int:
        """Drop early arrivals held longer than `max_age_ms` (the dispatcher's per-tick task).

        Safe because they were never acknowledged: the sender retransmits them once the gap
        before them is filled. Returns how many were dropped.
        """
        return sum(len(w.drop_older_than(now_ms, max_age_ms)) for w in self.windows.values())


def inbound(
    state: DialogState, stage: Stage, msg: InboundMessage, now: int, *, carrier: str | None
) -> None:
    """A message from another instance, which `carrier`'s transport or forwarder wrote to our
    ``inbound.<carrier>`` topic: dedupe and order per direction, enqueue, acknowledge.

    Its origin (``from_instance``) is believed only when our routes let `carrier` carry that
    instance's messages (the origin itself, or the forwarder between us): a peer cannot pose as
    another. (None: a caller that knows no carrier, as the engine's own unit tests.)

    The window moves on the stage's copy, so it moves with the request or not at all; a failed
    Kafka transaction rebuilds its shards, whose windows and closed endpoints are forgotten
    first (`Engine.drop_shard`).
    """
    if msg.to_instance != state.instance:
        # Passing through: the forwarder reads the same topic and sends it on; the final
        # receiver acknowledges it, so a record nobody forwards is retransmitted by its origin.
        return
    _check_origin(state, msg.from_instance, carrier)
    handle = target_handle(msg.conversation_id) if msg.from_initiator else msg.conversation_id
    receiver = _inbound_endpoint(state, stage, msg, handle, now)
    if receiver is None:
        # The conversation is over here (or never existed): acknowledge so the sender stops.
        stage.out.acks.append(_ack(msg, msg.seq, state.instance))
        return
    if state.queue_disabled(receiver.queue):
        # Not acknowledged: it stays in the sender's transmission queue and is sent again
        # after the queue is enabled.
        return
    window = stage.window(receiver)
    for item in window.offer(msg.seq, msg, now):
        body = item.body_bytes()
        refusal = _refusal(state, receiver, item, body)
        if refusal is not None:
            _fail_from_far(state, stage, receiver, refusal, now)
            continue
        accept(state, stage, receiver, item.message_type, body, item.seq, now)
    receiver.recv_seq = window.next_seq
    receiver.updated_ms = now
    stage.out.acks.append(_ack(msg, window.ack_seq, state.instance))


def _check_origin(state: DialogState, origin: str, carrier: str | None) -> None:
    """Nothing of a message is believed, not even the instance to acknowledge to, unless it
    comes from a peer our routes name, through the instance that may carry it. (Our own
    instance: a local message held in the transmission queue while its queue was off.)"""
    if origin == state.instance and carrier in (None, state.instance):
        return
    if origin not in state.catalog.peers:
        raise NotAuthorized(
            f"a message from broker instance {origin!r}, which no route of this instance names",
            code="unknown_peer",
        )
    if carrier is not None and not state.catalog.carries(carrier, origin):
        raise NotAuthorized(
            f"broker instance {carrier!r} wrote a message from {origin!r}, whose messages our "
            "routes do not bring through it",
            code="unknown_peer",
        )


def _refusal(
    state: DialogState, receiver: Endpoint, msg: InboundMessage, body: bytes
) -> str | None:
    """Why the receiving side refuses a message from another instance, as it would one sent
    here (`ksb.dialog.send`): too large, a type its contract does not have or that side may not
    send, a body its type's validation fails. None: accepted."""
    if len(body) > state.max_body_bytes:
        return f"message body is {len(body)} bytes, over the limit of {state.max_body_bytes}"
    if msg.message_type in (END_DIALOG, ERROR):
        return None
    mtype = state.catalog.message_types.get(msg.message_type)
    contract = state.catalog.contracts.get(receiver.contract)
    if mtype is None or contract is None or not contract.knows(mtype.name):
        return f"message type {msg.message_type!r} is not in contract {receiver.contract!r}"
    if not contract.allows(mtype.name, from_initiator=msg.from_initiator):
        side = "initiator" if msg.from_initiator else "target"
        return f"message type {mtype.name!r} may not be sent by the {side}"
    try:
        mtype.validate_body(body)
    except ValidationFailed as exc:
        return exc.reason
    return None


def _fail_from_far(
    state: DialogState, stage: Stage, receiver: Endpoint, reason: str, now: int
) -> None:
    """A message from another instance refused: the far side is sent an Error (in the
    conversation's order) and this side closes with its queued messages, as a target that
    refuses a local message fails the dialog (`ksb.dialog.send.fail_dialog`)."""
    if receiver.state is State.CLOSED:
        return
    transmit(state, stage, receiver, ERROR, error_body(VALIDATION_ERROR, reason), now)
    receiver.state = State.CLOSED
    receiver.updated_ms = now
    drop_queued(state, stage, receiver)


def _inbound_endpoint(
    state: DialogState, stage: Stage, msg: InboundMessage, handle: str, now: int
) -> Endpoint | None:
    if state.closed_remote(handle) and handle not in stage.endpoints:
        return None
    existing = stage.maybe_endpoint(handle)
    if existing is not None or not msg.from_initiator:
        return existing
    # The first message from a remote initiator creates the target endpoint, as locally; the
    # level comes from OUR catalog (levels never travel).
    cat = state.catalog
    service = cat.services.get(msg.to_service)
    ep = Endpoint(
        handle=handle,
        conversation_id=msg.conversation_id,
        is_initiator=False,
        state=State.STARTED_INBOUND,
        local_service=msg.to_service,
        remote_service=msg.from_service,
        contract=msg.contract,
        queue=service.queue if service is not None else "",
        group=handle,
        priority=cat.priorities.level(msg.contract, msg.to_service, msg.from_service),
        far_handle=msg.conversation_id,
        far_group=msg.from_group,
        created_ms=now,
        updated_ms=now,
        far_instance=msg.from_instance,
    )
    stage.put(ep)
    reason = None
    if service is None:
        reason = f"service {msg.to_service!r} is not hosted on broker instance {state.instance!r}"
    elif msg.contract not in service.contracts:
        reason = f"service {msg.to_service!r} does not accept contract {msg.contract!r}"
    else:
        try:
            state.permissions.check_peer_send(msg.from_instance, msg.to_service)
        except NotAuthorized as exc:
            reason = exc.reason
    if reason is None:
        return ep
    # Refuse the dialog: the initiator gets an Error; this side closes at once.
    stage.out.errors.append(
        ErrorRecord(request_id=msg.request_id, code="dialog_refused", reason=reason, handle=handle)
    )
    transmit(state, stage, ep, ERROR, error_body(CONTRACT_REFUSED, reason), now)
    ep.recv_seq = msg.seq + 1 if msg.seq == 0 else 0
    ep.state = State.CLOSED
    return None


def _ack(msg: InboundMessage, ack_seq: int, instance: str) -> AckRecord:
    return AckRecord(
        conversation_id=msg.conversation_id,
        from_initiator=msg.from_initiator,
        ack_seq=ack_seq,
        from_instance=instance,
        to_instance=msg.from_instance,
    )
