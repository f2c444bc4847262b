"""Doubling delays after failures, and the hold they put on the next try.

One curve for everything KSB retries after a failure: the transmitter's retransmission of what a
peer has not acknowledged, the activation monitor's hold after failed tasks, the external
activator's restarts of a failing command. It lives beside the other cross-cutting modules
(`ksb.clock`, `ksb.errors`) because the packages that use it (transmission, activation) sit
side by side and neither belongs under the other. The numbers themselves are each caller's
settings (`ksb.settings`); there are no defaults here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Backoff", "FailureHold"]


@dataclass(frozen=True)
class Backoff:
    """Delays: `initial_ms`, then times `factor` per attempt, capped at `max_ms`."""

    initial_ms: int
    max_ms: int
    factor: float = 2.0
    """Doubling: the shape of the curve, not a deployment's choice."""

    def __post_init__(self) -> None:
        if self.initial_ms <= 0:
            raise ValueError(f"initial_ms must be positive, got {self.initial_ms}")
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1, got {self.factor}")
        if self.max_ms < self.initial_ms:
            raise ValueError(f"max_ms ({self.max_ms}) must be >= initial_ms ({self.initial_ms})")

    def delay_ms(self, attempt: int) -> int:
        """Wait after the `attempt`-th try (0 = the first) before trying again."""
        try:
            delay = self.initial_ms * self.factor**attempt
        except OverflowError:  # a peer that has been down for days: long since at the cap
            return self.max_ms
        return self.max_ms if delay >= self.max_ms else round(delay)


@dataclass
class FailureHold:
    """`Backoff` kept for something retried after failures (an activated task, an external
    activator's command): each failure in a row holds the next try back for the next delay, and
    a success starts the curve over."""

    backoff: Backoff
    failures: int = 0
    """Failures in a row."""
    until_ms: int | None = None
    """No try before this (None: not held)."""

    def failed(self, now_ms: int) -> int:
        """One more failure at `now_ms`; returns how long the next try is held back (ms)."""
        delay = self.backoff.delay_ms(self.failures)
        self.failures += 1
        self.until_ms = now_ms + delay
        return delay

    def clear(self) -> None:
        """A success, or the fault mended: nothing is held back."""
        self.failures, self.until_ms = 0, None

    def holds(self, now_ms: int) -> bool:
        return self.until_ms is not None and now_ms < self.until_ms
