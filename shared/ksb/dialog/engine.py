"""The dispatcher's pure engine: requests in, records out.

The engine owns endpoint state, the set of messages still waiting in queues, the fences and the
conversation timers. It never touches Kafka: the dispatcher feeds it requests and writes the
`Outputs` of each request in one Kafka transaction together with the consumed offsets, which is
what makes delivery exactly-once.

Every request is applied to a copy-on-write `Stage` and merged only when it succeeded, so a
request with several actions (a multi-conversation SEND, a reader's commit) applies whole or leaves
no trace. The rules themselves live in one module each: `begin`, `send`, `end`, `receipts` (with
`fences`), `dead_letters`, `timers`, `remote` (messages from other instances).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from ksb.catalog.model import CatalogView
from ksb.dialog.begin import begin
from ksb.dialog.dead_letters import dead_letter, replay
from ksb.dialog.end import end
from ksb.dialog.endpoint import Endpoint, State
from ksb.dialog.fences import Fences
from ksb.dialog.outputs import Inflight, Outputs
from ksb.dialog.receipts import commit, refused_outcome
from ksb.dialog.remote import RemoteWindows, inbound
from ksb.dialog.send import send
from ksb.dialog.stage import Stage
from ksb.dialog.timers import Timers, fire_due, set_timer
from ksb.errors import KsbError, ProtocolError
from ksb.wire.protocol import (
    AnyRequest,
    BeginRequest,
    CommitRequest,
    DeadLetterRequest,
    EndRequest,
    ErrorRecord,
    InboundMessage,
    QueueMessage,
    ReplayRequest,
    SendRequest,
    TimerRequest,
)

__all__ = ["Engine"]


class Engine:
    """Endpoint state, queue membership, fences and timers for one broker instance."""

    def __init__(self, catalog: CatalogView, *, instance: str, max_body_bytes: int) -> None:
        self.catalog = catalog
        self.instance = instance
        self.max_body_bytes = max_body_bytes
        self.endpoints: dict[str, Endpoint] = {}
        self.inflight: dict[str, Inflight] = {}
        self.depth: dict[str, int] = {}
        """Unreceived messages per queue: `inflight` counted by queue, kept in step with it."""
        self.retained: dict[str, Inflight] = {}
        self.fences = Fences()
        self.timers = Timers()
        self.remote = RemoteWindows()
        self._by_handle: dict[str, set[str]] = {}
        self._order = 0

    # ------------------------------------------------------------------ rebuild from Kafka
    def load_endpoint(self, ep: Endpoint) -> None:
        if ep.state is State.CLOSED:
            self.endpoints.pop(ep.handle, None)
            self.remote.closed_endpoint(ep)
            return
        self.endpoints[ep.handle] = ep
        self.timers.arm(ep)

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
        stage = Stage(self, sent_ms)
        try:
            if isinstance(request, CommitRequest):
                commit(self, stage, request, now_ms)
            elif isinstance(request, DeadLetterRequest):
                dead_letter(self, stage, request, now_ms)
            elif isinstance(request, ReplayRequest):
                replay(self, stage, request)
            elif isinstance(request, InboundMessage):
                inbound(self, stage, request, now_ms)
            else:
                self.apply_action(stage, request, now_ms)
        except KsbError as exc:
            return self._refused(request, exc)
        self.merge(stage)
        return stage.out

    def apply_action(
        self,
        stage: Stage,
        req: BeginRequest | SendRequest | EndRequest | TimerRequest,
        now: int,
    ) -> None:
        """One action, alone or inside a commit."""
        if isinstance(req, BeginRequest):
            begin(self, stage, req, now)
        elif isinstance(req, SendRequest):
            send(self, stage, req, now)
        elif isinstance(req, EndRequest):
            end(self, stage, req, now)
        else:
            set_timer(stage, req, now)

    def _refused(self, request: AnyRequest, exc: KsbError) -> Outputs:
        out = Outputs()
        out.errors.append(
            ErrorRecord(
                request_id=request.request_id,
                code=exc.code,
                reason=exc.reason,
                handle=_request_handle(request),
            )
        )
        if isinstance(request, CommitRequest):
            refused_outcome(self, request, exc, out)
        return out

    def merge(self, stage: Stage) -> None:
        """Make a stage's changes the engine's own, and report every endpoint it touched."""
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
                self.remote.closed_endpoint(ep)
            else:
                self.endpoints[ep.handle] = ep
                self.timers.arm(ep)
            stage.out.endpoints.append(ep)

    # ------------------------------------------------------------------ what the rules ask
    def next_order(self) -> int:
        """The next enqueue order: RECEIVE's tie-break among equal levels, across partitions."""
        self._order += 1
        return self._order

    def queue_disabled(self, name: str) -> bool:
        queue = self.catalog.queues.get(name)
        return queue is not None and queue.disabled

    def queued_for(self, handle: str) -> set[str]:
        """Ids of the messages (waiting or retained) queued for the endpoint `handle`."""
        return self._by_handle.get(handle, set())

    # ------------------------------------------------------------------ timers and housekeeping
    def next_deadline_ms(self) -> int | None:
        return self.timers.next_deadline_ms()

    def tick(self, now_ms: int) -> Outputs:
        """Fire every due conversation timer and lifetime; stale heap entries are skipped."""
        return fire_due(self, now_ms)

    def purge_windows(self, now_ms: int, max_age_ms: int) -> int:
        """Drop early arrivals from other instances held longer than `max_age_ms`."""
        return self.remote.purge(now_ms, max_age_ms)

    @staticmethod
    def malformed(
        exc: ProtocolError, *, topic: str, partition: int, offset: int, raw: bytes | None
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

    # ------------------------------------------------------------------ queue membership
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

    def _unindex(self, mid: str, info: Inflight) -> None:
        mids = self._by_handle.get(info.handle)
        if mids is not None:
            mids.discard(mid)
            if not mids:
                del self._by_handle[info.handle]

    def _retains(self, queue: str) -> bool:
        q = self.catalog.queues.get(queue)
        return q is not None and q.retention == "ON"


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


def _claimed_request_id(raw: bytes | None) -> str | None:
    """The string `request_id` of a record that is a JSON object, however wrong the rest is."""
    try:
        value = json.loads(raw or b"")
    except (ValueError, RecursionError):
        return None
    request_id = value.get("request_id") if isinstance(value, dict) else None
    return request_id if isinstance(request_id, str) else None
