"""Acting on a monitor's decision: start an activated task, or tell external activators; reap the
tasks that exited.

Internal activation starts `python -m ksb.activation.activated` (a Python procedure called inside
each RECEIVE transaction) or the queue's command, with the instance's settings as the task's kind
reads them; tasks heartbeat into Redis, so a restarted activation service counts the tasks it did
not start. External activation publishes QUEUE_ACTIVATION (`ksb.wire.activation`). A task that
exits with a failure status holds activation back (`ksb.activation.monitor`), as a procedure that
cannot be loaded would otherwise be started again every check.

`ActivationHooks` sees every start and every exit, in order ("before" and "after" as the house's
hooks do): the activation benchmark records them through it.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import redis
from confluent_kafka import Producer

from ksb.activation.activated import EXIT_NOT_AUTHORIZED
from ksb.activation.monitor import Decision
from ksb.clock import Clock
from ksb.names import Names
from ksb.runtime.metrics import TASKS_STARTED
from ksb.settings import ActivatedTaskSettings, ActivationSettings, ClientSettings, settings_env
from ksb.wire.activation import QueueActivation, encode_activation_event
from ksb.wire.audit import AuditKind
from services.activation.watch import QueueWatch

__all__ = ["ActivationHooks", "Launcher"]

log = logging.getLogger("ksb.activation")

FIXES = {
    EXIT_NOT_AUTHORIZED: "its principal may not RECEIVE there, a grant missing or revoked "
    "(GRANT RECEIVE, then `ksb acl apply`)"
}
"""What mends a task's exit status that is a configuration fault (logged as an error)."""

TASK_STOP_S = 5.0
"""How long a task may take to end after SIGTERM before it is killed (service shutdown)."""

Audit = Callable[[AuditKind, QueueWatch, str], None]


class ActivationHooks:
    """What happens to activated tasks, for whoever wants to know; the default does nothing."""

    def started(self, w: QueueWatch, task_id: str, decision: Decision) -> None:
        """`task_id` was started on `w`'s queue because of `decision`."""

    def exited(self, w: QueueWatch, task_ids: list[str]) -> None:
        """These tasks of `w`'s queue were found exited (and reaped)."""


class Launcher:
    """Starts and reaps activated tasks, and publishes QUEUE_ACTIVATION events."""

    def __init__(
        self,
        settings: ActivationSettings,
        redis_client: redis.Redis,
        producer: Producer,
        *,
        clock: Clock,
        audit: Audit,
        hooks: ActivationHooks,
    ) -> None:
        self.settings = settings
        self.names = Names(settings.instance)
        self._redis = redis_client
        self._producer = producer
        self._clock = clock
        self._audit = audit
        self._hooks = hooks

    def act(self, w: QueueWatch, d: Decision) -> bool:
        """Act on one decision; True when it activated (a task started, or an event sent)."""
        if w.notifier is not None:
            if w.notifier.should_notify(d, self._clock.now_ms()):
                self._notify(w, d)
                return True
            return False
        if not d.activate or w.queue.activation.status != "ON":
            return False
        self._start_task(w, d)
        return True

    def _start_task(self, w: QueueWatch, d: Decision) -> None:
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
        until = int(time.time() * 1000) + self.settings.activated_heartbeat_ttl_ms
        self._redis.zadd(self.names.tasks_key(w.queue.name), {task_id: until})
        w.tasks[task_id] = subprocess.Popen(
            argv[0] if shell else argv,
            shell=shell,
            env=env,
            start_new_session=True,
        )
        w.last_activation_ms = self._clock.now_ms()
        w.activations += 1
        TASKS_STARTED.labels(w.queue.name).inc()
        self._audit("activation_start", w, task_id)
        self._hooks.started(w, task_id, d)
        log.info("activated %s on %s (%d running)", task_id, w.queue.name, len(w.tasks))

    def reap(self, w: QueueWatch) -> bool:
        """Reap `w`'s tasks that exited; True when any had."""
        exited = [tid for tid, p in w.tasks.items() if p.poll() is not None]
        for tid in exited:
            code = w.tasks.pop(tid).returncode
            self._redis.zrem(self.names.tasks_key(w.queue.name), tid)
            held = w.monitor.on_task_exit(self._clock.now_ms(), code)
            if held is None:
                log.info("task %s on %s exited with %s", tid, w.queue.name, code)
            else:  # started again while messages wait, as SQL Server does, after `held`
                fix = FIXES.get(code)
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
        if exited:
            self._hooks.exited(w, exited)
        return bool(exited)

    def stop_all(self, w: QueueWatch) -> None:
        """Stop `w`'s tasks (their open transactions roll back) and reap them."""
        for p in w.tasks.values():
            if p.poll() is None:
                p.terminate()
        for p in w.tasks.values():
            try:
                p.wait(TASK_STOP_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(TASK_STOP_S)
        self.reap(w)

    def _notify(self, w: QueueWatch, d: Decision) -> None:
        event = QueueActivation(
            instance=self.settings.instance,
            queue=w.queue.name,
            reason=d.reason,
            event_ms=self._clock.now_ms(),
        )
        self._producer.produce(
            self.names.activation, key=w.queue.name.encode(), value=encode_activation_event(event)
        )
        self._producer.poll(0)
        w.notifications += 1
        self._audit("queue_activation", w, d.reason)
        w.last_activation_ms = self._clock.now_ms()
        log.info("QUEUE_ACTIVATION event for %s (%s)", w.queue.name, d.reason)
