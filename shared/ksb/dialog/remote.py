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

from ksb.catalog.model import ERROR
from ksb.dialog.delivery import accept, transmit
from ksb.dialog.sequencing import ReceiveWindow
from ksb.dialog.stage import Stage
from ksb.dialog.state import DialogState
from ksb.dialog.system_messages import CONTRACT_REFUSED, error_body
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


def inbound(state: DialogState, stage: Stage, msg: InboundMessage, now: int) -> None:
    """A message from another instance: dedupe and order per direction, enqueue, acknowledge.

    The window moves on the stage's copy, so it moves with the request or not at all; a failed
    Kafka transaction rebuilds its shards, whose windows and closed endpoints are forgotten
    first (`Engine.drop_shard`).
    """
    if msg.to_instance != state.instance:
        # Passing through: the forwarder reads the same topic and sends it on; the final
        # receiver acknowledges it, so a record nobody forwards is retransmitted by its origin.
        return
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
        accept(state, stage, receiver, item.message_type, item.body_bytes(), item.seq, now)
    receiver.recv_seq = window.next_seq
    receiver.updated_ms = now
    stage.out.acks.append(_ack(msg, window.ack_seq, state.instance))


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
