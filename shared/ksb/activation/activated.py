"""An activated task: `python -m ksb.activation.activated QUEUE module:function TASK_ID`.

The queue monitor starts one per activation, logged in as the principal the queue's ``EXECUTE
AS`` names (`ksb.activation.host`). It RECEIVEs in a loop, hands each batch to the procedure
inside the transaction, commits, and returns when a RECEIVE finds the queue empty for
``KSB_ACTIVATED_IDLE_MS`` (settings). With a Redis login it heartbeats into the queue's task set,
so the count of running tasks survives a restart of the activation service and a crashed task
drops out when its heartbeat expires (without one, the activation service that started it keeps
its heartbeat). With Redis failing it ends rather than crash (a RECEIVE that cannot lock, a heartbeat or
its removal not written, are logged), and the monitor starts readers again once Redis is back.
A task whose principal may not RECEIVE from its queue (a grant missing or revoked) ends with one
line saying so and exit status `EXIT_NOT_AUTHORIZED`, which the activation service logs as a
configuration fault; a procedure that cannot be loaded ends with status 2, as a usage error does.

What runs before the first RECEIVE is kept to what a RECEIVE needs (the activation service waits
on it, and a task is started per activation): the Redis client, with its import (a fifth of a
second of CPU), is made in the heartbeat's own thread, which starts as the first RECEIVE is sent
(the activation service registered the task in Redis as it started it, for
``KSB_ACTIVATED_HEARTBEAT_TTL_MS``).
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ksb.errors import (
    CommitRefused,
    KsbError,
    LockLost,
    LockStoreUnavailable,
    NotAuthorized,
    QueueDisabled,
    SecurityError,
)
from ksb.names import Names
from ksb.sdk.client import KsbClient, Transaction
from ksb.settings import ActivatedTaskSettings
from ksb.wire.protocol import QueueMessage

if TYPE_CHECKING:
    import redis

__all__ = ["EXIT_NOT_AUTHORIZED", "Procedure", "resolve", "run_task"]

log = logging.getLogger("ksb.activation.activated")
Procedure = Callable[[Transaction, list[QueueMessage]], None]
EXIT_USAGE = 2
EXIT_NOT_AUTHORIZED = 3
"""A task's exit status when its principal may not RECEIVE from its queue."""


def resolve(path: str) -> Procedure:
    """``package.module:function`` (or the last dot) to the callable it names."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise KsbError(f"activation procedure {path!r} cannot be loaded: {exc}") from exc
    if not callable(fn):
        raise KsbError(f"activation procedure {path!r} is not callable")
    return fn  # type: ignore[no-any-return]


def _connect(settings: ActivatedTaskSettings) -> redis.Redis | None:
    """A Redis client for the task's heartbeats, or None when its principal has no Redis login
    (an `EXECUTE AS` application: the activation service that started it keeps its heartbeat)."""
    from ksb.runtime.redis_client import redis_client  # redis's import, off the RECEIVE's path

    if settings.kafka_security_protocol != "PLAINTEXT" and not settings.redis_username:
        return None
    try:
        return redis_client(settings)
    except SecurityError as exc:
        log.warning("no heartbeats of this task's own: %s", exc.reason)
        return None


class Heartbeat:
    """The task's heartbeat in Redis (the activation service counts running tasks by it), written
    every `activated_heartbeat_ms` from a thread of its own, which also makes the Redis client
    with `connect`: the first RECEIVE does not wait for redis's import or a connection."""

    def __init__(
        self,
        connect: Callable[[], redis.Redis | None],
        settings: ActivatedTaskSettings,
        queue: str,
        task_id: str,
    ) -> None:
        self._connect = connect
        self._settings = settings
        self._key = Names(settings.instance).tasks_key(queue)
        self._task_id = task_id
        self._stop = threading.Event()
        self._redis: redis.Redis | None = None
        self._thread = threading.Thread(target=self._run, name="ksb-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        from ksb.runtime.redis_client import best_effort  # redis's import, in this thread

        try:
            self._redis = self._connect()
        except Exception as exc:  # the task goes on; the monitor counts it until its entry lapses
            log.warning("no Redis client for the task heartbeat: %s", exc)
            return
        if self._redis is None:  # no Redis login of its own: its starter keeps its heartbeat
            return
        while not self._stop.is_set():
            with best_effort(log, "task heartbeat not written; the monitor's count misses it"):
                until = int(time.time() * 1000) + self._settings.activated_heartbeat_ttl_ms
                self._redis.zadd(self._key, {self._task_id: until})
            self._stop.wait(self._settings.activated_heartbeat_ms / 1000)

    def stop(self) -> None:
        """Stop beating and take the task out of the count (left to lapse if Redis fails)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        if self._redis is None:
            return
        from ksb.runtime.redis_client import best_effort

        with best_effort(log, f"task {self._task_id} not unregistered; its heartbeat lapses"):
            self._redis.zrem(self._key, self._task_id)


def run_task(
    client: KsbClient,
    heartbeats: Callable[[], redis.Redis | None],
    queue: str,
    procedure: Procedure,
    task_id: str,
    settings: ActivatedTaskSettings,
) -> int:
    """RECEIVE and process until the queue stays empty; returns the messages processed. The
    task's heartbeat goes to Redis through the client `heartbeats` makes (in the heartbeat's
    thread: `Heartbeat`)."""
    idle_ms = settings.activated_idle_ms
    beating = Heartbeat(heartbeats, settings, queue, task_id)
    beating.start()
    processed = 0
    try:
        while True:
            tx = client.transaction()
            try:
                msgs = tx.receive(queue, waitfor_ms=idle_ms)
            except QueueDisabled:
                tx.rollback()
                break
            except LockStoreUnavailable as exc:  # the monitor starts readers again once it can
                log.warning("ending: RECEIVE on %s failed: %s", queue, exc)
                tx.rollback()
                break
            if not msgs:
                tx.rollback()
                break
            try:
                procedure(tx, msgs)
            except Exception:
                log.exception("procedure failed; rolling back %d message(s)", len(msgs))
                if not tx.done:
                    tx.rollback()
                continue
            try:
                if not tx.done:
                    tx.commit()
            except (CommitRefused, LockLost) as exc:  # nothing applied: as after a rollback
                log.warning("commit of %d message(s) not applied: %s", len(msgs), exc)
                continue
            processed += len(msgs)
    finally:
        beating.stop()
    return processed


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s activated %(levelname)s %(message)s"
    )
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print(
            "usage: python -m ksb.activation.activated QUEUE module:function TASK_ID",
            file=sys.stderr,
        )
        return EXIT_USAGE
    queue, path, task_id = args
    try:
        procedure = resolve(path)
    except KsbError as exc:
        log.error("task %s: %s", task_id, exc.reason)
        return EXIT_USAGE
    settings = ActivatedTaskSettings.from_env()
    made: list[redis.Redis] = []

    def connect() -> redis.Redis | None:
        client = _connect(settings)
        made.extend([client] if client is not None else [])
        return client

    try:
        with KsbClient(settings) as client:
            n = run_task(client, connect, queue, procedure, task_id, settings)
    except NotAuthorized as exc:
        log.error("task %s ends: it may not RECEIVE from %s: %s", task_id, queue, exc.reason)
        return EXIT_NOT_AUTHORIZED
    finally:
        for r in made:
            r.close()
    log.info("task %s done: %d message(s)", task_id, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
