"""The dispatcher's pure engine: requests in, records out.

The engine owns endpoint state, the set of messages still waiting in queues, the fences and the
conversation timers. It never touches Kafka: the dispatcher feeds it requests and writes the
`Outputs` of each request in one Kafka transaction together with the consumed offsets, which is
what makes delivery exactly-once.

Every request is applied to a copy-on-write `Stage` and merged only when it succeeded, so a
request with several actions (a multi-conversation SEND, a reader's commit) applies whole or leaves
no trace. The rules themselves live in one module each: `begin`, `send`, `end`, `receipts` (with
`fences`), `dead_letters`, `timers`, `remote` (messages from other instances). They read this
engine only through `ksb.dialog.state.DialogState` and write only to the stage: the engine alone
dispatches requests to them, applies a commit's actions, and merges.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable

from ksb.catalog.model import CatalogView
from ksb.dialog import receipts, timers
from ksb.dialog.begin import begin
from ksb.dialog.counters import CounterScan, durable_change
from ksb.dialog.dead_letters import dead_letter, replay
from ksb.dialog.end import end
from ksb.dialog.fences import Fences
from ksb.dialog.membership import Membership
from ksb.dialog.outputs import Inflight, Outputs, QueueWrite
from ksb.dialog.permissions import OPEN, Permissions
from ksb.dialog.remote import RemoteWindows, inbound
from ksb.dialog.send import send
from ksb.dialog.sequencing import ReceiveWindow
from ksb.dialog.shards import Ownership
from ksb.dialog.sources import Source, check_kind
from ksb.dialog.stage import Stage
from ksb.dialog.timers import Timers, set_timer
from ksb.errors import ConversationError, KsbError, RequestFailed
from ksb.security.leases import LeaseSeal
from ksb.wire.depth import QueueDepth
from ksb.wire.endpoint import Endpoint, State
from ksb.wire.partitioning import partition_for
from ksb.wire.protocol import (
    AnyRequest,
    BeginRequest,
    CommitRequest,
    DeadLetterRequest,
    EndRequest,
    ErrorRecord,
    FenceRequest,
    InboundMessage,
    QueueMessage,
    ReplayRequest,
    SendRequest,
    TimerRequest,
)
from ksb.wire.relay import RelayAction

__all__ = ["Engine"]

log = logging.getLogger("ksb.dispatcher")


class Engine:
    """Endpoint state, queue membership, fences and timers for one broker instance (the one
    `ksb.dialog.state.DialogState`)."""

    def __init__(
        self,
        catalog: CatalogView,
        *,
        instance: str,
        max_body_bytes: int,
        max_output_bytes: int | None = None,
        ownership: Ownership | None = None,
    ) -> None:
        """`ownership` says which shards this engine owns (all of them when not given);
        `max_output_bytes` bounds the message bytes one request may enqueue and transmit (a
        SEND on many conversations, a commit's actions; None: no bound)."""
        self.catalog = catalog
        self.instance = instance
        self.max_body_bytes = max_body_bytes
        self.max_output_bytes = max_output_bytes
        self.ownership = ownership or Ownership(1)
        self.permissions: Permissions = OPEN
        """Who may act for which service and queue; the dispatcher sets the catalog's."""
        self.leases = LeaseSeal(None)
        """Opens the leases of receipts; the dispatcher sets the instance's key."""
        self.endpoints: dict[str, Endpoint] = {}
        self.waiting = Membership(self.endpoints, self._partitions, self.ownership.shard)
        """Every message waiting in a queue, by id: what a receipt needs (`ksb.dialog.membership`)."""
        self.fences = Fences()
        self.timers = Timers()
        self.remote = RemoteWindows()
        self._order = 0
        self._scan = CounterScan()
        self._group_sizes: dict[tuple[str, str], int] = {}
        """Open endpoints per (queue, group): when a group empties, its fence is forgotten."""
        self.depth_every_ms = 0
        """Queue depths are handed out for writing at most this often (the dispatcher sets
        `DispatcherSettings.depth_every_ms`; 0: with every batch that changes one)."""
        self._depth_due_ms = 0

    @property
    def depth(self) -> dict[str, int]:
        """Unreceived messages per queue."""
        return self.waiting.depth

    def changed_depths(self, now_ms: int) -> list[QueueDepth]:
        """The queue depths changed since they were last handed out, once `depth_every_ms` has
        passed since then (`ksb.wire.depth`): a partition more in a transaction is a produce
        request more, and the broker answers a connection's requests one after another, so
        writing them with every batch made each one-message transaction about 2.5 ms slower.
        A count left for later is due by `next_deadline_ms`, so a quiet dispatcher writes it in
        a transaction of its own."""
        if now_ms < self._depth_due_ms or not self.waiting.depths_changed:
            return []
        self._depth_due_ms = now_ms + self.depth_every_ms
        services = self.catalog.services_of_queue
        return [
            QueueDepth(queue=queue, shard=shard, depth=n, services=services.get(queue, ()))
            for (queue, shard), n in self.waiting.take_changed().items()
        ]

    @property
    def retained(self) -> dict[str, Inflight]:
        """Received messages RETENTION queues keep until their conversation ends."""
        return self.waiting.retained

    # ------------------------------------------------------------------ rebuild from Kafka
    def load_endpoint(self, ep: Endpoint) -> None:
        if ep.state is State.CLOSED:
            if self.endpoints.pop(ep.handle, None) is not None:
                self._left_group(ep)
            self.remote.closed_endpoint(ep)
            return
        if ep.handle not in self.endpoints:
            key = (ep.queue, ep.group)
            self._group_sizes[key] = self._group_sizes.get(key, 0) + 1
        self.endpoints[ep.handle] = ep
        self.timers.arm(ep)

    def load_queue_record(self, key: str, value: QueueMessage | None, partition: int) -> None:
        retains = value is not None and self._retains(value.queue)
        self.waiting.load(key, value, partition, retains)
        self._scan.note(key, value)
        if value is not None and value.status == 1:
            self._order = max(self._order, value.queuing_order + 1)

    def finish_load(self) -> None:
        """After a rebuild's records: the counters endpoint records leave to the queue records
        (`ksb.dialog.counters`)."""
        self._scan.restore(self.endpoints, self.waiting.waiting_of)

    def rebuilding(self, shards: Iterable[int]) -> Engine:
        """An empty engine like this one that owns only `shards`: a rebuild on another thread
        folds their records into it (`services.dispatcher.rebuild`), then this one `adopt`s it."""
        rebuilt = Engine(
            self.catalog,
            instance=self.instance,
            max_body_bytes=self.max_body_bytes,
            max_output_bytes=self.max_output_bytes,
            ownership=Ownership(self.ownership.shards, owned=shards),
        )
        rebuilt.permissions, rebuilt.leases = self.permissions, self.leases
        return rebuilt

    def adopt(self, rebuilt: Engine) -> None:
        """Take over the state `rebuilt` holds of its shards (loaded and finished, from an engine
        made by `rebuilding`), and own them. This engine holds nothing of those shards (they were
        never owned, or dropped), so nothing is merged record by record: it is a few dict
        updates, which the dispatcher's loop does between two transactions."""
        self.endpoints.update(rebuilt.endpoints)
        for ep in rebuilt.endpoints.values():
            self.timers.arm(ep)
        self._group_sizes.update(rebuilt._group_sizes)
        self.waiting.adopt(rebuilt.waiting)
        self.fences.adopt(rebuilt.fences)
        self.remote.closed.update(rebuilt.remote.closed)
        self._order = max(self._order, rebuilt._order)
        self.ownership.owned |= rebuilt.ownership.owned

    def drop_shard(self, shard: int) -> None:
        """Forget everything of a shard this engine no longer owns (another dispatcher rebuilds
        it from Kafka); the shard's timers are skipped when they come up."""
        self.ownership.owned.discard(shard)
        in_shard = self._in_shard(shard)
        gone = [ep for ep in self.endpoints.values() if in_shard(ep.group)]
        for ep in gone:
            self.endpoints.pop(ep.handle, None)
            self.remote.windows.pop(ep.handle, None)
            self._group_sizes.pop((ep.queue, ep.group), None)
        self.waiting.drop(shard)
        self.fences.drop(in_shard)
        self.remote.drop(in_shard)

    def _in_shard(self, shard: int) -> Callable[[str], bool]:
        return lambda group: self.ownership.shard(group) == shard

    # ------------------------------------------------------------------ requests
    def handle(
        self,
        request: AnyRequest,
        now_ms: int,
        *,
        sent_ms: int | None = None,
        principal: str | None = None,
        source: Source = Source.SHARED,
        peer: str | None = None,
    ) -> Outputs:
        """Apply one request of `principal` (None: a client without one), which came from
        `source` (`ksb.dialog.sources`: what kinds it may send); `peer`, for a message from
        another instance, is the instance whose ``inbound.<peer>`` topic carried it.
        ``sent_ms``, the request record's timestamp, is stamped on the messages it enqueues so
        that end-to-end latency can be measured when they are received."""
        stage = Stage(self, sent_ms, principal)
        try:
            check_kind(source, request.kind)
            if isinstance(request, CommitRequest):
                self._commit(stage, request, now_ms)
            elif isinstance(request, FenceRequest):
                receipts.fence(self, stage, request)
            elif isinstance(request, DeadLetterRequest):
                dead_letter(self, stage, request, now_ms)
            elif isinstance(request, ReplayRequest):
                replay(self, stage, request)
            elif isinstance(request, InboundMessage):
                inbound(self, stage, request, now_ms, carrier=peer)
            else:
                self.apply_action(stage, request, now_ms)
            self._check_output(stage.out)
        except KsbError as exc:
            return self._refused(request, exc, principal)
        except Exception as exc:  # the stage is dropped, the engine untouched
            return self._refused(request, _failed(exc), principal)
        self.merge(stage)
        stage.out.principal = principal
        return stage.out

    def handle_relayed(self, record: RelayAction, now_ms: int) -> Outputs:
        """Apply a commit's action that another dispatcher relayed to the owner of its group; a
        refusal is reported under the commit's request id."""
        stage = Stage(self, principal=record.principal)
        try:
            try:
                self.apply_action(stage, record.action, now_ms)
            except KsbError:
                raise
            except Exception as exc:  # as in `handle`
                raise _failed(exc) from exc
        except KsbError as exc:
            out = Outputs(principal=record.principal)
            out.errors.append(
                ErrorRecord(
                    request_id=record.request_id,
                    code=exc.code,
                    reason=exc.reason,
                    handle=_request_handle(record.action),
                )
            )
            return out
        self.merge(stage)
        stage.out.principal = record.principal
        return stage.out

    def _commit(self, stage: Stage, req: CommitRequest, now: int) -> None:
        """A reader's commit: its receipt, its actions here (the others relayed), its outcome."""
        receipts.receive(self, stage, req, now)
        for action in receipts.local_actions(self, stage, req):
            self.apply_action(stage, action, now)
        receipts.applied(self, stage, req)

    def apply_action(
        self,
        stage: Stage,
        req: BeginRequest | SendRequest | EndRequest | TimerRequest,
        now: int,
    ) -> None:
        """One action, alone or inside a commit, if its sender may act for the service."""
        if stage.principal is not None:
            self._check_send(stage, req)
        if isinstance(req, BeginRequest):
            begin(self, stage, req, now)
        elif isinstance(req, SendRequest):
            send(self, stage, req, now)
        elif isinstance(req, EndRequest):
            end(self, stage, req, now)
        else:
            set_timer(stage, req, now)

    def _check_send(
        self, stage: Stage, req: BeginRequest | SendRequest | EndRequest | TimerRequest
    ) -> None:
        """The sender must own the service it acts as; a BEGIN also needs SEND on a local target
        (a target on another instance checks its peer's grant on arrival)."""
        p, cat = self.permissions, self.catalog
        if isinstance(req, BeginRequest):
            sender = cat.services.get(req.from_service)
            if sender is not None:  # an unknown one is the rule's to refuse
                p.check_acts_as(stage.principal, sender.name, sender.queue, "BEGIN a dialog")
            if req.to_service in cat.services:
                p.check_send(stage.principal, req.to_service, "BEGIN a dialog")
            return
        handles = req.handles if isinstance(req, SendRequest) else (req.handle,)
        for h in handles:
            ep = stage.endpoint(h)
            p.check_acts_as(
                stage.principal, ep.local_service, ep.queue, f"{req.kind.upper()} on {h!r}"
            )

    def _check_output(self, out: Outputs) -> None:
        """Refuse a request whose messages come to more than `max_output_bytes`: each body is
        within its limit, but a SEND on many conversations (or a commit of many SENDs) would
        make one transaction of any size."""
        if self.max_output_bytes is None:
            return
        size = sum(_body_size(w.value) for w in out.queue if isinstance(w.value, QueueMessage))
        size += sum(_body_size(t) for t in out.transmissions)
        if size > self.max_output_bytes:
            raise ConversationError(
                f"this request would put {size} bytes of messages in queues and transmissions, "
                f"over the limit of {self.max_output_bytes} a request may",
                code="request_too_large",
            )

    def _refused(self, request: AnyRequest, exc: KsbError, principal: str | None) -> Outputs:
        out = Outputs(principal=principal)
        out.errors.append(
            ErrorRecord(
                request_id=request.request_id,
                code=exc.code,
                reason=exc.reason,
                handle=_request_handle(request),
            )
        )
        if isinstance(request, CommitRequest):
            receipts.refused_outcome(self, request, exc, principal, out)
        return out

    def merge(self, stage: Stage) -> None:
        """Make a stage's changes the engine's own, and report every endpoint whose record must
        be written: new ones, closed ones, and those that changed in more than the counters the
        queue records restore (`ksb.dialog.counters`).

        Endpoints that live on come first (a message's facts are its endpoint's), then the
        messages, then the endpoints that closed (their messages are gone by then).
        """
        changed: list[Endpoint] = []
        for (queue, group), token in stage.fences.items():
            self.fences.applied(queue, group, token)
        self.remote.keep(stage.windows)
        self._order = max(self._order, stage.order)
        for ep in stage.endpoints.values():
            before = self.endpoints.get(ep.handle)
            if ep.state is not State.CLOSED:
                if before is None:
                    key = (ep.queue, ep.group)
                    self._group_sizes[key] = self._group_sizes.get(key, 0) + 1
                self.endpoints[ep.handle] = ep
                self.timers.arm(ep)
            if before is None or ep.handle in stage.persist or durable_change(before, ep):
                changed.append(ep)
        for mid in stage.gone_inflight:
            if not self.waiting.remove(mid):
                self.waiting.retained.pop(mid, None)
        for mid, info in stage.new_inflight.items():
            self.waiting.add(mid, info)
        for mid, info in stage.new_retained.items():
            self.waiting.retain(mid, info)
        for ep in changed:
            if ep.state is State.CLOSED:
                if self.endpoints.pop(ep.handle, None) is not None and self._left_group(ep):
                    stage.out.queue.append(self._forget_group(ep))
                self.remote.closed_endpoint(ep)
        stage.out.endpoints += changed

    def _left_group(self, ep: Endpoint) -> bool:
        """An endpoint closed: True when it was its group's last and the group has a commit
        outcome record to remove."""
        key = (ep.queue, ep.group)
        left = self._group_sizes.get(key, 1) - 1
        if left > 0:
            self._group_sizes[key] = left
            return False
        self._group_sizes.pop(key, None)
        return self.fences.forget(ep.queue, ep.group)

    def _forget_group(self, ep: Endpoint) -> QueueWrite:
        """The tombstone of an emptied group's newest commit outcome (and fence)."""
        partition = partition_for(ep.group, self._partitions(ep.queue))
        return QueueWrite(ep.queue, partition, receipts.outcome_key(ep.group), None)

    # ------------------------------------------------------------------ what the rules read
    def fence(self, queue: str, group: str) -> int:
        return self.fences.get(queue, group)

    def receive_window(self, receiver: Endpoint) -> ReceiveWindow[InboundMessage]:
        return self.remote.copy_of(receiver)

    def closed_remote(self, handle: str) -> bool:
        return handle in self.remote.closed

    def queue_disabled(self, name: str) -> bool:
        queue = self.catalog.queues.get(name)
        return queue is not None and queue.disabled

    def group_open(self, queue: str, group: str) -> bool:
        return (queue, group) in self._group_sizes

    def last_order(self) -> int:
        return self._order

    # ------------------------------------------------------------------ timers and housekeeping
    def next_deadline_ms(self) -> int | None:
        """When the next timer fires, or changed queue depths are due for writing."""
        deadline = self.timers.next_deadline_ms()
        if self.waiting.depths_changed and (deadline is None or self._depth_due_ms < deadline):
            return self._depth_due_ms
        return deadline

    def tick(self, now_ms: int) -> Outputs:
        """Fire every due conversation timer and lifetime, each as its own staged change; stale
        heap entries are skipped."""
        out = Outputs()
        while (due := self.timers.pop_due(now_ms)) is not None:
            stage = Stage(self)
            if timers.fire(self, stage, due, now_ms):
                self.merge(stage)
                out.extend(stage.out)
        return out

    def purge_windows(self, now_ms: int, max_age_ms: int) -> int:
        """Drop early arrivals from other instances held longer than `max_age_ms`."""
        return self.remote.purge(now_ms, max_age_ms)

    @staticmethod
    def malformed(
        exc: KsbError, *, topic: str, partition: int, offset: int, raw: bytes | None
    ) -> Outputs:
        """The error record for a record that is not a valid request.

        It carries the `request_id` the record gave, when the record is a JSON object with a
        string one, so a client waiting for the outcome of its own request finds the refusal by
        id (the error topic is keyed by it); otherwise the source position says which record it was.
        """
        out = Outputs()
        out.errors.append(
            ErrorRecord(
                request_id=_claimed_request_id(raw),
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

    def _retains(self, queue: str) -> bool:
        q = self.catalog.queues.get(queue)
        return q is not None and q.retention == "ON"

    def _partitions(self, queue: str) -> int:
        """A queue's partition count (its messages' partition follows from their group)."""
        q = self.catalog.queues.get(queue)
        return q.partitions if q is not None else 1


def _request_handle(request: AnyRequest) -> str | None:
    if isinstance(request, DeadLetterRequest | ReplayRequest):
        return request.message.conversation_handle
    if isinstance(request, InboundMessage | FenceRequest):
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


def _claimed_request_id(raw: bytes | None) -> str | None:
    """The string `request_id` of a record that is a JSON object, however wrong the rest is."""
    try:
        value = json.loads(raw or b"")
    except (ValueError, RecursionError):
        return None
    request_id = value.get("request_id") if isinstance(value, dict) else None
    return request_id if isinstance(request_id, str) else None


def _body_size(m: QueueMessage | InboundMessage) -> int:
    return len(m.body or m.body_b64 or "")


def _failed(exc: Exception) -> RequestFailed:
    """A rule's unforeseen failure on one request, as that request's refusal (logged with its
    traceback: it is a defect to fix, but never a reason to stop applying the others)."""
    log.exception("a request failed in the engine; refused")
    return RequestFailed(f"the dispatcher failed on this request: {type(exc).__name__}: {exc}")
