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
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time
from collections.abc import Callable

import redis

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
from ksb.runtime.redis_client import best_effort, redis_client
from ksb.sdk.client import KsbClient, Transaction
from ksb.settings import ActivatedTaskSettings
from ksb.wire.protocol import QueueMessage

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


def run_task(
    client: KsbClient,
    heartbeats: redis.Redis | None,
    queue: str,
    procedure: Procedure,
    task_id: str,
    settings: ActivatedTaskSettings,
) -> int:
    """RECEIVE and process until the queue stays empty; returns the messages processed. The
    task's heartbeat goes to Redis through `heartbeats` (the activation service counts it),
    unless it has none."""
    names = Names(settings.instance)
    idle_ms = settings.activated_idle_ms
    tasks_key = names.tasks_key(queue)
    stop = threading.Event()

    def beat() -> None:
        if heartbeats is None:
            return
        with best_effort(log, "task heartbeat not written; the monitor's count misses it"):
            until = int(time.time() * 1000) + settings.activated_heartbeat_ttl_ms
            heartbeats.zadd(tasks_key, {task_id: until})

    def heartbeat() -> None:
        while not stop.is_set():
            beat()
            stop.wait(settings.activated_heartbeat_ms / 1000)

    beat()
    beating = threading.Thread(target=heartbeat, daemon=True)
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
        stop.set()
        beating.join(2)
        if heartbeats is not None:
            with best_effort(log, f"task {task_id} not unregistered; its heartbeat lapses"):
                heartbeats.zrem(tasks_key, task_id)
    return processed


def _heartbeats(settings: ActivatedTaskSettings) -> redis.Redis | None:
    """A Redis client for the task's heartbeats, or None when its principal has no Redis login
    (the activation service that started it keeps its heartbeat then)."""
    if settings.kafka_security_protocol != "PLAINTEXT" and not settings.redis_username:
        return None
    try:
        return redis_client(settings)
    except SecurityError as exc:
        log.warning("no heartbeats of this task's own: %s", exc.reason)
        return None


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
    heartbeats = _heartbeats(settings)
    try:
        with KsbClient(settings) as client:
            n = run_task(client, heartbeats, queue, procedure, task_id, settings)
    except NotAuthorized as exc:
        log.error("task %s ends: it may not RECEIVE from %s: %s", task_id, queue, exc.reason)
        return EXIT_NOT_AUTHORIZED
    finally:
        if heartbeats is not None:
            heartbeats.close()
    log.info("task %s done: %d message(s)", task_id, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
