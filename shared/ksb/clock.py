"""Injectable clocks.

Every timing rule (the 5 s tick, 10/15/60/90 s intervals, lock leases, dialog lifetimes) reads time through
a `Clock`, so tests drive those rules with `ManualClock` in milliseconds instead of sleeping.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["Clock", "ManualClock", "SystemClock"]


class Clock(Protocol):
    def now_ms(self) -> int:
        """Milliseconds on a wall clock (event times, deadlines stored in Kafka)."""
        ...

    def sleep(self, seconds: float) -> None:
        """Block the caller; a manual clock advances instead of blocking."""
        ...


class SystemClock:
    """The real clock."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class ManualClock:
    """A clock that moves only when told, so timing rules are tested without waiting."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now_ms = start_ms
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        with self._lock:
            return self._now_ms

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now_ms += round(seconds * 1000)

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)
