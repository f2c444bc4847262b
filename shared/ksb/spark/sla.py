"""SLA windows of one queue: event-time tumbling windows per service and priority (no Spark here).

Each window counts what happened to the queue's messages (enqueued, received, RECEIVEs, rollbacks,
refused commits, purges, dead letters, errors), the time in queue and end-to-end latency of the
received ones (`ksb.spark.histogram`: p50/p95/p99 and the maximum), breaches of the catalog's
per-level target, and the distinct readers. It runs beside the ordering audit inside the job's one
stateful operator, so the audit topic is read and parsed once for both.

Watermark: after each micro-batch, windows that end at or before the queue's newest event time
minus ``watermark_ms`` are final and dropped from the state; a later event for such a window is
late and ignored, as Spark's own watermark would. The watermark is the queue's own, not the whole
topic's: a queue nobody writes to keeps its last windows until its next event.

Rows are absolute figures of each window touched since the last drain (update mode), so a
replayed micro-batch writes the same numbers again instead of adding them twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ksb.spark.histogram import bucket_of, percentiles

__all__ = ["COUNTED_KINDS", "SLA_COLUMNS", "SlaWindows"]

COUNTED_KINDS: dict[str, str] = {
    "enqueue": "enqueued",
    "commit": "received",
    "receive": "receives",
    "rollback": "rollbacks",
    "refused": "refused",
    "purge": "purged",
    "dead_letter": "dead_lettered",
    "error": "errors",
}
"""Event kind -> the count column it adds to."""
_INDEX = {kind: i for i, kind in enumerate(COUNTED_KINDS)}
_QUANTILES = (0.5, 0.95, 0.99)

SLA_COLUMNS = (
    "window_start_ms",
    "window_end_ms",
    "queue",
    "service",
    "priority",
    *COUNTED_KINDS.values(),
    "breaches",
    "tiq_p50_ms",
    "tiq_p95_ms",
    "tiq_p99_ms",
    "tiq_max_ms",
    "e2e_p50_ms",
    "e2e_p95_ms",
    "e2e_p99_ms",
    "readers",
    "target_ms",
)

SeriesKey = tuple[int, str, int]
"""(window start ms, service, priority)."""


@dataclass
class _Series:
    counts: list[int] = field(default_factory=lambda: [0] * len(_INDEX))
    breaches: int = 0
    tiq: dict[int, int] = field(default_factory=dict)
    e2e: dict[int, int] = field(default_factory=dict)
    tiq_max: int | None = None
    readers: set[str] = field(default_factory=set)


@dataclass
class SlaWindows:
    """The open SLA windows of one queue."""

    window_ms: int = 10_000
    watermark_ms: int = 30_000
    targets: Mapping[int, int] = field(default_factory=dict)
    """The catalog's time-in-queue target per level (``sla_targets_ms``)."""
    series: dict[SeriesKey, _Series] = field(default_factory=dict)
    max_event_ms: int = 0
    closed_before_ms: int = 0
    """Windows ending at or before this are final: their events are late."""
    late: int = 0
    """Events ignored because their window was already final (kept for the logs)."""
    _touched: set[SeriesKey] = field(default_factory=set)

    def add(
        self,
        kind: str,
        event_ms: int,
        service: str | None,
        priority: int | None,
        time_in_queue_ms: int | None,
        end_to_end_ms: int | None,
        reader: str | None,
    ) -> None:
        start = event_ms - event_ms % self.window_ms
        if start + self.window_ms <= self.closed_before_ms:
            self.late += 1
            return
        key = (start, service or "", priority or 0)
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = _Series()
        index = _INDEX.get(kind)
        if index is not None:
            s.counts[index] += 1
        if kind == "commit":
            if time_in_queue_ms is not None:
                b = bucket_of(time_in_queue_ms)
                s.tiq[b] = s.tiq.get(b, 0) + 1
                if s.tiq_max is None or time_in_queue_ms > s.tiq_max:
                    s.tiq_max = time_in_queue_ms
                target = self.targets.get(key[2])
                if target is not None and time_in_queue_ms > target:
                    s.breaches += 1
            if end_to_end_ms is not None:
                b = bucket_of(end_to_end_ms)
                s.e2e[b] = s.e2e.get(b, 0) + 1
        elif kind == "receive" and reader is not None:
            s.readers.add(reader)
        self._touched.add(key)
        if event_ms > self.max_event_ms:
            self.max_event_ms = event_ms

    def drain_rows(self, queue: str) -> list[dict[str, Any]]:
        """Rows of the windows touched since the last drain; then final windows are dropped."""
        rows = [self._row(queue, key, self.series[key]) for key in sorted(self._touched)]
        self._touched.clear()
        self.closed_before_ms = max(self.closed_before_ms, self.max_event_ms - self.watermark_ms)
        for key in [k for k in self.series if k[0] + self.window_ms <= self.closed_before_ms]:
            del self.series[key]
        return rows

    def _row(self, queue: str, key: SeriesKey, s: _Series) -> dict[str, Any]:
        start, service, priority = key
        tiq = percentiles(s.tiq, _QUANTILES)
        e2e = percentiles(s.e2e, _QUANTILES)
        row: dict[str, Any] = {
            "window_start_ms": start,
            "window_end_ms": start + self.window_ms,
            "queue": queue,
            "service": service,
            "priority": priority,
        }
        row.update(zip(COUNTED_KINDS.values(), s.counts, strict=True))
        row.update(
            breaches=s.breaches,
            tiq_p50_ms=tiq[0],
            tiq_p95_ms=tiq[1],
            tiq_p99_ms=tiq[2],
            tiq_max_ms=s.tiq_max,
            e2e_p50_ms=e2e[0],
            e2e_p95_ms=e2e[1],
            e2e_p99_ms=e2e[2],
            readers=len(s.readers),
            target_ms=self.targets.get(priority),
        )
        return row

    # ----------------------------------------------------------------- state store
    def to_state(self) -> dict[str, Any]:
        """Open windows as plain JSON-able data (the settings, window and targets, are not state)."""
        return {
            "max": self.max_event_ms,
            "closed": self.closed_before_ms,
            "late": self.late,
            "series": [
                [
                    start,
                    service,
                    priority,
                    s.counts,
                    s.breaches,
                    list(s.tiq.items()),
                    list(s.e2e.items()),
                    s.tiq_max,
                    sorted(s.readers),
                ]
                for (start, service, priority), s in self.series.items()
            ],
        }

    @classmethod
    def from_state(
        cls,
        d: Mapping[str, Any],
        *,
        window_ms: int,
        watermark_ms: int,
        targets: Mapping[int, int],
    ) -> SlaWindows:
        series = {
            (int(start), str(service), int(priority)): _Series(
                counts=[int(n) for n in counts],
                breaches=int(breaches),
                tiq={int(b): int(n) for b, n in tiq},
                e2e={int(b): int(n) for b, n in e2e},
                tiq_max=None if tiq_max is None else int(tiq_max),
                readers=set(readers),
            )
            for start, service, priority, counts, breaches, tiq, e2e, tiq_max, readers in d[
                "series"
            ]
        }
        return cls(
            window_ms=window_ms,
            watermark_ms=watermark_ms,
            targets=targets,
            series=series,
            max_event_ms=int(d["max"]),
            closed_before_ms=int(d["closed"]),
            late=int(d.get("late", 0)),
        )
