"""Audit hooks: every service reports what happened to which message, for the Spark audit job.

Every service reports through a typed hook (`AuditHook`); the record is `ksb.wire.audit`. The
default does nothing, so code paths stay the same with auditing off; `KafkaAudit` produces one small JSON record per event to
``ksb.<instance>.audit``, keyed by queue so that all events of one queue sit in one partition in the
order they were produced: the ordering audit replays them in that order. A hook that fails is logged
and skipped: auditing never stops the broker. docs/audit.md is the reference.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from ksb.dialog.outputs import Inflight, Outputs, Received
from ksb.names import Names
from ksb.wire.audit import BATCH_EVENTS, AuditEvent, AuditKind, encode_batch
from ksb.wire.protocol import CommitOutcome, QueueMessage

__all__ = ["Audit", "AuditHook", "BatchedAudit", "KafkaAudit", "dispatcher_events"]

log = logging.getLogger("ksb.audit")


class AuditHook:
    """The hook interface, and its no-op default."""

    def emit(self, event: AuditEvent) -> None:
        return None

    def emit_batch(self, events: list[AuditEvent]) -> None:
        """Several events at once (one transaction's); by default one by one."""
        for event in events:
            self.emit(event)

    def flush(self, timeout_s: float = 5.0) -> None:
        return None


class KafkaAudit(AuditHook):
    """Produce events to the instance's audit topic, keyed by queue, asynchronously.

    Given a transactional producer inside an open transaction (the dispatcher's), the events commit or
    abort with the records they describe; the Spark job reads them read_committed.
    """

    def __init__(self, producer: Producer, names: Names) -> None:
        self._producer = producer
        self._topic = names.audit

    def emit(self, event: AuditEvent) -> None:
        self._producer.produce(
            self._topic, key=event.queue.encode(), value=event.to_json(), on_delivery=_report
        )

    def emit_batch(self, events: list[AuditEvent]) -> None:
        """One record per queue (and per `BATCH_EVENTS`), the events in their order: a record
        per event would be most of what the dispatcher writes per message."""
        by_queue: dict[str, list[AuditEvent]] = {}
        for event in events:
            by_queue.setdefault(event.queue, []).append(event)
        for queue, mine in by_queue.items():
            for start in range(0, len(mine), BATCH_EVENTS):
                value = encode_batch(mine[start : start + BATCH_EVENTS])
                self._producer.produce(
                    self._topic, key=queue.encode(), value=value, on_delivery=_report
                )

    def flush(self, timeout_s: float = 5.0) -> None:
        self._producer.flush(timeout_s)


class BatchedAudit(AuditHook):
    """Keeps events until `drain` hands them to `inner` as one batch (one record per queue).

    A client emits an event per RECEIVE; a record, and so a produce request, per event cost the
    reader and the broker more than the RECEIVE's own commit record. The client drains it from
    the thread that serves its producer (every 50 ms at most) and when it flushes or closes, so
    an event reaches the topic a few tens of milliseconds later, in the order it was emitted.
    """

    def __init__(self, inner: AuditHook) -> None:
        self._inner = inner
        self._events: list[AuditEvent] = []
        self._lock = threading.Lock()

    def emit(self, event: AuditEvent) -> None:
        with self._lock:
            self._events.append(event)

    def emit_batch(self, events: list[AuditEvent]) -> None:
        with self._lock:
            self._events += events

    def drain(self) -> None:
        with self._lock:
            events, self._events = self._events, []
        if events:
            self._inner.emit_batch(events)

    def flush(self, timeout_s: float = 5.0) -> None:
        self.drain()
        self._inner.flush(timeout_s)


def _report(err: KafkaError | None, _msg: Message) -> None:
    if err is not None:
        log.warning("audit event not stored: %s", err)


class Audit:
    """The hooks a component reports to, called in order; a hook that raises is logged, not fatal."""

    def __init__(self, *hooks: AuditHook) -> None:
        self.hooks = hooks

    @property
    def enabled(self) -> bool:
        return bool(self.hooks)

    def emit(self, events: Iterable[AuditEvent]) -> None:
        for event in events:
            for hook in self.hooks:
                try:
                    hook.emit(event)
                except Exception:
                    log.exception("audit hook %s failed on a %s event", hook, event.kind)

    def emit_batch(self, events: list[AuditEvent]) -> None:
        if not events:
            return
        for hook in self.hooks:
            try:
                hook.emit_batch(events)
            except Exception:
                log.exception("audit hook %s failed on a batch of %d events", hook, len(events))

    def flush(self, timeout_s: float = 5.0) -> None:
        for hook in self.hooks:
            try:
                hook.flush(timeout_s)
            except Exception:
                log.exception("audit hook %s failed to flush", hook)


def dispatcher_events(out: Outputs, now_ms: int, instance: str) -> list[AuditEvent]:
    """The audit events of one request's outputs, derived after the fact so the engine stays pure.

    enqueue per message written ready; receive per receipt applied under a lease (what its
    RECEIVE saw, at its time: the queue service sealed it in the lease, so the event is written
    once, in the transaction that applies the commit, and never for a RECEIVE rolled back);
    commit per message received (with its time in queue and, when the sender's time is known,
    end-to-end latency); refused per refused commit; purge per ready message dropped with its
    closed endpoint; dead_letter per message moved aside; error per error record.
    """
    events: list[AuditEvent] = [_receive_event(r, out.received, instance) for r in out.receipts]
    for w in out.queue:
        v = w.value
        if isinstance(v, QueueMessage):
            if v.status == 1:
                events.append(_message_event("enqueue", v, now_ms, instance))
        elif isinstance(v, CommitOutcome) and not v.applied:
            events.append(
                AuditEvent(
                    kind="refused",
                    event_ms=now_ms,
                    instance=instance,
                    queue=w.queue,
                    group=v.group,
                    reason=v.reason,
                )
            )
    pairs: tuple[tuple[AuditKind, list[Inflight]], ...] = (
        ("commit", out.received),
        ("purge", out.purged),
    )
    for kind, infos in pairs:
        for info in infos:
            events.append(
                AuditEvent(
                    kind=kind,
                    event_ms=now_ms,
                    instance=instance,
                    queue=info.queue,
                    service=info.service or None,
                    conversation_handle=info.handle,
                    group=info.group,
                    priority=info.priority,
                    message_id=info.message_id or None,
                    enqueued_ms=info.enqueued_ms,
                    time_in_queue_ms=max(0, now_ms - info.enqueued_ms),
                    end_to_end_ms=None if info.sent_ms is None else max(0, now_ms - info.sent_ms),
                )
            )
    for d in out.dead_letters:
        time_in_queue = max(0, now_ms - d.message.enqueued_ms)
        events.append(
            _message_event(
                "dead_letter",
                d.message,
                now_ms,
                instance,
                time_in_queue_ms=time_in_queue,
                reason=d.reason,
            )
        )
    for e in out.errors:
        events.append(
            AuditEvent(
                kind="error",
                event_ms=now_ms,
                instance=instance,
                conversation_handle=e.handle,
                reason=f"{e.code}: {e.reason}",
            )
        )
    return events


def _receive_event(r: Received, received: list[Inflight], instance: str) -> AuditEvent:
    c = r.claims
    first = next((i for i in received if i.message_id in r.message_ids), None)
    return AuditEvent(
        kind="receive",
        event_ms=c.received_ms,
        instance=instance,
        queue=c.queue,
        service=first.service or None if first else None,
        conversation_handle=first.handle if first else None,
        group=c.group,
        priority=c.level,
        ready_priority=c.ready_level,
        targeted=c.targeted,
        message_ids=r.message_ids,
        count=len(r.message_ids),
        reader=c.holder,
    )


def _message_event(
    kind: AuditKind, m: QueueMessage, now_ms: int, instance: str, **extra: Any
) -> AuditEvent:
    """An event about one queued message, with the message's own identifying fields."""
    return AuditEvent(
        kind=kind,
        event_ms=now_ms,
        instance=instance,
        queue=m.queue,
        service=m.service_name,
        conversation_id=m.conversation_id,
        conversation_handle=m.conversation_handle,
        group=m.conversation_group_id,
        priority=m.priority,
        message_id=m.message_id,
        enqueued_ms=m.enqueued_ms,
        **extra,
    )
