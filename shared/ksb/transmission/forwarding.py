"""The forwarder's pure state: messages passing through this instance on their way elsewhere.

An ``inbound`` record whose ``to_instance`` is another broker instance reached us because the
sender's route names us as its next hop (``Route.via``). The forwarder looks up our own route for
the record's service and broker instance and copies the record, unchanged, to the next hop's
``inbound`` topic. What it holds lives in memory only: a record it could not pass on within
`Intervals.forwarder_stale_ms` (60 s) is dropped, and so is everything it held when it stops. Nothing
is lost by that, because only the final receiver acknowledges and the origin retransmits whatever
stays unacknowledged.

Forwarding ignores priority levels: every forwarded message goes at level 5 (first in, first out),
whatever the sender's level, as Service Broker's forwarder does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ksb.catalog.model import CatalogView, Route
from ksb.transmission.links import route_problem
from ksb.wire.protocol import InboundMessage

__all__ = ["FORWARDING_PRIORITY", "ForwardQueue", "next_hop"]

FORWARDING_PRIORITY = 5
"""The one level every forwarded message travels at."""


def next_hop(view: CatalogView, record: InboundMessage, instance: str, now_ms: int) -> Route | str:
    """Our route onwards for `record`, or why there is none (no route, expired, a loop)."""
    problem = route_problem(view, record.to_service, record.to_instance, now_ms)
    if problem is not None:
        return problem
    route = view.routes[record.to_service]
    if route.next_hop == instance:
        return f"route {route.name!r} sends {record.to_service!r} back to this instance (a loop)"
    return route


@dataclass
class _Held:
    record: InboundMessage
    received_ms: int
    in_flight: bool = False
    problem: str | None = None


class ForwardQueue:
    """Records waiting to be forwarded, in arrival order; the caller produces and reports back."""

    def __init__(self) -> None:
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self.forwarded = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._held)

    def add(self, record: InboundMessage, now_ms: int) -> bool:
        """A record to pass on; False if the same message is already held (a retransmission)."""
        if record.message_id in self._held:
            return False
        self._held[record.message_id] = _Held(record, now_ms)
        return True

    def take(self, n: int) -> list[InboundMessage]:
        """Up to n records not in flight, oldest first, now marked in flight."""
        out: list[InboundMessage] = []
        for held in self._held.values():
            if len(out) >= n:
                break
            if not held.in_flight:
                held.in_flight = True
                out.append(held.record)
        return out

    def delivered(self, message_id: str) -> None:
        if self._held.pop(message_id, None) is not None:
            self.forwarded += 1

    def failed(self, message_id: str, reason: str) -> None:
        """Not passed on (no route, or the next hop refused it): try again until it goes stale."""
        held = self._held.get(message_id)
        if held is not None:
            held.in_flight = False
            held.problem = reason

    def drop_stale(self, now_ms: int, stale_ms: int) -> int:
        """Forget what waited `stale_ms` without being forwarded; the origin sends it again."""
        stale = [
            mid
            for mid, h in self._held.items()
            if not h.in_flight and now_ms - h.received_ms >= stale_ms
        ]
        for mid in stale:
            del self._held[mid]
        self.dropped += len(stale)
        return len(stale)

    def rows(self, now_ms: int) -> list[dict[str, Any]]:
        """One row per held message, for the forwarder's view."""
        return [
            {
                "message_id": mid,
                "conversation_id": h.record.conversation_id,
                "seq": h.record.seq,
                "to_service": h.record.to_service,
                "to_instance": h.record.to_instance,
                "priority": FORWARDING_PRIORITY,
                "status": "SENDING" if h.in_flight else "WAITING",
                "held_ms": now_ms - h.received_ms,
                "last_failure": h.problem,
            }
            for mid, h in self._held.items()
        ]
