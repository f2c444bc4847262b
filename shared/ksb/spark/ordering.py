"""The priority-ordering audit of one queue, as a pure state machine (no Spark here).

The Spark job feeds each queue's audit events to one `QueueOrdering`, in the order they were
produced (one queue's events share one partition of the audit topic), and keeps it in Spark's state
store between micro-batches. Replaying a queue's history it knows, at every RECEIVE, which groups were
ready and at which level, and which were locked: a RECEIVE of a group at level L while another
*unlocked* group with a higher level was ready is an **inversion** (high, low). A RECEIVE the
scheduler flagged as a starvation-prevention exception is counted apart, since that reordering is
deliberate. `transmit`/`acknowledge` on a transmission queue follow the same rules as
`receive`/`commit`.

It also measures activation reaction time: from a QUEUE_ACTIVATION event or an activated task's
start to the next RECEIVE on the queue, and keeps the backlog: ready messages and groups, locked
groups, and the enqueue time of the oldest ready message (`ksb.spark.backlog_age`).

State is per group and level (message counts), not per message, so it stays small for deep queues.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ksb.spark.backlog_age import BacklogAge

__all__ = ["ROW_COLUMNS", "OrderingEvent", "QueueOrdering"]

# Columns of every row the machine emits; `row` says which of them are meaningful.
ROW_COLUMNS = (
    "row",
    "queue",
    "kind",
    "window_start_ms",
    "event_ms",
    "high",
    "low",
    "inversions",
    "starvation_exceptions",
    "reaction_ms",
    "ready_messages",
    "ready_groups",
    "locked_groups",
    "oldest_enqueued_ms",
    "oldest_age_ms",
)

_TAKE = frozenset({"receive", "transmit"})
_REMOVE = frozenset({"commit", "purge", "dead_letter", "acknowledge"})
_UNLOCK = frozenset({"commit", "acknowledge", "refused", "rollback"})
_ACTIVATE = frozenset({"queue_activation", "activation_start"})


@dataclass(frozen=True)
class OrderingEvent:
    """The fields of an audit event this audit needs."""

    kind: str
    event_ms: int
    group: str | None = None
    priority: int | None = None
    count: int | None = None
    targeted: bool = False
    starvation_exception: bool = False
    enqueued_ms: int | None = None


@dataclass
class QueueOrdering:
    """Ready groups by level, locked groups, and the inversion counts of one queue."""

    window_ms: int = 10_000
    retain_ms: int = 600_000
    """Per-window counts older than this (behind the newest event) are no longer re-emitted."""
    lock_ttl_ms: int = 30_000
    """A lock with no commit or rollback seen for this long is taken as expired (a crashed reader)."""
    ready: dict[str, dict[int, int]] = field(default_factory=dict)
    locked: dict[str, int] = field(default_factory=dict)
    """Locked group -> when its RECEIVE was seen."""
    pending_activation_ms: int | None = None
    windows: dict[int, dict[tuple[str, int, int], list[int]]] = field(default_factory=dict)
    totals: dict[tuple[str, int, int], list[int]] = field(default_factory=dict)
    max_event_ms: int = 0
    age: BacklogAge = field(default_factory=BacklogAge)
    """Enqueue times of the ready messages, for the age of the oldest."""
    _touched_windows: set[tuple[int, str, int, int]] = field(default_factory=set)
    _reactions: list[tuple[int, int]] = field(default_factory=list)

    # ----------------------------------------------------------------- the rules
    def level(self, group: str) -> int:
        """A group's level: the highest priority among its ready messages (0: none ready)."""
        levels = self.ready.get(group)
        return max(levels) if levels else 0

    def highest_other(self, group: str) -> int:
        """The highest level among ready, unlocked groups other than ``group``."""
        best = 0
        for g, levels in self.ready.items():
            if g != group and levels and not self.is_locked(g):
                best = max(best, max(levels))
        return best

    def is_locked(self, group: str) -> bool:
        since = self.locked.get(group)
        return since is not None and self.max_event_ms - since < self.lock_ttl_ms

    def apply(self, e: OrderingEvent) -> None:
        self.apply_fields(
            e.kind,
            e.event_ms,
            e.group,
            e.priority,
            e.count,
            e.targeted,
            e.starvation_exception,
            e.enqueued_ms,
        )

    def apply_fields(
        self,
        kind: str,
        event_ms: int,
        group: str | None,
        priority: int | None,
        count: int | None,
        targeted: bool,
        starvation_exception: bool,
        enqueued_ms: int | None,
    ) -> None:
        """`apply` without building an `OrderingEvent`: the Spark job calls this once per event."""
        if event_ms > self.max_event_ms:
            self.max_event_ms = event_ms
        if group is None:
            if kind in _ACTIVATE and self.pending_activation_ms is None:
                self.pending_activation_ms = event_ms
            return
        if kind == "enqueue":
            if priority is not None:
                levels = self.ready.setdefault(group, {})
                levels[priority] = levels.get(priority, 0) + (count or 1)
                self.age.add(enqueued_ms if enqueued_ms is not None else event_ms, count or 1)
        elif kind in _TAKE:
            self._take(kind, event_ms, group, priority, targeted, starvation_exception)
        if kind in _REMOVE:
            removed = self._remove(group, priority, count or 1)
            if removed:
                self.age.remove(enqueued_ms, removed)
        if kind in _UNLOCK:
            self.locked.pop(group, None)
        if kind in _ACTIVATE and self.pending_activation_ms is None:
            self.pending_activation_ms = event_ms

    def _take(
        self,
        kind: str,
        event_ms: int,
        group: str,
        priority: int | None,
        targeted: bool,
        starvation_exception: bool,
    ) -> None:
        if kind == "receive" and self.pending_activation_ms is not None:
            self._reactions.append((event_ms, max(0, event_ms - self.pending_activation_ms)))
            self.pending_activation_ms = None
        # WHERE names its group, and a second RECEIVE continues the group it holds: no choice made.
        if not targeted and not self.is_locked(group):
            low = priority if priority is not None else self.level(group)
            high = self.highest_other(group)
            if high > low:
                self._count(kind, event_ms, high, low, starvation_exception)
        self.locked[group] = event_ms

    def _remove(self, group: str, priority: int | None, n: int) -> int:
        """Take up to ``n`` ready messages of ``group`` away; how many there were to take."""
        levels = self.ready.get(group)
        if not levels:
            return 0
        if priority is None or priority not in levels:
            priority = max(levels)  # a removal we cannot place: take it from the top
        had = levels[priority]
        if had > n:
            levels[priority] = had - n
        else:
            del levels[priority]
        if not levels:
            del self.ready[group]
        return min(had, n)

    def _count(self, kind: str, event_ms: int, high: int, low: int, starvation: bool) -> None:
        start = event_ms - event_ms % self.window_ms
        slot = 1 if starvation else 0
        key = (kind, high, low)
        self.windows.setdefault(start, {}).setdefault(key, [0, 0])[slot] += 1
        self.totals.setdefault(key, [0, 0])[slot] += 1
        self._touched_windows.add((start, kind, high, low))

    # ----------------------------------------------------------------- output
    def drain_rows(self, queue: str) -> list[dict[str, Any]]:
        """Rows for what changed since the last drain, with absolute counts (idempotent to re-write):
        inversion counts of each touched window and pair, the running total of every pair,
        activation reaction times, and one backlog snapshot."""
        rows: list[dict[str, Any]] = []
        for start, kind, high, low in sorted(self._touched_windows):
            inv, starv = self.windows.get(start, {}).get((kind, high, low), [0, 0])
            rows.append(
                _row(
                    "inversions",
                    queue,
                    kind=kind,
                    window_start_ms=start,
                    high=high,
                    low=low,
                    inversions=inv,
                    starvation_exceptions=starv,
                )
            )
        # Every pair's running total, touched or not: a restarted job's exporter learns them all
        # from the first batch that has events of this queue.
        for kind, high, low in sorted(self.totals):
            inv, starv = self.totals[(kind, high, low)]
            rows.append(
                _row(
                    "totals",
                    queue,
                    kind=kind,
                    high=high,
                    low=low,
                    inversions=inv,
                    starvation_exceptions=starv,
                )
            )
        for event_ms, reaction_ms in self._reactions:
            rows.append(_row("reaction", queue, event_ms=event_ms, reaction_ms=reaction_ms))
        self.age.compact(self.max_event_ms)
        oldest = self.age.oldest_ms()
        rows.append(
            _row(
                "backlog",
                queue,
                event_ms=self.max_event_ms,
                ready_messages=sum(sum(v.values()) for v in self.ready.values()),
                ready_groups=len(self.ready),
                locked_groups=sum(1 for g in self.locked if self.is_locked(g)),
                oldest_enqueued_ms=oldest,
                oldest_age_ms=None if oldest is None else max(0, self.max_event_ms - oldest),
            )
        )
        self._touched_windows.clear()
        self._reactions.clear()
        horizon = self.max_event_ms - self.retain_ms
        for start in [s for s in self.windows if s + self.window_ms < horizon]:
            del self.windows[start]
        for g in [g for g in self.locked if not self.is_locked(g)]:
            del self.locked[g]
        return rows

    # ----------------------------------------------------------------- state store
    def to_json(self) -> str:
        return json.dumps(self.to_state(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> QueueOrdering:
        return cls.from_state(json.loads(text))

    def to_state(self) -> dict[str, Any]:
        """The machine as plain JSON-able data, for the job's per-queue state."""
        return {
            "window_ms": self.window_ms,
            "retain_ms": self.retain_ms,
            "lock_ttl_ms": self.lock_ttl_ms,
            "ready": {g: {str(p): n for p, n in lv.items()} for g, lv in self.ready.items()},
            "locked": self.locked,
            "pending": self.pending_activation_ms,
            "windows": {
                str(s): [[k, h, lo, *c] for (k, h, lo), c in w.items()]
                for s, w in self.windows.items()
            },
            "totals": [[k, h, lo, *c] for (k, h, lo), c in self.totals.items()],
            "max": self.max_event_ms,
            "age": self.age.to_state(),
        }

    @classmethod
    def from_state(cls, d: Mapping[str, Any]) -> QueueOrdering:
        return cls(
            window_ms=int(d["window_ms"]),
            retain_ms=int(d["retain_ms"]),
            lock_ttl_ms=int(d["lock_ttl_ms"]),
            ready={g: {int(p): int(n) for p, n in lv.items()} for g, lv in d["ready"].items()},
            locked={g: int(t) for g, t in d["locked"].items()},
            pending_activation_ms=d["pending"],
            windows={
                int(s): {(k, int(h), int(lo)): [int(i), int(st)] for k, h, lo, i, st in w}
                for s, w in d["windows"].items()
            },
            totals={(k, int(h), int(lo)): [int(i), int(st)] for k, h, lo, i, st in d["totals"]},
            max_event_ms=int(d["max"]),
            age=BacklogAge.from_state(d.get("age", [])),
        )


def _row(row: str, queue: str, **values: Any) -> dict[str, Any]:
    out: dict[str, Any] = dict.fromkeys(ROW_COLUMNS)
    out["row"] = row
    out["queue"] = queue
    out.update(values)
    return out
