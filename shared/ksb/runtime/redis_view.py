"""Publishing a service's JSON views to Redis off its main loop.

Views are best effort (delivery never needs Redis), so a slow or absent Redis must not stall the
loop that sends messages: the loop hands over a snapshot and a task handler writes it. Writes
are serialised and each takes the newest snapshot under the lock, so an older view never
overwrites a newer one, and snapshots that pile up while Redis is slow are skipped, not queued.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from ksb.errors import KsbError
from ksb.names import Names
from ksb.runtime.task_handlers import TaskHandlers

__all__ = ["RedisView", "Writes", "read_transmission_view"]

log = logging.getLogger("ksb.runtime.redis_view")

Writes = Callable[["redis.client.Pipeline"], None]
"""Queues the snapshot's commands on a pipeline; the view runs them in one round trip."""


class RedisView:
    """One view of one service, refreshed at most every `every_ms`."""

    def __init__(
        self, name: str, r: redis.Redis, handlers: TaskHandlers, every_ms: int = 500
    ) -> None:
        self.name = name
        self._r = r
        self._handlers = handlers
        self._every_ms = every_ms
        self._due_ms = 0
        self._lock = threading.Lock()
        self._latest: Writes | None = None

    def due(self, now_ms: int) -> bool:
        """Time for a new snapshot; the caller builds it only then (building costs)."""
        if now_ms < self._due_ms:
            return False
        self._due_ms = now_ms + self._every_ms
        return True

    def offer(self, writes: Writes) -> None:
        with self._lock:
            self._latest = writes
        try:
            self._handlers.submit(f"publish_{self.name}", self._write)
        except KsbError as exc:  # full or stopping: the next snapshot goes out instead
            log.warning("%s view not published now: %s", self.name, exc)

    def offer_value(self, key: str, value: str) -> None:
        """The common case: the whole view is one JSON string under one key."""

        def writes(pipe: redis.client.Pipeline) -> None:
            pipe.set(key, value)

        self.offer(writes)

    def _write(self) -> None:
        with self._lock:
            writes, self._latest = self._latest, None
            if writes is None:
                return
            try:
                # Not a MULTI: a view may span keys of several cluster slots (the transport's
                # connections and suppressions), which a cluster runs in no one transaction.
                # Its one writer replaces it whole each time; a reader at worst sees half a
                # refresh.
                pipe = self._r.pipeline(transaction=False)
                writes(pipe)
                pipe.execute()
            except redis.RedisError as exc:
                log.warning("could not publish the %s view: %s", self.name, exc)


def read_transmission_view(r: redis.Redis, names: Names) -> dict[str, Any]:
    """The transmitter's messages and the transport's connections, as one view (empty lists
    before either service has published)."""
    raw: list[bytes | None] = r.mget(names.transmission_view_key, names.connections_view_key)  # type: ignore[assignment]
    raw_messages, raw_connections = raw
    messages = json.loads(raw_messages) if raw_messages else {}
    connections = json.loads(raw_connections) if raw_connections else {}
    return {
        "updated_ms": messages.get("updated_ms"),
        "messages": messages.get("messages", []),
        "connections": connections.get("connections", []),
    }
