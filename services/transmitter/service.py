"""The transmitter of one broker instance: the transmission queue and who gets what next.

The loop: fold the ``transmission`` topic (what our dispatcher wrote, read_committed) and our own
cluster's ``acks`` topic into the transmission queue, resolve each destination's route (which
address and next hop carry it), pick what goes next by priority for destinations that are not
suppressed, and hand it to the transport as a packet on the ``outbound`` topic
(`ksb.transmission.links.Packet` headers). The transport answers on ``links``
(`ksb.transmission.links.LinkEvent`): a failed or broken connection suppresses its destination here too,
and a destination that connects again (or whose suppression ran out) gets everything it has not
acknowledged queued again at once. What is not acknowledged in time is queued again on its
back-off. State is in memory and rebuilt from the topics on start (all read from the
beginning), which is exact because acks are cumulative; the receivers drop whatever is sent twice.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import redis
from confluent_kafka import Consumer, Producer, TopicPartition

from ksb.audit import Audit, KafkaAudit
from ksb.backoff import Backoff
from ksb.catalog.model import CatalogView, Route
from ksb.clock import Clock
from ksb.errors import ProtocolError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.metrics import TRANSMISSION_DEPTH
from ksb.runtime.redis_client import redis_client
from ksb.runtime.redis_view import RedisView
from ksb.runtime.service import Service, TickTask
from ksb.settings import TransmitterSettings
from ksb.transmission.links import Packet, Peers, delivery_problem, route_for
from ksb.transmission.queue import TransmissionQueue
from ksb.wire.audit import AuditEvent, AuditKind
from ksb.wire.links import parse_link_event
from ksb.wire.protocol import AckRecord, InboundMessage, dumps, parse_record

__all__ = ["Transmitter"]

log = logging.getLogger("ksb.transmitter")


class Transmitter(Service):
    """The transmission queue of `settings.instance`, run in the service shell."""

    name = "transmitter"

    def __init__(self, settings: TransmitterSettings, *, clock: Clock | None = None) -> None:
        super().__init__(settings, clock)
        self.settings: TransmitterSettings = settings
        self.peers = Peers()
        self.queue = TransmissionQueue(
            max_wait_ms=settings.max_wait_ms,
            backoff=Backoff(initial_ms=settings.retry_initial_ms, max_ms=settings.retry_max_ms),
            max_held_bytes=settings.transmitter_memory_bytes,
        )
        self._tx_position = 0  # next offset of `transmission` the main consumer will read
        self.audit = Audit()
        """Audit events (transmit, acknowledge, suppression) for the Spark audit; never fatal."""
        self._outbound: Producer | None = None
        self._tx: Consumer | None = None
        self._acks: Consumer | None = None
        self._links: Consumer | None = None
        self._redis: redis.Redis | None = None
        self._view: RedisView | None = None

    def open(self) -> None:
        s = self.settings
        kafka.ensure_topics(kafka.admin(s), kafka.core_topics(self.names, s))
        self._self_check()
        self.shell.read_catalog()
        self._tx = kafka.consumer(s)
        self._tx.assign([TopicPartition(self.names.transmission, 0, -2)])
        self._acks = kafka.consumer(s)
        self._acks.assign([TopicPartition(self.names.acks, 0, -2)])
        self._links = kafka.consumer(s, read_committed=False)
        self._links.assign([TopicPartition(self.names.links, 0, -2)])
        self._outbound = kafka.producer(s)
        self.audit = Audit(KafkaAudit(kafka.producer(s), self.names))
        self._redis = redis_client(s)
        # The view goes to Redis from a task handler: a slow Redis must not stall transmission.
        self._view = RedisView("transmission", self._redis, self.handlers, s.view_every_ms)

    def tick_tasks(self) -> Iterable[TickTask]:
        s = self.settings
        return (
            TickTask(s.reclassify_every_ticks, "reclassify", lambda _t: self._reclassify()),
            TickTask(s.reclassify_every_ticks, "reregister", lambda _t: self._reregister()),
            TickTask(s.reclassify_every_ticks, "trim_caches", lambda _t: self._trim_caches()),
            TickTask(
                s.acked_cleanup_every_ticks, "cleanup_acked", lambda _t: self._cleanup_acked()
            ),
        )

    def on_catalog(self, view: CatalogView) -> None:
        self._reclassify()

    def step(self) -> None:
        assert self._tx is not None and self._acks is not None and self._links is not None
        assert self._view is not None
        got = self._poll_transmission(self._tx)
        self._poll_acks(self._acks, 0 if got else 0.02)
        self._poll_links(self._links)
        now = self.clock.now_ms()
        self.queue.retransmit_due(now)
        self._send(now)
        self._publish_view(self._view, now)

    def close(self) -> None:
        for c in (self._tx, self._acks, self._links):
            if c is not None:
                c.close()
        if self._outbound is not None:
            self._outbound.flush(2)
            self._outbound = None
        self.audit.flush(2)
        if self._redis is not None:
            self._redis.close()

    def _cleanup_acked(self) -> None:
        if self._acks is not None:
            self._poll_acks(self._acks, 0)

    def _self_check(self) -> None:
        """Fail fast on a transmission topic that is missing (a mistyped instance)."""
        md = kafka.admin(self.settings).list_topics(timeout=10).topics
        if self.names.transmission not in md:
            raise RuntimeError(f"topic {self.names.transmission} does not exist")

    # ----------------------------------------------------------------- input
    def _poll_transmission(self, c: Consumer) -> int:
        n = 0
        for m in c.consume(self.settings.batch, 0.02):
            if m.error() is not None or m.value() is None:
                kafka.log_consumer_error(m, log)
                continue
            try:
                record = parse_record(InboundMessage, m.value(), "transmission record")
            except ProtocolError as exc:
                log.warning("unreadable transmission record at %s: %s", m.offset(), exc)
                continue
            offset = m.offset() or 0
            self.queue.add(record, self._route_problem(record), offset=offset)
            self._tx_position = offset + 1
            n += 1
        return n

    def _reregister(self) -> None:
        """Dialogs set aside at the memory limit get their records back once memory frees up:
        re-read `transmission` from the earliest one up to where the main consumer is."""
        start = self.queue.replay_from()
        if start is None or start >= self._tx_position:
            return
        c = kafka.consumer(self.settings)
        try:
            c.assign([TopicPartition(self.names.transmission, 0, start)])
            held = self.queue.reregister(_records_until(c, self._tx_position), self._route_problem)
        finally:
            c.close()
        log.info(
            "re-registered %d message(s) of dialogs set aside for memory; %d direction(s) still wait",
            held,
            self.queue.unclassified,
        )

    def _trim_caches(self) -> None:
        """Forget failure reasons of destinations that have nothing left to send."""
        self.peers.forget(self.queue.destinations())

    def _poll_acks(self, c: Consumer, timeout_s: float) -> None:
        for m in c.consume(self.settings.batch, timeout_s):
            if m.error() is not None or m.value() is None:
                kafka.log_consumer_error(m, log)
                continue
            try:
                ack = parse_record(AckRecord, m.value(), "ack record")
            except ProtocolError:
                continue
            if self.queue.ack(ack):
                self._audit(
                    "acknowledge",
                    self.clock.now_ms(),
                    conversation_id=ack.conversation_id,
                    service=ack.from_instance,
                )

    def _poll_links(self, c: Consumer) -> None:
        """The transport's connection changes: suppression, and destinations that came back."""
        for m in c.consume(self.settings.batch, 0):
            if m.error() is not None or m.value() is None:
                kafka.log_consumer_error(m, log)
                continue
            try:
                self.peers.apply(parse_link_event(m.value()))
            except ProtocolError as exc:
                log.warning("unreadable links record at %s: %s", m.offset(), exc)
        for dest in self.peers.reopened(self.clock.now_ms()):
            again = self.queue.requeue_destination(dest)
            if again:
                log.info("%s is reachable again: %d unacknowledged queued again", dest, again)

    # ----------------------------------------------------------------- routes
    def _route_problem(self, record: InboundMessage) -> str | None:
        return delivery_problem(
            self.catalog,
            record.to_service,
            record.to_instance,
            self.settings.instance,
            self.clock.now_ms(),
        )

    def _route(self, destination: str) -> Route | None:
        return route_for(
            self.catalog, destination, self.clock.now_ms(), instance=self.settings.instance
        )

    def _packet(self, destination: str, now: int) -> Packet | None:
        """Where the transport carries messages for `destination` now (None: no usable route)."""
        route = self._route(destination)
        if route is None:
            return None
        inbound = Names(route.next_hop).inbound_from(self.settings.instance)
        return Packet(destination, route.address, inbound, now)

    def _reclassify(self) -> None:
        """Catalog or route change: re-resolve every message's route (the transport follows the
        address each packet names, so a changed route moves the connection with it)."""
        self.queue.reclassify(self._route_problem, self.catalog.catalog.honor_broker_priority)

    # ----------------------------------------------------------------- hand-off
    def _send(self, now: int) -> None:
        """Hand the scheduler's picks for reachable destinations to the transport, in order."""
        p = self._outbound
        assert p is not None
        p.poll(0)
        packets: dict[str, Packet | None] = {}  # one route lookup per destination and batch
        for record in self.queue.take(now, self.peers.reachable(now), self.settings.batch):
            dest = record.to_instance
            if dest not in packets:
                packets[dest] = self._packet(dest, now)
            packet = packets[dest]
            if packet is None:  # expired this very moment: its retransmission will find it held
                continue
            p.produce(
                self.names.outbound,
                key=record.key.encode(),  # the receiving group: its shard at the other end
                value=dumps(record),
                headers=packet.headers(),
            )
            level, starved = self.queue.last_take.get(record.message_id, (record.priority, False))
            self._audit(
                "transmit",
                now,
                service=record.to_service,
                conversation_id=record.conversation_id,
                message_id=record.message_id,
                priority=level,
                enqueued_ms=record.enqueued_ms,
                time_in_queue_ms=max(0, now - record.enqueued_ms),
                starvation_exception=starved,
            )

    def _audit(self, kind: AuditKind, now: int, **fields: Any) -> None:
        self.audit.emit(
            [AuditEvent(kind=kind, event_ms=now, instance=self.settings.instance, **fields)]
        )

    # ----------------------------------------------------------------- views
    def _publish_view(self, view: RedisView, now: int) -> None:
        if not view.due(now):
            return
        snapshot = json.dumps(
            {"updated_ms": now, "messages": self.queue.rows(now, self.peers.failures())}
        )
        depth = self.queue.depth_by_priority()
        for level in range(1, 11):
            TRANSMISSION_DEPTH.labels(str(level)).set(depth.get(level, 0))
        view.offer_value(self.names.transmission_view_key, snapshot)


def _records_until(
    c: Consumer, end: int, timeout_s: float = 30
) -> Iterator[tuple[int, InboundMessage]]:
    """(offset, record) from the consumer's position up to `end` (exclusive), readable ones only."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for m in c.consume(500, 0.2):
            if m.error() is not None or m.value() is None:
                continue
            offset = m.offset() or 0
            if offset >= end:
                return
            record = _parse(m.value() or b"")
            if record is not None:
                yield offset, record
            if offset + 1 >= end:
                return
    raise TimeoutError(f"could not re-read the transmission topic up to offset {end}")


def _parse(raw: bytes) -> InboundMessage | None:
    try:
        return parse_record(InboundMessage, raw, "transmission record")
    except ProtocolError:
        return None
