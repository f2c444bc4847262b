"""Starting a broker instance, retrying a failed start, and the BCNs that tell subscribers about it.

Service Broker scans, every 5th timer notification, the databases whose broker failed to start
(a missing master key, say), tries again, and fires a broker configuration notification (BCN). A KSB
dispatcher meets the same situation when it is started (by docker-compose, for instance) before its
catalog was applied (or while no catalog record is valid: invalid ones are skipped), or before its
queue topics exist: it
used to crash or run against an empty catalog. With this state machine it stays up, reports why it is
not started, retries every 5th tick and then runs normally.

A configuration change (a new catalog record) also makes the next tick retry, as ALTER DATABASE ...
ENABLE_BROKER starts a broker at once instead of waiting for the timer: the operator has just done
what the failure asked for, and waiting up to four more ticks would only look like a hang.

Kafka coming back is the same kind of news. While a start failed because Kafka did not answer, the
dispatcher asks it, cheaply and off its loop, on every tick (`probe_due`); a probe that finds Kafka
answering after an earlier probe found it silent makes the next tick retry (`on_probe`). Only that
edge, seen by the probes themselves, counts: a Kafka that answers metadata requests and still fails
the start (a transaction coordinator not ready, a topic it refuses to create) stays on the 5th-tick
cadence instead of being retried on every other tick for as long as it lasts. The price is that a
Kafka back before the first probe after a failed attempt waits for the cadence, at most four ticks.

Everything here is pure: the dispatcher does the I/O and hands in ticks, failures and milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from confluent_kafka import KafkaException

from ksb.errors import KsbError
from ksb.wire.protocol import BcnEvent, BrokerNotification

__all__ = [
    "BROKER_RETRY_EVERY",
    "KAFKA_UNAVAILABLE",
    "BrokerNotStarted",
    "BrokerStart",
    "BrokerState",
    "StartFailure",
    "failure_from_exception",
    "start_problem",
]

BROKER_RETRY_EVERY = 5
"""A failed start is retried on every 5th tick (Service Broker's cadence)."""

KAFKA_UNAVAILABLE = "kafka_unavailable"
"""The failure code of a start that Kafka did not answer; the one a Kafka probe can cut short."""


class BrokerState(str, Enum):
    NOT_STARTED = "not_started"
    FAILED = "failed"
    STARTED = "started"


@dataclass(frozen=True)
class StartFailure:
    """Why a start attempt failed: a stable ``code`` for machines, a ``reason`` for people."""

    code: str
    reason: str


class BrokerNotStarted(KsbError):
    """A start attempt found the broker's configuration not ready (see `start_problem`)."""

    code = "broker_not_started"

    def __init__(self, failure: StartFailure) -> None:
        super().__init__(failure.reason)
        self.failure = failure


def start_problem(
    instance: str, catalog_version: int, missing_topics: Sequence[str]
) -> StartFailure | None:
    """What keeps a broker with this catalog and these missing topics from starting, if anything.

    Version 0 means no catalog was ever applied: every request would be refused as naming an unknown
    service. A queue topic missing would make the first transaction writing to it time out.
    """
    if catalog_version <= 0:
        return StartFailure(
            "no_catalog",
            f"no catalog applied to instance {instance} (run `ksb catalog apply`)",
        )
    if missing_topics:
        names = ", ".join(sorted(missing_topics))
        return StartFailure(
            "missing_topics",
            f"catalog v{catalog_version} names topics that do not exist: {names}",
        )
    return None


def failure_from_exception(exc: BaseException) -> StartFailure:
    """Classify what a start attempt raised, so subscribers can tell a bad catalog from Kafka."""
    if isinstance(exc, BrokerNotStarted):
        return exc.failure
    if isinstance(exc, (KafkaException, TimeoutError)):
        return StartFailure(KAFKA_UNAVAILABLE, f"Kafka: {exc}")
    if isinstance(exc, (KsbError, ValueError)):  # CatalogError, bad JSON, pydantic's errors
        return StartFailure("invalid_catalog", f"catalog record unreadable: {exc}")
    return StartFailure("start_error", f"{type(exc).__name__}: {exc}")


class BrokerStart:
    """One broker instance's start state; each transition returns the BCN to publish."""

    def __init__(
        self, instance: str, *, service: str = "dispatcher", retry_every: int = BROKER_RETRY_EVERY
    ) -> None:
        if retry_every < 1:
            raise ValueError(f"retry_every must be >= 1, got {retry_every}")
        self.instance = instance
        self.service = service
        self.retry_every = retry_every
        self.state = BrokerState.NOT_STARTED
        self.failure: StartFailure | None = None
        self.attempts = 0
        self.last_attempt_tick: int | None = None
        self.started_tick: int | None = None
        self.catalog_version = 0
        self._changed = False
        self._kafka_back = False
        """A probe found Kafka answering again: the next `due` says yes."""
        self._kafka_seen_down = False
        """A probe since the latest attempt found Kafka silent."""
        self._probe_sent_tick: int | None = None

    @property
    def started(self) -> bool:
        return self.state is BrokerState.STARTED

    @property
    def waiting_for_kafka(self) -> bool:
        """Whether the latest attempt failed because Kafka did not answer."""
        return (
            self.state is BrokerState.FAILED
            and self.failure is not None
            and self.failure.code == KAFKA_UNAVAILABLE
        )

    def due(self, tick: int) -> bool:
        """Whether to try a start on this tick: every 5th while failed, or after a change."""
        if self.state is BrokerState.STARTED:
            return False
        if self.state is BrokerState.NOT_STARTED:
            return True
        return self._changed or self._kafka_back or tick % self.retry_every == 0

    def probe_due(self, tick: int) -> bool:
        """Whether to ask Kafka on this tick if it answers again.

        Only while the start failed for want of Kafka, never on a tick that retries anyway, and one
        probe at a time; a probe unanswered for `retry_every` ticks counts as lost (its handler died).
        """
        if not self.waiting_for_kafka or self.due(tick):
            return False
        sent = self._probe_sent_tick
        return sent is None or tick - sent >= self.retry_every

    def probe_sent(self, tick: int) -> None:
        """A probe was handed to a task handler on `tick`."""
        self._probe_sent_tick = tick

    def on_probe(self, sent_tick: int, reachable: bool) -> bool:
        """A probe's answer; True when it makes the next tick retry (Kafka answers after silence).

        An answer to a probe sent before the latest attempt is stale: that attempt knows better.
        """
        if sent_tick == self._probe_sent_tick:
            self._probe_sent_tick = None
        stale = self.last_attempt_tick is not None and sent_tick < self.last_attempt_tick
        if stale or not self.waiting_for_kafka:
            return False
        if not reachable:
            self._kafka_seen_down = True
            return False
        if not self._kafka_seen_down:
            return False  # no probe saw it silent: it may have answered all along
        self._kafka_seen_down = False
        self._kafka_back = True
        return True

    def note_configuration_change(self) -> None:
        """A new catalog record arrived: worth a retry on the next tick instead of the 5th."""
        if self.state is BrokerState.FAILED:
            self._changed = True

    def attempt(self, tick: int) -> None:
        """Record that a start is being tried now (on `tick`; 0 before the first tick)."""
        self.attempts += 1
        self.last_attempt_tick = tick
        self._changed = False
        self._kafka_back = False
        self._kafka_seen_down = False  # what the probes saw before this attempt is history
        self._probe_sent_tick = None

    def on_failed(self, failure: StartFailure, now_ms: int) -> BrokerNotification:
        """The attempt failed: the broker stays down until a later tick retries."""
        self.state = BrokerState.FAILED
        self.failure = failure
        return self._bcn("start_failed", now_ms, code=failure.code, reason=failure.reason)

    def on_started(self, catalog_version: int, now_ms: int) -> BrokerNotification:
        self.state = BrokerState.STARTED
        self.failure = None
        self.started_tick = self.last_attempt_tick
        self.catalog_version = catalog_version
        return self._bcn("started", now_ms)

    def on_catalog(self, version: int, now_ms: int) -> BrokerNotification | None:
        """A catalog version the running broker now applies; None when nothing changed."""
        if self.state is not BrokerState.STARTED or version == self.catalog_version:
            return None
        self.catalog_version = version
        return self._bcn("catalog_changed", now_ms, attempt=0)

    def problem(self) -> str | None:
        """None once started; otherwise why not, in one line (the body of /healthz)."""
        if self.started:
            return None
        if self.failure is None:
            return f"broker of instance {self.instance} not started yet (first attempt)"
        return (
            f"broker of instance {self.instance} not started ({self.failure.code}, "
            f"attempt {self.attempts}): {self.failure.reason}"
        )

    def status(self) -> dict[str, Any]:
        """For health views and logs: the state and, while not started, why."""
        out: dict[str, Any] = {
            "state": self.state.value,
            "attempts": self.attempts,
            "catalog_version": self.catalog_version,
        }
        if self.failure is not None:
            out["code"] = self.failure.code
            out["reason"] = self.failure.reason
        return out

    def _bcn(
        self,
        event: BcnEvent,
        now_ms: int,
        *,
        attempt: int | None = None,
        code: str | None = None,
        reason: str | None = None,
    ) -> BrokerNotification:
        return BrokerNotification(
            event=event,
            instance=self.instance,
            service=self.service,
            catalog_version=self.catalog_version,
            attempt=self.attempts if attempt is None else attempt,
            code=code,
            reason=reason,
            at_ms=now_ms,
        )
