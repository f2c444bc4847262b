"""The sending half of exactly-once delivery between instances: what to send again, and when.

Each direction of a dialog that crosses instances is numbered from 0 by its sending dispatcher;
the receiving dispatcher keeps the other half (`ksb.dialog.sequencing.ReceiveWindow`) and
acknowledges the highest number it delivered with no gap. The transmitter keeps one
`Retransmitter` per direction it sends: everything not yet acknowledged is sent again, with a
`ksb.backoff.Backoff`, so a dead or slow peer costs less and less traffic. Pure: time comes in as
int milliseconds.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from ksb.backoff import Backoff

__all__ = ["Retransmitter"]


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

    def __init__(self, backoff: Backoff) -> None:
        self._backoff = backoff
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
