"""The transmitter's pure state: the transmission queue of one broker instance.

What the dispatcher wrote to the ``transmission`` topic waits here until the receiving instance
acknowledges it. The parts are the ones already proven alone: `TransmissionScheduler` decides what
goes next across all destinations (priority, starvation prevention, HONOR_BROKER_PRIORITY), and one
`Retransmitter` per conversation direction decides what to send again and when. Acknowledgements
are cumulative, so an acknowledged message leaves at once, wherever it is (waiting or in flight).

A message whose target service has no route (or, for a local message, whose target queue is
disabled) is held aside with that reason in the view and is reconsidered on every reclassification
(catalog change, every 2nd tick); it never stops the rest.
After a reconnection everything unacknowledged for that destination is queued again at once rather
than waiting out its backoff, because the likely reason it went unacknowledged was the broken link.

Memory is bounded (`max_held_bytes`). A record that does not fit *unclassifies* its dialog
direction: the queue keeps only where that direction's first missing record lies in the
``transmission`` topic and skips every later record of it, so what is held is always a prefix of
each direction and nothing is reordered. When the held bytes fall back under half the budget, a
reclassification re-reads the topic from the earliest such offset (`replay_from`, `reregister`):
the directions get their records back in order, as many as fit. That is Service Broker's
reclassification after a resource limit: a pause for those dialogs, never a loss or a duplicate
(the topic keeps every record until it is acknowledged, and acknowledged ones are skipped).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

from ksb.backoff import Backoff
from ksb.transmission.links import QUEUE_DISABLED, ROUTE_EXPIRED
from ksb.transmission.retransmit import Retransmitter
from ksb.transmission.scheduler import Pending, TransmissionScheduler
from ksb.wire.protocol import AckRecord, InboundMessage

__all__ = ["WAITING_FOR_MEMORY", "Direction", "TransmissionQueue", "held_size"]

Direction = tuple[str, bool]
"""(conversation id, sent by the initiator): one numbered stream of messages."""

RouteOf = Callable[[InboundMessage], str | None]
"""Why a message cannot be routed now (None: it can)."""


@dataclass
class _Held:
    record: InboundMessage
    sent_once: bool = False
    no_route: str | None = None


@dataclass(frozen=True)
class _Unclassified:
    """A dialog direction set aside for lack of memory: its first record not held, and where."""

    offset: int
    first: InboundMessage


WAITING_FOR_MEMORY = (
    "transmitter memory limit reached: this dialog direction is unclassified from this message "
    "on and is re-registered when memory frees up"
)

RECORD_OVERHEAD_BYTES = 512
"""Bookkeeping per held record beyond its body (model, dict entries, scheduler entry)."""


def held_size(record: InboundMessage) -> int:
    """What holding `record` costs against the memory budget."""
    return len(record.body or "") + len(record.body_b64 or "") + RECORD_OVERHEAD_BYTES


class TransmissionQueue:
    """Unacknowledged outbound messages, their order, their retransmission and their view."""

    def __init__(
        self,
        *,
        honor_broker_priority: bool = True,
        max_wait_ms: int,
        backoff: Backoff,
        max_held_bytes: int | None = None,
    ) -> None:
        self._max_wait_ms = max_wait_ms
        self._max_held_bytes = max_held_bytes
        self.held_bytes = 0
        self._unclassified: dict[Direction, _Unclassified] = {}
        self._backoff = backoff
        self.scheduler = TransmissionScheduler(honor_broker_priority, max_wait_ms=max_wait_ms)
        self._honor = honor_broker_priority
        self._held: dict[str, _Held] = {}
        self._by_dir: dict[Direction, dict[int, str]] = {}
        self._retx: dict[Direction, Retransmitter] = {}
        self._acked: dict[Direction, int] = {}
        self.last_take: dict[str, tuple[int, bool]] = {}
        """Per message of the last `take`: (effective level, sent as a starvation exception)."""

    def __len__(self) -> int:
        return len(self._held)

    # -- input --------------------------------------------------------------------------------
    def add(
        self, record: InboundMessage, route_problem: str | None = None, *, offset: int = -1
    ) -> bool:
        """A record from the transmission topic at `offset`; False if it is not held now: already
        acknowledged or known, or its direction is (or just became) unclassified for memory."""
        d = (record.conversation_id, record.from_initiator)
        if record.seq <= self._acked.get(d, -1) or record.message_id in self._held:
            return False
        if d in self._unclassified:
            return False
        if not self._fits(record):
            self._unclassified[d] = _Unclassified(offset, record)
            return False
        self._hold(d, record, route_problem)
        return True

    def _fits(self, record: InboundMessage) -> bool:
        if self._max_held_bytes is None:
            return True
        return self.held_bytes + held_size(record) <= self._max_held_bytes

    def _hold(self, d: Direction, record: InboundMessage, route_problem: str | None) -> None:
        self.held_bytes += held_size(record)
        self._held[record.message_id] = _Held(record, no_route=route_problem)
        self._by_dir.setdefault(d, {})[record.seq] = record.message_id
        if route_problem is None:
            self.scheduler.add(_pending(record))

    # -- reclassification after a memory limit ---------------------------------------------------
    @property
    def unclassified(self) -> int:
        """Dialog directions waiting for memory."""
        return len(self._unclassified)

    def replay_from(self) -> int | None:
        """Where to re-read the topic to re-register unclassified dialogs, or None: nothing is
        waiting, or memory has not come back (under half the budget) yet."""
        if not self._unclassified:
            return None
        if self._max_held_bytes is not None and self.held_bytes * 2 > self._max_held_bytes:
            return None
        return min(u.offset for u in self._unclassified.values())

    def reregister(
        self, records: Iterable[tuple[int, InboundMessage]], route_problem: RouteOf
    ) -> int:
        """Re-read records (offset order, from `replay_from` up to what `add` has seen): give each
        unclassified direction back its records in order while they fit. A direction that fits
        to the end is classified again; one that does not keeps its new first offset."""
        waiting = self._unclassified
        self._unclassified = {}
        stopped: dict[Direction, _Unclassified] = {}
        held = 0
        try:
            for offset, record in records:
                d = (record.conversation_id, record.from_initiator)
                u = waiting.get(d)
                if u is None or offset < u.offset or d in stopped:
                    continue
                if record.seq <= self._acked.get(d, -1) or record.message_id in self._held:
                    continue
                if not self._fits(record):
                    stopped[d] = _Unclassified(offset, record)
                    continue
                self._hold(d, record, route_problem(record))
                held += 1
        except BaseException:
            # A read that broke off: every direction still waits (what was held is skipped
            # as known on the next pass), so nothing is lost.
            self._unclassified = {**waiting, **stopped}
            raise
        self._unclassified = stopped
        return held

    def ack(self, ack: AckRecord) -> int:
        """Forget every message the ack covers; returns how many left the queue."""
        d = (ack.conversation_id, ack.from_initiator)
        if ack.ack_seq <= self._acked.get(d, -1):
            return 0
        self._acked[d] = ack.ack_seq
        retx = self._retx.get(d)
        if retx is not None:
            retx.acked(ack.ack_seq)
        seqs = self._by_dir.get(d, {})
        done = [s for s in seqs if s <= ack.ack_seq]
        for s in done:
            mid = seqs.pop(s)
            gone = self._held.pop(mid, None)
            if gone is not None:
                self.held_bytes -= held_size(gone.record)
            self.scheduler.remove(mid)

        if not seqs:
            self._by_dir.pop(d, None)
            if retx is not None and retx.unacked == 0:
                del self._retx[d]
        return len(done)

    # -- output -------------------------------------------------------------------------------
    def take(self, now_ms: int, destinations: Container[str], n: int) -> list[InboundMessage]:
        """Up to n messages for connected destinations, in schedule order, marked as sent."""
        out: list[InboundMessage] = []
        self.last_take = {}
        while len(out) < n:
            s = self.scheduler.next(now_ms, destinations)
            if s is None:
                break
            self.last_take[s.pending.message_id] = (s.effective_level, s.starvation_exception)
            held = self._held[s.pending.message_id]
            if not held.sent_once:
                held.sent_once = True
                d = (held.record.conversation_id, held.record.from_initiator)
                self._retx.setdefault(d, Retransmitter(self._backoff)).sent(held.record.seq, now_ms)
            out.append(held.record)
        return out

    def retransmit_due(self, now_ms: int) -> int:
        """Queue again what has waited past its backoff without an ack; returns how many."""
        again = 0
        for d, retx in self._retx.items():
            for seq in retx.due(now_ms):
                mid = self._by_dir.get(d, {}).get(seq)
                if mid is not None and self._requeue(mid):
                    again += 1
        return again

    def requeue_destination(self, destination: str) -> int:
        """A (re)connected destination: queue again everything it has not acknowledged."""
        return sum(
            self._requeue(mid)
            for mid, h in list(self._held.items())
            if h.record.to_instance == destination and h.sent_once
        )

    def _requeue(self, mid: str) -> bool:
        held = self._held[mid]
        if held.no_route is not None or mid in self.scheduler:
            return False
        self.scheduler.add(_pending(held.record))
        return True

    # -- reclassification ---------------------------------------------------------------------
    def reclassify(self, route_problem: RouteOf, honor_broker_priority: bool) -> None:
        """Re-resolve every message's route and the HONOR setting (after a catalog change).

        Messages keep their place: the scheduler is rebuilt in the original enqueue order, so a
        conversation's order never changes, and what was in flight stays in flight.
        """
        waiting = {mid for mid in self._held if mid in self.scheduler}
        if honor_broker_priority != self._honor:
            self._honor = honor_broker_priority
            self.scheduler = TransmissionScheduler(
                honor_broker_priority, max_wait_ms=self._max_wait_ms
            )
        for mid, held in sorted(self._held.items(), key=lambda kv: _order(kv[1].record)):
            held.no_route = route_problem(held.record)
            if held.no_route is not None:
                self.scheduler.remove(mid)
            elif (mid in waiting or not held.sent_once) and mid not in self.scheduler:
                self.scheduler.add(_pending(held.record))

    # -- views --------------------------------------------------------------------------------
    def depth_by_priority(self) -> dict[int, int]:
        """Unacknowledged messages per assigned level (the transmission queue depth metric)."""
        depth: dict[int, int] = {}
        for h in self._held.values():
            depth[h.record.priority] = depth.get(h.record.priority, 0) + 1
        return depth

    def destinations(self) -> set[str]:
        """Every destination with an unacknowledged message, waiting or not."""
        return {h.record.to_instance for h in self._held.values()}

    def pending_destinations(self) -> set[str]:
        return {h.record.to_instance for mid, h in self._held.items() if mid in self.scheduler}

    def rows(
        self, now_ms: int, failures: dict[str, str], limit: int = 1000
    ) -> list[dict[str, Any]]:
        """Like sys.transmission_queue: one row per unacknowledged message, next to go first."""
        effective = {r.message_id: r.effective_level for r in self.scheduler.waiting(now_ms)}
        rows = [
            _row(u.first, now_ms, "WAITING_FOR_MEMORY", WAITING_FOR_MEMORY, None)
            for u in self._unclassified.values()
        ]
        for mid, h in sorted(
            self._held.items(),
            key=lambda kv: (-kv[1].record.priority, _order(kv[1].record)),
        )[:limit]:
            r = h.record
            if h.no_route is not None:
                status = _held_status(h.no_route)
            elif mid in effective:
                status = "RETRY" if h.sent_once else "PENDING"
            else:
                status = "SENT"
            reason = h.no_route or failures.get(r.to_instance)
            rows.append(_row(r, now_ms, status, reason, effective.get(mid)))
        return rows


def _row(
    r: InboundMessage, now_ms: int, status: str, reason: str | None, effective: int | None
) -> dict[str, Any]:
    return {
        "message_id": r.message_id,
        "conversation_id": r.conversation_id,
        "from_initiator": r.from_initiator,
        "seq": r.seq,
        "to_service": r.to_service,
        "to_instance": r.to_instance,
        "message_type": r.message_type,
        "priority": r.priority,
        "effective_priority": effective,
        "status": status,
        "waited_ms": now_ms - r.enqueued_ms,
        "last_failure": reason,
    }


def _held_status(reason: str) -> str:
    if reason.startswith(ROUTE_EXPIRED):
        return "ROUTE_EXPIRED"
    if reason.startswith(QUEUE_DISABLED):
        return "QUEUE_DISABLED"
    return "NO_ROUTE"


def _order(r: InboundMessage) -> tuple[int, str, bool, int]:
    return (r.enqueued_ms, r.conversation_id, r.from_initiator, r.seq)


def _pending(r: InboundMessage) -> Pending:
    # One scheduler "conversation" per direction, so each direction keeps its own send order.
    return Pending(
        message_id=r.message_id,
        conversation_id=f"{r.conversation_id}/{'i' if r.from_initiator else 't'}",
        seq=r.seq,
        level=r.priority,
        destination=r.to_instance,
        enqueued_ms=r.enqueued_ms,
    )
