"""The transport service: one connection per destination broker instance, fed by the transmitter.

The loop: read the ``outbound`` topic (packets the transmitter picked, in order, each with its
destination, address and next-hop topic in headers), open a connection to a destination that
has packets and is not suppressed, send each packet (fragmented when large,
`ksb.wire.fragments.wire_records`) to the next hop's ``inbound``, relay acks from far clusters onto
ours (`ksb.transmission.ack_relay`), and report every connection change on ``links``
(`ksb.transmission.links.LinkEvent`), which is how the transmitter learns what is suppressed and what
came back. Packets for a suppressed destination, and packets older than `packet_ttl_ms`, are
dropped: the transmission queue still holds them and sends them again, so nothing is lost.

How far ``outbound`` was read is committed under ``Names.transport_group``, so a restarted
transport goes on where it stopped instead of resending everything.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from ksb.audit import Audit, KafkaAudit
from ksb.catalog.model import CatalogView
from ksb.clock import Clock
from ksb.errors import ProtocolError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.metrics import CONNECTIONS, SUPPRESSED_DESTINATIONS
from ksb.runtime.redis_client import redis_client
from ksb.runtime.redis_view import RedisView
from ksb.runtime.service import Service, TickTask
from ksb.settings import TransportSettings
from ksb.transmission.ack_relay import AckRelay
from ksb.transmission.links import Links, Packet, bootstrap_of, route_for
from ksb.wire.audit import AuditEvent, AuditKind
from ksb.wire.fragments import wire_records
from ksb.wire.links import LinkEvent, encode_link_event
from ksb.wire.protocol import InboundMessage, parse_record

__all__ = ["Transport"]

log = logging.getLogger("ksb.transmission.links")


@dataclass
class _Connection:
    address: str
    """Bootstrap servers of the cluster the destination (or its forwarder) is on."""
    producer: Producer
    topic: str
    """The next hop's ``inbound`` topic: the destination's own, or a forwarder's."""


class Transport(Service):
    """Connections of `settings.instance` to other broker instances, run in the service shell."""

    name = "transport"

    def __init__(self, settings: TransportSettings, *, clock: Clock | None = None) -> None:
        super().__init__(settings, clock)
        self.settings: TransportSettings = settings
        self.links = Links(
            suppress_after_disconnect_ms=settings.suppress_after_disconnect_ms,
            suppress_after_failed_connect_ms=settings.suppress_after_failed_connect_ms,
            idle_connection_ms=settings.idle_connection_ms,
        )
        self.relay = AckRelay(settings, batch=settings.batch, clock=self.clock)
        self.sent = 0
        self.dropped = 0
        self.audit = Audit()
        self._conns: dict[str, _Connection] = {}
        self._delivery_errors: list[tuple[str, str]] = []
        self._local: Producer | None = None
        self._outbound: Consumer | None = None
        self._redis: redis.Redis | None = None
        self._view: RedisView | None = None

    def open(self) -> None:
        s = self.settings
        kafka.ensure_topics(kafka.admin(s), kafka.core_topics(self.names, s))
        self.shell.read_catalog()
        self._local = kafka.producer(s)
        self.audit = Audit(KafkaAudit(kafka.producer(s), self.names))
        self._outbound = self._outbound_consumer()
        self._redis = redis_client(s)
        self._view = RedisView("connections", self._redis, self.handlers, s.view_every_ms)
        restored = _load_suppression(self._redis, self.names)
        self.links.restore_suppression(restored, self.clock.now_ms())

    def tick_tasks(self) -> Iterable[TickTask]:
        s = self.settings
        return (
            TickTask(1, "commit", lambda _t: self._commit_position()),
            TickTask(s.reroute_every_ticks, "close_rerouted", lambda _t: self._close_rerouted()),
            TickTask(s.idle_check_every_ticks, "close_idle", lambda _t: self._close_idle()),
        )

    def on_catalog(self, view: CatalogView) -> None:
        self._close_rerouted()

    def step(self) -> None:
        assert self._outbound is not None and self._local is not None and self._view is not None
        self._carry(kafka.consume_batch(self._outbound, self.settings.batch, 0.02))
        now = self.clock.now_ms()
        self._delivery_reports(now)
        if self.relay.pump(self._local):
            self._local.poll(0)
        self._publish_view(self._view, now)

    def close(self) -> None:
        log.info("transport: %d sent, %d dropped", self.sent, self.dropped)
        if self._outbound is not None:
            self._commit_position()
            self._outbound.close()
        self.relay.close()
        for conn in self._conns.values():
            conn.producer.flush(2)
        if self._local is not None:
            self._local.flush(2)
        self.audit.flush(2)
        # Drop the clients now: librdkafka keeps reconnecting for as long as one is alive.
        self._conns.clear()
        self._local = None
        if self._redis is not None:
            self._redis.close()

    def _commit_position(self) -> None:
        if self._outbound is not None:
            _commit(self._outbound)

    def _outbound_consumer(self) -> Consumer:
        """Assigned, not subscribed (one reader, no group join delay); starts where it stopped."""
        c = kafka.consumer(self.settings, group=self.names.transport_group)
        committed = _committed(c, TopicPartition(self.names.outbound, 0))
        c.assign(
            [
                TopicPartition(
                    self.names.outbound, 0, committed if committed >= 0 else OFFSET_BEGINNING
                )
            ]
        )
        return c

    # ----------------------------------------------------------------- packets
    def _carry(self, batch: list[Message]) -> None:
        now = self.clock.now_ms()
        for m in batch:
            if m.error() is not None or m.value() is None:
                kafka.log_consumer_error(m, log)
                continue
            packet = Packet.from_headers(m.headers())
            if packet is None:
                log.warning("outbound record at %s has no packet headers: skipped", m.offset())
                continue
            if now - packet.taken_ms > self.settings.packet_ttl_ms:
                self.dropped += 1
                continue
            conn = self._connection(packet, now)
            if conn is None:
                self.dropped += 1
                continue
            self._send(conn, packet, m, now)

    def _send(self, conn: _Connection, packet: Packet, m: Message, now: int) -> None:
        raw = m.value() or b""
        try:
            record = parse_record(InboundMessage, raw, "outbound record")
        except ProtocolError as exc:
            log.warning("unreadable outbound record at %s: %s", m.offset(), exc)
            return
        for value in wire_records(record, self.settings.fragment_bytes, whole=raw):
            conn.producer.produce(
                conn.topic,
                key=m.key(),
                value=value,
                on_delivery=self._delivered(packet.destination),
            )
        self.sent += 1
        self.links.on_activity(packet.destination, now, sent=1)

    def _delivered(self, dest: str) -> Any:
        def report(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                self._delivery_errors.append((dest, f"delivery to {dest} failed: {err.str()}"))

        return report

    def _delivery_reports(self, now: int) -> None:
        for conn in self._conns.values():
            conn.producer.poll(0)
        errors, self._delivery_errors = self._delivery_errors, []
        for dest, reason in errors:
            if dest not in self._conns:
                continue
            log.warning("connection to %s broke: %s", dest, reason)
            self._drop(dest)
            self._publish(self.links.on_disconnect(dest, reason, now))

    # ----------------------------------------------------------------- connections
    def _connection(self, packet: Packet, now: int) -> _Connection | None:
        """The open connection for the packet's destination, opened now if it may be."""
        address = bootstrap_of(packet.address, self.settings.kafka_bootstrap)
        conn = self._conns.get(packet.destination)
        if conn is not None and (conn.address, conn.topic) == (address, packet.topic):
            return conn
        if conn is not None:
            log.info("route to %s changed: closing its connection", packet.destination)
            self._close(packet.destination, now)
        if self.links.is_suppressed(packet.destination, now):
            return None
        return self._connect(packet.destination, address, packet.topic, now)

    def _connect(self, dest: str, address: str, topic: str, now: int) -> _Connection | None:
        connect_timeout_s = self.settings.connect_timeout_ms / 1000
        p = kafka.remote_producer(
            self.settings,
            address,
            delivery_timeout_ms=self.settings.delivery_timeout_ms,
            connect_timeout_s=connect_timeout_s,
        )
        try:
            _handshake(p, topic, address, connect_timeout_s)
            self.relay.watch(address, self.settings.instance, connect_timeout_s)
        except (KafkaException, _ConnectFailed, TimeoutError) as exc:
            now = self.clock.now_ms()  # the back-off counts from the failure, not the attempt
            reason = f"connect to {dest} at {address} failed: {exc}"
            log.warning("%s", reason)
            self._publish(self.links.on_failed_connect(dest, address, reason, now))
            self._audit("suppression", now, service=dest, reason=reason)
            return None
        now = self.clock.now_ms()
        conn = _Connection(address, p, topic)
        self._conns[dest] = conn
        self._publish(self.links.on_connected(dest, address, now))
        log.info("connected to %s at %s", dest, address)
        return conn

    def _drop(self, dest: str) -> None:
        conn = self._conns.pop(dest, None)
        if conn is None:
            return
        conn.producer.flush(0)
        if not any(c.address == conn.address for c in self._conns.values()):
            self.relay.unwatch(conn.address)

    def _close(self, dest: str, now: int) -> None:
        self._drop(dest)
        self._publish(self.links.close(dest, now))

    def _close_rerouted(self) -> None:
        """A route that changed or expired stops use of its path now, not when it idles out;
        packets already picked for the old path are still carried (they name it)."""
        now = self.clock.now_ms()
        for dest, conn in list(self._conns.items()):
            route = route_for(self.catalog, dest, now, instance=self.settings.instance)
            own = self.settings.kafka_bootstrap
            if route is None or (
                bootstrap_of(route.address, own),
                Names(route.next_hop).inbound_from(self.settings.instance),
            ) != (
                conn.address,
                conn.topic,
            ):
                log.info("route to %s changed or expired: closing its connection", dest)
                self._close(dest, now)

    def _close_idle(self) -> None:
        now = self.clock.now_ms()
        for dest in self.links.idle(now):
            log.info("closing idle connection to %s", dest)
            self._close(dest, now)

    def _publish(self, event: LinkEvent | None) -> None:
        """Tell the transmitter (``links``); the record goes out with the next poll."""
        if event is None or self._local is None:
            return
        self._local.produce(
            self.names.links, key=event.destination.encode(), value=encode_link_event(event)
        )
        self._local.poll(0)

    def _audit(self, kind: AuditKind, now: int, **fields: Any) -> None:
        self.audit.emit(
            [AuditEvent(kind=kind, event_ms=now, instance=self.settings.instance, **fields)]
        )

    # ----------------------------------------------------------------- views
    def _publish_view(self, view: RedisView, now: int) -> None:
        if not view.due(now):
            return
        suppressed = self.links.suppressed(now)
        CONNECTIONS.labels("transport").set(len(self._conns))
        SUPPRESSED_DESTINATIONS.labels("transport").set(len(suppressed))
        snapshot = json.dumps({"updated_ms": now, "connections": self.links.rows(now)})
        key, zkey = self.names.connections_view_key, self.names.suppress_key

        def writes(pipe: redis.client.Pipeline) -> None:
            pipe.set(key, snapshot)
            pipe.delete(zkey)
            if suppressed:
                pipe.zadd(zkey, dict(suppressed))

        view.offer(writes)


class _ConnectFailed(Exception):
    pass


def _handshake(p: Producer, topic: str, address: str, timeout_s: float) -> None:
    """The next hop's inbound topic is there: the address is a cluster hosting that instance."""
    md = p.list_topics(topic, timeout=timeout_s)
    tmd = md.topics.get(topic)
    if tmd is None or tmd.error is not None or not tmd.partitions:
        raise _ConnectFailed(f"no topic {topic!r} at {address}")


_COORDINATOR_NOT_READY = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError._TIMED_OUT,
    }
)


def _committed(c: Consumer, tp: TopicPartition, timeout_s: float = 60) -> int:
    """The committed offset (negative: none), waiting out a group coordinator that is still
    loading on a freshly started Kafka (NOT_COORDINATOR, COORDINATOR_LOAD_IN_PROGRESS)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return int(c.committed([tp], timeout=10)[0].offset)
        except KafkaException as exc:
            err = exc.args[0]
            if not (err.retriable() or err.code() in _COORDINATOR_NOT_READY):
                raise
            if time.monotonic() > deadline:
                raise
            log.info("outbound position not readable yet (%s): retrying", exc.args[0].str())
            time.sleep(0.2)


def _commit(c: Consumer) -> None:
    try:
        c.commit(asynchronous=True)
    except KafkaException as exc:  # nothing consumed yet, or a passing error: next tick again
        if exc.args[0].code() != KafkaError._NO_OFFSET:
            log.warning("could not commit the outbound position: %s", exc)


def _load_suppression(r: redis.Redis, names: Names) -> dict[str, int]:
    try:
        raw: list[tuple[bytes, float]] = r.zrange(names.suppress_key, 0, -1, withscores=True)  # type: ignore[assignment]
    except redis.RedisError:
        return {}
    return {k.decode(): int(v) for k, v in raw}
