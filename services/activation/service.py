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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
from confluent_kafka import Producer

from ksb.activation.activated import EXIT_NOT_AUTHORIZED
from ksb.activation.events import Traces, decisions, edges
from ksb.activation.monitor import Decision, ExternalNotifier, QueueMonitor, QueueObservation
from ksb.activation.poison import PoisonAction, disabled, on_rollbacks, to_dead_letter
from ksb.audit import Audit, KafkaAudit
from ksb.backoff import Backoff
from ksb.catalog.model import Catalog, CatalogView, Queue
from ksb.clock import Clock
from ksb.errors import KsbError
from ksb.runtime import kafka
from ksb.runtime.catalog_store import apply_catalog, load_catalog
from ksb.runtime.metrics import (
    RUNNABLE_GROUPS,
    TASKS_RUNNING,
    TASKS_STARTED,
    WAITING_READERS,
    JsonRoute,
)
from ksb.runtime.redis_client import redis_client
from ksb.runtime.redis_view import RedisView, Writes
from ksb.runtime.service import Service, TickTask
from ksb.sdk.reader import QueueReader
from ksb.settings import ActivatedTaskSettings, ActivationSettings, ClientSettings, settings_env
from ksb.wire.activation import BrokerQueueDisabled, QueueActivation, encode_activation_event
from ksb.wire.audit import AuditEvent, AuditKind
from ksb.wire.protocol import DeadLetterRequest, dumps

__all__ = ["ActivationService", "QueueWatch"]

log = logging.getLogger("ksb.activation")
_MAX_CANDIDATES = 512

_FIXES = {
    EXIT_NOT_AUTHORIZED: "its principal may not RECEIVE there, a grant missing or revoked "
    "(GRANT RECEIVE, then `ksb acl apply`)"
}
"""What mends a task's exit status that is a configuration fault (logged as an error)."""

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
    traces: Traces = field(default_factory=Traces)
    """The queue and its readers as of the previous look (`ksb.activation.events`)."""
    last_activation_ms: int | None = None
    activations: int = 0
    notifications: int = 0
    view: dict[str, Any] = field(default_factory=dict)


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
    ) -> None:
        super().__init__(settings, clock)
        self.settings: ActivationSettings = settings
        self._given_redis = redis_client
        self._redis: redis.Redis | None = None
        self.watches: dict[str, QueueWatch] = {}
        self._producer: Producer | None = None
        self.audit = Audit()
        self._catalog = CatalogView(Catalog())
        self._monitor_tick = False
        self._rows: RedisView | None = None
        """Offered at most once per check, when a row changed; not rate-limited beyond that."""
        self._disabling: dict[str, int] = {}
        """Queues disabled in Redis whose catalog write this service has not read back yet: the
        catalog version that writes it (0 while it is being written)."""
        self._disabling_lock = threading.Lock()

    @property
    def redis(self) -> redis.Redis:
        assert self._redis is not None, "the Redis client is made in open()"
        return self._redis

    # ----------------------------------------------------------------- life cycle
    def open(self) -> None:
        s = self.settings
        self._redis = self._given_redis or redis_client(s)
        self._rows = RedisView("monitors", self._redis, self.handlers)
        kafka.ensure_topics(kafka.admin(s), kafka.core_topics(self.names, s))
        self._producer = kafka.producer(s)
        self.audit = Audit(KafkaAudit(self._producer, self.names))
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
        with self._disabling_lock:  # the catalog that says OFF itself has been read
            for name, version in list(self._disabling.items()):
                if 0 < version <= view.version:
                    del self._disabling[name]
        old, self._catalog = self._catalog, view
        altered = {n for n, q in view.queues.items() if old.queues.get(n) != q}
        self._sync(view, altered)

    def close(self) -> None:
        """Stop the tasks this service started (their open transactions roll back), then the
        monitors. (The shell has already drained the handlers: the newest monitor rows are
        written.)"""
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
        if self._producer is not None:
            self._producer.flush(5)

    # ----------------------------------------------------------------- catalog
    def _sync(self, view: CatalogView, altered: set[str]) -> None:
        """Create, drop and re-configure monitors; mirror disabled queues into Redis."""
        self._mirror(view)
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
                    # A monitor reads a body only to dead-letter it: no cache of records.
                    self.settings.narrow(ClientSettings, reader_cache_bytes=0),
                    name,
                    self.redis,
                    holder=f"monitor-{uuid.uuid4().hex[:8]}",
                )
                w = self.watches[name] = QueueWatch(
                    q,
                    reader,
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
                self._act(w, w.monitor.on_alter(self._observe(w)[0]))

    def _mirror(self, view: CatalogView) -> None:
        """Disabled queues and dead-letter policies into Redis, where RECEIVE reads them.

        On every catalog and again on every monitor tick: a Redis that failed the write, or
        restarted empty, has them back within a tick (found by the chaos harness: a Redis stall
        during a catalog change ended the service, and a Redis restarted empty lost the policies
        until the next catalog)."""
        with self._disabling_lock:
            # A queue being disabled stays so while its catalog write is still on its way.
            disabled = set(self._disabling)
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
            except redis.RedisError as exc:
                # Redis restarted, refused or too slow: this queue is checked again next time,
                # from what Redis holds then, instead of the service exiting (found by the chaos
                # harness, where every Redis kill ended the activation service).
                log.warning("queue %s not checked this time: Redis %r", w.queue.name, exc)
        if changed and self._rows is not None:
            self._rows.offer(self._rows_snapshot())
        time.sleep(self.settings.activation_check_ms / 1000)

    def _check(self, w: QueueWatch, tick: bool) -> bool:
        """One queue's events and decision; True when its monitor row changed."""
        exited = self._reap(w)
        obs, now = self._observe(w)
        seen, w.traces = edges(w.traces, now)
        if seen.received and w.notifier is not None:
            w.notifier.on_receive()
        if seen.rolled_back:
            self._on_rollback(w, now.rollbacks)
        tasks_all_exited = exited and not w.tasks
        for d in decisions(w.monitor, obs, seen, tasks_all_exited=tasks_all_exited, tick=tick):
            if self._act(w, d):
                break
        return self._update_view(w, obs)

    def _on_rollback(self, w: QueueWatch, rollbacks: int) -> None:
        action = on_rollbacks(w.queue, rollbacks, self.settings.poison_rollbacks)
        if action is PoisonAction.DEAD_LETTER:
            self._dead_letters(w)
        elif action is PoisonAction.DISABLE:
            self._poisoned(w, rollbacks)

    def _observe(self, w: QueueWatch) -> tuple[QueueObservation, Traces]:
        """One pipelined Redis round trip: locks of the candidate groups plus the readers' traces."""
        cands, ready_messages = w.reader.candidates(_MAX_CANDIDATES)
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
        traces = Traces(
            ready=ready_messages,
            receive_ms=int(activity.get("last_receive_ms", 0)),
            empty_ms=int(activity.get("last_empty_ms", 0)),
            rollbacks=int(rollbacks or 0),
        )
        return obs, traces

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
        # Tasks get the instance's KSB_* settings as their kind reads them (a procedure runs in
        # `python -m ksb.activation.activated`; a command is any program using the SDK), plus
        # which queue and task they are.
        task_settings = self.settings.narrow(
            ActivatedTaskSettings if act.procedure is not None else ClientSettings
        )
        env = settings_env(
            task_settings,
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
            held = w.monitor.on_task_exit(self.clock.now_ms(), code)
            if held is None:
                log.info("task %s on %s exited with %s", tid, w.queue.name, code)
            else:  # started again while messages wait, as SQL Server does, after `held`
                fix = _FIXES.get(code)
                log.log(
                    logging.ERROR if fix else logging.WARNING,
                    "task %s on %s failed (exit %s%s); the next in %d ms",
                    tid,
                    w.queue.name,
                    code,
                    f": {fix}" if fix else "",
                    held,
                )
            self._audit("activation_stop", w, f"{tid} exited with {code}")
        return bool(exited)

    def _notify(self, w: QueueWatch, d: Decision) -> None:
        event = QueueActivation(
            instance=self.settings.instance,
            queue=w.queue.name,
            reason=d.reason,
            event_ms=self.clock.now_ms(),
        )
        assert self._producer is not None
        self._producer.produce(
            self.names.activation, key=w.queue.name.encode(), value=encode_activation_event(event)
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
        due = set(to_dead_letter(counts, policy.max_rollbacks))
        gone = []
        for mid, n in counts.items():
            msg = w.reader.ready_message(mid)
            if msg is None:
                gone.append(mid)  # received since, or already dead-lettered
            elif mid in due:
                req = DeadLetterRequest(message=msg, reason=f"rolled back {n} times")
                self._producer.produce(
                    self.names.requests_for(self.settings.sender),
                    key=msg.conversation_group_id.encode(),
                    value=dumps(req),
                )
                gone.append(mid)
                log.warning("dead-lettering %s from %s after %d rollbacks", mid, w.queue.name, n)
        if gone:
            self.redis.hdel(key, *gone)
            self._producer.flush(5)

    def _poisoned(self, w: QueueWatch, rollbacks: int) -> None:
        """Rollbacks in a row (`ksb.activation.poison`): disable the queue; no message is lost.

        Redis first, on the loop: RECEIVE refuses from this moment. The catalog write and the event
        follow on a task handler (inline if none takes it: the catalog must not be left behind).
        """
        name = w.queue.name
        with self._disabling_lock:
            if name in self._disabling:
                return
            self._disabling[name] = 0
        self.redis.set(self.names.disabled_key(name), 1)
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
        """On a task handler: STATUS = OFF in a new catalog version, then BROKER_QUEUE_DISABLED.

        The queue stays in `_disabling` until this service reads the catalog version that says
        OFF (`on_catalog`), or this write fails: the mirror written on every tick must not let a
        poisoned queue go in the moment between the write and its reading."""
        try:
            written = apply_catalog(self.settings, disabled(load_catalog(self.settings), name))
            with self._disabling_lock:
                self._disabling[name] = written.version
            event = BrokerQueueDisabled(
                instance=self.settings.instance,
                queue=name,
                reason=reason,
                event_ms=self.clock.now_ms(),
            )
            assert self._producer is not None
            self._producer.produce(
                self.names.activation, key=name.encode(), value=encode_activation_event(event)
            )
            self._producer.flush(5)
        except BaseException:
            with self._disabling_lock:
                self._disabling.pop(name, None)
            raise

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
