"""A Kafka bug the harness meets after a kill -9 of the broker, and the operator's remedy for it.

Seen with Kafka 4.2.0 (chaos seed 83157): after the broker came back on its data, its group
coordinator found itself out of step with ``__consumer_offsets-N`` ("the last written offset
returned is 9794 while the coordinator expected 1"), reloaded that partition in place, and the
reload failed ("Group ... is not a consumer group") on ordinary consumer-protocol records. The
same data loads without an error in a freshly started broker (checked on that run's saved data
directory), so the fault is in the broker's memory, not in what KSB wrote. Until the broker
restarts, every group on that partition answers NOT_COORDINATOR: dispatchers cannot commit and a
transport cannot read its committed offsets. KSB cannot repair the broker; an operator restarts
it, and so does the harness: `CoordinatorWatch` reads the broker's log as it grows and asks for a
restart when a coordinator partition failed to load. Every such restart is reported as a fault
of its own (column ``kfix``), and the round's invariants are checked as after any other fault.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable

from devtools.processes import LogTail

__all__ = ["CoordinatorWatch", "failed_loads"]

log = logging.getLogger("devtools.chaos")

_FAILED_LOAD = re.compile(
    r"Failed to load metadata from (__consumer_offsets-\d+|__transaction_state-\d+)"
)


def failed_loads(text: str) -> list[str]:
    """The coordinator partitions `text` (broker log lines) says failed to load."""
    return _FAILED_LOAD.findall(text)


class CoordinatorWatch:
    """Calls `restart(why)` when the broker's log says a coordinator partition failed to load.

    `restart` returns False when it could not act now (a Kafka fault holds the broker: its own
    restart reloads every partition anyway); the failure is then asked about again next time.
    """

    def __init__(
        self, tail: LogTail, restart: Callable[[str], bool], *, every_s: float = 2.0
    ) -> None:
        self.tail = tail
        self.restart = restart
        self.every_s = every_s
        self.pending: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        self.pending += [p for p in failed_loads(self.tail.new_text()) if p not in self.pending]
        if self.pending:
            why = f"kafka's group coordinator failed to load {', '.join(self.pending)}"
            if self.restart(why):
                self.pending = []

    def start(self) -> CoordinatorWatch:
        self._thread = threading.Thread(target=self._run, name="chaos-coordinator-watch")
        self._thread.daemon = True
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check()
            except Exception:
                log.exception("watching the broker's log")
