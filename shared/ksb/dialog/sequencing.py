"""Exactly-once, in-order delivery of one conversation direction between broker instances: the
receiving half.

Inside one instance a Kafka transaction gives exactly-once delivery. Between instances the link can
lose, duplicate and reorder messages, so each direction of a dialog carries sequence numbers from
0 (assigned by the sending dispatcher). The receiving dispatcher keeps a `ReceiveWindow`: it hands
on only the next expected sequence number, holds early arrivals until the gap fills, drops every
copy it has already seen, and acknowledges the highest contiguous number it delivered. The sending
half, which sends again what is not acknowledged, is the transmitter's
(`ksb.transmission.retransmit`).

Nothing is lost when the receiver throws a buffered message away (because it is too old, or because
the buffer is full): the sender never saw it acknowledged and will send it again. That is what lets
the receiver keep a hard bound on its memory. Pure: no I/O, and time comes in as int milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["ReceiveWindow"]

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

    def __init__(self, *, next_seq: int = 0, max_buffered: int = 1024) -> None:
        if next_seq < 0:
            raise ValueError(f"next_seq must be >= 0, got {next_seq}")
        if max_buffered < 0:
            raise ValueError(f"max_buffered must be >= 0, got {max_buffered}")
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

    def copy(self) -> ReceiveWindow[T]:
        """A window in the same place, whose offers leave this one as it is (a request's staged
        copy, `ksb.dialog.stage.Stage.window`)."""
        twin: ReceiveWindow[T] = ReceiveWindow(
            next_seq=self._next_seq, max_buffered=self._max_buffered
        )
        twin._buffer = dict(self._buffer)
        twin._duplicates, twin._refused, twin._purged = (
            self._duplicates,
            self._refused,
            self._purged,
        )
        return twin

    def offer(self, seq: int, item: T, now_ms: int) -> list[T]:
        """Take one arrival at `now_ms`; return the items now deliverable, in sequence order
        (often none)."""
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
            self._buffer[seq] = _Buffered(item, now_ms)
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
        dropped = sorted(seq for seq, at in arrivals.items() if now_ms - at >= max_age_ms)
        for seq in dropped:
            del self._buffer[seq]
        self._purged += len(dropped)
        return dropped
