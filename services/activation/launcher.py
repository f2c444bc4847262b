"""Acting on a monitor's decision: start an activated task, or tell external activators; reap the
tasks that exited.

Internal activation starts `python -m ksb.activation.activated` (a Python procedure called inside
each RECEIVE transaction) or a command the host's configuration defines and the queue names
(`ksb.activation.host`), logged in as the principal of the queue's ``EXECUTE AS``: the task's
settings are the instance's, with that principal's login in place of this service's, so no
secret of the host's passes to it, through its environment or otherwise. Where the kernel allows
it the task is also confined (`ksb.runtime.confinement`): it cannot read the host's password
files, nor the other logins the host holds, only its own. A start the host refuses (an unmapped
``EXECUTE AS``, a principal it has no login for, a command it does not define) is logged as a
configuration fault and held back like a failing task. Tasks heartbeat into Redis when their
principal has a Redis login, and this service keeps the heartbeats of the tasks it started, so
a restarted activation service counts the tasks it did not start. External activation publishes
QUEUE_ACTIVATION (`ksb.wire.activation`). A task that exits with a failure status holds
activation back (`ksb.activation.monitor`), as a procedure that cannot be loaded would
otherwise be started again every check.

`ActivationHooks` sees every start and every exit, in order ("before" and "after" as the house's
hooks do): the activation benchmark records them through it.
"""

from __future__ import annotations

import logging
import subprocess
import time
import uuid
from collections.abc import Callable

import redis
from confluent_kafka import Producer

from ksb.activation.activated import EXIT_NOT_AUTHORIZED, EXIT_USAGE
from ksb.activation.host import ActivationHostConfig, confined_argv, task_launch, task_settings
from ksb.activation.monitor import Decision
from ksb.clock import Clock
from ksb.errors import CatalogError
from ksb.names import Names
from ksb.runtime import confinement
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
        host: ActivationHostConfig,
    ) -> None:
        self.settings = settings
        self.names = Names(settings.instance)
        self._redis = redis_client
        self._producer = producer
        self._clock = clock
        self._audit = audit
        self._hooks = hooks
        self._host = host
        self._secured = settings.kafka_security_protocol != "PLAINTEXT"
        self._confine = self._secured and confinement.available()
        if self._secured and not self._confine:
            log.warning("this kernel has no Landlock: activated tasks are not confined")
        self._beaten_ms: dict[str, int] = {}

    def act(self, w: QueueWatch, d: Decision) -> bool:
        """Act on one decision; True when it activated (a task started, or an event sent)."""
        if w.notifier is not None:
            if w.notifier.should_notify(d, self._clock.now_ms()):
                self._notify(w, d)
                return True
            return False
        if not d.activate or w.queue.activation.status != "ON":
            return False
        return self._start_task(w, d)

    def _start_task(self, w: QueueWatch, d: Decision) -> bool:
        act = w.queue.activation
        task_id = f"{w.queue.name}-{uuid.uuid4().hex[:8]}"
        try:
            launch = task_launch(
                self._host,
                act,
                instance=self.settings.instance,
                queue=w.queue.name,
                task_id=task_id,
                secured=self._secured,
            )
        except CatalogError as exc:
            self._refuse(w, exc)
            return False
        w.refused = None
        # Tasks get the instance's KSB_* settings as their kind reads them (a procedure runs in
        # `python -m ksb.activation.activated`; a command is any program using the SDK), logged
        # in as their own principal, plus which queue and task they are.
        model = ActivatedTaskSettings if act.procedure is not None else ClientSettings
        task = task_settings(self.settings, model, launch.principal, launch.login)
        env = settings_env(
            task,
            ACTIVATED_QUEUE=w.queue.name,
            ACTIVATED_TASK_ID=task_id,
            ACTIVATED_EXECUTE_AS=launch.principal,
        )
        argv = launch.argv
        if self._confine:
            argv = confined_argv(argv, self.settings, self._host.secret_files(), task)
        # Tasks heartbeat into Redis themselves; register now so the count is right at once.
        until = int(time.time() * 1000) + self.settings.activated_heartbeat_ttl_ms
        self._redis.zadd(self.names.tasks_key(w.queue.name), {task_id: until})
        w.tasks[task_id] = subprocess.Popen(argv, env=env, start_new_session=True)
        w.last_activation_ms = self._clock.now_ms()
        w.activations += 1
        TASKS_STARTED.labels(w.queue.name).inc()
        self._audit("activation_start", w, task_id)
        self._hooks.started(w, task_id, d)
        log.info(
            "activated %s on %s as %s (%d running)",
            task_id,
            w.queue.name,
            launch.principal,
            len(w.tasks),
        )
        return True

    def _refuse(self, w: QueueWatch, exc: CatalogError) -> None:
        """A start this host refuses: a configuration fault, logged once per reason, and held
        back as a failing task is (an ALTER QUEUE clears the hold)."""
        held = w.monitor.on_task_exit(self._clock.now_ms(), EXIT_USAGE)
        if w.refused != exc.reason:
            w.refused = exc.reason
            log.error(
                "no task started on %s: %s (%s); the next attempt in %s ms",
                w.queue.name,
                exc.reason,
                exc.code,
                held,
            )
            self._audit("activation_stop", w, f"refused: {exc.code}")

    def keep_alive(self, w: QueueWatch) -> None:
        """Renew the heartbeats of the tasks this service started and that still run, every
        ``activated_heartbeat_ms`` (a task without a Redis login writes none of its own)."""
        now = int(time.time() * 1000)
        if now - self._beaten_ms.get(w.queue.name, 0) < self.settings.activated_heartbeat_ms:
            return
        alive = [tid for tid, p in w.tasks.items() if p.poll() is None]
        if alive:
            until = now + self.settings.activated_heartbeat_ttl_ms
            self._redis.zadd(self.names.tasks_key(w.queue.name), dict.fromkeys(alive, until))
        self._beaten_ms[w.queue.name] = now

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
