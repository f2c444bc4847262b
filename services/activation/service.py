"""The activation service: one queue monitor per queue with activation ON or an event notification.

Each monitor looks at its queue every ``activation_check_ms`` (`services.activation.looks`: the
queue service's count of ready and runnable work, the readers' traces in Redis), feeds
`ksb.activation.monitor.QueueMonitor` and acts on its decision (`services.activation.launcher`):
start an activated task (internal activation) or publish a QUEUE_ACTIVATION event (external
activation). Runnable work, not lag, drives it: a group whose lock is held is not work a new
reader could do. After ``poison_rollbacks`` rollbacks in a row the queue is disabled
(`services.activation.poisoning`).

Periodic tasks (`ksb.runtime.ticker`, every ``settings.tick_ms``): the task handlers are checked and a dead
one restarted, and each queue monitor takes its tick (`QueueMonitor.on_tick`) in its next check. The
monitors themselves run on the faster ``activation_check_ms`` loop.

What runs on the task handlers (`ksb.runtime.task_handlers`, 2 x CPUs unless given), because one
queue's slow I/O must not hold up every other queue's activation decisions: writing the monitor
rows (``sys.dm_broker_queue_monitors``) to Redis (`ksb.runtime.redis_view`), and disabling a
poisoned queue in the catalog. Starting and reaping activated tasks stays on the loop: the
running-task count every decision reads must not lag behind a start still queued for a handler.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import redis
from confluent_kafka import Producer

from ksb.activation.events import decisions, edges
from ksb.activation.host import load_host_config
from ksb.activation.monitor import ExternalNotifier, QueueMonitor, QueueObservation
from ksb.activation.poison import PoisonAction, on_rollbacks
from ksb.audit import Audit, KafkaAudit
from ksb.backoff import Backoff
from ksb.catalog.model import Catalog, CatalogView
from ksb.clock import Clock
from ksb.errors import KsbError
from ksb.runtime import kafka
from ksb.runtime.metrics import JsonRoute
from ksb.runtime.redis_client import redis_client
from ksb.runtime.redis_view import RedisView, Writes
from ksb.runtime.service import Service, TickTask
from ksb.sdk.queue_service import QueueServiceClient
from ksb.settings import ActivationSettings
from ksb.wire.audit import AuditEvent, AuditKind
from services.activation.launcher import ActivationHooks, Launcher
from services.activation.looks import Looks
from services.activation.poisoning import Poisoning
from services.activation.watch import QueueWatch

__all__ = ["ActivationService", "QueueWatch"]

log = logging.getLogger("ksb.activation")

HANDLERS_STOP_S = 10.0
"""How long shutdown waits for the handlers to finish queued work (a catalog write takes seconds)."""


class ActivationService(Service):
    """The queue monitors of `settings.instance`, run in the service shell."""

    name = "activation"
    drain_s = HANDLERS_STOP_S

    def __init__(
        self,
        settings: ActivationSettings,
        *,
        clock: Clock | None = None,
        redis_client: redis.Redis | None = None,
        hooks: ActivationHooks | None = None,
    ) -> None:
        """`hooks` sees every task started and reaped (the activation benchmark records them)."""
        super().__init__(settings, clock)
        self.settings: ActivationSettings = settings
        self._given_redis = redis_client
        self._hooks = hooks or ActivationHooks()
        self._redis: redis.Redis | None = None
        self.watches: dict[str, QueueWatch] = {}
        self._producer: Producer | None = None
        self.audit = Audit()
        self._catalog = CatalogView(Catalog())
        self._monitor_tick = False
        self._rows: RedisView | None = None
        """Offered at most once per check, when a row changed; not rate-limited beyond that."""
        self._queues: QueueServiceClient | None = None
        self._looks: Looks | None = None
        self._launcher: Launcher | None = None
        self._poisoning: Poisoning | None = None

    @property
    def redis(self) -> redis.Redis:
        assert self._redis is not None, "the Redis client is made in open()"
        return self._redis

    @property
    def poisoning(self) -> Poisoning:
        assert self._poisoning is not None, "made in open()"
        return self._poisoning

    @property
    def launcher(self) -> Launcher:
        assert self._launcher is not None, "made in open()"
        return self._launcher

    # ----------------------------------------------------------------- life cycle
    def open(self) -> None:
        s = self.settings
        self._redis = self._given_redis or redis_client(s)
        self._rows = RedisView("monitors", self._redis, self.handlers)
        kafka.ensure_topics(kafka.admin(s), kafka.core_topics(self.names, s))
        self._producer = kafka.producer(s)
        self.audit = Audit(KafkaAudit(self._producer, self.names))
        self._queues = QueueServiceClient(s)
        self._looks = Looks(self.names, self._redis, self._queues)
        self._launcher = Launcher(
            s,
            self._redis,
            self._producer,
            clock=self.clock,
            audit=self._audit,
            hooks=self._hooks,
            host=load_host_config(s.activation_config),
        )
        self._poisoning = Poisoning(
            s, self._redis, self._producer, self.handlers, clock=self.clock, audit=self._audit
        )
        self._catalog = self.shell.read_catalog()
        self._sync(self._catalog, altered=set())
        log.info("activation: %d monitor(s)", len(self.watches))

    def tick_tasks(self) -> Iterable[TickTask]:
        return (TickTask(1, "queue_monitors", self._note_monitor_tick),)

    def routes(self) -> Mapping[str, JsonRoute]:
        return {"/monitors": self.monitors, "/tasks": self.tasks}

    def _note_monitor_tick(self, _tick: int) -> None:
        # The monitors' tick is taken in each queue's next check, with that queue's other events,
        # so a queue still acts on at most one decision per check.
        self._monitor_tick = True

    def on_catalog(self, view: CatalogView) -> None:
        self.poisoning.read(view)
        old, self._catalog = self._catalog, view
        altered = {n for n, q in view.queues.items() if old.queues.get(n) != q}
        self._sync(view, altered)

    def close(self) -> None:
        """Stop the tasks this service started (their open transactions roll back). (The shell
        has already drained the handlers: the newest monitor rows are written.)"""
        if self._launcher is not None:
            for w in self.watches.values():
                self._launcher.stop_all(w)
        self.watches.clear()
        if self._queues is not None:
            self._queues.close()
        if self._producer is not None:
            self._producer.flush(5)

    # ----------------------------------------------------------------- catalog
    def _sync(self, view: CatalogView, altered: set[str]) -> None:
        """Create, drop and re-configure monitors; mirror disabled queues into Redis."""
        self._mirror(view)
        wanted = {
            q.name: q
            for q in view.queues.values()
            if q.activation.status == "ON" or q.name in view.notifications
        }
        for name in list(self.watches):
            if name not in wanted:
                self.watches.pop(name)
        for name, q in wanted.items():
            note = view.notifications.get(name)
            w = self.watches.get(name)
            if w is None:
                self.watches[name] = QueueWatch(
                    q,
                    QueueMonitor(
                        empty_grace_ms=self.settings.activation_empty_grace_ms,
                        starting_hold_ms=self.settings.activation_starting_hold_ms,
                        retry=Backoff(
                            initial_ms=self.settings.activation_retry_ms,
                            max_ms=self.settings.activation_retry_max_ms,
                        ),
                    ),
                    ExternalNotifier(note.timeout_s * 1000) if note else None,
                )
                continue
            changed = w.queue != q
            w.queue = q
            if note is None:
                w.notifier = None
            elif w.notifier is None:
                w.notifier = ExternalNotifier(note.timeout_s * 1000)
            if changed or name in altered:
                self.launcher.act(w, w.monitor.on_alter(self._look(w)[0]))

    def _mirror(self, view: CatalogView) -> None:
        """Disabled queues and dead-letter policies into Redis, where RECEIVE reads them.

        On every catalog and again on every monitor tick: a Redis that failed the write, or
        restarted empty, has them back within a tick (found by the chaos harness: a Redis stall
        during a catalog change ended the service, and a Redis restarted empty lost the policies
        until the next catalog)."""
        # A queue being disabled stays so while its catalog write is still on its way.
        disabled = self.poisoning.disabling()
        disabled |= {q.name for q in view.queues.values() if q.status == "OFF"}
        policies: dict[str | bytes | bytearray | memoryview[int] | int | float, Any] = {
            q.name: q.dead_letter.max_rollbacks for q in view.queues.values() if q.dead_letter
        }
        # The policies replace the hash whole, in one MULTI (one key: one slot on a cluster);
        # each queue's disabled flag lives in its queue's slot, so the flags go as a plain
        # pipeline, which a cluster client splits by node.
        policy = self.redis.pipeline(transaction=True)
        policy.delete(self.names.dead_letter_policy_key)
        if policies:
            policy.hset(self.names.dead_letter_policy_key, mapping=policies)
        flags = self.redis.pipeline(transaction=False)
        for name in sorted(disabled | set(view.queues)):
            if name in disabled:
                flags.set(self.names.disabled_key(name), 1)
            else:
                flags.delete(self.names.disabled_key(name))
        try:
            policy.execute()
            flags.execute()
        except redis.RedisError as exc:
            log.warning("disabled queues and policies not mirrored into Redis this time: %r", exc)

    # ----------------------------------------------------------------- the loop
    def step(self) -> None:
        """Every ``activation_check_ms``: each queue's events and decision."""
        tick, self._monitor_tick = self._monitor_tick, False
        if tick:
            self._mirror(self._catalog)
        changed = False
        for w in list(self.watches.values()):
            try:
                changed |= self._check(w, tick)
            except (redis.RedisError, KsbError) as exc:
                # Redis or the queue service restarted, refused or too slow: this queue is
                # checked again next time, instead of the service exiting (found by the chaos
                # harness, where every Redis kill ended the activation service).
                log.warning("queue %s not checked this time: %r", w.queue.name, exc)
        if changed and self._rows is not None:
            self._rows.offer(self._rows_snapshot())
        time.sleep(self.settings.activation_check_ms / 1000)

    def _check(self, w: QueueWatch, tick: bool) -> bool:
        """One queue's events and decision; True when its monitor row changed."""
        exited = self.launcher.reap(w)
        self.launcher.keep_alive(w)
        obs, now = self._look(w)
        seen, w.traces = edges(w.traces, now)
        if seen.received and w.notifier is not None:
            w.notifier.on_receive()
        if seen.rolled_back:
            action = on_rollbacks(w.queue, now.rollbacks, self.settings.poison_rollbacks)
            if action is PoisonAction.DISABLE:
                self.poisoning.poisoned(w, now.rollbacks)
        tasks_all_exited = exited and not w.tasks
        for d in decisions(w.monitor, obs, seen, tasks_all_exited=tasks_all_exited, tick=tick):
            if self.launcher.act(w, d):
                break
        return self._update_view(w, obs)

    def _look(self, w: QueueWatch) -> tuple[QueueObservation, Any]:
        assert self._looks is not None
        return self._looks.look(w)

    def _audit(self, kind: AuditKind, w: QueueWatch, reason: str) -> None:
        if self.audit.enabled:
            event = AuditEvent(
                kind=kind,
                event_ms=self.clock.now_ms(),
                instance=self.settings.instance,
                queue=w.queue.name,
                reason=reason,
            )
            self.audit.emit([event])

    # ----------------------------------------------------------------- views
    def monitors(self) -> list[dict[str, Any]]:
        """Like sys.dm_broker_queue_monitors: one row per queue monitor."""
        return [dict(w.view) for w in list(self.watches.values())]

    def tasks(self) -> list[dict[str, Any]]:
        """Like sys.dm_broker_activated_tasks: the tasks this service started and still runs."""
        rows = []
        for w in list(self.watches.values()):
            act = w.queue.activation
            for tid, p in list(w.tasks.items()):
                if p.poll() is None:
                    rows.append(
                        {
                            "task_id": tid,
                            "queue": w.queue.name,
                            "procedure": act.procedure or act.command,
                            "execute_as": act.execute_as,
                            "pid": p.pid,
                        }
                    )
        return rows

    def _update_view(self, w: QueueWatch, obs: QueueObservation) -> bool:
        view = {
            "queue": w.queue.name,
            "state": w.monitor.state,
            "activation": "EXTERNAL" if w.notifier is not None else "INTERNAL",
            "ready_messages": obs.ready_messages,
            "runnable_groups": obs.ready_groups,
            "tasks_waiting": obs.waiting_receivers,
            "running_tasks": obs.running_tasks,
            "max_queue_readers": obs.max_queue_readers,
            "last_empty_rowset_ms": obs.last_empty_receive_ms,
            "last_activated_ms": w.last_activation_ms,
            "activations": w.activations,
            "notifications": w.notifications,
            "tasks": sorted(w.tasks),
            "refused": w.refused,
        }
        if view == w.view:
            return False
        w.view = view
        return True

    def _rows_snapshot(self) -> Writes:
        """Every monitor's row, for a task handler to write: a newer snapshot replaces an older
        one not yet written, so each carries all rows, not only the changed ones."""
        key = self.names.monitors_key
        rows = {name: json.dumps(w.view) for name, w in self.watches.items() if w.view}

        def writes(pipe: redis.client.Pipeline) -> None:
            for name, row in rows.items():
                pipe.hset(key, name, row)

        return writes
