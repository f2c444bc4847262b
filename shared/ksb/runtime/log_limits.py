"""A rate limit for log lines that repeat: the first of a kind, then one per interval, counted.

A Kafka client that cannot reach its broker says so on every reconnect attempt, a few times a
second per client, and a process has a dozen clients: the one useful line drowns the log. A
`RepeatLimit` lets the first record of each kind through at once, then at most one per
`REPEAT_EVERY_S`, and that one says how many like it were held back since the last. Records
below INFO are never held: whoever turned DEBUG on asked for every line.

A record's kind is its ``kind`` attribute when the code that logged it set one (`ksb.runtime.
kafka_logs` does, from the text with its numbers taken out), else its logger, level and format
string: the same call site at the same level is the same kind whatever its arguments.

The interval is a module constant, not a setting: it changes what a log says, never what KSB
does; the process's logging configuration (levels, handlers) is the deployment's knob for its
logs; and one filter serves a whole process, which may hold several clients' settings at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from dataclasses import dataclass

from ksb.clock import Clock, SystemClock

__all__ = ["LIBRARY_LOGGERS", "REPEAT_EVERY_S", "RepeatLimit", "limit_repeats"]

REPEAT_EVERY_S = 30.0
"""After the first record of a kind, at most one more per this many seconds."""

LIBRARY_LOGGERS = ("aiokafka", "redis")
"""Client libraries that log through Python's logging on their own: aiokafka (under faust, in the
external activator) logs every failed reconnect attempt; redis-py, a cluster node it lost. A
service's log handler limits their repeats (`ksb.runtime.service.configure_logging`)."""

_MAX_KINDS = 1_000
"""Kinds remembered at most; past that, those quiet for a whole interval are forgotten."""


@dataclass
class _Seen:
    passed_at: float
    held: int = 0


class RepeatLimit(logging.Filter):
    """Holds back repeats of a record's kind within `every_s` of the last one let through; the
    next one let through carries the count of those held back. Thread-safe.

    As a logger's filter it sees only the records logged on that very logger (not its
    children's); as a handler's filter, every record the handler gets, and `prefixes` then
    narrows it to the loggers named (a prefix matches the logger and its children)."""

    def __init__(
        self,
        every_s: float = REPEAT_EVERY_S,
        *,
        prefixes: tuple[str, ...] = (),
        clock: Clock | None = None,
    ) -> None:
        super().__init__()
        self.every_s = every_s
        self.prefixes = prefixes
        self._clock = clock or SystemClock()
        self._seen: dict[Hashable, _Seen] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO or not self._applies_to(record.name):
            return True
        kind = getattr(record, "kind", None) or (record.name, record.levelno, str(record.msg))
        with self._lock:
            now = self._clock.now_ms() / 1000
            seen = self._seen.get(kind)
            if seen is not None and now - seen.passed_at < self.every_s:
                seen.held += 1
                return False
            if seen is None and len(self._seen) >= _MAX_KINDS:
                self._forget(now)
            self._seen[kind] = _Seen(now)
        if seen is not None and seen.held:
            record.msg = (
                f"{record.getMessage()} "
                f"({seen.held} more like it in the last {now - seen.passed_at:.0f} s)"
            )
            record.args = None
        return True

    def _applies_to(self, name: str) -> bool:
        if not self.prefixes:
            return True
        return any(name == p or name.startswith(p + ".") for p in self.prefixes)

    def _forget(self, now: float) -> None:
        for kind in [k for k, s in self._seen.items() if now - s.passed_at >= self.every_s]:
            del self._seen[kind]


def limit_repeats(logger: logging.Logger, every_s: float = REPEAT_EVERY_S) -> logging.Logger:
    """`logger` with a `RepeatLimit` of its own (once, however often it is asked)."""
    if not any(isinstance(f, RepeatLimit) for f in logger.filters):
        logger.addFilter(RepeatLimit(every_s))
    return logger
