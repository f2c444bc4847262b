"""Poison message handling's last step: a queue rolled back too often in a row is disabled.

The queue service counts rollbacks (`services.queue.rollbacks`); the monitor sees the count rise
and asks `ksb.activation.poison` what it leads to. To disable: Redis first, on the loop (the
queue service's RECEIVE refuses from that moment), then a catalog version with STATUS = OFF and
a BROKER_QUEUE_DISABLED event, on a task handler (reading and writing the catalog takes seconds).
No message is lost: they wait in the queue until ALTER QUEUE ... STATUS = ON.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis
from confluent_kafka import Producer

from ksb.activation.poison import disabled
from ksb.catalog.model import CatalogView
from ksb.clock import Clock
from ksb.errors import KsbError
from ksb.names import Names
from ksb.runtime.catalog_store import apply_catalog, load_catalog
from ksb.runtime.task_handlers import TaskHandlers
from ksb.settings import ActivationSettings
from ksb.wire.activation import BrokerQueueDisabled, encode_activation_event
from ksb.wire.audit import AuditKind
from services.activation.watch import QueueWatch

__all__ = ["Poisoning"]

log = logging.getLogger("ksb.activation")

Audit = Callable[[AuditKind, QueueWatch, str], None]


class Poisoning:
    """Disables poisoned queues, and remembers those whose catalog write is on its way."""

    def __init__(
        self,
        settings: ActivationSettings,
        redis_client: redis.Redis,
        producer: Producer,
        handlers: TaskHandlers,
        *,
        clock: Clock,
        audit: Audit,
    ) -> None:
        self.settings = settings
        self.names = Names(settings.instance)
        self._redis = redis_client
        self._producer = producer
        self._handlers = handlers
        self._clock = clock
        self._audit = audit
        self._disabling: dict[str, int] = {}
        """Queues disabled in Redis whose catalog write this service has not read back yet: the
        catalog version that writes it (0 while it is being written)."""
        self._lock = threading.Lock()

    def disabling(self) -> set[str]:
        """Queues being disabled: the Redis mirror keeps them disabled meanwhile."""
        with self._lock:
            return set(self._disabling)

    def read(self, view: CatalogView) -> None:
        """A catalog version was read: the queues it says OFF are disabled by it now."""
        with self._lock:
            for name, version in list(self._disabling.items()):
                if 0 < version <= view.version:
                    del self._disabling[name]

    def poisoned(self, w: QueueWatch, rollbacks: int) -> None:
        """Rollbacks in a row: disable the queue; no message is lost.

        Redis first, on the loop: RECEIVE refuses from this moment. The catalog write and the
        event follow on a task handler (inline if none takes it: the catalog must not be left
        behind).
        """
        name = w.queue.name
        with self._lock:
            if name in self._disabling:
                return
            self._disabling[name] = 0
        self._redis.set(self.names.disabled_key(name), 1)
        self._redis.set(self.names.rollbacks_key(name), 0)
        reason = f"{rollbacks} rollbacks in a row"
        log.warning("queue %s disabled after %s", name, reason)
        self._audit("queue_disabled", w, reason)
        try:
            self._handlers.submit("disable_queue", lambda: self._disable_in_catalog(name, reason))
        except KsbError as exc:
            log.warning(
                "no task handler for disabling %s (%s); writing the catalog inline", name, exc
            )
            self._disable_in_catalog(name, reason)

    def _disable_in_catalog(self, name: str, reason: str) -> None:
        """On a task handler: STATUS = OFF in a new catalog version, then BROKER_QUEUE_DISABLED.

        The queue stays in `_disabling` until this service reads the catalog version that says
        OFF (`read`), or this write fails: the mirror written on every tick must not let a
        poisoned queue go in the moment between the write and its reading."""
        try:
            written = apply_catalog(self.settings, disabled(load_catalog(self.settings), name))
            with self._lock:
                self._disabling[name] = written.version
            event = BrokerQueueDisabled(
                instance=self.settings.instance,
                queue=name,
                reason=reason,
                event_ms=self._clock.now_ms(),
            )
            self._producer.produce(
                self.names.activation, key=name.encode(), value=encode_activation_event(event)
            )
            self._producer.flush(5)
        except BaseException:
            with self._lock:
                self._disabling.pop(name, None)
            raise
