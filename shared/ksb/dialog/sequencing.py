"""Exactly-once, in-order delivery of one conversation direction between broker instances.

Inside one instance a Kafka transaction gives exactly-once delivery. Between instances the link can
lose, duplicate and reorder messages, so each direction of a dialog carries sequence numbers from
0 (assigned by the sending dispatcher), and the two ends use the two halves of this module:

* the receiving dispatcher keeps a `ReceiveWindow`: it hands on only the next expected sequence
  number, holds early arrivals until the gap fills, drops every copy it has already seen, and
  acknowledges the highest contiguous number it delivered;
* the sender keeps a `Retransmitter`: everything not yet acknowledged is sent again, with
  exponential backoff so a dead or slow peer costs less and less traffic.

Nothing is lost when the receiver throws a buffered message away (because it is too old, or because
the buffer is full): the sender never saw it acknowledged and will send it again. That is what lets
the receiver keep a hard bound on its memory. Both classes are pure: no I/O, and time comes in as
int milliseconds read by the caller (or by the window, through an injected `Clock`).

The retransmitter's `Backoff` is also the curve for other things retried after failures, kept by a
`FailureHold` (the activation monitor's failed tasks, the external activator's commands).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ksb.clock import Clock
from ksb.runtime.ticker import stale

__all__ = ["Backoff", "FailureHold", "ReceiveWindow", "Retransmitter"]

T = TypeVar("T")


@dataclass
class _Buffered(Generic[T]):
    item: T
    arrived_ms: int


class ReceiveWindow(Generic[T]):
    """The receiving end of one conversation direction: turns any arrival order into 0, 1, 2, ...

    `offer` returns what became deliverable; the caller must deliver those items (for KSB: write
    them to the queue topic in its transaction) before it acknowledges `ack_seq`. A buffer bound
    keeps a peer that races far ahead from growing memory without limit; the next expected number
    is always accepted, even with a full buffer, so a full window can never block progress.
    """

    def __init__(self, clock: Clock, *, next_seq: int = 0, max_buffered: int = 1024) -> None:
        if next_seq < 0:
            raise ValueError(f"next_seq must be >= 0, got {next_seq}")
        if max_buffered < 0:
            raise ValueError(f"max_buffered must be >= 0, got {max_buffered}")
        self._clock = clock
        self._next_seq = next_seq
        self._max_buffered = max_buffered
        self._buffer: dict[int, _Buffered[T]] = {}
        self._duplicates = 0
        self._refused = 0
        self._purged = 0

    @property
    def next_seq(self) -> int:
        """The sequence number the window waits for."""
        return self._next_seq

    @property
    def ack_seq(self) -> int:
        """Highest sequence number delivered with no gap before it (-1 before the first)."""
        return self._next_seq - 1

    @property
    def buffered(self) -> int:
        """Early arrivals held until the gap before them fills."""
        return len(self._buffer)

    @property
    def duplicates(self) -> int:
        """Copies dropped because they were already delivered or already buffered."""
        return self._duplicates

    @property
    def refused(self) -> int:
        """Early arrivals dropped because the buffer was full (the sender retransmits them)."""
        return self._refused

    @property
    def purged(self) -> int:
        """Buffered arrivals dropped by `drop_older_than`."""
        return self._purged

    def offer(self, seq: int, item: T) -> list[T]:
        """Take one arrival; return the items now deliverable, in sequence order (often none)."""
        if seq < 0:
            raise ValueError(f"sequence numbers start at 0, got {seq}")
        if seq < self._next_seq or seq in self._buffer:
            # The first copy wins: a later one may be a retransmission of the same message, and
            # delivering it again is exactly the duplicate this window exists to prevent.
            self._duplicates += 1
            return []
        if seq > self._next_seq:
            if len(self._buffer) >= self._max_buffered:
                self._refused += 1
                return []
            self._buffer[seq] = _Buffered(item, self._clock.now_ms())
            return []
        ready = [item]
        self._next_seq += 1
        while (held := self._buffer.pop(self._next_seq, None)) is not None:
            ready.append(held.item)
            self._next_seq += 1
        return ready

    def drop_older_than(self, now_ms: int, max_age_ms: int) -> list[int]:
        """Drop buffered arrivals at least `max_age_ms` old; return their sequence numbers.

        An arrival that has waited that long sits behind a gap the sender has not filled, so holding
        it only costs memory: the sender's retransmission brings it back once the gap is filled.
        """
        arrivals = {seq: held.arrived_ms for seq, held in self._buffer.items()}
        dropped = sorted(stale(arrivals, now_ms, max_age_ms))
        for seq in dropped:
            del self._buffer[seq]
        self._purged += len(dropped)
        return dropped


@dataclass(frozen=True)
class Backoff:
    """Retransmission delays: `initial_ms`, then times `factor` per attempt, capped at `max_ms`."""

    initial_ms: int = 1_000
    factor: float = 2.0
    max_ms: int = 60_000

    def __post_init__(self) -> None:
        if self.initial_ms <= 0:
            raise ValueError(f"initial_ms must be positive, got {self.initial_ms}")
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1, got {self.factor}")
        if self.max_ms < self.initial_ms:
            raise ValueError(f"max_ms ({self.max_ms}) must be >= initial_ms ({self.initial_ms})")

    def delay_ms(self, attempt: int) -> int:
        """Wait after the `attempt`-th transmission (0 = the first send) before sending again."""
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

    backoff: Backoff = field(default_factory=Backoff)
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


@dataclass
class _Unacked:
    attempt: int
    due_ms: int


class Retransmitter:
    """The sending end of one conversation direction: what to send again, and when.

    Acknowledgements are cumulative (the receiver's `ack_seq`), so an old acknowledgement that
    arrives after a newer one changes nothing. `due` assumes the caller sends again everything it
    returns, and schedules the next attempt from that moment.
    """

    def __init__(self, backoff: Backoff | None = None) -> None:
        self._backoff = backoff or Backoff()
        self._unacked: dict[int, _Unacked] = {}
        # (due_ms, seq); entries whose seq was acked or rescheduled are skipped when popped.
        self._heap: list[tuple[int, int]] = []
        self._acked_seq = -1

    @property
    def unacked(self) -> int:
        """Messages sent and not yet acknowledged."""
        return len(self._unacked)

    @property
    def acked_seq(self) -> int:
        """Highest sequence number the receiver acknowledged (-1 before the first)."""
        return self._acked_seq

    @property
    def next_due_ms(self) -> int | None:
        """When `due` next has something to return, so a loop can sleep until then."""
        self._discard_invalid_top()
        return self._heap[0][0] if self._heap else None

    def attempts(self, seq: int) -> int:
        """How many times `seq` has been handed out for sending (0 if acknowledged or unknown)."""
        entry = self._unacked.get(seq)
        return 0 if entry is None else entry.attempt + 1

    def sent(self, seq: int, now_ms: int) -> None:
        """Record the first send of `seq`; its first retransmission falls `initial_ms` later."""
        if seq < 0:
            raise ValueError(f"sequence numbers start at 0, got {seq}")
        if seq <= self._acked_seq:
            return  # already acknowledged (an ack can overtake a slow caller): nothing to resend
        if seq in self._unacked:
            raise ValueError(f"sequence number {seq} was already sent and is not acknowledged")
        self._schedule(seq, attempt=0, now_ms=now_ms)

    def acked(self, up_to_seq: int) -> int:
        """Forget every message up to and including `up_to_seq`; return how many were forgotten."""
        if up_to_seq <= self._acked_seq:
            return 0
        self._acked_seq = up_to_seq
        done = [seq for seq in self._unacked if seq <= up_to_seq]
        for seq in done:
            del self._unacked[seq]
        return len(done)

    def due(self, now_ms: int) -> list[int]:
        """Sequence numbers to send again now, lowest first, so the receiver's gap closes first."""
        ready: list[int] = []
        while True:
            self._discard_invalid_top()
            if not self._heap or self._heap[0][0] > now_ms:
                break
            _, seq = heapq.heappop(self._heap)
            ready.append(seq)
        ready.sort()
        for seq in ready:
            self._schedule(seq, attempt=self._unacked[seq].attempt + 1, now_ms=now_ms)
        return ready

    def _schedule(self, seq: int, *, attempt: int, now_ms: int) -> None:
        due_ms = now_ms + self._backoff.delay_ms(attempt)
        self._unacked[seq] = _Unacked(attempt=attempt, due_ms=due_ms)
        heapq.heappush(self._heap, (due_ms, seq))

    def _discard_invalid_top(self) -> None:
        while self._heap:
            due_ms, seq = self._heap[0]
            entry = self._unacked.get(seq)
            if entry is not None and entry.due_ms == due_ms:
                return
            heapq.heappop(self._heap)
