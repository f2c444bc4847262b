"""The forwarder service: passes on inbound records addressed to other broker instances.

A sender whose route names this instance as its next hop (``via``) writes to our
``inbound.<sender>`` topic records whose ``to_instance`` is someone else; our dispatcher leaves
those alone and this service picks them up. It reads every ``inbound.<writer>`` topic our routes
bring messages through, from its end (what arrived while it was down is not ours to recover:
nobody acknowledged it, so the origin sends it again), believes a record's origin only when our
routes let its writer carry that instance's messages (as the dispatcher does,
`ksb.dialog.remote`), holds records in memory only (`ksb.transmission.forwarding.ForwardQueue`),
and copies each one unchanged to ``inbound.<this instance>`` of the next hop, on the cluster our
own route names, first in first out at priority 5: the next hop believes it because its routes
go through us. Every 5th tick it drops what it could not forward within ``forwarder_stale_ms``
(60 s by default).

The acks of what it forwarded to another cluster are written there, where the origin may not
reach: the forwarder relays them onto its own cluster (`ksb.transmission.ack_relay`), the cluster the origin's
route reached it on, so every hop carries the acks one cluster back.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

import redis
from confluent_kafka import (
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from ksb.catalog.model import CatalogView
from ksb.clock import Clock
from ksb.errors import ProtocolError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.metrics import CONNECTIONS, export_transport_defaults
from ksb.runtime.redis_client import redis_client
from ksb.runtime.redis_view import RedisView
from ksb.runtime.service import Service, TickTask
from ksb.settings import ForwarderSettings
from ksb.transmission.ack_relay import AckRelay
from ksb.transmission.forwarding import ForwardQueue, next_hop
from ksb.transmission.links import bootstrap_of
from ksb.wire.fragments import Reassembler, wire_records
from ksb.wire.protocol import FragmentRecord, parse_inbound

__all__ = ["Forwarder"]

log = logging.getLogger("ksb.forwarder")


class Forwarder(Service):
    """Forwarding for `settings.instance`, run in the service shell."""

    name = "forwarder"

    def __init__(self, settings: ForwarderSettings, *, clock: Clock | None = None) -> None:
        super().__init__(settings, clock)
        self.settings: ForwarderSettings = settings
        self.queue = ForwardQueue()
        self._producers: dict[str, Producer] = {}  # bootstrap servers -> producer
        self._reports: list[tuple[str, str | None]] = []  # (message id, error) from callbacks
        self._pieces = Reassembler()  # fragments of large messages passing through
        self.relay = AckRelay(settings, batch=settings.batch, clock=self.clock)
        self._inbound: Consumer | None = None
        self._reading: set[str] = set()
        """The ``inbound.<writer>`` topics assigned."""
        self._redis: redis.Redis | None = None
        self._view: RedisView | None = None

    def open(self) -> None:
        s = self.settings
        kafka.ensure_topics(kafka.admin(s), kafka.core_topics(self.names, s))
        self.shell.read_catalog()
        self._inbound = kafka.consumer(s, read_committed=False)
        self._read_new_topics(self._inbound)
        self._redis = redis_client(s)
        self._view = RedisView("forwarded", self._redis, self.handlers, s.view_every_ms)
        export_transport_defaults("forwarder")

    def on_catalog(self, view: CatalogView) -> None:
        if self._inbound is not None:
            self._read_new_topics(self._inbound)

    def _read_new_topics(self, c: Consumer) -> None:
        """Read, from their ends, the ``inbound.<writer>`` topics of writers our routes bring
        messages through that are not read yet (a topic not made yet is tried again with the
        next catalog)."""
        writers = {w for ws in self.catalog.carriers.values() for w in ws}
        wanted = {self.names.inbound_from(w) for w in writers} - self._reading
        added: list[TopicPartition] = []
        for topic in sorted(wanted):
            md = c.list_topics(topic, timeout=10).topics.get(topic)
            if md is None or md.error is not None or not md.partitions:
                log.warning("no topic %s yet: its records are read once it exists", topic)
                continue
            added += [TopicPartition(topic, p, OFFSET_END) for p in sorted(md.partitions)]
            self._reading.add(topic)
        if added:
            c.incremental_assign(added)

    def tick_tasks(self) -> Iterable[TickTask]:
        every = self.settings.stale_check_every_ticks
        return (TickTask(every, "drop_stale", lambda _t: self._drop_stale()),)

    def step(self) -> None:
        assert self._inbound is not None and self._view is not None
        self._poll_inbound(self._inbound)
        self._forward()
        self._publish_view(self._view)
        local = self._producer(self.settings.kafka_bootstrap)
        if self.relay.pump(local):
            local.poll(0)

    def close(self) -> None:
        log.info(
            "forwarder: %d forwarded, %d dropped, %d held (dropped)",
            self.queue.forwarded,
            self.queue.dropped,
            len(self.queue),
        )
        if self._inbound is not None:
            self._inbound.close()
        self.relay.close()
        for p in self._producers.values():
            p.flush(2)
        self._producers.clear()
        if self._redis is not None:
            self._redis.close()

    def _poll_inbound(self, c: Any) -> None:
        now = self.clock.now_ms()
        for m in c.consume(self.settings.batch, 0.02):
            if m.error() is not None or m.value() is None:
                kafka.log_consumer_error(m, log)
                continue
            try:
                got = parse_inbound(m.value())
                if got.to_instance == self.settings.instance:
                    continue  # ours: the dispatcher's
                writer = (m.topic() or "")[len(self.names.inbound_prefix) :]
                if not self.catalog.carries(writer, got.from_instance):
                    log.warning(
                        "dropped a record of %s written by %s, which our routes do not carry",
                        got.from_instance,
                        writer,
                    )
                    continue
                record = self._pieces.offer(got, now) if isinstance(got, FragmentRecord) else got
            except (ProtocolError, ValueError):
                continue  # the dispatcher reports unreadable records
            if record is not None:
                self.queue.add(record, now)

    def _forward(self) -> None:
        for p in self._producers.values():
            p.poll(0)
        for mid, err in self._reports:
            if err is None:
                self.queue.delivered(mid)
            else:
                self.queue.failed(mid, err)
        self._reports.clear()
        now = self.clock.now_ms()
        for record in self.queue.take(self.settings.batch):
            hop = next_hop(self.catalog, record, self.settings.instance, now)
            if isinstance(hop, str):
                self.queue.failed(record.message_id, hop)
                continue
            address = bootstrap_of(hop.address, self.settings.kafka_bootstrap)
            try:
                self.relay.watch(address, record.from_instance)
            except (KafkaException, TimeoutError) as exc:
                self.queue.failed(record.message_id, f"cannot reach {address}: {exc}")
                continue
            values = wire_records(record, self.settings.fragment_bytes)
            report = self._report(record.message_id, len(values))
            for value in values:
                self._producer(address).produce(
                    Names(hop.next_hop).inbound_from(self.settings.instance),
                    key=record.key.encode(),
                    value=value,
                    on_delivery=report,
                )
        CONNECTIONS.labels("forwarder").set(len(self._producers))

    def _publish_view(self, view: RedisView) -> None:
        now = self.clock.now_ms()
        if not view.due(now):
            return
        snapshot = json.dumps({"updated_ms": now, "messages": self.queue.rows(now)})
        view.offer_value(self.names.forwarded_view_key, snapshot)

    def _producer(self, address: str) -> Producer:
        p = self._producers.get(address)
        if p is None:
            p = kafka.remote_producer(
                self.settings, address, delivery_timeout_ms=self.settings.delivery_timeout_ms
            )
            self._producers[address] = p
        return p

    def _report(self, message_id: str, records: int) -> Any:
        """One outcome per message: failed at the first failed record, delivered after the last."""
        left = [records]

        def report(err: KafkaError | None, _msg: Message) -> None:
            if left[0] <= 0:
                return
            if err is not None:
                left[0] = 0
                self._reports.append((message_id, err.str()))
                return
            left[0] -= 1
            if left[0] == 0:
                self._reports.append((message_id, None))

        return report

    def _drop_stale(self) -> None:
        now = self.clock.now_ms()
        self._pieces.purge(now, self.settings.forwarder_stale_ms)
        dropped = self.queue.drop_stale(now, self.settings.forwarder_stale_ms)
        if dropped:
            log.info("dropped %d message(s) not forwarded in time (the origins resend)", dropped)
