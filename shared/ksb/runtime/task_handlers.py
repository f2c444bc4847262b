"""Task handlers: a service's small pool of always-running workers for its asynchronous tasks.

Service Broker runs up to twice as many task handlers as CPUs for its async tasks; they start with
the engine and always run, and on every timer notification the task infrastructure restarts any
handler that failed. KSB keeps that shape so that work which must not stall a service's hot loop
(waiting for a Kafka acknowledgement, say) has somewhere to go, and so that a handler lost to a bug
costs at most one tick of reduced capacity instead of silently shrinking the pool forever.

Two kinds of failure are kept apart on purpose:

* a *task* that raises an ordinary exception is logged and counted; its handler takes the next one,
  because one bad task must not cost the service a worker;
* a *handler* that dies anyway (a `BaseException` escaped the task, or its thread never started) is
  left dead until the next tick's `TaskHandlers.check`, which restarts it and counts the restart.
  The decision which slots to restart is the pure `handlers_to_restart`.

Handlers are threads: the tasks are I/O waits, which the GIL does not serialise. CPU-bound work gains
nothing from them and should stay on the caller's thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ksb.errors import KsbError
from ksb.runtime.metrics import ASYNC_TASK_FAILURES, TASK_HANDLER_RESTARTS, TASK_HANDLERS

__all__ = [
    "HandlersStopped",
    "Task",
    "TaskHandlers",
    "TaskQueueFull",
    "default_handler_count",
    "handlers_to_restart",
]

log = logging.getLogger("ksb.runtime.task_handlers")

Task = Callable[[], None]


class TaskQueueFull(KsbError):
    """More tasks are waiting than the pool accepts: the handlers are not keeping up."""

    code = "task_queue_full"


class HandlersStopped(KsbError):
    """A task submitted after `TaskHandlers.stop`: nobody would ever run it."""

    code = "task_handlers_stopped"


def default_handler_count(cpu_count: int | None) -> int:
    """Service Broker's rule: twice the CPUs (one CPU when the count is unknown)."""
    return 2 * max(1, cpu_count or 1)


def handlers_to_restart(alive: Sequence[bool], *, stopping: bool) -> list[int]:
    """The slots whose handler is not running and should be.

    While stopping, handlers exit on purpose after draining, so none is restarted.
    """
    if stopping:
        return []
    return [slot for slot, running in enumerate(alive) if not running]


@dataclass(frozen=True)
class _Item:
    name: str
    fn: Task


class TaskHandlers:
    """A fixed number of handler threads taking submitted tasks from one FIFO queue.

    `start` once, `submit` from any thread, `check` on every tick, `stop` on shutdown.
    """

    def __init__(self, service: str, size: int | None = None, *, max_pending: int = 10_000) -> None:
        count = default_handler_count(os.cpu_count()) if size is None else size
        if count < 1:
            raise ValueError(f"task handlers: size must be >= 1, got {count}")
        if max_pending < 1:
            raise ValueError(f"task handlers: max_pending must be >= 1, got {max_pending}")
        self.service = service
        self._max_pending = max_pending
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._threads: list[threading.Thread | None] = [None] * count
        self._stopping = False
        self._started = False
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return len(self._threads)

    @property
    def alive(self) -> int:
        """Handlers running now."""
        return sum(self._alive())

    @property
    def pending(self) -> int:
        """Tasks submitted and not yet taken by a handler."""
        return self._queue.qsize()

    def start(self) -> None:
        """Start every handler; one whose thread cannot start is retried by the next `check`."""
        with self._lock:
            if self._started:
                return
            self._started = True
            for slot in range(self.size):
                self._spawn(slot)
        TASK_HANDLERS.labels(self.service).set(self.alive)
        TASK_HANDLER_RESTARTS.labels(self.service)
        ASYNC_TASK_FAILURES.labels(self.service)

    def submit(self, name: str, fn: Task) -> None:
        """Queue `fn` for the next free handler; never blocks the caller."""
        if self._stopping:
            raise HandlersStopped(f"task {name!r} submitted after the task handlers stopped")
        if self._queue.qsize() >= self._max_pending:
            raise TaskQueueFull(f"{self._max_pending} tasks already wait; {name!r} refused")
        self._queue.put(_Item(name, fn))

    def check(self, tick: int = 0) -> list[int]:
        """The every-tick rule: restart each handler that died or never started; returns slots."""
        with self._lock:
            if not self._started:
                return []
            slots = handlers_to_restart(self._alive(), stopping=self._stopping)
            for slot in slots:
                TASK_HANDLER_RESTARTS.labels(self.service).inc()
                log.warning(
                    "%s task handler %d was not running on tick %d; restarting it",
                    self.service,
                    slot,
                    tick,
                )
                self._spawn(slot)
        TASK_HANDLERS.labels(self.service).set(self.alive)
        return slots

    def on_tick(self, tick: int) -> None:
        """`check` in the shape `Ticker.every` takes."""
        self.check(tick)

    def stop(self, timeout_s: float = 5.0) -> int:
        """Let the handlers finish what is queued, then end them; returns the tasks left undone."""
        with self._lock:
            self._stopping = True
            # One None per handler, queued after every waiting task: stopping drains the queue.
            for _ in self._threads:
                self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        TASK_HANDLERS.labels(self.service).set(self.alive)
        left = sum(1 for item in list(self._queue.queue) if item is not None)
        if left:
            log.warning("%s task handlers stopped with %d task(s) undone", self.service, left)
        return left

    def _alive(self) -> list[bool]:
        return [t is not None and t.is_alive() for t in self._threads]

    def _spawn(self, slot: int) -> None:
        thread = threading.Thread(
            target=self._serve, args=(slot,), name=f"ksb-{self.service}-task-{slot}", daemon=True
        )
        try:
            thread.start()
        except RuntimeError as exc:  # "can't start new thread": out of threads or memory
            log.error("%s task handler %d did not start: %s", self.service, slot, exc)
            self._threads[slot] = None
            return
        self._threads[slot] = thread

    def _serve(self, slot: int) -> None:
        try:
            while True:
                item = self._queue.get()
                try:
                    if item is None:
                        return
                    self._run(item)
                finally:
                    self._queue.task_done()
        except BaseException as exc:
            # Not re-raised: the thread ends here either way, and the tick restarts it. Logging is
            # the report; an unhandled thread exception would only add a second, unstructured one.
            log.error(
                "%s task handler %d died (%s: %s); the next tick restarts it",
                self.service,
                slot,
                type(exc).__name__,
                exc,
            )

    def _run(self, item: _Item) -> None:
        try:
            item.fn()
        except Exception:
            ASYNC_TASK_FAILURES.labels(self.service).inc()
            log.exception("%s task %r failed; its handler goes on", self.service, item.name)
