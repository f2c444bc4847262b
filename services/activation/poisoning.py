"""Poison message handling's last step: a queue rolled back too often in a row is disabled.

The queue service counts rollbacks (`services.queue.rollbacks`); the monitor sees the count rise
and asks `ksb.activation.poison` what it leads to. To disable: Redis first, on the loop (the
queue service's RECEIVE refuses from that moment), then a queue-status record saying so
(`ksb.wire.queue_status`) and a BROKER_QUEUE_DISABLED event, on a task handler. Not a catalog
version: this service may not write the catalog (`ksb.security.governance`), and every service
that follows the catalog reads the status records with it, so the queue is OFF for all of them.
No message is lost: they wait in the queue until ALTER QUEUE ... STATUS = ON.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis
from confluent_kafka import Producer

from ksb.catalog.model import CatalogView
from ksb.clock import Clock
from ksb.errors import KsbError
from ksb.names import Names
from ksb.runtime.catalog_store import write_queue_status
from ksb.runtime.task_handlers import TaskHandlers
from ksb.settings import ActivationSettings
from ksb.wire.activation import BrokerQueueDisabled, encode_activation_event
from ksb.wire.audit import AuditKind
from ksb.wire.queue_status import QueueStatus
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
        self._disabling: dict[str, bool] = {}
        """Queues disabled in Redis whose status record this service has not read back yet:
        whether the record is written."""
        self._lock = threading.Lock()

    def disabling(self) -> set[str]:
        """Queues being disabled: the Redis mirror keeps them disabled meanwhile."""
        with self._lock:
            return set(self._disabling)

    def read(self, view: CatalogView) -> None:
        """A view was read: the queues it has OFF are disabled by it now."""
        with self._lock:
            for name, written in list(self._disabling.items()):
                queue = view.queues.get(name)
                if written and (queue is None or queue.disabled):
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
            self._disabling[name] = False
        self._redis.set(self.names.disabled_key(name), 1)
        self._redis.set(self.names.rollbacks_key(name), 0)
        reason = f"{rollbacks} rollbacks in a row"
        log.warning("queue %s disabled after %s", name, reason)
        self._audit("queue_disabled", w, reason)
        try:
            self._handlers.submit("disable_queue", lambda: self._disable(name, reason))
        except KsbError as exc:
            log.warning(
                "no task handler for disabling %s (%s); writing its status inline", name, exc
            )
            self._disable(name, reason)

    def _disable(self, name: str, reason: str) -> None:
        """On a task handler: the queue's status record, then BROKER_QUEUE_DISABLED.

        The queue stays in `_disabling` until this service reads a view that has it OFF
        (`read`), or this write fails: the mirror written on every tick must not let a poisoned
        queue go in the moment between the write and its reading."""
        try:
            status = QueueStatus(
                instance=self.settings.instance,
                queue=name,
                disabled=True,
                reason=f"poison message handling: {reason}",
                event_ms=self._clock.now_ms(),
                by=self.settings.acting_principal,
            )
            write_queue_status(self.settings, status)
            with self._lock:
                self._disabling[name] = True
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
