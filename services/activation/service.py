"""The activation service: one queue monitor per queue with activation ON or an event notification.

Each monitor follows its queue topic (the same `QueueIndex` readers use) and the readers' traces in
Redis (waiting sessions, last receive, last empty receive, rollbacks in a row, task heartbeats), feeds
`ksb.activation.monitor.QueueMonitor` and acts on its decision: start an activated task (internal activation) or
publish a QUEUE_ACTIVATION event (external activation). Runnable work, not lag, drives it: a group
whose lock is held is not work a new reader could do.

It also applies poison-message handling: after ``poison_rollbacks`` rollbacks in a row the queue is
disabled in the catalog and a BROKER_QUEUE_DISABLED event is published.

Periodic tasks (`ksb.runtime.ticker`, every ``settings.tick_ms``): the task handlers are checked and a dead
one restarted, and each queue monitor takes its tick (`QueueMonitor.on_tick`) in its next check. The
monitors themselves run on the faster ``activation_check_ms`` loop.

What runs on the task handlers (`ksb.runtime.task_handlers`, 2 x CPUs unless given), because one queue's
slow I/O must not hold up every other queue's activation decisions:

* writing the monitor rows (``sys.dm_broker_queue_monitors``) to Redis (`ksb.runtime.redis_view`);
* disabling a poisoned queue in the catalog and publishing BROKER_QUEUE_DISABLED: reading the
  catalog topic and writing a new version takes seconds. The Redis mark that makes RECEIVE refuse
  stays on the loop, so the queue stops at once; the catalog follows.

Starting and reaping activated tasks stays on the loop: the running-task count every decision
reads must not lag behind a start still queued for a handler.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis
from confluent_kafka import Producer

from ksb.activation.monitor import Decision, ExternalNotifier, QueueMonitor, QueueObservation
from ksb.audit import Audit, AuditEvent, AuditKind, KafkaAudit
from ksb.catalog.model import CatalogView, Queue
from ksb.clock import Clock, SystemClock
from ksb.errors import KsbError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.catalog_store import CatalogWatcher, apply_catalog, load_catalog
from ksb.runtime.metrics import (
    HEALTHY,
    RUNNABLE_GROUPS,
    TASKS_RUNNING,
    TASKS_STARTED,
    WAITING_READERS,
)
from ksb.runtime.redis_view import RedisView, Writes
from ksb.runtime.task_handlers import TaskHandlers
from ksb.runtime.ticker import Intervals, Ticker
from ksb.sdk.reader import QueueReader
from ksb.settings import Settings, settings_env
from ksb.wire.protocol import DeadLetterRequest, dumps

__all__ = ["ActivationService", "QueueWatch"]

log = logging.getLogger("ksb.activation")
_MAX_CANDIDATES = 512

HANDLERS_STOP_S = 10.0
"""How long shutdown waits for the handlers to finish queued work (a catalog write takes seconds)."""


@dataclass
class QueueWatch:
    """One queue monitor's state: what it has seen and what it has started."""

    queue: Queue
    reader: QueueReader
    monitor: QueueMonitor
    notifier: ExternalNotifier | None
    tasks: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    last_ready: int = 0
    last_receive_ms: int = 0
    last_empty_ms: int = 0
    rollbacks: int = 0
    last_activation_ms: int | None = None
    activations: int = 0
    notifications: int = 0
    view: dict[str, Any] = field(default_factory=dict)


class ActivationService:
    def __init__(
        self,
        settings: Settings,
        *,
        clock: Clock | None = None,
        redis_client: redis.Redis | None = None,
        task_handlers: int | None = None,
    ) -> None:
        self.settings = settings
        self.names = Names(settings.instance)
        self.clock = clock or SystemClock()
        self.redis = redis_client or redis.Redis.from_url(settings.redis_url)
        self.watches: dict[str, QueueWatch] = {}
        self.ready = threading.Event()
        self._producer: Producer | None = None
        self.audit = Audit()
        self._watcher: CatalogWatcher | None = None
        self.handlers = TaskHandlers("activation", task_handlers)
        """Async work off the monitor loop: monitor rows to Redis, poisoned-queue catalog writes."""
        self.ticker = self._schedule(self.clock.now_ms())
        self._monitor_tick = False
        self._rows = RedisView("monitors", self.redis, self.handlers)
        """Offered at most once per check, when a row changed; not rate-limited beyond that."""
        self._disabling: set[str] = set()
        """Queues disabled in Redis whose catalog write a handler has not finished yet."""
        self._disabling_lock = threading.Lock()

    def _schedule(self, start_ms: int) -> Ticker:
        """The periodic timer: task handlers checked, then the monitors' tick noted, every tick."""
        ticker = Ticker(start_ms, Intervals(tick_ms=self.settings.tick_ms).schedule)
        ticker.every(1, "task_handlers", self.handlers.on_tick)
        ticker.every(1, "queue_monitors", self._note_monitor_tick)
        return ticker

    def _note_monitor_tick(self, _tick: int) -> None:
        # The monitors' tick is taken in each queue's next check, with that queue's other events,
        # so a queue still acts on at most one decision per check.
        self._monitor_tick = True

    # ----------------------------------------------------------------- life cycle
    def start(self) -> None:
        s = self.settings
        kafka.ensure_topics(kafka.admin(s), kafka.core_topics(self.names, s))
        self._producer = kafka.producer(s)
        self.audit = Audit(KafkaAudit(self._producer, self.names))
        self._watcher = CatalogWatcher(s)
        self._watcher.view = CatalogView(load_catalog(s))
        self._sync(self._watcher.view, altered=set())
        # Ticks count from here: the seconds spent creating topics and reading the catalog are not
        # ticks the monitors missed.
        self.ticker = self._schedule(self.clock.now_ms())
        self.ready.set()
        log.info(
            "activation ready (instance %s, %d monitor(s), tick %d ms, %d task handlers)",
            s.instance,
            len(self.watches),
            s.tick_ms,
            self.handlers.size,
        )

    def run(self, stop: threading.Event) -> None:
        self.handlers.start()
        try:
            self.start()
            HEALTHY.labels("activation").set(1)
            while not stop.is_set():
                self.step()
                stop.wait(self.settings.activation_check_ms / 1000)
        finally:
            HEALTHY.labels("activation").set(0)
            self.close()

    def close(self) -> None:
        """Finish the handlers' work, stop the tasks this service started (their open transactions
        roll back), then the monitors."""
        self.handlers.stop(HANDLERS_STOP_S)  # drains: the newest monitor rows are written
        for w in self.watches.values():
            for p in w.tasks.values():
                if p.poll() is None:
                    p.terminate()
            for p in w.tasks.values():
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
            self._reap(w)
            w.reader.close()
        self.watches.clear()
        if self._watcher is not None:
            self._watcher.close()
        if self._producer is not None:
            self._producer.flush(5)

    # ----------------------------------------------------------------- catalog
    def _sync(self, view: CatalogView, altered: set[str]) -> None:
        """Create, drop and re-configure monitors; mirror disabled queues into Redis."""
        with self._disabling_lock:
            # A queue being disabled stays so while its catalog write is still on its way.
            disabled = sorted(self._disabling)
        disabled += [q.name for q in view.queues.values() if q.status == "OFF"]
        policies: dict[str | bytes | bytearray | memoryview[int] | int | float, Any] = {
            q.name: q.dead_letter.max_rollbacks for q in view.queues.values() if q.dead_letter
        }
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.names.disabled_key, self.names.dead_letter_policy_key)
        if disabled:
            pipe.sadd(self.names.disabled_key, *disabled)
        if policies:
            pipe.hset(self.names.dead_letter_policy_key, mapping=policies)
        pipe.execute()
        wanted = {
            q.name: q
            for q in view.queues.values()
            if q.activation.status == "ON" or q.name in view.notifications or q.dead_letter
        }
        for name in list(self.watches):
            if name not in wanted:
                self.watches.pop(name).reader.close()
        for name, q in wanted.items():
            note = view.notifications.get(name)
            w = self.watches.get(name)
            if w is None:
                reader = QueueReader(
                    self.settings, name, self.redis, holder=f"monitor-{uuid.uuid4().hex[:8]}"
                )
                w = self.watches[name] = QueueWatch(
                    q,
                    reader,
                    QueueMonitor(empty_grace_ms=self.settings.activation_empty_grace_ms),
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
                self._act(w, w.monitor.on_alter(self._observe(w)))

    # ----------------------------------------------------------------- the loop
    def step(self) -> None:
        assert self._watcher is not None
        old = self._watcher.view
        if self._watcher.poll(0):
            new = self._watcher.view
            altered = {n for n, q in new.queues.items() if old.queues.get(n) != q}
            self._sync(new, altered)
        self.ticker.poll(self.clock.now_ms())  # restarts dead handlers; notes the monitors' tick
        tick, self._monitor_tick = self._monitor_tick, False
        changed = False
        for w in list(self.watches.values()):
            changed |= self._check(w, tick)
        if changed:
            self._rows.offer(self._rows_snapshot())

    def _check(self, w: QueueWatch, tick: bool) -> bool:
        """One queue's events and decision; True when its monitor row changed."""
        exited = self._reap(w)
        obs, activity, rollbacks = self._observe_all(w)
        decisions: list[Decision] = []
        if obs.ready_messages > w.last_ready:
            decisions.append(w.monitor.on_message_arrived(obs, had_unread_before=w.last_ready > 0))
        w.last_ready = obs.ready_messages
        receive_ms = int(activity.get("last_receive_ms", 0))
        if receive_ms > w.last_receive_ms:
            w.last_receive_ms = receive_ms
            if w.notifier is not None:
                w.notifier.on_receive()
            decisions.append(w.monitor.on_receive(obs, returned_empty=False))
        empty_ms = int(activity.get("last_empty_ms", 0))
        if empty_ms > w.last_empty_ms:
            w.last_empty_ms = empty_ms
            decisions.append(w.monitor.on_receive(obs, returned_empty=True))
        if rollbacks > w.rollbacks:
            decisions.append(w.monitor.on_rollback(obs))
            if w.queue.dead_letter is not None:
                self._dead_letters(w)
            elif rollbacks >= self.settings.poison_rollbacks:
                self._poisoned(w, rollbacks)
        w.rollbacks = rollbacks
        if exited and not w.tasks:
            decisions.append(w.monitor.on_tasks_exited(obs))
        if tick:
            decisions.append(w.monitor.on_tick(obs))
        for d in decisions:
            if self._act(w, d):
                break
        return self._update_view(w, obs)

    def _observe(self, w: QueueWatch) -> QueueObservation:
        return self._observe_all(w)[0]

    def _observe_all(self, w: QueueWatch) -> tuple[QueueObservation, dict[str, str], int]:
        """One pipelined Redis round trip: locks of the candidate groups plus the readers' traces."""
        with w.reader._cond:
            cands = []
            for g in w.reader.index.candidates():
                cands.append(g)
                if len(cands) >= _MAX_CANDIDATES:
                    break
            ready_messages = w.reader.index.ready_messages
        now_wall = int(time.time() * 1000)
        pipe = self.redis.pipeline(transaction=False)
        for g in cands:
            pipe.hget(self.names.lock_key(w.queue.name, g), "holder")
        pipe.hgetall(self.names.activity_key(w.queue.name))
        pipe.zcount(self.names.waiting_key(w.queue.name), now_wall, "+inf")
        pipe.get(self.names.rollbacks_key(w.queue.name))
        pipe.zremrangebyscore(self.names.tasks_key(w.queue.name), "-inf", now_wall)
        pipe.zcard(self.names.tasks_key(w.queue.name))
        res = pipe.execute()
        holders, (activity, waiting, rollbacks, _expired, tasks) = (
            res[: len(cands)],
            res[len(cands) :],
        )
        runnable = sum(1 for h in holders if not h)
        activity = {_s(k): _s(v) for k, v in (activity or {}).items()}
        last_empty = int(activity.get("last_empty_ms", 0)) or None
        running = max(int(tasks), sum(1 for p in w.tasks.values() if p.poll() is None))
        RUNNABLE_GROUPS.labels(w.queue.name).set(runnable)
        TASKS_RUNNING.labels(w.queue.name).set(running)
        WAITING_READERS.labels(w.queue.name).set(int(waiting))
        obs = QueueObservation(
            now_ms=now_wall,
            ready_groups=runnable,
            ready_messages=ready_messages,
            waiting_receivers=int(waiting),
            running_tasks=running,
            last_empty_receive_ms=last_empty,
            max_queue_readers=w.queue.activation.max_queue_readers,
            activation_enabled=w.queue.activation.status == "ON" or w.notifier is not None,
            queue_enabled=w.queue.status == "ON",
        )
        return obs, activity, int(rollbacks or 0)

    # ----------------------------------------------------------------- acting
    def _act(self, w: QueueWatch, d: Decision) -> bool:
        if w.notifier is not None:
            if w.notifier.should_notify(d, self.clock.now_ms()):
                self._notify(w, d)
                return True
            return False
        if not d.activate or w.queue.activation.status != "ON":
            return False
        self._start_task(w)
        return True

    def _start_task(self, w: QueueWatch) -> None:
        act = w.queue.activation
        task_id = f"{w.queue.name}-{uuid.uuid4().hex[:8]}"
        if act.procedure is not None:
            argv = [
                sys.executable,
                "-m",
                "ksb.activation.activated",
                w.queue.name,
                act.procedure,
                task_id,
            ]
            shell = False
        else:
            argv = [act.command or "true"]
            shell = True
        # Commands get the instance's KSB_* settings plus which queue and task they are.
        env = settings_env(
            self.settings,
            ACTIVATED_QUEUE=w.queue.name,
            ACTIVATED_TASK_ID=task_id,
            ACTIVATED_EXECUTE_AS=act.execute_as,
        )
        # Tasks heartbeat into Redis themselves; register now so the count is right at once.
        self.redis.zadd(
            self.names.tasks_key(w.queue.name), {task_id: int(time.time() * 1000) + 5000}
        )
        w.tasks[task_id] = subprocess.Popen(
            argv[0] if shell else argv,
            shell=shell,
            env=env,
            start_new_session=True,
        )
        w.last_activation_ms = self.clock.now_ms()
        w.activations += 1
        TASKS_STARTED.labels(w.queue.name).inc()
        self._audit("activation_start", w, task_id)
        log.info("activated %s on %s (%d running)", task_id, w.queue.name, len(w.tasks))

    def _reap(self, w: QueueWatch) -> bool:
        exited = [tid for tid, p in w.tasks.items() if p.poll() is not None]
        for tid in exited:
            code = w.tasks.pop(tid).returncode
            self.redis.zrem(self.names.tasks_key(w.queue.name), tid)
            log.info("task %s on %s exited with %s", tid, w.queue.name, code)
            self._audit("activation_stop", w, f"{tid} exited with {code}")
        return bool(exited)

    def _notify(self, w: QueueWatch, d: Decision) -> None:
        event = {
            "v": 1,
            "kind": "QUEUE_ACTIVATION",
            "instance": self.settings.instance,
            "queue": w.queue.name,
            "reason": d.reason,
            "event_ms": self.clock.now_ms(),
        }
        assert self._producer is not None
        self._producer.produce(
            self.names.activation, key=w.queue.name.encode(), value=json.dumps(event).encode()
        )
        self._producer.poll(0)
        w.notifications += 1
        self._audit("queue_activation", w, d.reason)
        w.last_activation_ms = self.clock.now_ms()
        log.info("QUEUE_ACTIVATION event for %s (%s)", w.queue.name, d.reason)

    def _dead_letters(self, w: QueueWatch) -> None:
        """Messages rolled back ``max_rollbacks`` times go to the dead-letter topic, one by one."""
        policy = w.queue.dead_letter
        assert policy is not None and self._producer is not None
        key = self.names.message_rollbacks_key(w.queue.name)
        counts = {_s(k): int(v) for k, v in self.redis.hgetall(key).items()}
        gone = []
        for mid, n in counts.items():
            with w.reader._cond:
                msg = w.reader.index.messages.get(mid)
            if msg is None:
                gone.append(mid)  # received since, or already dead-lettered
            elif n >= policy.max_rollbacks:
                req = DeadLetterRequest(
                    kind="dead_letter", message=msg, reason=f"rolled back {n} times"
                )
                self._producer.produce(
                    self.names.requests, key=msg.conversation_group_id.encode(), value=dumps(req)
                )
                gone.append(mid)
                log.warning("dead-lettering %s from %s after %d rollbacks", mid, w.queue.name, n)
        if gone:
            self.redis.hdel(key, *gone)
            self._producer.flush(5)

    def _poisoned(self, w: QueueWatch, rollbacks: int) -> None:
        """Rollbacks in a row: disable the queue (unless poison handling is OFF); no message is lost.

        Redis first, on the loop: RECEIVE refuses from this moment. The catalog write and the event
        follow on a task handler (inline if none takes it: the catalog must not be left behind).
        """
        name = w.queue.name
        if w.queue.poison_message_handling != "ON" or w.queue.status != "ON":
            return
        with self._disabling_lock:
            if name in self._disabling:
                return
            self._disabling.add(name)
        self.redis.sadd(self.names.disabled_key, name)
        self.redis.set(self.names.rollbacks_key(name), 0)
        reason = f"{rollbacks} rollbacks in a row"
        log.warning("queue %s disabled after %s", name, reason)
        self._audit("queue_disabled", w, reason)
        try:
            self.handlers.submit("disable_queue", lambda: self._disable_in_catalog(name, reason))
        except KsbError as exc:
            log.warning(
                "no task handler for disabling %s (%s); writing the catalog inline", name, exc
            )
            self._disable_in_catalog(name, reason)

    def _disable_in_catalog(self, name: str, reason: str) -> None:
        """On a task handler: STATUS = OFF in a new catalog version, then BROKER_QUEUE_DISABLED."""
        try:
            current = load_catalog(self.settings)
            queues = tuple(
                q.model_copy(update={"status": "OFF"}) if q.name == name else q
                for q in current.queues
            )
            apply_catalog(self.settings, current.model_copy(update={"queues": queues}))
            event = {
                "v": 1,
                "kind": "BROKER_QUEUE_DISABLED",
                "instance": self.settings.instance,
                "queue": name,
                "reason": reason,
                "event_ms": self.clock.now_ms(),
            }
            assert self._producer is not None
            self._producer.produce(
                self.names.activation, key=name.encode(), value=json.dumps(event).encode()
            )
            self._producer.flush(5)
        finally:
            with self._disabling_lock:
                self._disabling.discard(name)

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


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
