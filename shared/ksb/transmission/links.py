"""The transport's pure bookkeeping: connections, suppression, and what the transmitter learns of them.

The transport is its own service (`services.transport`); the transmitter hands it packets over
the ``outbound`` topic and hears back over the ``links`` topic. On Kafka a *connection* to another
broker instance is:

- a producer to the next hop's ``inbound`` topic (the destination's own, or its route's ``via``
  forwarder's) on the cluster the route's address names (``LOCAL``: our own cluster);
- an ack channel: a consumer of our ``acks`` topic on that same cluster, where the far dispatcher
  acknowledges what it received, relayed onto our own cluster's ``acks`` topic
  (`ksb.transmission.ack_relay`), so the transmitter only ever reads its own cluster;
- a handshake: reading the next hop's ``inbound`` metadata (proof that the address is a Kafka
  cluster hosting that instance) and creating our ``acks`` topic there if it is missing.

Liveness comes from the producer's delivery reports: a failed delivery is a disconnect.

The rules are the seed's: a destination is not tried again for 15 s after a disconnect and for
60 s after every failed attempt (`ksb.transmission.suppression`), connections idle for 90 s are closed,
and attempts go only to destinations that have packets waiting. The transport keeps the
suppression deadlines in Redis (``Names.suppress_key``) so a restarted transport does not hammer a
dead peer; losing them only means retrying sooner.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any

from ksb.catalog.model import CatalogView, Route
from ksb.transmission.suppression import Suppression
from ksb.wire.links import LinkEvent, LinkEventKind

__all__ = [
    "LOCAL_ADDRESS",
    "QUEUE_DISABLED",
    "ROUTE_EXPIRED",
    "Headers",
    "Link",
    "LinkEvent",
    "Links",
    "Packet",
    "Peers",
    "bootstrap_of",
    "delivery_problem",
    "route_for",
    "route_problem",
]

LOCAL_ADDRESS = "LOCAL"
"""A route address meaning the cluster this instance runs on."""


def bootstrap_of(address: str, own_bootstrap: str) -> str:
    """The Kafka bootstrap list a route address names (``LOCAL``: our own cluster's)."""
    return own_bootstrap if address == LOCAL_ADDRESS else address


ROUTE_EXPIRED = "route expired"
"""How the reason for a message held behind an expired route begins (status ``ROUTE_EXPIRED``)."""


QUEUE_DISABLED = "target queue disabled"
"""How the reason for a local message held behind a disabled queue begins (status ``QUEUE_DISABLED``)."""


def delivery_problem(
    view: CatalogView, to_service: str, to_instance: str, instance: str, now_ms: int
) -> str | None:
    """Why a transmission record cannot be sent now (None: it can).

    A record for this very `instance` is a local message that the dispatcher held back because
    its target queue was disabled (or an earlier one of its conversation was held): it needs no
    route, only the queue enabled again. Anything else needs a usable route.
    """
    if to_instance != instance:
        return route_problem(view, to_service, to_instance, now_ms)
    service = view.services.get(to_service)
    if service is None:
        return f"service {to_service!r} is no longer hosted on this instance"
    queue = view.queues.get(service.queue)
    if queue is not None and queue.disabled:
        return (
            f"{QUEUE_DISABLED}: queue {queue.name!r} has STATUS = OFF; ALTER QUEUE ... STATUS = ON"
        )
    return None


def route_problem(view: CatalogView, to_service: str, to_instance: str, now_ms: int) -> str | None:
    """Why a message for `to_service` on `to_instance` cannot be sent now (None: it can).

    A route with a LIFETIME expires that long after its catalog version was applied and stays
    expired until a newer version that still declares it is applied (which restarts the count).
    """
    route = view.routes.get(to_service)
    if route is None:
        return f"no route to service {to_service!r}"
    if route.broker_instance != to_instance:
        return (
            f"the route to {to_service!r} names broker instance "
            f"{route.broker_instance!r}, the dialog is with {to_instance!r}"
        )
    expires = route.expires_ms(view.catalog.applied_ms)
    if expires is not None and now_ms >= expires:
        return (
            f"{ROUTE_EXPIRED}: route {route.name!r} (LIFETIME {route.lifetime_s} s) expired at "
            f"{expires}; apply a catalog that renews it"
        )
    return None


def route_for(
    view: CatalogView, destination: str, now_ms: int, *, instance: str | None = None
) -> Route | None:
    """A usable (unexpired) route to broker instance `destination`: its address and next hop.

    `instance` (ours) always has one, to our own cluster: held-back local messages go that way.
    """
    if destination == instance:
        return Route(name="(local)", service_name="*", broker_instance=instance)
    for route in view.routes.values():
        if route.broker_instance != destination:
            continue
        expires = route.expires_ms(view.catalog.applied_ms)
        if expires is None or now_ms < expires:
            return route
    return None


@dataclass
class Link:
    """One destination instance as the transport sees it (a row of sys.dm_broker_connections)."""

    destination: str
    address: str
    connected: bool = False
    connected_ms: int | None = None
    last_activity_ms: int = 0
    sent: int = 0
    failed_attempts: int = 0
    last_error: str | None = None


class Links:
    """Connection state per destination; the caller does the I/O and reports what happened."""

    def __init__(
        self,
        *,
        suppress_after_disconnect_ms: int,
        suppress_after_failed_connect_ms: int,
        idle_connection_ms: int,
    ) -> None:
        self.suppression = Suppression(
            after_disconnect_ms=suppress_after_disconnect_ms,
            after_failed_connect_ms=suppress_after_failed_connect_ms,
        )
        self.idle_connection_ms = idle_connection_ms
        self._links: dict[str, Link] = {}

    def link(self, destination: str) -> Link | None:
        return self._links.get(destination)

    def connected(self) -> set[str]:
        return {d for d, link in self._links.items() if link.connected}

    def on_connected(self, destination: str, address: str, now_ms: int) -> LinkEvent:
        link = self._links.setdefault(destination, Link(destination, address))
        link.address, link.connected, link.connected_ms = address, True, now_ms
        link.last_activity_ms = now_ms
        link.failed_attempts = 0
        link.last_error = None
        self.suppression.on_connected(destination)
        return LinkEvent(
            destination=destination, kind="connected", address=address, event_ms=now_ms
        )

    def on_failed_connect(
        self, destination: str, address: str, reason: str, now_ms: int
    ) -> LinkEvent:
        link = self._links.setdefault(destination, Link(destination, address))
        link.address, link.connected = address, False
        link.failed_attempts += 1
        link.last_error = reason
        self.suppression.on_failed_connect(destination, now_ms)
        return self._event(link, "failed", now_ms)

    def on_disconnect(self, destination: str, reason: str, now_ms: int) -> LinkEvent | None:
        """The connection broke (a delivery failed): drop it and back off before reconnecting."""
        link = self._links.get(destination)
        if link is None or not link.connected:
            return None
        link.connected = False
        link.last_error = reason
        self.suppression.on_disconnect(destination, now_ms)
        return self._event(link, "disconnected", now_ms)

    def is_suppressed(self, destination: str, now_ms: int) -> bool:
        return self.suppression.is_suppressed(destination, now_ms)

    def _event(self, link: Link, kind: LinkEventKind, now_ms: int) -> LinkEvent:
        return LinkEvent(
            destination=link.destination,
            kind=kind,
            address=link.address,
            event_ms=now_ms,
            suppressed_until_ms=self.suppression.suppressed_until(link.destination),
            reason=link.last_error,
        )

    def on_activity(self, destination: str, now_ms: int, sent: int = 0) -> None:
        link = self._links.get(destination)
        if link is not None:
            link.last_activity_ms = now_ms
            link.sent += sent

    def close(self, destination: str, now_ms: int) -> LinkEvent | None:
        """Closed on purpose (idle, or its route changed): no suppression, reopen on demand."""
        link = self._links.get(destination)
        if link is None or not link.connected:
            return None
        link.connected = False
        return self._event(link, "closed", now_ms)

    def idle(self, now_ms: int) -> list[str]:
        """Connected destinations idle for `idle_connection_ms`: they hold sockets and buffers
        for nothing, and the caller closes them."""
        return [
            d
            for d, link in self._links.items()
            if link.connected and now_ms - link.last_activity_ms >= self.idle_connection_ms
        ]

    def suppressed(self, now_ms: int) -> dict[str, int]:
        """Destinations suppressed now -> until when (ms), for Redis and the views."""
        return {d: u for d, u in self.suppression.deadlines().items() if u > now_ms}

    def restore_suppression(self, deadlines: dict[str, int], now_ms: int) -> None:
        for dest, until in deadlines.items():
            if until > now_ms:
                self.suppression.restore(dest, until)

    def rows(self, now_ms: int) -> list[dict[str, Any]]:
        """The connections view (like sys.dm_broker_connections)."""
        suppressed = self.suppressed(now_ms)
        return [
            {
                "destination": link.destination,
                "address": link.address,
                "state": "CONNECTED" if link.connected else "CLOSED",
                "connected_ms": link.connected_ms,
                "idle_ms": now_ms - link.last_activity_ms if link.connected else None,
                "sent": link.sent,
                "failed_attempts": link.failed_attempts,
                "suppressed_until_ms": suppressed.get(link.destination),
                "last_error": link.last_error,
            }
            for link in sorted(self._links.values(), key=lambda k: k.destination)
        ]


@dataclass(frozen=True)
class Packet:
    """Where the transmitter wants one message carried: the headers of an ``outbound`` record.

    The transmitter resolves the route (it owns the association of dialogs with destinations),
    so the transport needs no catalog: it follows the address and topic it is handed.
    """

    destination: str
    address: str
    topic: str
    taken_ms: int

    def headers(self) -> list[tuple[str, str | bytes | None]]:
        return [
            ("ksb-destination", self.destination),
            ("ksb-address", self.address),
            ("ksb-topic", self.topic),
            ("ksb-taken-ms", str(self.taken_ms)),
        ]

    @classmethod
    def from_headers(cls, headers: Headers | None) -> Packet | None:
        """None when a header is missing or unreadable (a record not written by a transmitter)."""
        got = dict(headers or {})
        try:
            return cls(
                destination=_text(got["ksb-destination"]),
                address=_text(got["ksb-address"]),
                topic=_text(got["ksb-topic"]),
                taken_ms=int(_text(got["ksb-taken-ms"])),
            )
        except (KeyError, ValueError):
            return None


Headers = dict[str, str | bytes | None] | list[tuple[str, str | bytes | None]]
"""Kafka record headers as confluent-kafka hands them over."""


def _text(value: str | bytes | None) -> str:
    if value is None:
        raise ValueError("empty header")
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class _NotSuppressed:
    until: dict[str, int]
    now_ms: int

    def __contains__(self, destination: object) -> bool:
        return isinstance(destination, str) and self.until.get(destination, 0) <= self.now_ms


class Peers:
    """The transmitter's picture of the transport's connections, folded from ``links`` events.

    It answers two questions: which destinations may be sent to now (not suppressed), and which
    just became reachable again, so that what they have not acknowledged is queued again at once
    instead of after its retransmission back-off.
    """

    def __init__(self) -> None:
        self._until: dict[str, int] = {}
        self._errors: dict[str, str] = {}
        self._reopened: list[str] = []

    def apply(self, event: LinkEvent) -> None:
        dest = event.destination
        if event.kind == "connected":
            self._until.pop(dest, None)
            self._errors.pop(dest, None)
            self._reopened.append(dest)
        elif event.kind in ("failed", "disconnected"):
            if event.suppressed_until_ms is not None:
                self._until[dest] = max(event.suppressed_until_ms, self._until.get(dest, 0))
            if event.reason:
                self._errors[dest] = event.reason

    def sendable(self, destinations: Iterable[str], now_ms: int) -> set[str]:
        reachable = self.reachable(now_ms)
        return {d for d in destinations if d in reachable}

    def reachable(self, now_ms: int) -> Container[str]:
        """Every destination not suppressed at `now_ms`, as a filter for the scheduler: asking it
        costs a dict lookup, where listing the destinations with messages costs a full scan."""
        return _NotSuppressed(dict(self._until), now_ms)

    def reopened(self, now_ms: int) -> list[str]:
        """Destinations connected again, or whose suppression ran out, since the last call."""
        for dest, until in list(self._until.items()):
            if until <= now_ms:
                del self._until[dest]
                self._reopened.append(dest)
        out, self._reopened = sorted(set(self._reopened)), []
        return out

    def failures(self) -> dict[str, str]:
        """The last error per destination that has not connected since: the view's last_failure."""
        return dict(self._errors)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop errors of destinations with nothing left to send (cache trimming)."""
        wanted = set(keep)
        for dest in list(self._errors):
            if dest not in wanted:
                del self._errors[dest]
