"""The transmitter and transport of one broker instance, as one process.

They run together because on Kafka the "transport" is only a producer per destination plus an ack
consumer per cluster: keeping both in one loop means the pure parts (`ksb.transmission_queue`,
`ksb.transport`) share one clock and one view without a hand-off protocol between processes. The
modules stay separate, so a split later only adds a topic between them.

The loop: fold the ``transmission`` topic (what our dispatcher wrote, read_committed) and the
``acks`` topics into the transmission queue, open connections to destinations with pending messages
that are not suppressed, send what the scheduler picks to the remote ``inbound`` topic, queue again
what was not acknowledged in time, and publish the views to Redis. State is in memory and rebuilt
from the two topics on start (both read from the beginning), which is exact because acks are
cumulative; the receivers drop whatever is sent twice.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from ksb import kafka
from ksb.audit import Audit, AuditEvent, AuditKind, KafkaAudit
from ksb.catalog import CatalogView, Route
from ksb.catalog_store import CatalogWatcher, load_catalog
from ksb.clock import Clock, SystemClock
from ksb.errors import KsbError
from ksb.fragments import wire_records
from ksb.metrics import (
    CONNECTIONS,
    HEALTHY,
    SUPPRESSED_DESTINATIONS,
    TRANSMISSION_DEPTH,
    serve_metrics,
)
from ksb.names import Names
from ksb.protocol import AckRecord, InboundMessage
from ksb.sequencing import Backoff
from ksb.settings import Settings
from ksb.task_handlers import TaskHandlers
from ksb.ticker import Intervals, Ticker
from ksb.transmission_queue import TransmissionQueue
from ksb.transport import LOCAL_ADDRESS, Links, delivery_problem, route_for

__all__ = ["Transmitter", "TransmitterOptions"]

log = logging.getLogger("ksb.transmitter")


@dataclass(frozen=True)
class TransmitterOptions:
    """Knobs beyond `Settings` and `Intervals`, with production defaults; tests shorten them."""

    batch: int = 500
    connect_timeout_s: float = 3.0
    delivery_timeout_ms: int = 5_000
    view_every_ms: int = 500
    max_wait_ms: int = 10_000
    task_handlers: int | None = None
    """Task handler threads (None: 2 x CPUs)."""
    backoff: Backoff = field(default_factory=lambda: Backoff(initial_ms=2_000, max_ms=60_000))


@dataclass
class _Connection:
    address: str
    producer: Producer
    topic: str
    """The next hop's ``inbound`` topic: the destination's own, or a forwarder's."""


class Transmitter:
    """Transmission queue + transport for `settings.instance`; `run(stop)` until stopped."""

    def __init__(
        self,
        settings: Settings,
        *,
        intervals: Intervals | None = None,
        options: TransmitterOptions | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings
        self.names = Names(settings.instance)
        self.intervals = intervals or Intervals(tick_ms=settings.tick_ms)
        self.options = options or TransmitterOptions()
        self.clock = clock or SystemClock()
        self.ready = threading.Event()
        self.links = Links(self.intervals)
        self.queue = TransmissionQueue(
            max_wait_ms=self.options.max_wait_ms,
            backoff=self.options.backoff,
            max_held_bytes=settings.transmitter_memory_bytes,
        )
        self._tx_position = 0  # next offset of `transmission` the main consumer will read
        self.catalog = CatalogView(load_catalog(settings))
        self._conns: dict[str, _Connection] = {}
        self._acks: dict[str, Consumer] = {}  # bootstrap servers -> consumer of our acks topic
        self._failures: dict[str, str] = {}  # destination -> last failure, for the view
        self._delivery_errors: list[tuple[str, str]] = []
        self._view_due_ms = 0
        # The view goes to Redis from a task handler: a slow Redis must not stall transmission.
        self.handlers = TaskHandlers("transmitter", self.options.task_handlers)
        self._view_lock = threading.Lock()
        self._view_latest: tuple[dict[str, Any], dict[str, int]] | None = None
        # Audit events (transmit, acknowledge, suppression) for the Spark audit; never fatal.
        self.audit = Audit(KafkaAudit(kafka.producer(settings), self.names))

    # ----------------------------------------------------------------- the loop
    def run(self, stop: threading.Event) -> None:
        s = self.settings
        kafka.ensure_topics(kafka.admin(s), kafka.core_topics(self.names, s))
        watcher = CatalogWatcher(s)
        watcher.view = self.catalog
        tx = kafka.consumer(s)
        tx.assign([TopicPartition(self.names.transmission, 0, -2)])
        r = redis.Redis.from_url(s.redis_url)
        ticker = Ticker(self.clock.now_ms(), self.intervals.schedule)
        ticker.every(1, "task_handlers", self.handlers.on_tick)
        ticker.every(1, "retransmit", lambda _t: self._retransmit())
        ticker.every(2, "connect", lambda _t: self._connect_pending())
        ticker.every(2, "reclassify", lambda _t: self._reclassify())
        ticker.every(2, "reregister", lambda _t: self._reregister())
        ticker.every(2, "trim_caches", lambda _t: self._trim_caches())
        ticker.every(5, "close_idle", lambda _t: self._close_idle())
        ticker.every(5, "cleanup_acked", lambda _t: self._poll_acks(0))
        self.links.restore_suppression(_load_suppression(r, self.names), self.clock.now_ms())
        self._ack_consumer(s.kafka_bootstrap)
        self._self_check()
        serve_metrics(s.metrics_port, host=s.metrics_host)
        self.handlers.start()
        HEALTHY.labels("transmitter").set(1)
        self.ready.set()
        log.info("transmitter ready (instance %s, tick %d ms)", s.instance, self.intervals.tick_ms)
        try:
            while not stop.is_set():
                if watcher.poll(0):
                    self.catalog = watcher.view
                    self._reclassify()
                got = self._poll_transmission(tx)
                self._poll_acks(0 if got else 0.02)
                now = self.clock.now_ms()
                ticker.poll(now)
                self.queue.retransmit_due(now)
                self._connect_pending()
                self._send(now)
                self._publish_view(r, now)
        finally:
            HEALTHY.labels("transmitter").set(0)
            self.handlers.stop(2)
            log.info("transmitter stopped after %d tick(s)", ticker.tick)
            tx.close()
            watcher.close()
            for c in self._acks.values():
                c.close()
            for conn in self._conns.values():
                conn.producer.flush(2)
            self.audit.flush(2)
            # Drop the clients now: librdkafka keeps reconnecting for as long as one is alive.
            self._conns.clear()
            self._acks.clear()
            r.close()

    def _self_check(self) -> None:
        """Fail fast on a transmission topic that is missing (a mistyped instance)."""
        md = kafka.admin(self.settings).list_topics(timeout=10).topics
        if self.names.transmission not in md:
            raise RuntimeError(f"topic {self.names.transmission} does not exist")

    # ----------------------------------------------------------------- input
    def _poll_transmission(self, c: Consumer) -> int:
        n = 0
        for m in c.consume(self.options.batch, 0.02):
            if m.error() is not None or m.value() is None:
                _log_error(m)
                continue
            try:
                record = InboundMessage.model_validate_json(m.value() or b"")
            except ValueError as exc:
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
        pending = self.queue.destinations()
        for dest in list(self._failures):
            if dest not in pending:
                del self._failures[dest]

    def _poll_acks(self, timeout_s: float) -> None:
        for c in list(self._acks.values()):
            for m in c.consume(self.options.batch, timeout_s):
                if m.error() is not None or m.value() is None:
                    _log_error(m)
                    continue
                try:
                    ack = AckRecord.model_validate_json(m.value() or b"")
                except ValueError:
                    continue
                if self.queue.ack(ack):
                    now = self.clock.now_ms()
                    self.links.on_activity(ack.from_instance, now)
                    self._audit(
                        "acknowledge",
                        now,
                        conversation_id=ack.conversation_id,
                        service=ack.from_instance,
                    )
            timeout_s = 0

    def _ack_consumer(self, bootstrap: str) -> None:
        if bootstrap in self._acks:
            return
        extra: dict[str, Any] = {"bootstrap.servers": bootstrap}
        c = kafka.consumer(self.settings, **extra)
        c.assign([TopicPartition(self.names.acks, 0, -2)])
        self._acks[bootstrap] = c

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

    def _bootstrap(self, address: str) -> str:
        return self.settings.kafka_bootstrap if address == LOCAL_ADDRESS else address

    def _reclassify(self) -> None:
        """Catalog or route change: re-resolve routes, drop links whose address changed."""
        self.queue.reclassify(self._route_problem, self.catalog.catalog.honor_broker_priority)
        for dest, conn in list(self._conns.items()):
            route = self._route(dest)
            if (
                route is None
                or self._bootstrap(route.address) != conn.address
                or (Names(route.next_hop).inbound != conn.topic)
            ):
                log.info("route to %s changed or expired: closing its connection", dest)
                self._close(dest)

    # ----------------------------------------------------------------- transport
    def _connect_pending(self) -> None:
        now = self.clock.now_ms()
        for dest in self.links.to_connect(self.queue.pending_destinations(), now):
            self._connect(dest, now)

    def _connect(self, dest: str, now: int) -> None:
        route = self._route(dest)
        if route is None:
            self._failures[dest] = f"no usable route names broker instance {dest!r}"
            return
        address = self._bootstrap(route.address)
        inbound = Names(route.next_hop).inbound
        p = kafka.producer(
            self.settings,
            extra={
                "bootstrap.servers": address,
                "message.timeout.ms": self.options.delivery_timeout_ms,
                "socket.connection.setup.timeout.ms": int(self.options.connect_timeout_s * 1000),
            },
        )
        try:
            md = p.list_topics(inbound, timeout=self.options.connect_timeout_s)
            tmd = md.topics.get(inbound)
            if tmd is None or tmd.error is not None or not tmd.partitions:
                raise _ConnectFailed(
                    f"instance {route.next_hop!r} has no inbound topic at {address}"
                )
        except (KafkaException, _ConnectFailed) as exc:
            reason = f"connect to {dest} at {address} failed: {exc}"
            log.warning("%s", reason)
            self._failures[dest] = reason
            self.links.on_failed_connect(dest, address, reason, now)
            self._audit("suppression", now, service=dest, reason=reason)
            return
        self._conns[dest] = _Connection(address, p, inbound)
        self._ack_consumer(address)
        self.links.on_connected(dest, address, now)
        self._failures.pop(dest, None)
        again = self.queue.requeue_destination(dest)
        log.info("connected to %s at %s (%d unacknowledged queued again)", dest, address, again)

    def _send(self, now: int) -> None:
        for conn in self._conns.values():
            conn.producer.poll(0)
        for dest, reason in self._delivery_errors:
            self._failures[dest] = reason
            if dest in self._conns:
                log.warning("connection to %s broke: %s", dest, reason)
                self._close(dest)
                self.links.on_disconnect(dest, reason, now)
                self.links.suppression.on_disconnect(dest, now)
                self._audit("suppression", now, service=dest, reason=reason)
        self._delivery_errors.clear()
        live = set(self._conns)
        if not live:
            return
        batch = self.queue.take(now, live, self.options.batch)
        for record in batch:
            dest = record.to_instance
            conn = self._conns[dest]
            for value in wire_records(record, self.settings.fragment_bytes):
                conn.producer.produce(
                    conn.topic,
                    key=record.conversation_id.encode(),
                    value=value,
                    on_delivery=self._delivered(dest),
                )
            self.links.on_activity(dest, now, sent=1)
            self._audit(
                "transmit",
                now,
                service=record.to_service,
                conversation_id=record.conversation_id,
                message_id=record.message_id,
                priority=self.queue.last_take.get(record.message_id, (record.priority, False))[0],
                enqueued_ms=record.enqueued_ms,
                time_in_queue_ms=max(0, now - record.enqueued_ms),
                starvation_exception=self.queue.last_take.get(record.message_id, (0, False))[1],
            )

    def _audit(self, kind: AuditKind, now: int, **fields: Any) -> None:
        self.audit.emit(
            [AuditEvent(kind=kind, event_ms=now, instance=self.settings.instance, **fields)]
        )

    def _delivered(self, dest: str) -> Any:
        def report(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                self._delivery_errors.append((dest, f"delivery to {dest} failed: {err.str()}"))

        return report

    def _retransmit(self) -> None:
        self.queue.retransmit_due(self.clock.now_ms())

    def _close(self, dest: str) -> None:
        conn = self._conns.pop(dest, None)
        if conn is not None:
            conn.producer.flush(0)
        self.links.close(dest)

    def _close_idle(self) -> None:
        for dest in self.links.idle(self.clock.now_ms()):
            log.info("closing idle connection to %s", dest)
            self._close(dest)

    # ----------------------------------------------------------------- views
    def _publish_view(self, r: redis.Redis, now: int) -> None:
        if now < self._view_due_ms:
            return
        self._view_due_ms = now + self.options.view_every_ms
        view = {
            "updated_ms": now,
            "messages": self.queue.rows(now, self._failures),
            "connections": self.links.rows(now),
        }
        suppressed = self.links.suppressed(now)
        depth = self.queue.depth_by_priority()
        for level in range(1, 11):
            TRANSMISSION_DEPTH.labels(str(level)).set(depth.get(level, 0))
        CONNECTIONS.labels("transmitter").set(len(self._conns))
        SUPPRESSED_DESTINATIONS.labels("transmitter").set(len(suppressed))
        with self._view_lock:
            self._view_latest = (view, suppressed)
        try:
            self.handlers.submit("publish_view", lambda: self._write_view(r))
        except KsbError as exc:  # full or stopping: the next snapshot goes out instead
            log.warning("transmission view not published now: %s", exc)

    def _write_view(self, r: redis.Redis) -> None:
        """On a task handler: write the newest snapshot. Writes are serialised and each takes the
        newest snapshot under the lock, so an older view never overwrites a newer one."""
        with self._view_lock:
            if self._view_latest is None:
                return
            view, suppressed = self._view_latest
            self._view_latest = None
            try:
                pipe = r.pipeline()
                pipe.set(self.names.transmission_view_key, json.dumps(view))
                pipe.delete(self.names.suppress_key)
                if suppressed:
                    pipe.zadd(self.names.suppress_key, {d: u for d, u in suppressed.items()})
                pipe.execute()
            except redis.RedisError as exc:  # views are best effort; delivery needs no Redis
                log.warning("could not publish the transmission view: %s", exc)


class _ConnectFailed(Exception):
    pass


def _load_suppression(r: redis.Redis, names: Names) -> dict[str, int]:
    try:
        raw: list[tuple[bytes, float]] = r.zrange(names.suppress_key, 0, -1, withscores=True)  # type: ignore[assignment]
    except redis.RedisError:
        return {}
    return {k.decode(): int(v) for k, v in raw}


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
        return InboundMessage.model_validate_json(raw)
    except ValueError:
        return None


def _log_error(m: Message) -> None:
    err = m.error()
    if err is not None and err.code() != KafkaError._PARTITION_EOF:
        log.warning("consumer error: %s", err)
