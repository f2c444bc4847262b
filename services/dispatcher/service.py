"""The dispatcher's I/O shell around `ksb.engine.Engine`.

It consumes the requests topic and writes each batch's outputs, endpoint changes and consumed offsets
in one Kafka transaction. On start, and after any failed transaction, it rebuilds the engine from
Kafka (catalog, endpoints, queue topics) after fencing any older dispatcher with init_transactions, so
a crash at any point neither loses nor duplicates a message.
"""

from __future__ import annotations

import logging
import threading
import time

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer

from ksb import kafka
from ksb.catalog import CatalogView
from ksb.catalog_store import CatalogWatcher, load_catalog
from ksb.clock import Clock, SystemClock
from ksb.endpoint import decode_endpoint, encode_endpoint
from ksb.engine import Engine, Outputs
from ksb.errors import ProtocolError
from ksb.metrics import COMMITS, ERRORS, HEALTHY, REQUESTS, TXN_SECONDS
from ksb.names import Names
from ksb.protocol import (
    CommitOutcome,
    CommitRequest,
    QueueMessage,
    dumps,
    parse_queue_record,
    parse_request,
)
from ksb.settings import Settings

__all__ = ["Dispatcher"]

log = logging.getLogger("ksb.dispatcher")


class Dispatcher:
    """One broker instance's dispatcher (run one; a second one fences the first)."""

    def __init__(self, settings: Settings, *, clock: Clock | None = None) -> None:
        self.settings = settings
        self.names = Names(settings.instance)
        self.clock = clock or SystemClock()
        self.ready = threading.Event()
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        self._watcher: CatalogWatcher | None = None
        self.engine: Engine | None = None

    # ----------------------------------------------------------------- start-up
    def start(self) -> None:
        s = self.settings
        kafka.ensure_topics(kafka.admin(s), kafka.core_topics(self.names, s))
        self._producer = kafka.producer(
            s, transactional_id=self.names.dispatcher_txn_id, extra={"linger.ms": 1}
        )
        self._producer.init_transactions(60)
        self._rebuild()
        self._consumer = kafka.consumer(s, group=self.names.dispatcher_group)
        self._consumer.subscribe([self.names.requests])
        self.ready.set()
        log.info("dispatcher ready (instance %s)", self.settings.instance)

    def _rebuild(self) -> None:
        s = self.settings
        view = CatalogView(load_catalog(s))
        if self._watcher is not None:
            self._watcher.close()
        self._watcher = CatalogWatcher(s)
        self._watcher.view = view
        engine = Engine(view, instance=s.instance, max_body_bytes=s.max_body_bytes)
        c = kafka.consumer(s)
        try:
            kafka.read_to_end(
                c, self.names.endpoints, lambda m: _load_endpoint(engine, m), timeout_s=120
            )
            for queue in view.queues.values():
                kafka.read_to_end(
                    c, self.names.queue(queue.name), lambda m: _load_queue(engine, m), timeout_s=120
                )
        finally:
            c.close()
        self.engine = engine
        log.info(
            "rebuilt: catalog v%d, %d endpoints, %d messages in queues",
            view.version,
            len(engine.endpoints),
            len(engine.inflight),
        )

    # ----------------------------------------------------------------- the loop
    def run(self, stop: threading.Event) -> None:
        self.start()
        HEALTHY.labels("dispatcher").set(1)
        try:
            while not stop.is_set():
                try:
                    self.step()
                except KafkaException as exc:
                    self._recover(exc)
        finally:
            HEALTHY.labels("dispatcher").set(0)
            self.close()

    def step(self) -> int:
        """Handle one batch of requests and due timers in one transaction; returns requests seen."""
        assert self._consumer and self._producer and self.engine and self._watcher
        if self._watcher.poll(0):
            self.engine.catalog = self._watcher.view
            log.info("catalog v%d applied", self._watcher.view.version)
        now = self.clock.now_ms()
        deadline = self.engine.next_deadline_ms()
        wait_s = 0.1 if deadline is None else min(0.1, max(0.0, (deadline - now) / 1000))
        msgs = kafka.consume_batch(self._consumer, self.settings.batch_max, wait_s)
        records = [m for m in msgs if _is_record(m)]
        now = self.clock.now_ms()
        deadline = self.engine.next_deadline_ms()
        if not records and (deadline is None or deadline > now):
            return 0
        started = time.perf_counter()
        p = self._producer
        p.begin_transaction()
        for m in records:
            self._emit(self._handle(m, now))
        self._emit(self.engine.tick(now))
        if records:
            positions = self._consumer.position(self._consumer.assignment())
            p.send_offsets_to_transaction(positions, self._consumer.consumer_group_metadata())
        p.commit_transaction(30)
        TXN_SECONDS.observe(time.perf_counter() - started)
        return len(records)

    def _handle(self, m: Message, now: int) -> Outputs:
        assert self.engine is not None
        raw = m.value()
        try:
            request = parse_request(raw)
        except ProtocolError as exc:
            ERRORS.labels(exc.code).inc()
            return Engine.malformed(
                exc,
                topic=m.topic() or "",
                partition=m.partition() or 0,
                offset=m.offset() or 0,
                raw=raw,
            )
        REQUESTS.labels(request.kind).inc()
        out = self.engine.handle(request, now)
        for e in out.errors:
            ERRORS.labels(e.code).inc()
        if isinstance(request, CommitRequest) and request.receipt is not None:
            COMMITS.labels("refused" if out.errors else "applied").inc()
        return out

    def _emit(self, out: Outputs) -> None:
        p = self._producer
        assert p is not None
        for w in out.queue:
            value = None if w.value is None else dumps(w.value)
            p.produce(
                self.names.queue(w.queue), key=w.key.encode(), value=value, partition=w.partition
            )
        # The endpoints topic is compacted: only each handle's last state in a batch matters.
        for ep in {e.handle: e for e in out.endpoints}.values():
            p.produce(self.names.endpoints, key=ep.handle.encode(), value=encode_endpoint(ep))
        for e in out.errors:
            p.produce(self.names.errors, key=(e.request_id or "").encode(), value=dumps(e))
        for d in out.dead_letters:
            topic = self.names.dead_letters(d.message.queue)
            p.produce(topic, key=d.message.message_id.encode(), value=dumps(d))
        if len(p) > 50_000:
            p.poll(0)

    def _recover(self, exc: KafkaException) -> None:
        """A failed transaction: abort it, rebuild state from Kafka, and rewind to committed offsets."""
        err = exc.args[0]
        log.warning("transaction failed (%s); rebuilding from Kafka", err)
        assert self._producer is not None
        if err.fatal():
            raise exc
        if err.txn_requires_abort():
            self._producer.abort_transaction(30)
        if self._consumer is not None:
            self._consumer.close()
        self._rebuild()
        self._consumer = kafka.consumer(self.settings, group=self.names.dispatcher_group)
        self._consumer.subscribe([self.names.requests])

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        if self._producer is not None:
            self._producer.flush(5)
            self._producer = None


def _is_record(m: Message) -> bool:
    err = m.error()
    if err is None:
        return True
    if err.code() != KafkaError._PARTITION_EOF:
        log.warning("consumer error: %s", err)
    return False


def _load_endpoint(engine: Engine, m: Message) -> None:
    value = m.value()
    if value is not None:
        engine.load_endpoint(decode_endpoint(value))


def _load_queue(engine: Engine, m: Message) -> None:
    key = (m.key() or b"").decode()
    if key.startswith("commit/"):
        return
    try:
        value = parse_queue_record(m.value())
    except ProtocolError:
        return
    if isinstance(value, CommitOutcome):
        return
    msg: QueueMessage | None = value
    engine.load_queue_record(key, msg, m.partition() or 0)
