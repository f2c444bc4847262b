"""The broker's periodic timer: which housekeeping runs on which tick.

Service Broker does its housekeeping on one coarse timer: every notification, every 2nd and every
5th. KSB keeps that shape so that the housekeeping cost is predictable and independent of traffic,
and so every rule here can be tested by handing in milliseconds instead of waiting.

The tick counter counts notifications that were actually delivered, not wall-clock periods. When
the caller stalls (a GC pause, a slow Kafka poll) `Ticker.poll` runs the tick that is due plus at
most `max_catch_up` missed ones and drops the rest: housekeeping is idempotent, so replaying a
burst of stale ticks would only add latency at the worst moment. Because the counter counts
delivered ticks, an "every 5th" task still runs on every 5th delivered tick after a stall.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["TickFn", "Ticker"]

logger = logging.getLogger(__name__)

TickFn = Callable[[int], None]
"""A housekeeping task: called with the number of the tick it runs on."""


@dataclass(frozen=True)
class _Task:
    every: int
    name: str
    fn: TickFn


class Ticker:
    """Counts ticks and runs the tasks due on each; the caller owns the loop and the clock.

    Tick k (1-based) falls at `start_ms + k * tick_ms`. Tasks run in registration order, so a task
    registered after another on the same tick can rely on the first having run.
    """

    def __init__(self, start_ms: int, *, tick_ms: int, max_catch_up: int = 1) -> None:
        """`tick_ms` is `ServiceSettings.tick_ms`; `max_catch_up` how many missed ticks a stalled
        caller still gets (the rest are dropped, see the module)."""
        if tick_ms <= 0:
            raise ValueError(f"tick_ms must be positive, got {tick_ms}")
        if max_catch_up < 0:
            raise ValueError(f"max_catch_up must be >= 0, got {max_catch_up}")
        self._tick_ms = tick_ms
        self._next_due_ms = start_ms + self._tick_ms
        self._max_catch_up = max_catch_up
        self._tick = 0
        self._tasks: list[_Task] = []

    @property
    def tick(self) -> int:
        """Number of ticks delivered so far."""
        return self._tick

    @property
    def next_due_ms(self) -> int:
        """When the next tick falls, so a loop can sleep exactly until then."""
        return self._next_due_ms

    def every(self, n: int, name: str, fn: TickFn) -> None:
        """Run `fn(tick)` on every n-th tick."""
        if n < 1:
            raise ValueError(f"task {name!r}: n must be >= 1, got {n}")
        if any(task.name == name for task in self._tasks):
            raise ValueError(f"task {name!r} is already registered")
        self._tasks.append(_Task(every=n, name=name, fn=fn))

    def poll(self, now_ms: int) -> list[str]:
        """Deliver the due ticks (at most 1 + max_catch_up) and return the task names that ran."""
        ran: list[str] = []
        delivered = 0
        while now_ms >= self._next_due_ms and delivered <= self._max_catch_up:
            self._tick += 1
            self._next_due_ms += self._tick_ms
            delivered += 1
            ran.extend(self._run(self._tick))
        if now_ms >= self._next_due_ms:
            self._drop_missed(now_ms)
        return ran

    def _drop_missed(self, now_ms: int) -> None:
        missed = (now_ms - self._next_due_ms) // self._tick_ms + 1
        self._next_due_ms += missed * self._tick_ms
        logger.warning("ticker fell behind: dropped %d missed tick(s)", missed)

    def _run(self, tick: int) -> list[str]:
        ran: list[str] = []
        for task in self._tasks:
            if tick % task.every != 0:
                continue
            try:
                task.fn(tick)
            except Exception:
                # Supervision: one broken housekeeping task must not starve the others.
                logger.exception("tick task %r failed on tick %d", task.name, tick)
                continue
            ran.append(task.name)
        return ran
