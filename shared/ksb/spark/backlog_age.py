"""When the oldest ready message of a queue was enqueued, from enqueue and removal events alone.

An operator's first question about a queue is how long its oldest message has waited. The
ordering audit counts ready messages per group and level, not per message, so that a deep queue
keeps a small state; this keeps the same promise for enqueue times. It is a multiset of enqueue
times in tiers that coarsen with age: to 10 ms for the last 10 s, to the second for the last 10
minutes, to the minute beyond. The error of the age it reports is at most the tier's step, which
is always small beside the age itself (at most 10 %, reached only at the tier edges), and the
state holds at most about 1,000 + 600 + one entry per minute of backlog, however deep the queue.

A removal names the enqueue time of the message it removes (`commit`, `purge` and `dead_letter`
events carry ``enqueued_ms``); one that does not (`acknowledge`) removes the oldest, as a queue
that is served in order would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["TIERS", "BacklogAge"]

TIERS: tuple[tuple[int, int], ...] = ((10, 10_000), (1_000, 600_000), (60_000, 0))
"""(step ms, kept at this step while younger than ms; 0 = no limit), finest first."""


@dataclass
class BacklogAge:
    """Enqueue times of the ready messages, floored to their tier's step, with counts."""

    tiers: list[dict[int, int]] = field(default_factory=lambda: [{} for _ in TIERS])

    def add(self, enqueued_ms: int, n: int = 1) -> None:
        step = TIERS[0][0]
        slot = self.tiers[0]
        key = enqueued_ms - enqueued_ms % step
        slot[key] = slot.get(key, 0) + n

    def remove(self, enqueued_ms: int | None, n: int = 1) -> None:
        """Take ``n`` messages enqueued at ``enqueued_ms`` out (the oldest ones if unknown)."""
        while n > 0:
            found = self._find(enqueued_ms) if enqueued_ms is not None else None
            if found is None:
                found = self._oldest_key()
                if found is None:
                    return
            tier, key = found
            slot = self.tiers[tier]
            taken = min(n, slot[key])
            if slot[key] == taken:
                del slot[key]
            else:
                slot[key] -= taken
            n -= taken
            enqueued_ms = None  # the rest of a multi-message removal comes from the oldest

    def oldest_ms(self) -> int | None:
        """The oldest ready message's enqueue time, floored to its tier's step."""
        found = self._oldest_key()
        return None if found is None else found[1]

    def count(self) -> int:
        return sum(sum(slot.values()) for slot in self.tiers)

    def compact(self, now_ms: int) -> None:
        """Move entries older than their tier's span into the next, coarser tier."""
        for tier, (_step, span_ms) in enumerate(TIERS[:-1]):
            slot, coarser = self.tiers[tier], self.tiers[tier + 1]
            step = TIERS[tier + 1][0]
            for key in [k for k in slot if now_ms - k >= span_ms]:
                target = key - key % step
                coarser[target] = coarser.get(target, 0) + slot.pop(key)

    def _find(self, enqueued_ms: int) -> tuple[int, int] | None:
        for tier, (step, _span) in enumerate(TIERS):
            key = enqueued_ms - enqueued_ms % step
            if key in self.tiers[tier]:
                return tier, key
        return None

    def _oldest_key(self) -> tuple[int, int] | None:
        best: tuple[int, int] | None = None
        for tier, slot in enumerate(self.tiers):
            if slot:
                key = min(slot)
                if best is None or key < best[1]:
                    best = (tier, key)
        return best

    # ----------------------------------------------------------------- state store
    def to_state(self) -> list[list[list[int]]]:
        return [[[k, n] for k, n in slot.items()] for slot in self.tiers]

    @classmethod
    def from_state(cls, state: Any) -> BacklogAge:
        tiers = [{int(k): int(n) for k, n in slot} for slot in state]
        tiers += [{} for _ in range(len(TIERS) - len(tiers))]
        return cls(tiers=tiers)
