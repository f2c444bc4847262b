"""The per-queue figures the dispatcher is the authority for: depth, time in queue, purges."""

from __future__ import annotations

from prometheus_client import Histogram

from ksb.catalog.model import CatalogView
from ksb.dialog.engine import Engine
from ksb.dialog.outputs import Outputs
from ksb.runtime.metrics import COMMITS, PURGE_REASONS, PURGES, QUEUE_DEPTH, TIME_IN_QUEUE

__all__ = ["QueueMetrics"]


class QueueMetrics:
    """Per-queue figures the dispatcher is the authority for: depth, time in queue, purges.

    Label children are cached, so the hot path is a dict lookup and an observe per message.
    """

    def __init__(self) -> None:
        self._time_in_queue: dict[tuple[str, int], Histogram] = {}
        self._declared: set[str] = set()

    def declare(self, view: CatalogView) -> None:
        """Create every queue's depth and purge series at 0, so "none yet" reads as 0, not absent."""
        for name in view.queues:
            if name not in self._declared:
                self._declared.add(name)
                for reason in PURGE_REASONS:
                    PURGES.labels(name, reason)
        COMMITS.labels("applied")
        COMMITS.labels("refused")

    def export_depth(self, engine: Engine) -> None:
        depth = engine.depth
        for name in self._declared | depth.keys():
            QUEUE_DEPTH.labels(name).set(depth.get(name, 0))

    def observe(self, out: Outputs, now_ms: int) -> None:
        for info in out.received:
            key = (info.queue, info.priority)
            child = self._time_in_queue.get(key)
            if child is None:
                child = self._time_in_queue[key] = TIME_IN_QUEUE.labels(
                    info.queue, str(info.priority)
                )
            child.observe(max(0, now_ms - info.enqueued_ms) / 1000)
        for info in out.purged:
            PURGES.labels(info.queue, "conversation_closed").inc()
        for d in out.dead_letters:
            PURGES.labels(d.message.queue, "dead_letter").inc()
