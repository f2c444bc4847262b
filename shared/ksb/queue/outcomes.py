"""Commit outcomes, waited for by request id.

A client produces its commit record to Kafka, then asks the queue service for the outcome. The
outcome reaches the service in the queue topic, possibly before the question (the dispatcher is
fast), or after it, and the question may come to another replica than the RECEIVE did (the first
one died). So every replica remembers the newest outcomes it read, by request id, a bounded
number of them, and a question waits on an event of its own until its outcome is read: one
outcome wakes one waiter, never all of them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ksb.queue.fold import Outcome

__all__ = ["Outcomes"]


class Outcomes:
    """The newest outcomes read, and the commits waiting for theirs."""

    def __init__(self, remember: int) -> None:
        self._remember = remember
        self._read: OrderedDict[str, Outcome] = OrderedDict()
        self._waiting: dict[str, list[threading.Event]] = {}
        self._lock = threading.Lock()

    def read(self, outcome: Outcome) -> None:
        """An outcome was read from the queue topic: remember it, wake whoever waits for it."""
        rid = outcome.record.request_id
        with self._lock:
            self._read[rid] = outcome
            self._read.move_to_end(rid)
            while len(self._read) > self._remember:
                self._read.popitem(last=False)
            events = self._waiting.pop(rid, [])
        for event in events:
            event.set()

    def wait(self, request_id: str, timeout_s: float) -> Outcome | None:
        """The outcome of `request_id`, waiting up to `timeout_s` for it to be read."""
        with self._lock:
            found = self._read.get(request_id)
            if found is not None:
                return found
            event = threading.Event()
            self._waiting.setdefault(request_id, []).append(event)
        event.wait(timeout_s)
        with self._lock:
            waiters = self._waiting.get(request_id)
            if waiters is not None and event in waiters:
                waiters.remove(event)
                if not waiters:
                    del self._waiting[request_id]
            return self._read.get(request_id)

    @property
    def waiting(self) -> int:
        with self._lock:
            return sum(len(w) for w in self._waiting.values())
