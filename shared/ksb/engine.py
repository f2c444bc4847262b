"""The dispatcher's pure engine: requests in, records out.

The engine owns endpoint state, the set of messages still waiting in queues and the conversation timers.
It never touches Kafka: the dispatcher feeds it requests and writes the `Outputs` of each request in one
Kafka transaction together with the consumed offsets, which is what makes delivery exactly-once.

Every request is handled as a small transaction over a staging area, so a request with several actions
(a multi-conversation SEND, a reader's commit) either applies whole or leaves no trace.
"""

from __future__ import annotations

import heapq
import json
import uuid
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from ksb import endpoint as ep_rules
from ksb.catalog import DIALOG_TIMER, END_DIALOG, ERROR, CatalogView, MessageType
from ksb.endpoint import Endpoint, State
from ksb.errors import CatalogError, ConversationError, KsbError, ProtocolError, ValidationFailed
from ksb.protocol import (
    AckRecord,
    AnyRequest,
    BeginRequest,
    CommitOutcome,
    CommitRequest,
    DeadLetterRecord,
    DeadLetterRequest,
    EndRequest,
    ErrorRecord,
    InboundMessage,
    QueueMessage,
    Receipt,
    ReplayRequest,
    SendRequest,
    TimerRequest,
    encode_body,
)
from ksb.sequencing import ReceiveWindow

__all__ = ["Engine", "Inflight", "Outputs", "QueueWrite", "partition_for", "target_handle"]

_TARGET_NS = uuid.UUID("6b7a1c2e-5f44-4f0e-9a51-0c1b7d1e3a10")
_VALIDATION_CODE = {
    "NONE": "N",
    "EMPTY": "E",
    "WELL_FORMED_XML": "X",
    "VALID_XML": "X",
    "WELL_FORMED_JSON": "J",
    "SCHEMA": "S",
}
# Error codes placed in Error messages; negative like Service Broker's system errors.
LIFETIME_EXPIRED = -8489
VALIDATION_ERROR = -9615
CONTRACT_REFUSED = -8408


def partition_for(group: str, partitions: int) -> int:
    """A group's messages all live in one partition of its queue topic, in send order."""
    return zlib.crc32(group.encode()) % partitions


@dataclass(frozen=True)
class QueueWrite:
    """One record for a queue topic: a message, a receipt (value None), or a commit outcome."""

    queue: str
    partition: int
    key: str
    value: QueueMessage | CommitOutcome | None


@dataclass(frozen=True)
class Inflight:
    """A message still in a queue: enough to apply its receipt without reading it back."""

    queue: str
    partition: int
    group: str
    handle: str
    message_type: str
    retained: QueueMessage | None = None
    """The message itself, kept only for RETENTION queues, which rewrite it as received."""
    priority: int = 5
    enqueued_ms: int = 0
    """Level and enqueue time, for the time-in-queue figures the dispatcher exports at receipt."""
    message_id: str = ""
    service: str = ""
    sent_ms: int | None = None
    """For the audit events (ksb.audit): which message, which service, and when it was sent."""


@dataclass
class Outputs:
    queue: list[QueueWrite] = field(default_factory=list)
    endpoints: list[Endpoint] = field(default_factory=list)
    errors: list[ErrorRecord] = field(default_factory=list)
    dead_letters: list[DeadLetterRecord] = field(default_factory=list)
    received: list[Inflight] = field(default_factory=list)
    """Messages a commit received (for metrics; nothing is written for them beyond `queue`)."""
    purged: list[Inflight] = field(default_factory=list)
    """Unreceived messages that left their queue because their conversation closed."""
    transmissions: list[InboundMessage] = field(default_factory=list)
    """Messages for another broker instance: written to this instance's transmission topic."""
    acks: list[AckRecord] = field(default_factory=list)
    """Acknowledgements of inbound messages: written to ``ksb.<to_instance>.acks``."""

    def extend(self, other: Outputs) -> None:
        self.queue.extend(other.queue)
        self.endpoints.extend(other.endpoints)
        self.errors.extend(other.errors)
        self.dead_letters.extend(other.dead_letters)
        self.received.extend(other.received)
        self.purged.extend(other.purged)
        self.transmissions.extend(other.transmissions)
        self.acks.extend(other.acks)


class _Stage:
    """Copy-on-write view of the engine's state for one request."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.endpoints: dict[str, Endpoint] = {}
        self.new_inflight: dict[str, Inflight] = {}
        self.gone_inflight: set[str] = set()
        self.new_retained: dict[str, Inflight] = {}
        self.out = Outputs()
        self.sent_ms: int | None = None

    def endpoint(self, handle: str) -> Endpoint:
        if handle in self.endpoints:
            return self.endpoints[handle]
        base = self.engine.endpoints.get(handle)
        if base is None or base.state is State.CLOSED:
            raise ConversationError(
                f"unknown or closed conversation handle {handle!r}", code="unknown_conversation"
            )
        ep = base.copy()
        self.endpoints[handle] = ep
        return ep

    def maybe_endpoint(self, handle: str | None) -> Endpoint | None:
        if handle is None:
            return None
        try:
            return self.endpoint(handle)
        except ConversationError:
            return None

    def put(self, ep: Endpoint) -> None:
        self.endpoints[ep.handle] = ep


class Engine:
    """Endpoint state, queue membership and timers for one broker instance."""

    def __init__(self, catalog: CatalogView, *, instance: str, max_body_bytes: int) -> None:
        self.catalog = catalog
        self.instance = instance
        self.max_body_bytes = max_body_bytes
        self.endpoints: dict[str, Endpoint] = {}
        self.inflight: dict[str, Inflight] = {}
        self.depth: dict[str, int] = {}
        """Unreceived messages per queue: `inflight` counted by queue, kept in step with it."""
        self.fences: dict[tuple[str, str], int] = {}
        self.retained: dict[str, Inflight] = {}
        self._by_handle: dict[str, set[str]] = {}
        self._timers: list[tuple[int, str, str]] = []
        self._order = 0
        # Remote dialogs: one receive window per local endpoint whose far side is on another
        # instance. Only `Endpoint.recv_seq` is durable; a window is rebuilt from it on demand.
        self._windows: dict[str, ReceiveWindow[InboundMessage]] = {}
        self._window_clock = _StepClock()
        # Remote endpoints that were CLOSED: a late retransmission must not begin them again.
        self._closed_remote: set[str] = set()
        self._last_purge_ms = 0
        # The dispatcher's periodic task (the seed's every-tick rule): early arrivals not picked up
        # within 10 s are dropped on the next 5 s tick.
        self.inbound_stale_ms = 10_000
        self.purge_every_ms = 5_000

    # ------------------------------------------------------------------ rebuild from Kafka
    def load_endpoint(self, ep: Endpoint) -> None:
        if ep.state is State.CLOSED:
            self.endpoints.pop(ep.handle, None)
            self._windows.pop(ep.handle, None)
            if ep.far_instance is not None:
                self._closed_remote.add(ep.handle)
            return
        self.endpoints[ep.handle] = ep
        self._arm(ep)

    def load_queue_record(self, key: str, value: QueueMessage | None, partition: int) -> None:
        if value is None:
            old = self._pop_inflight(key) or self.retained.pop(key, None)
            if old is not None:
                self._unindex(key, old)
            return
        info = Inflight(
            value.queue,
            partition,
            value.conversation_group_id,
            value.conversation_handle,
            value.message_type_name,
            value if self._retains(value.queue) else None,
            priority=value.priority,
            enqueued_ms=value.enqueued_ms,
            message_id=key,
            service=value.service_name,
            sent_ms=value.sent_ms,
        )
        self._by_handle.setdefault(info.handle, set()).add(key)
        if value.status != 1:
            self._pop_inflight(key)
            self.retained[key] = info
            return
        self._add_inflight(key, info)
        self._order = max(self._order, value.queuing_order + 1)

    # ------------------------------------------------------------------ requests
    def handle(self, request: AnyRequest, now_ms: int, *, sent_ms: int | None = None) -> Outputs:
        """Apply one request. ``sent_ms``, the request record's timestamp, is stamped on the
        messages it enqueues so that end-to-end latency can be measured when they are received."""
        stage = _Stage(self)
        stage.sent_ms = sent_ms
        try:
            if isinstance(request, CommitRequest):
                self._commit(stage, request, now_ms)
            elif isinstance(request, DeadLetterRequest):
                self._dead_letter(stage, request, now_ms)
            elif isinstance(request, ReplayRequest):
                self._replay(stage, request)
            elif isinstance(request, InboundMessage):
                self._inbound(stage, request, now_ms)
            else:
                self._action(stage, request, now_ms)
        except KsbError as exc:
            return self._refused(request, exc, now_ms)
        self._merge(stage)
        return stage.out

    def _refused(self, request: AnyRequest, exc: KsbError, now_ms: int) -> Outputs:
        out = Outputs()
        handle = _request_handle(request)
        out.errors.append(
            ErrorRecord(
                request_id=request.request_id, code=exc.code, reason=exc.reason, handle=handle
            )
        )
        if isinstance(request, CommitRequest) and request.receipt is not None:
            r = request.receipt
            queue = self.catalog.queues.get(r.queue)
            partitions = queue.partitions if queue else 1
            out.queue.append(
                QueueWrite(
                    r.queue,
                    partition_for(r.group, partitions),
                    f"commit/{request.request_id}",
                    CommitOutcome(
                        request_id=request.request_id,
                        group=r.group,
                        token=r.token,
                        applied=False,
                        reason=f"{exc.code}: {exc.reason}",
                    ),
                )
            )
            out.queue.append(_forget_outcome(out.queue[-1]))
        return out

    def _merge(self, stage: _Stage) -> None:
        for mid in stage.gone_inflight:
            info = self._pop_inflight(mid) or self.retained.pop(mid, None)
            if info is not None and mid not in stage.new_retained:
                self._unindex(mid, info)
        for mid, info in stage.new_inflight.items():
            self._add_inflight(mid, info)
            self._by_handle.setdefault(info.handle, set()).add(mid)
        self.retained.update(stage.new_retained)
        for ep in stage.endpoints.values():
            if ep.state is State.CLOSED:
                self.endpoints.pop(ep.handle, None)
                self._windows.pop(ep.handle, None)
                if ep.far_instance is not None:
                    self._closed_remote.add(ep.handle)
            else:
                self.endpoints[ep.handle] = ep
                self._arm(ep)
            stage.out.endpoints.append(ep)

    def _action(
        self, stage: _Stage, req: BeginRequest | SendRequest | EndRequest | TimerRequest, now: int
    ) -> None:
        if isinstance(req, BeginRequest):
            self._begin(stage, req, now)
        elif isinstance(req, SendRequest):
            self._send(stage, req, now)
        elif isinstance(req, EndRequest):
            self._end(stage, req, now)
        else:
            self._timer(stage, req, now)

    # ------------------------------------------------------------------ BEGIN DIALOG
    def _begin(self, stage: _Stage, req: BeginRequest, now: int) -> None:
        if req.handle in self.endpoints or req.handle in stage.endpoints:
            existing = stage.endpoints.get(req.handle) or self.endpoints[req.handle]
            if existing.is_initiator and existing.remote_service == req.to_service:
                return  # a retried BEGIN: the dialog already exists
            raise ConversationError(
                f"handle {req.handle!r} is already in use", code="duplicate_handle"
            )
        cat = self.catalog
        cat.service(req.from_service)  # an unknown sender is refused before anything else
        contract = cat.contract(req.contract)
        target = cat.services.get(req.to_service)
        if target is None:
            self._begin_remote(stage, req, now)
            return
        if contract.name not in target.contracts:
            raise CatalogError(
                f"service {target.name!r} does not accept contract {contract.name!r}",
                code="contract_not_accepted",
            )
        self._put_initiator(stage, req, now, remote_service=target.name, far_instance=None)

    def _begin_remote(self, stage: _Stage, req: BeginRequest, now: int) -> None:
        """A target on another instance: the route names it; the far endpoint is not ours to make.

        The target's acceptance of the contract is checked by the target's dispatcher when the
        first message arrives (it answers with an Error message if it refuses).
        """
        cat = self.catalog
        route = cat.routes.get(req.to_service)
        if route is None:
            raise CatalogError(
                f"unknown target service {req.to_service!r} (no local service, no route)",
                code="unknown_service",
            )
        if req.to_broker_instance is not None and req.to_broker_instance != route.broker_instance:
            raise CatalogError(
                f"no route to service {req.to_service!r} on broker instance "
                f"{req.to_broker_instance!r} (the route names {route.broker_instance!r})",
                code="unknown_service",
            )
        if route.broker_instance == self.instance:
            raise CatalogError(
                f"route {route.name!r} points service {req.to_service!r} at this instance, "
                "which does not host it",
                code="unknown_service",
            )
        self._put_initiator(
            stage, req, now, remote_service=req.to_service, far_instance=route.broker_instance
        )

    def _put_initiator(
        self,
        stage: _Stage,
        req: BeginRequest,
        now: int,
        *,
        remote_service: str,
        far_instance: str | None,
    ) -> None:
        """The initiator endpoint, in the related conversation's group (or the named or a new one),
        with the level its own catalog assigns; the conversation id is the initiator's handle."""
        cat = self.catalog
        local = cat.service(req.from_service)
        contract = cat.contract(req.contract)
        group = req.conversation_group_id or str(uuid.uuid4())
        if req.related_conversation is not None:
            group = stage.endpoint(req.related_conversation).group
        stage.put(
            Endpoint(
                handle=req.handle,
                conversation_id=req.handle,
                is_initiator=True,
                state=State.STARTED_OUTBOUND,
                local_service=local.name,
                remote_service=remote_service,
                contract=contract.name,
                queue=local.queue,
                group=group,
                priority=cat.priorities.level(contract.name, local.name, remote_service),
                far_handle=target_handle(req.handle),
                created_ms=now,
                updated_ms=now,
                lifetime_deadline_ms=now + req.lifetime_s * 1000 if req.lifetime_s else None,
                far_instance=far_instance,
            )
        )

    def _ensure_target(self, stage: _Stage, initiator: Endpoint, now: int) -> Endpoint:
        """The target endpoint comes into being with the first message sent to it."""
        assert initiator.far_handle is not None
        existing = stage.endpoints.get(initiator.far_handle) or self.endpoints.get(
            initiator.far_handle
        )
        if existing is not None:
            return stage.endpoint(existing.handle)
        service = self.catalog.service(initiator.remote_service)
        level = self.catalog.priorities.level(
            initiator.contract, service.name, initiator.local_service
        )
        ep = Endpoint(
            handle=initiator.far_handle,
            conversation_id=initiator.conversation_id,
            is_initiator=False,
            state=State.STARTED_INBOUND,
            local_service=service.name,
            remote_service=initiator.local_service,
            contract=initiator.contract,
            queue=service.queue,
            group=str(uuid.uuid4()),
            priority=level,
            far_handle=initiator.handle,
            created_ms=now,
            updated_ms=now,
            lifetime_deadline_ms=initiator.lifetime_deadline_ms,
        )
        stage.put(ep)
        return ep

    def _peer(self, stage: _Stage, sender: Endpoint, now: int) -> Endpoint | None:
        if sender.is_initiator:
            if sender.far_handle in stage.endpoints or sender.far_handle in self.endpoints:
                return stage.maybe_endpoint(sender.far_handle)
            return None
        return stage.maybe_endpoint(sender.far_handle)

    # ------------------------------------------------------------------ SEND
    def _send(self, stage: _Stage, req: SendRequest, now: int) -> None:
        body = req.body_bytes()
        if len(body) > self.max_body_bytes:
            raise ConversationError(
                f"message body is {len(body)} bytes, over the limit of {self.max_body_bytes}",
                code="body_too_large",
            )
        mtype = self.catalog.message_type(req.message_type)
        senders = [stage.endpoint(h) for h in dict.fromkeys(req.handles)]
        for sender in senders:
            ep_rules.check_can_send(sender)
            contract = self.catalog.contract(sender.contract)
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
        for sender in senders:
            self._deliver(stage, sender, mtype, body, now)

    def _deliver(
        self, stage: _Stage, sender: Endpoint, mtype: MessageType, body: bytes, now: int
    ) -> None:
        if sender.far_instance is not None:
            self._deliver_remote(stage, sender, mtype, body, now)
            return
        receiver = (
            self._ensure_target(stage, sender, now)
            if sender.is_initiator
            else stage.endpoint(sender.far_handle or "")
        )
        sender.state = ep_rules.after_send(sender)
        sender.updated_ms = now
        try:
            mtype.validate_body(body)
        except ValidationFailed as exc:
            # The receiving side refuses the message and fails the dialog, as a target would.
            self._fail_dialog(stage, sender, receiver, VALIDATION_ERROR, exc.reason, now)
            return
        if self._must_park(sender, receiver):
            self._transmit(stage, sender, mtype.name, body, now, to_instance=self.instance)
            return
        receiver.recv_seq = sender.send_seq + 1
        self._enqueue(
            stage,
            receiver,
            mtype.name,
            _VALIDATION_CODE[mtype.validation.value],
            body,
            sender.send_seq,
            now,
        )
        sender.send_seq += 1

    def _deliver_remote(
        self, stage: _Stage, sender: Endpoint, mtype: MessageType, body: bytes, now: int
    ) -> None:
        """Validate here (the target would refuse the same body), then hand to the transmitter."""
        sender.state = ep_rules.after_send(sender)
        sender.updated_ms = now
        try:
            mtype.validate_body(body)
        except ValidationFailed as exc:
            # As a remote target would: the dialog fails on both sides. Our side gets the Error
            # message now; the far side is told with an Error in the conversation's order.
            self._enqueue(
                stage, sender, ERROR, "X", _error_body(VALIDATION_ERROR, exc.reason), -1, now
            )
            self._transmit(stage, sender, ERROR, _error_body(VALIDATION_ERROR, exc.reason), now)
            sender.state = ep_rules.after_peer_error(sender)
            sender.error_code, sender.error_description = VALIDATION_ERROR, exc.reason
            return
        self._transmit(stage, sender, mtype.name, body, now)

    def _must_park(self, sender: Endpoint, receiver: Endpoint) -> bool:
        """Whether a local message goes through the transmission queue instead of straight in.

        Local delivery skips the transmission queue unless the target queue is disabled; and once
        one message of a direction waits there, every later one of that direction waits behind
        it (the receiver's `recv_seq` lags the sender's `send_seq`), so order is never broken.
        """
        return self._queue_disabled(receiver.queue) or receiver.recv_seq < sender.send_seq

    def _queue_disabled(self, name: str) -> bool:
        queue = self.catalog.queues.get(name)
        return queue is not None and queue.disabled

    def _transmit(
        self,
        stage: _Stage,
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
        stage.out.transmissions.append(
            InboundMessage(
                kind="inbound",
                message_id=str(uuid.uuid4()),
                conversation_id=sender.conversation_id,
                from_instance=self.instance,
                to_instance=destination,
                from_service=sender.local_service,
                to_service=sender.remote_service,
                contract=sender.contract,
                message_type=message_type,
                from_initiator=sender.is_initiator,
                seq=sender.send_seq,
                priority=sender.priority,
                enqueued_ms=now,
                **encode_body(body),
            )
        )
        sender.send_seq += 1
        sender.updated_ms = now

    # ------------------------------------------------------------------ inbound (remote senders)
    def _inbound(self, stage: _Stage, msg: InboundMessage, now: int) -> None:
        """A message from another instance: dedupe and order per direction, enqueue, acknowledge.

        Nothing here raises after the window has moved, so the window and the stage stay in step;
        a failed Kafka transaction rebuilds the whole engine (and so every window) anyway.
        """
        if msg.to_instance != self.instance:
            # Passing through: the forwarder reads the same topic and sends it on; the final
            # receiver acknowledges it, so a record nobody forwards is retransmitted by its origin.
            return
        handle = target_handle(msg.conversation_id) if msg.from_initiator else msg.conversation_id
        receiver = self._inbound_endpoint(stage, msg, handle, now)
        if receiver is None:
            # The conversation is over here (or never existed): acknowledge so the sender stops.
            stage.out.acks.append(_ack(msg, msg.seq, self.instance))
            return
        if self._queue_disabled(receiver.queue):
            # Not acknowledged: it stays in the sender's transmission queue and is sent again
            # after the queue is enabled.
            return
        window = self._windows.get(handle)
        if window is None or window.next_seq != receiver.recv_seq:
            # (A local dialog also moves `recv_seq` on direct deliveries, so a cached window can
            # be behind it; the durable number wins.)
            window = ReceiveWindow(self._window_clock, next_seq=receiver.recv_seq)
            self._windows[handle] = window
        self._window_clock.now = now
        for item in window.offer(msg.seq, msg):
            self._accept(stage, receiver, item, now)
        receiver.recv_seq = window.next_seq
        receiver.updated_ms = now
        stage.out.acks.append(_ack(msg, window.ack_seq, self.instance))

    def _inbound_endpoint(
        self, stage: _Stage, msg: InboundMessage, handle: str, now: int
    ) -> Endpoint | None:
        if handle in self._closed_remote and handle not in stage.endpoints:
            return None
        existing = stage.maybe_endpoint(handle)
        if existing is not None or not msg.from_initiator:
            return existing
        # The first message from a remote initiator creates the target endpoint, as locally; the
        # level comes from OUR catalog (levels never travel).
        cat = self.catalog
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
            group=str(uuid.uuid4()),
            priority=cat.priorities.level(msg.contract, msg.to_service, msg.from_service),
            far_handle=msg.conversation_id,
            created_ms=now,
            updated_ms=now,
            far_instance=msg.from_instance,
        )
        stage.put(ep)
        reason = None
        if service is None:
            reason = (
                f"service {msg.to_service!r} is not hosted on broker instance {self.instance!r}"
            )
        elif msg.contract not in service.contracts:
            reason = f"service {msg.to_service!r} does not accept contract {msg.contract!r}"
        if reason is not None:
            # Refuse the dialog: the initiator gets an Error; this side closes at once.
            stage.out.errors.append(
                ErrorRecord(
                    request_id=msg.request_id, code="dialog_refused", reason=reason, handle=handle
                )
            )
            self._transmit(stage, ep, ERROR, _error_body(CONTRACT_REFUSED, reason), now)
            ep.recv_seq = msg.seq + 1 if msg.seq == 0 else 0
            ep.state = State.CLOSED
            return None
        return ep

    def _accept(self, stage: _Stage, receiver: Endpoint, msg: InboundMessage, now: int) -> None:
        """One in-order inbound message: into the queue, and the state change it implies."""
        if msg.message_type == END_DIALOG:
            if receiver.state in (State.DISCONNECTED_OUTBOUND, State.ERROR):
                # We ended first (or failed): the far side's EndDialog closes us; nobody reads it.
                receiver.state = State.CLOSED
                self._drop_queued(stage, receiver)
                return
            self._enqueue(stage, receiver, END_DIALOG, "E", b"", msg.seq, now)
            receiver.state = ep_rules.after_peer_ended(receiver)
            return
        if receiver.state in (State.DISCONNECTED_OUTBOUND, State.ERROR, State.CLOSED):
            return  # Service Broker drops messages for a conversation this side has given up
        if msg.message_type == ERROR:
            body = msg.body_bytes()
            self._enqueue(stage, receiver, ERROR, "X", body, msg.seq, now)
            receiver.state = ep_rules.after_peer_error(receiver)
            code, desc = _parse_error(body)
            receiver.error_code, receiver.error_description = code, desc
            return
        mtype = self.catalog.message_types.get(msg.message_type)
        validation = _VALIDATION_CODE[mtype.validation.value] if mtype is not None else "N"
        self._enqueue(stage, receiver, msg.message_type, validation, msg.body_bytes(), msg.seq, now)

    def _enqueue(
        self,
        stage: _Stage,
        receiver: Endpoint,
        message_type: str,
        validation: str,
        body: bytes,
        seq: int,
        now: int,
    ) -> None:
        queue = self.catalog.queue(receiver.queue)
        message_id = str(uuid.uuid4())
        part = partition_for(receiver.group, queue.partitions)
        msg = QueueMessage(
            message_id=message_id,
            queue=queue.name,
            priority=receiver.priority,
            queuing_order=self._next_order(),
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
            **encode_body(body),
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

    def _next_order(self) -> int:
        self._order += 1
        return self._order

    def _fail_dialog(
        self, stage: _Stage, sender: Endpoint, receiver: Endpoint, code: int, reason: str, now: int
    ) -> None:
        """The receiver refuses the dialog: an Error goes back to the sender, the receiver closes."""
        self._enqueue(stage, sender, ERROR, "X", _error_body(code, reason), -1, now)
        sender.state = ep_rules.after_peer_error(sender)
        sender.error_code, sender.error_description = code, reason
        receiver.state = State.CLOSED
        receiver.updated_ms = now
        self._drop_queued(stage, receiver)

    # ------------------------------------------------------------------ END CONVERSATION
    def _end(self, stage: _Stage, req: EndRequest, now: int) -> None:
        ep = stage.endpoint(req.handle)
        ep.updated_ms = now
        if req.cleanup:
            ep.state = State.CLOSED
            self._drop_queued(stage, ep)
            return
        if ep.far_instance is not None:
            self._end_remote(stage, ep, req, now)
            return
        peer = self._peer(stage, ep, now)
        new_state = ep_rules.after_end(ep)
        if (
            peer is not None
            and peer.state is not State.CLOSED
            and ep.state
            not in (
                State.DISCONNECTED_INBOUND,
                State.ERROR,
            )
        ):
            if self._must_park(ep, peer):
                self._park_end(stage, ep, req, now)
                ep.state = new_state
                return
            peer.recv_seq = ep.send_seq + 1
            if req.error_code is not None:
                desc = req.error_description or ""
                self._enqueue(
                    stage, peer, ERROR, "X", _error_body(req.error_code, desc), ep.send_seq, now
                )
                peer.state = ep_rules.after_peer_error(peer)
                peer.error_code, peer.error_description = req.error_code, desc
            else:
                self._enqueue(stage, peer, END_DIALOG, "E", b"", ep.send_seq, now)
                peer.state = ep_rules.after_peer_ended(peer)
            ep.send_seq += 1
        elif peer is None and ep.is_initiator:
            new_state = State.CLOSED  # nothing was ever sent: there is no far side to tell
        ep.state = new_state
        if ep.state is State.CLOSED:
            self._drop_queued(stage, ep)

    def _park_end(self, stage: _Stage, ep: Endpoint, req: EndRequest, now: int) -> None:
        """A local END behind parked messages: its EndDialog or Error waits in line with them,
        and the peer's state changes when it is accepted (`_accept`), as for a remote peer."""
        if req.error_code is not None:
            body = _error_body(req.error_code, req.error_description or "")
            self._transmit(stage, ep, ERROR, body, now, to_instance=self.instance)
        else:
            self._transmit(stage, ep, END_DIALOG, b"", now, to_instance=self.instance)

    def _add_inflight(self, mid: str, info: Inflight) -> None:
        old = self.inflight.get(mid)
        if old is not None:
            self.depth[old.queue] -= 1
        self.inflight[mid] = info
        self.depth[info.queue] = self.depth.get(info.queue, 0) + 1

    def _pop_inflight(self, mid: str) -> Inflight | None:
        info = self.inflight.pop(mid, None)
        if info is not None:
            self.depth[info.queue] -= 1
        return info

    def _end_remote(self, stage: _Stage, ep: Endpoint, req: EndRequest, now: int) -> None:
        """END toward another instance: the EndDialog (or Error) travels like any message.

        Unlike a local dialog, the far side cannot see our receipt of its EndDialog, so a side that
        ends second (DISCONNECTED_INBOUND) also sends an EndDialog: that is what closes the first.
        """
        new_state = ep_rules.after_end(ep)
        if ep.state is State.STARTED_OUTBOUND and ep.send_seq == 0:
            new_state = State.CLOSED  # nothing was ever sent: there is no far side to tell
        elif ep.state is not State.ERROR:
            if req.error_code is not None:
                body = _error_body(req.error_code, req.error_description or "")
                self._transmit(stage, ep, ERROR, body, now)
                new_state = State.CLOSED  # nothing more can come that this side would accept
            else:
                self._transmit(stage, ep, END_DIALOG, b"", now)
        ep.state = new_state
        if ep.state is State.CLOSED:
            self._drop_queued(stage, ep)

    def _unindex(self, mid: str, info: Inflight) -> None:
        mids = self._by_handle.get(info.handle)
        if mids is not None:
            mids.discard(mid)
            if not mids:
                del self._by_handle[info.handle]

    def _retains(self, queue: str) -> bool:
        q = self.catalog.queues.get(queue)
        return q is not None and q.retention == "ON"

    def _drop_queued(self, stage: _Stage, ep: Endpoint) -> None:
        """A closed endpoint's messages leave its queue, retained ones included."""
        mine = [
            (mid, self.inflight.get(mid) or self.retained.get(mid))
            for mid in self._by_handle.get(ep.handle, ())
        ]
        mine += [(mid, i) for mid, i in stage.new_inflight.items() if i.handle == ep.handle]
        mine += [(mid, i) for mid, i in stage.new_retained.items() if i.handle == ep.handle]
        for mid, info in mine:
            if info is None:
                continue
            received_now = mid in stage.new_retained
            if mid in stage.gone_inflight and not received_now:
                continue
            if not received_now and (mid in self.inflight or mid in stage.new_inflight):
                stage.out.purged.append(info)
            stage.gone_inflight.add(mid)
            stage.new_inflight.pop(mid, None)
            stage.new_retained.pop(mid, None)
            stage.out.queue.append(QueueWrite(info.queue, info.partition, mid, None))
        ep.outstanding = 0

    # ------------------------------------------------------------------ BEGIN CONVERSATION TIMER
    def _timer(self, stage: _Stage, req: TimerRequest, now: int) -> None:
        ep = stage.endpoint(req.handle)
        if ep.state in (State.CLOSED, State.DISCONNECTED_OUTBOUND):
            raise ConversationError(
                f"cannot set a timer on conversation {ep.handle}: it is {ep.state.name}",
                code="conversation_closed",
            )
        ep.timer_deadline_ms = now + round(req.timeout_s * 1000)
        ep.updated_ms = now

    # ------------------------------------------------------------------ commit
    def _commit(self, stage: _Stage, req: CommitRequest, now: int) -> None:
        if req.receipt is not None:
            self._apply_receipt(stage, req.receipt, now)
        for action in req.actions:
            self._action(stage, action, now)
        if req.receipt is not None:
            r = req.receipt
            queue = self.catalog.queue(r.queue)
            stage.out.queue.append(
                QueueWrite(
                    r.queue,
                    partition_for(r.group, queue.partitions),
                    f"commit/{req.request_id}",
                    CommitOutcome(
                        request_id=req.request_id, group=r.group, token=r.token, applied=True
                    ),
                )
            )
            stage.out.queue.append(_forget_outcome(stage.out.queue[-1]))
            if r.token:
                self.fences[(r.queue, r.group)] = r.token

    def _apply_receipt(self, stage: _Stage, r: Receipt, now: int) -> None:
        fence = self.fences.get((r.queue, r.group), 0)
        if r.token and r.token < fence:
            raise ConversationError(
                f"stale lock token {r.token} for group {r.group} (a newer holder committed {fence})",
                code="stale_token",
            )
        self.catalog.queue(r.queue)  # an unknown queue is refused before anything is applied
        for mid in dict.fromkeys(r.message_ids):
            info = self.inflight.get(mid)
            if info is None or mid in stage.gone_inflight:
                raise ConversationError(
                    f"message {mid} is not waiting in queue {r.queue!r} (already received?)",
                    code="already_received",
                )
            if info.queue != r.queue or info.group != r.group:
                raise ConversationError(
                    f"message {mid} is not in group {r.group} of queue {r.queue!r}",
                    code="wrong_group",
                )
            stage.gone_inflight.add(mid)
            stage.out.received.append(info)
            if info.retained is not None:
                # RETENTION ON: the message stays, marked received, until its conversation ends.
                kept = info.retained.model_copy(update={"status": 0})
                stage.out.queue.append(QueueWrite(r.queue, info.partition, mid, kept))
                stage.new_retained[mid] = info
            else:
                stage.out.queue.append(QueueWrite(r.queue, info.partition, mid, None))
            receiver = stage.maybe_endpoint(info.handle)
            if receiver is None:
                continue
            receiver.outstanding = max(0, receiver.outstanding - 1)
            receiver.state = ep_rules.after_receive(receiver)
            receiver.updated_ms = now
            if info.message_type in (END_DIALOG, ERROR):
                peer = stage.maybe_endpoint(receiver.far_handle)
                if peer is not None:
                    peer.state = ep_rules.after_peer_received_end(peer)
                    peer.updated_ms = now

    # ------------------------------------------------------------------ dead letters
    def _dead_letter(self, stage: _Stage, req: DeadLetterRequest, now: int) -> None:
        m = req.message
        info = self.inflight.get(m.message_id)
        if info is None or info.queue != m.queue:
            raise ConversationError(
                f"message {m.message_id} is not waiting in queue {m.queue!r}",
                code="already_received",
            )
        stage.gone_inflight.add(m.message_id)
        stage.out.queue.append(QueueWrite(m.queue, info.partition, m.message_id, None))
        stage.out.dead_letters.append(
            DeadLetterRecord(message=m, reason=req.reason, dead_lettered_ms=now)
        )
        receiver = stage.maybe_endpoint(info.handle)
        if receiver is not None:
            receiver.outstanding = max(0, receiver.outstanding - 1)
            queue = self.catalog.queues.get(m.queue)
            code = queue.dead_letter.error_code if queue and queue.dead_letter else -1
            if receiver.state not in (State.DISCONNECTED_OUTBOUND, State.CLOSED):
                end = EndRequest(
                    kind="end",
                    handle=receiver.handle,
                    error_code=code,
                    error_description=f"message dead-lettered: {req.reason}",
                )
                self._end(stage, end, now)

    def _replay(self, stage: _Stage, req: ReplayRequest) -> None:
        m = req.message
        if m.message_id in self.inflight:
            raise ConversationError(
                f"message {m.message_id} is already in its queue", code="duplicate_message"
            )
        queue = self.catalog.queue(m.queue)
        part = partition_for(m.conversation_group_id, queue.partitions)
        again = m.model_copy(update={"status": 1, "queuing_order": self._next_order()})
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

    # ------------------------------------------------------------------ timers
    def _arm(self, ep: Endpoint) -> None:
        if ep.timer_deadline_ms is not None:
            heapq.heappush(self._timers, (ep.timer_deadline_ms, ep.handle, "timer"))
        if ep.lifetime_deadline_ms is not None and ep.state is not State.ERROR:
            heapq.heappush(self._timers, (ep.lifetime_deadline_ms, ep.handle, "lifetime"))

    def next_deadline_ms(self) -> int | None:
        return self._timers[0][0] if self._timers else None

    def purge_windows(self, now_ms: int, max_age_ms: int) -> int:
        """Drop early arrivals held longer than `max_age_ms` (the dispatcher's per-tick task).

        Safe because they were never acknowledged: the sender retransmits them once the gap
        before them is filled. Returns how many were dropped.
        """
        return sum(len(w.drop_older_than(now_ms, max_age_ms)) for w in self._windows.values())

    def tick(self, now_ms: int) -> Outputs:
        """Fire every due conversation timer and lifetime; stale heap entries are skipped."""
        if self._windows and now_ms - self._last_purge_ms >= self.purge_every_ms:
            self._last_purge_ms = now_ms
            self.purge_windows(now_ms, self.inbound_stale_ms)
        out = Outputs()
        while self._timers and self._timers[0][0] <= now_ms:
            deadline, handle, kind = heapq.heappop(self._timers)
            stage = _Stage(self)
            ep = stage.maybe_endpoint(handle)
            if ep is None:
                continue
            if kind == "timer" and ep.timer_deadline_ms == deadline:
                ep.timer_deadline_ms = None
                self._enqueue(stage, ep, DIALOG_TIMER, "E", b"", -1, now_ms)
            elif kind == "lifetime" and ep.lifetime_deadline_ms == deadline:
                self._expire(stage, ep, now_ms)
            else:
                continue
            self._merge(stage)
            out.extend(stage.out)
        return out

    def _expire(self, stage: _Stage, ep: Endpoint, now: int) -> None:
        reason = "The conversation's lifetime has expired."
        sides = [ep]
        peer = stage.maybe_endpoint(ep.far_handle)
        if peer is not None and peer.lifetime_deadline_ms == ep.lifetime_deadline_ms:
            sides.append(peer)
        for side in sides:
            side.lifetime_deadline_ms = None
            if side.state in (State.ERROR, State.CLOSED):
                continue
            self._enqueue(stage, side, ERROR, "X", _error_body(LIFETIME_EXPIRED, reason), -1, now)
            side.state = State.ERROR
            side.error_code, side.error_description = LIFETIME_EXPIRED, reason

    # ------------------------------------------------------------------ errors for bad records
    @staticmethod
    def malformed(
        exc: ProtocolError, *, topic: str, partition: int, offset: int, raw: bytes | None
    ) -> Outputs:
        out = Outputs()
        out.errors.append(
            ErrorRecord(
                request_id=None,
                code=exc.code,
                reason=exc.reason,
                source_topic=topic,
                source_partition=partition,
                source_offset=offset,
                raw=(raw or b"")[:512].decode(errors="replace"),
            )
        )
        return out

    def leaked(self, now_ms: int, idle_ms: int) -> Iterable[Endpoint]:
        for ep in self.endpoints.values():
            if (
                ep.state in (State.DISCONNECTED_INBOUND, State.DISCONNECTED_OUTBOUND)
                or now_ms - ep.updated_ms > idle_ms
            ):
                yield ep


def _forget_outcome(outcome: QueueWrite) -> QueueWrite:
    """An outcome is read once, right after it is written; its tombstone lets compaction drop it."""
    return QueueWrite(outcome.queue, outcome.partition, outcome.key, None)


def target_handle(conversation_id: str) -> str:
    """The target endpoint's handle, derived so both sides can be found from the conversation id."""
    return str(uuid.uuid5(_TARGET_NS, conversation_id))


def _error_body(code: int, description: str) -> bytes:
    return json.dumps({"code": code, "description": description}).encode()


class _StepClock:
    """The engine's notion of now for receive windows: set from each request's `now_ms`."""

    def __init__(self) -> None:
        self.now = 0

    def now_ms(self) -> int:
        return self.now

    def sleep(self, seconds: float) -> None:
        """Part of the Clock protocol; the engine never blocks, so sleeping only moves time on."""
        self.now += round(seconds * 1000)


def _ack(msg: InboundMessage, ack_seq: int, instance: str) -> AckRecord:
    return AckRecord(
        conversation_id=msg.conversation_id,
        from_initiator=msg.from_initiator,
        ack_seq=ack_seq,
        from_instance=instance,
        to_instance=msg.from_instance,
    )


def _parse_error(body: bytes) -> tuple[int | None, str | None]:
    import json

    try:
        d = json.loads(body)
        return int(d["code"]), str(d.get("description", ""))
    except (ValueError, KeyError, TypeError):
        return None, body.decode(errors="replace")


def _request_handle(request: AnyRequest) -> str | None:
    if isinstance(request, DeadLetterRequest | ReplayRequest):
        return request.message.conversation_handle
    if isinstance(request, InboundMessage):
        return None
    if isinstance(request, SendRequest):
        return request.handles[0]
    if isinstance(request, CommitRequest):
        for action in request.actions:
            h = _request_handle(action)
            if h is not None:
                return h
        return None
    return request.handle
