"""What Kafka clients say, as Python logging records with levels that mean what they say.

librdkafka writes its log lines straight to stderr unless a client has a log callback, and it
reports errors such as an unreachable broker to ``error_cb``, or as one more log line when a
client has none. So a healthy process printed raw lines like ``GroupCoordinator: SASL
authentication error: ... Broker transport failure`` (a consumer closed while its coordinator
connection was logging in), and a process whose broker was down printed one per reconnect
attempt, several a second per client. Every client KSB makes (`ksb.runtime.kafka`) hands both
to a `ClientLog`, which logs them on the logger ``ksb.kafka.<role>`` (``producer``,
``consumer``, ``group``, ``admin``), rate-limited by `ksb.runtime.log_limits.RepeatLimit`.

Levels. librdkafka's syslog levels arrive as confluent-kafka maps them (3 ERROR, 4 WARNING, 5
and 6 INFO, 7 DEBUG), and an error callback's as ERROR, except for transient failures, which
librdkafka retries on its own (a refused connection while a broker restarts, a transport
failure, all brokers down, a request timed out): those are INFO while young, and WARNING once
the same kind has gone on for `PERSIST_S` in that client, so an outage that lasts still shows
at the level operators watch.

When lines arrive. confluent-kafka queues a client's log lines and errors and hands them over
in the thread that serves the client (``poll``, ``consume``, ``flush``), so librdkafka's own
threads never call Python. An AdminClient is served only by its ``poll``: `ksb.runtime.kafka`
calls it where it waits on one; a client never served keeps its lines until it is destroyed,
and they are then dropped (what went wrong reaches the caller as the call's own error).

What an error callback changes. A consumer without one gets librdkafka's client-wide errors (a
transport failure, all brokers down) back from ``poll``/``consume`` as error records; with one,
those go to the callback, and only a partition's own errors (authorization refused, unknown
topic, end of partition) still come as records. So a loop that raised on any error record
(`ksb.runtime.kafka.read_to_end`, the dispatcher's rebuild, the SDK's read-back) now rides out
a broker restart until its own deadline, and one that logged each (the ack relay) no longer
repeats the callback's line on every pass.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError

from ksb.clock import Clock, SystemClock
from ksb.runtime.log_limits import limit_repeats

__all__ = ["PERSIST_S", "ClientLog", "Streaks", "client_log", "is_transient", "kind_of"]

PERSIST_S = 30.0
"""A transient failure of one kind that has gone on this long in a client is logged as WARNING.
librdkafka's reconnect backoff tops out at 10 s, so a failure that goes on repeats well within
it; a kind not seen for this long has ended, and starts over. A module constant for the reason
given in `ksb.runtime.log_limits`: it changes what a log says, never what KSB does."""

_TRANSIENT_TEXT = re.compile(
    r"Connection refused|Broker transport failure|Disconnected|Connection reset|[Tt]imed out|"
    r"Receive failed|Send failed|brokers are down|Failed to resolve|Connection setup timed out"
)
"""What librdkafka says of a connection it lost or could not make, and will make again."""

_TRANSIENT_CODES = frozenset(
    {
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._RESOLVE,
        KafkaError._TIMED_OUT,
    }
)

_THREAD = re.compile(r"^\[thrd:[^\]]*\]: ")
_AFTER = re.compile(r"\s*\(after \d+ms in state \w+(, \d+ identical error\(s\) suppressed)?\)")
_NUMBER = re.compile(r"\d+")


def is_transient(text: str, code: int | None = None) -> bool:
    """Whether a log line or error says a connection was lost or refused, which librdkafka
    retries on its own. A failed login counts only when the connection under it failed (wrong
    credentials say ``Authentication failed``, and stay errors)."""
    return code in _TRANSIENT_CODES or bool(_TRANSIENT_TEXT.search(text))


def kind_of(text: str) -> str:
    """A line's kind for the rate limit: its text without the time it took and with every
    number as ``#`` (ports, broker ids, counts), so one broker's refusals are one kind and the
    same refusal reported as a log line and as an error is one too."""
    return _NUMBER.sub("#", _AFTER.sub("", text))


class Streaks:
    """How long each kind of transient failure has been going on in one client: a kind not
    seen for `persist_s` has ended, and starts over when it comes back."""

    def __init__(self, persist_s: float = PERSIST_S, clock: Clock | None = None) -> None:
        self.persist_s = persist_s
        self._clock = clock or SystemClock()
        self._runs: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def seen(self, kind: str) -> float:
        """Record one more of `kind`; how long it has been going on, in seconds."""
        now = self._clock.now_ms() / 1000
        with self._lock:
            first, last = self._runs.get(kind, (now, now))
            if now - last >= self.persist_s:
                first = now
            self._runs[kind] = (first, now)
        return now - first


@dataclass(frozen=True)
class _Line:
    level: int
    source: str
    text: str


class ClientLog:
    """One client's log callback (confluent-kafka's ``logger``: anything with `log`) and error
    callback (`error`), logging on `logger`. Never raises: an exception in either callback
    would surface from the client's ``poll``."""

    def __init__(self, logger: logging.Logger, streaks: Streaks | None = None) -> None:
        self.logger = logger
        self.streaks = streaks or Streaks()

    def log(self, level: int, fmt: str, *args: Any) -> None:
        """confluent-kafka calls ``logger.log(level, "%s [%s] %s", facility, client, text)``."""
        try:
            if len(args) == 3:
                facility, client, text = (str(a) for a in args)
                line = _Line(level, f"{client} {facility}", _THREAD.sub("", text))
            else:
                line = _Line(level, "librdkafka", fmt % args)
            self._emit(line, transient=is_transient(line.text))
        except Exception:  # a log line must never break the client that logged it
            self.logger.debug("librdkafka log line not handled: %r %r", fmt, args, exc_info=True)

    def error(self, err: KafkaError) -> None:
        """The client's ``error_cb``: librdkafka says most of these are informational, and it
        recovers from them on its own; a fatal one also fails the client's next call."""
        try:
            line = _Line(logging.ERROR, f"error {err.name()}", err.str())
            self._emit(line, transient=not err.fatal() and is_transient(err.str(), err.code()))
        except Exception:
            self.logger.debug("Kafka error callback not handled: %r", err, exc_info=True)

    def _emit(self, line: _Line, *, transient: bool) -> None:
        kind = kind_of(line.text)
        level, note = line.level, ""
        if transient and level >= logging.WARNING:
            lasted_s = self.streaks.seen(kind)
            if lasted_s >= self.streaks.persist_s:
                level, note = logging.WARNING, f" (going on for {lasted_s:.0f} s)"
            else:
                level = logging.INFO
        if self.logger.isEnabledFor(level):
            self.logger.log(
                level, "%s: %s%s", line.source, line.text, note, extra={"kind": (level, kind)}
            )


def client_log(role: str, *, debug: bool = False) -> dict[str, Any]:
    """The configuration entries that send one new client's log lines and errors to
    ``ksb.kafka.<role>``; `debug` (librdkafka's ``debug`` contexts are on) lets its DEBUG lines
    through whatever level the process logs at."""
    logger = limit_repeats(logging.getLogger(f"ksb.kafka.{role}"))
    if debug:
        logger.setLevel(logging.DEBUG)
    sink = ClientLog(logger)
    return {"logger": sink, "error_cb": sink.error}
