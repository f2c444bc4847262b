"""The records of ``ksb.<instance>.audit`` (version 1): what happened to which message, when.

Every service reports through the hooks of `ksb.audit`; this module is the record itself, its
encoder and its decoder, for the writers and for the readers (the Spark audit and SLA job, the
chaos harness). docs/audit.md is the reference.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = [
    "AUDIT_VERSION",
    "BATCH_EVENTS",
    "AuditBatch",
    "AuditEvent",
    "AuditKind",
    "encode_batch",
    "parse_audit_event",
    "parse_audit_record",
]

AUDIT_VERSION = 1

AuditKind = Literal[
    "enqueue",
    "receive",
    "commit",
    "rollback",
    "refused",
    "transmit",
    "acknowledge",
    "purge",
    "dead_letter",
    "suppression",
    "activation_start",
    "activation_stop",
    "queue_activation",
    "queue_disabled",
    "error",
]


class AuditEvent(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One audit record. Optional fields are left out of the JSON when unknown, to keep it small
    (``queue`` when empty, ``targeted`` and ``starvation_exception`` when false).

    Readers must ignore fields they do not know (version 1 may gain optional fields); `v` changes
    only when a field changes meaning. A msgspec struct: the dispatcher writes two per message.
    """

    kind: AuditKind
    event_ms: int
    instance: str
    queue: str = ""
    service: str | None = None
    conversation_id: str | None = None
    conversation_handle: str | None = None
    group: str | None = None
    priority: int | None = None
    message_id: str | None = None
    message_ids: tuple[str, ...] | None = None
    count: int | None = None
    enqueued_ms: int | None = None
    time_in_queue_ms: int | None = None
    end_to_end_ms: int | None = None
    ready_priority: int | None = None
    """receive: the highest level among the groups this reader saw ready and not held by itself."""
    targeted: bool = False
    """receive: RECEIVE with WHERE (a named group or conversation), which no ordering rule covers."""
    reader: str | None = None
    starvation_exception: bool = False
    reason: str | None = None
    v: Literal[1] = 1

    def to_json(self) -> bytes:
        """``{"v":1,...}``: the version first (msgspec leaves out the default; it goes back here)."""
        return b'{"v":1,' + _ENCODER.encode(self)[1:]


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(AuditEvent)
_EVENT_START = b'{"kind":'


def _events_json(events: list[AuditEvent]) -> bytes:
    """A JSON array of `events`, each as `AuditEvent.to_json` writes it, in one encoder call (the
    dispatcher writes two events per message). Every object in it is an event, which begins with
    its ``kind``; a string value cannot hold the bytes ``{"kind":`` unescaped, so putting the
    version back in front of each is a plain replace."""
    return _ENCODER.encode(events).replace(_EVENT_START, b'{"v":1,"kind":')


BATCH_EVENTS = 500
"""Events per batch record at most (a record stays well under the producer's 1 MiB limit)."""


class AuditBatch(msgspec.Struct, tag_field="kind", tag="batch"):
    """Several events of one queue in one record: what the dispatcher writes per transaction."""

    events: list[AuditEvent]
    v: Literal[1] = 1


_BATCH_DECODER = msgspec.json.Decoder(AuditBatch)


def parse_audit_event(raw: bytes) -> AuditEvent:
    return _DECODER.decode(raw)


def parse_audit_record(raw: bytes) -> list[AuditEvent]:
    """The events of one audit record: one event, or a batch of them."""
    try:
        return [_DECODER.decode(raw)]
    except msgspec.ValidationError:
        return _BATCH_DECODER.decode(raw).events


def encode_batch(events: list[AuditEvent]) -> bytes:
    """One batch record of `events` (at most `BATCH_EVENTS`, all of one queue)."""
    return b'{"kind":"batch","v":1,"events":%s}' % _events_json(events)
