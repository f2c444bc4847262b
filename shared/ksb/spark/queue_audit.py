"""One queue's whole audit state: the ordering audit and the SLA windows, fed a batch at a time.

The job keeps one `QueueAudit` per queue in Spark's state store. Both halves need the same events
of the same queue, so they share one stateful operator, and the audit topic is read and parsed
once for both (it used to be read by two queries, one per half). Each micro-batch hands the queue's
new events over as columns, in the order they were produced; `drain_rows` then gives the rows of
both outputs in one table whose ``row`` column says which output (and which kind of ordering row)
each belongs to.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ksb.spark.ordering import ROW_COLUMNS, QueueOrdering
from ksb.spark.sla import SLA_COLUMNS, SlaWindows

__all__ = [
    "EVENT_FIELDS",
    "ORDERING_COLUMNS",
    "OUTPUT_COLUMNS",
    "SLA_COLUMNS",
    "AuditSettings",
    "QueueAudit",
]

EVENT_FIELDS = (
    "kind",
    "event_ms",
    "group",
    "priority",
    "count",
    "enqueued_ms",
    "time_in_queue_ms",
    "end_to_end_ms",
    "targeted",
    "starvation_exception",
    "service",
    "reader",
)
"""The audit event fields `QueueAudit.apply` reads (docs/audit.md), in its argument order."""

ORDERING_COLUMNS = ROW_COLUMNS
OUTPUT_COLUMNS = (*ROW_COLUMNS, *(c for c in SLA_COLUMNS if c not in ROW_COLUMNS))
"""Every column of both outputs; an SLA row has ``row`` = "sla"."""


@dataclass(frozen=True)
class AuditSettings:
    """What a queue's audit is configured with (not state: a restart may change them)."""

    window_ms: int = 10_000
    watermark_ms: int = 30_000
    sla_targets_ms: Mapping[int, int] = field(default_factory=dict)


class QueueAudit:
    """The ordering audit and SLA windows of one queue."""

    def __init__(self, ordering: QueueOrdering, sla: SlaWindows) -> None:
        self.ordering = ordering
        self.sla = sla

    @classmethod
    def new(cls, settings: AuditSettings) -> QueueAudit:
        return cls(
            QueueOrdering(window_ms=settings.window_ms),
            SlaWindows(
                window_ms=settings.window_ms,
                watermark_ms=settings.watermark_ms,
                targets=settings.sla_targets_ms,
            ),
        )

    def apply(self, columns: Mapping[str, Sequence[Any]]) -> int:
        """Apply one batch of events, given as one sequence per `EVENT_FIELDS` name (None for a
        missing value), in production order; returns how many were applied."""
        ordering, sla = self.ordering.apply_fields, self.sla.add
        n = 0
        for (
            kind,
            event_ms,
            group,
            priority,
            count,
            enqueued_ms,
            tiq,
            e2e,
            targeted,
            starvation,
            service,
            reader,
        ) in zip(*(columns[f] for f in EVENT_FIELDS), strict=True):
            ordering(
                kind,
                event_ms,
                group,
                priority,
                count,
                bool(targeted),
                bool(starvation),
                enqueued_ms,
            )
            sla(kind, event_ms, service, priority, tiq, e2e, reader)
            n += 1
        return n

    def drain_rows(self, queue: str) -> list[dict[str, Any]]:
        """Ordering rows, then SLA rows (``row`` = "sla"), every `OUTPUT_COLUMNS` key present."""
        rows = []
        for r in self.ordering.drain_rows(queue):
            rows.append(dict.fromkeys(OUTPUT_COLUMNS) | r)
        for r in self.sla.drain_rows(queue):
            rows.append(dict.fromkeys(OUTPUT_COLUMNS) | r | {"row": "sla"})
        return rows

    # ----------------------------------------------------------------- state store
    def to_json(self) -> str:
        state = {"ordering": self.ordering.to_state(), "sla": self.sla.to_state()}
        return json.dumps(state, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, settings: AuditSettings) -> QueueAudit:
        d = json.loads(text)
        return cls(
            QueueOrdering.from_state(d["ordering"]),
            SlaWindows.from_state(
                d["sla"],
                window_ms=settings.window_ms,
                watermark_ms=settings.watermark_ms,
                targets=settings.sla_targets_ms,
            ),
        )
