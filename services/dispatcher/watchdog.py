"""A dispatcher process whose Kafka transaction call is stuck ends itself, so a fresh one takes over.

After a broker restart librdkafka's ``send_offsets_to_transaction`` was seen to block far beyond the
time limit it was given (found by the chaos harness, seeds 108087 and 108089): the dispatcher's loop
stopped, its shards stopped with it, and only ``max.poll.interval.ms`` (then Kafka's 5 minutes;
now ``KSB_REBALANCE_TIMEOUT_MS``, 30 s) later did the group hand them to another member. Nothing
inside the process can unblock the call, so the watchdog ends the process instead: its supervisor
(the compose restart policy, `DispatcherPool`, the chaos harness) starts a new one, whose
transactional id fences the stuck incarnation, and the group moves its shards at once (a dead
member's session ends). Nothing is lost: what the stuck transaction held was never committed.

Only the process entry point (`services.dispatcher.__main__`) starts the watchdog's thread; a
dispatcher run in a thread (tests) has the guard and no thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["EXIT_STUCK", "Watchdog"]

log = logging.getLogger("ksb.dispatcher")

EXIT_STUCK = 70
"""The exit status of a dispatcher that ended itself (EX_SOFTWARE)."""


def _exit_now() -> None:
    logging.shutdown()
    os._exit(EXIT_STUCK)  # the stuck call holds a lock no clean exit could take


class Watchdog:
    """Watches the Kafka calls made inside `guard`; one that outlives `limit_s` ends the process."""

    def __init__(
        self,
        limit_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_stuck: Callable[[], None] = _exit_now,
    ) -> None:
        self.limit_s = limit_s
        self._clock = clock
        self._on_stuck = on_stuck
        self._call: tuple[str, float] | None = None

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        self._call = (what, self._clock())
        try:
            yield
        finally:
            self._call = None

    def overdue(self) -> str | None:
        """The call that has run longer than the limit, named with how long, or None."""
        call = self._call
        if call is None:
            return None
        what, since = call
        took = self._clock() - since
        return f"{what} blocked for {took:.0f} s" if took > self.limit_s else None

    def check(self) -> bool:
        """End the process if a call is overdue; True when one was."""
        stuck = self.overdue()
        if stuck is None:
            return False
        log.critical(
            "%s (limit %.0f s): exiting so a fresh dispatcher takes over", stuck, self.limit_s
        )
        self._on_stuck()
        return True

    def start(self, every_s: float = 1.0) -> threading.Thread:
        """Check every `every_s` seconds in a daemon thread, for the life of the process."""

        def watch() -> None:
            while not self.check():
                time.sleep(every_s)

        t = threading.Thread(target=watch, name="dispatcher-watchdog", daemon=True)
        t.start()
        return t
