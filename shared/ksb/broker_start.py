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

Everything here is pure: the dispatcher does the I/O and hands in ticks, failures and milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from confluent_kafka import KafkaException

from ksb.errors import KsbError
from ksb.protocol import BcnEvent, BrokerNotification

__all__ = [
    "BROKER_RETRY_EVERY",
    "BrokerNotStarted",
    "BrokerStart",
    "BrokerState",
    "StartFailure",
    "failure_from_exception",
    "start_problem",
]

BROKER_RETRY_EVERY = 5
"""A failed start is retried on every 5th tick (Service Broker's cadence)."""


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
        return StartFailure("kafka_unavailable", f"Kafka: {exc}")
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

    @property
    def started(self) -> bool:
        return self.state is BrokerState.STARTED

    def due(self, tick: int) -> bool:
        """Whether to try a start on this tick: every 5th while failed, or after a change."""
        if self.state is BrokerState.STARTED:
            return False
        if self.state is BrokerState.NOT_STARTED:
            return True
        return self._changed or tick % self.retry_every == 0

    def note_configuration_change(self) -> None:
        """A new catalog record arrived: worth a retry on the next tick instead of the 5th."""
        if self.state is BrokerState.FAILED:
            self._changed = True

    def attempt(self, tick: int) -> None:
        """Record that a start is being tried now (on `tick`; 0 before the first tick)."""
        self.attempts += 1
        self.last_attempt_tick = tick
        self._changed = False

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
