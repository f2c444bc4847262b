"""The dispatcher's I/O shell around `ksb.dialog.engine.Engine`.

It consumes the requests topic and writes each batch's outputs, endpoint changes and consumed offsets
in one Kafka transaction. On start, and after any failed transaction, it rebuilds the engine from
Kafka (catalog, endpoints, queue topics) after fencing any older dispatcher with init_transactions, so
a crash at any point neither loses nor duplicates a message.

Periodic tasks (`ksb.runtime.ticker`, every ``settings.tick_ms``):

* every tick, the task handlers (`ksb.runtime.task_handlers`) are checked and a dead one is restarted;
* a broker that failed to start (no valid catalog applied yet, missing queue topics, Kafka
  unreachable) is retried every 5th tick, or on the next tick after a new catalog
  record (`ksb.dialog.broker_start`), or, when Kafka was unreachable, on the next tick after a probe finds
  it answering again. Until then the process stays up with health 0, /healthz answers 503 with the
  reason, and the reason is in the ``ksb_broker_info`` metric, the log and a BCN.

What runs on the task handlers:

* publishing broker configuration notifications (BCNs) to ``ksb.<instance>.bcn``. A BCN is not part
  of any dispatcher transaction (a failed start has none, and the catalog change it reports was
  written by whoever applied it), and waiting for Kafka to acknowledge it, for seconds while Kafka
  is down, must not stall the transaction loop or the retry ticks;
* the Kafka probe (`_KafkaProbe`): a metadata request that takes its whole time-out exactly when
  Kafka is down, so it must not run on the loop either.

The per-commit metrics stay inline on purpose: they are CPU work that a thread hop under the GIL
would only make slower.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from confluent_kafka import (
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient
from prometheus_client import Histogram

from ksb.audit import Audit, KafkaAudit, dispatcher_events
from ksb.catalog.model import Catalog, CatalogView
from ksb.clock import Clock, SystemClock
from ksb.dialog.broker_start import (
    BROKER_RETRY_EVERY,
    BrokerNotStarted,
    BrokerStart,
    failure_from_exception,
    start_problem,
)
from ksb.dialog.endpoint import decode_endpoint, encode_endpoint
from ksb.dialog.engine import Engine
from ksb.dialog.outputs import Outputs
from ksb.errors import KsbError, ProtocolError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.catalog_store import CatalogWatcher, load_catalog
from ksb.runtime.metrics import (
    BROKER_START_FAILURES,
    BROKER_STATUS,
    COMMITS,
    ERRORS,
    HEALTHY,
    PURGE_REASONS,
    PURGES,
    QUEUE_DEPTH,
    REQUESTS,
    TIME_IN_QUEUE,
    TXN_SECONDS,
    register_health_check,
    unregister_health_check,
)
from ksb.runtime.task_handlers import TaskHandlers, TaskQueueFull
from ksb.runtime.ticker import Ticker, TickSchedule
from ksb.settings import Settings
from ksb.wire.fragments import Reassembler
from ksb.wire.protocol import (
    AnyRequest,
    BrokerNotification,
    CommitOutcome,
    CommitRequest,
    FragmentRecord,
    QueueMessage,
    dumps,
    parse_inbound,
    parse_queue_record,
    parse_request,
)

__all__ = [
    "PROBE_TIMEOUT_S",
    "REASSEMBLY_STALE_MS",
    "START_TIMEOUT_S",
    "Dispatcher",
    "kafka_answers",
]

INBOUND_STALE_MS = 10_000
"""Early arrivals from another instance older than this are dropped on the next tick."""

REASSEMBLY_STALE_MS = 60_000
"""A large inbound message still missing fragments this long after its first one is forgotten."""

START_TIMEOUT_S = 10.0
"""How long one start attempt waits for Kafka's metadata before it counts as failed."""

BCN_FLUSH_S = 10.0
"""How long a task handler waits for Kafka to acknowledge BCNs before logging that they are late."""

PROBE_TIMEOUT_S = 1.0
"""How long the Kafka probe waits for metadata: short, so an answer is back before the next tick."""

log = logging.getLogger("ksb.dispatcher")


class Dispatcher:
    """One broker instance's dispatcher (run one; a second one fences the first)."""

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Clock | None = None,
        task_handlers: int | None = None,
        retry_every_ticks: int = BROKER_RETRY_EVERY,
        kafka_probe: Callable[[], bool] | None = None,
    ) -> None:
        """`kafka_probe` says whether Kafka answers now (default `kafka_answers`); tests use it to
        simulate an outage, as they use `clock` to simulate time."""
        self.settings = settings
        self.names = Names(settings.instance)
        self.clock = clock or SystemClock()
        self.ready = threading.Event()
        """Set once the broker has started and the dispatcher takes requests."""
        self.broker = BrokerStart(settings.instance, retry_every=retry_every_ticks)
        self.handlers = TaskHandlers("dispatcher", task_handlers)
        """Async work off the transaction loop: BCN publishing (2 x CPUs unless given)."""
        self.ticker = Ticker(self.clock.now_ms(), TickSchedule(tick_ms=settings.tick_ms))
        self.ticker.every(1, "task_handlers", self.handlers.on_tick)
        self.ticker.every(1, "broker_start", self._broker_tick)
        self.ticker.every(1, "purge_stale_inbound", self._purge_stale_inbound)
        self._bcn = _BcnPublisher(settings, self.names, self.handlers)
        self._kafka_probe = _KafkaProbe(
            self.handlers, kafka_probe or (lambda: kafka_answers(settings))
        )
        self._catalog_probe: Consumer | None = None
        self._catalog_end: int | None = None
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        self._watcher: CatalogWatcher | None = None
        self.engine: Engine | None = None
        self.audit = Audit()
        self._queue_metrics = _QueueMetrics()
        self._pieces = Reassembler()
        """Fragments of large inbound messages (memory only: the origin resends what is lost)."""

    # ----------------------------------------------------------------- start-up
    def start(self) -> None:
        """Start the broker, or raise what keeps it from starting (`BrokerNotStarted`, Kafka's)."""
        s = self.settings
        admin = kafka.admin(s)
        kafka.ensure_topics(admin, kafka.core_topics(self.names, s), timeout_s=START_TIMEOUT_S)
        catalog = load_catalog(s)
        problem = start_problem(s.instance, catalog.version, self._missing_topics(admin, catalog))
        if problem is not None:
            raise BrokerNotStarted(problem)
        self._producer = kafka.producer(
            s, transactional_id=self.names.dispatcher_txn_id, extra={"linger.ms": 1}
        )
        self._producer.init_transactions(60)
        # Audit events go through the transactional producer: they commit with what they describe.
        self.audit = Audit(KafkaAudit(self._producer, self.names))
        self._rebuild(catalog)
        self._consumer = kafka.consumer(s, group=self.names.dispatcher_group)
        self._consumer.subscribe([self.names.requests, self.names.inbound])

    def _missing_topics(self, admin: AdminClient, catalog: Catalog) -> list[str]:
        """The catalog's queue and dead-letter topics that Kafka does not have (yet)."""
        existing = set(admin.list_topics(timeout=START_TIMEOUT_S).topics)
        wanted = [self.names.queue(q.name) for q in catalog.queues]
        wanted += [self.names.dead_letters(q.name) for q in catalog.queues]
        return [t for t in wanted if t not in existing]

    def try_start(self, tick: int) -> bool:
        """One start attempt on `tick`; a failure is reported (log, metrics, BCN), not raised."""
        self.broker.attempt(tick)
        self._catalog_moved()  # the baseline: a catalog record from now on makes a change
        try:
            self.start()
        except Exception as exc:
            failure = failure_from_exception(exc)
            if failure.code == "start_error":  # not a configuration problem: keep the traceback
                log.exception("start attempt %d raised", self.broker.attempts)
            self._discard_clients()
            self._publish(self.broker.on_failed(failure, self.clock.now_ms()))
            BROKER_START_FAILURES.labels("dispatcher", failure.code).inc()
            self._export_status()
            log.warning(
                "broker not started (attempt %d, %s): %s; retrying every %d ticks",
                self.broker.attempts,
                failure.code,
                failure.reason,
                self.broker.retry_every,
            )
            return False
        assert self.engine is not None
        self._close_catalog_probe()
        self._publish(self.broker.on_started(self.engine.catalog.version, self.clock.now_ms()))
        self._export_status()
        self.ready.set()
        log.info("dispatcher ready (instance %s)", self.settings.instance)
        return True

    def _purge_stale_inbound(self, _tick: int) -> None:
        """Every tick: early arrivals from other instances not picked up in time are dropped
        (their senders retransmit them), as Service Broker's dispatcher does every notification."""
        if self.engine is not None:
            self.engine.purge_windows(self.clock.now_ms(), INBOUND_STALE_MS)

    def _broker_tick(self, tick: int) -> None:
        """The every-5th-tick retry (and the next tick after a new catalog record or Kafka's return)."""
        if self.broker.started:
            return
        for sent_tick, reachable in self._kafka_probe.answers():
            if self.broker.on_probe(sent_tick, reachable):
                log.info("Kafka answers again; retrying the broker start on tick %d", tick)
        if self._catalog_moved():
            self.broker.note_configuration_change()
        if self.broker.due(tick):
            self.try_start(tick)
        elif self.broker.probe_due(tick) and self._kafka_probe.submit(tick):
            self.broker.probe_sent(tick)

    def _catalog_moved(self) -> bool:
        """Whether a catalog record arrived since the last look (a cheap watermark query)."""
        try:
            if self._catalog_probe is None:
                self._catalog_probe = kafka.consumer(self.settings)
            _low, end = self._catalog_probe.get_watermark_offsets(
                TopicPartition(self.names.catalog, 0), timeout=1.0
            )
        except KafkaException:
            return False  # Kafka or the topic is not there yet: the 5th tick retries anyway
        # No baseline means the topic was missing at the last attempt (that attempt created it):
        # any record there now is one the attempt may not have seen.
        previous = 0 if self._catalog_end is None else self._catalog_end
        self._catalog_end = end
        return end != previous

    def _close_catalog_probe(self) -> None:
        if self._catalog_probe is not None:
            self._catalog_probe.close()
            self._catalog_probe = None

    def _export_status(self) -> None:
        status = self.broker.status()
        HEALTHY.labels("dispatcher").set(1 if self.broker.started else 0)
        BROKER_STATUS.labels("dispatcher").info({k: str(v) for k, v in status.items()})

    def _publish(self, bcn: BrokerNotification | None) -> None:
        if bcn is not None:
            self._bcn.publish(bcn)

    def _close_readers(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None

    def _discard_clients(self) -> None:
        """Drop what a failed start attempt built, so the next attempt starts clean."""
        self._close_readers()
        self._producer = None
        self.engine = None
        self.audit = Audit()

    def _rebuild(self, catalog: Catalog | None = None) -> None:
        s = self.settings
        view = CatalogView(catalog if catalog is not None else load_catalog(s))
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
        self._pieces = Reassembler()
        self._queue_metrics.declare(view)
        self._queue_metrics.export_depth(engine)
        log.info(
            "rebuilt: catalog v%d, %d endpoints, %d messages in queues",
            view.version,
            len(engine.endpoints),
            len(engine.inflight),
        )

    # ----------------------------------------------------------------- the loop
    def run(self, stop: threading.Event) -> None:
        """Start the broker (retrying on the ticks) and run it until `stop` is set."""
        register_health_check("dispatcher", self.broker.problem)
        self.handlers.start()
        # Not "dispatcher ready": that line means the broker takes requests (tests wait for it).
        log.info(
            "dispatcher process ready (instance %s, tick %d ms, %d task handlers)",
            self.settings.instance,
            self.settings.tick_ms,
            self.handlers.size,
        )
        try:
            self.try_start(0)
            while not stop.is_set():
                if self.broker.started:
                    try:
                        self.step()
                    except KafkaException as exc:
                        self._recover(exc)
                else:
                    wait_ms = self.ticker.next_due_ms - self.clock.now_ms()
                    if wait_ms > 0 and stop.wait(min(wait_ms, 100) / 1000):
                        break
                self.ticker.poll(self.clock.now_ms())
        finally:
            HEALTHY.labels("dispatcher").set(0)
            unregister_health_check("dispatcher", self.broker.problem)
            self.handlers.stop(BCN_FLUSH_S)
            self.close()

    def step(self) -> int:
        """Handle one batch of requests and due timers in one transaction; returns requests seen."""
        assert self._consumer and self._producer and self.engine and self._watcher
        if self._watcher.poll(0):
            self.engine.catalog = self._watcher.view
            self._queue_metrics.declare(self._watcher.view)
            self._publish(self.broker.on_catalog(self._watcher.view.version, self.clock.now_ms()))
            log.info("catalog v%d applied", self._watcher.view.version)
        now = self.clock.now_ms()
        deadline = self.engine.next_deadline_ms()
        wait_s = 0.1 if deadline is None else min(0.1, max(0.0, (deadline - now) / 1000))
        msgs = kafka.consume_batch(self._consumer, self.settings.batch_max, wait_s)
        records = [m for m in msgs if _is_record(m)]
        now = self.clock.now_ms()
        if len(self._pieces):
            self._pieces.purge(now, REASSEMBLY_STALE_MS)
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
        self._queue_metrics.export_depth(self.engine)
        return len(records)

    def _handle(self, m: Message, now: int) -> Outputs:
        assert self.engine is not None
        raw = m.value()
        try:
            request: AnyRequest | None
            if m.topic() == self.names.inbound:
                request = self._inbound(raw, now)
                if request is None:
                    return Outputs()
            else:
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
        out = self.engine.handle(request, now, sent_ms=_sent_ms(m))
        for e in out.errors:
            ERRORS.labels(e.code).inc()
        if isinstance(request, CommitRequest) and request.receipt is not None:
            COMMITS.labels("refused" if out.errors else "applied").inc()
        return out

    def _inbound(self, raw: bytes | None, now: int) -> AnyRequest | None:
        """An ``inbound`` record: a whole message, or a fragment (None until the last arrives)."""
        got = parse_inbound(raw)
        if not isinstance(got, FragmentRecord):
            return got
        if got.to_instance != self.settings.instance:
            return None  # passing through: the forwarder's
        try:
            return self._pieces.offer(got, now)
        except ValueError as exc:
            raise ProtocolError(f"fragments of {got.message_id} do not join: {exc}") from exc

    def _emit(self, out: Outputs) -> None:
        p = self._producer
        assert p is not None
        if out.received or out.purged or out.dead_letters:
            self._queue_metrics.observe(out, self.clock.now_ms())
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
        self._emit_remote(out)
        if self.audit.enabled:
            self.audit.emit(dispatcher_events(out, self.clock.now_ms(), self.settings.instance))

    def _emit_remote(self, out: Outputs) -> None:
        """Cross-instance records, in the same transaction as the queue writes they belong with.

        A transmission record is durable the moment the SEND is, and an acknowledgement is written
        only together with the queue write of what it acknowledges, so neither can get ahead.
        """
        p = self._producer
        assert p is not None
        for t in out.transmissions:
            p.produce(self.names.transmission, key=t.conversation_id.encode(), value=dumps(t))
        for a in out.acks:
            p.produce(Names(a.to_instance).acks, key=a.conversation_id.encode(), value=dumps(a))

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
        assert self.engine is not None
        self._publish(self.broker.on_catalog(self.engine.catalog.version, self.clock.now_ms()))
        self._consumer = kafka.consumer(self.settings, group=self.names.dispatcher_group)
        self._consumer.subscribe([self.names.requests, self.names.inbound])

    def close(self) -> None:
        self._close_readers()
        if self._producer is not None:
            self._producer.flush(5)
            self._producer = None
        self._close_catalog_probe()
        self._bcn.close()


class _BcnPublisher:
    """Publishes BCNs from a task handler, in the order the dispatcher raised them.

    The loop only appends to `_pending` and submits a drain; a drain takes the lock, produces every
    pending BCN in order and waits for the acknowledgement, so two handlers draining at once cannot
    reorder a "start_failed" after the "started" that followed it.
    """

    def __init__(self, settings: Settings, names: Names, handlers: TaskHandlers) -> None:
        self._settings = settings
        self._names = names
        self._handlers = handlers
        self._pending: deque[BrokerNotification] = deque()
        self._lock = threading.Lock()
        self._producer: Producer | None = None

    def publish(self, bcn: BrokerNotification) -> None:
        """Called on the loop's thread: queue `bcn` and let a handler send it."""
        self._pending.append(bcn)
        try:
            self._handlers.submit("bcn", self.drain)
        except TaskQueueFull:
            log.warning("task handlers busy; BCN %s goes out with the next one", bcn.event)

    def drain(self) -> None:
        with self._lock:
            if not self._pending:
                return
            if self._producer is None:
                self._producer = kafka.producer(self._settings)
            while self._pending:
                bcn = self._pending.popleft()
                self._producer.produce(
                    self._names.bcn,
                    key=bcn.instance.encode(),
                    value=dumps(bcn),
                    on_delivery=_bcn_delivered,
                )
            left = self._producer.flush(BCN_FLUSH_S)
        if left:
            log.warning("%d BCN(s) not acknowledged yet; the producer keeps trying", left)

    def close(self) -> None:
        """Send what is still pending (no handler may be left to do it) and wait briefly."""
        self.drain()
        with self._lock:
            if self._producer is not None:
                self._producer.flush(2)
                self._producer = None


def kafka_answers(settings: Settings, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether Kafka answers a metadata request within `timeout_s`.

    A fresh admin client each time: a long-lived one backs its reconnects off for up to ten seconds
    and would notice Kafka's return late.
    """
    try:
        kafka.admin(settings).list_topics(timeout=timeout_s)
    except KafkaException:
        return False
    return True


class _KafkaProbe:
    """Runs a Kafka probe on a task handler; the loop takes the answers on its next tick.

    Answers carry the tick the probe was sent on, so `BrokerStart.on_probe` can tell a stale one
    from news.
    """

    def __init__(self, handlers: TaskHandlers, probe: Callable[[], bool]) -> None:
        self._handlers = handlers
        self._probe = probe
        self._answers: queue.SimpleQueue[tuple[int, bool]] = queue.SimpleQueue()

    def submit(self, tick: int) -> bool:
        """Called on the loop's thread: hand a probe to a handler; False when none would take it."""
        try:
            self._handlers.submit("kafka_probe", lambda: self._ask(tick))
        except KsbError as exc:  # full or stopping: the next tick probes again
            log.warning("Kafka probe not sent on tick %d: %s", tick, exc)
            return False
        return True

    def _ask(self, tick: int) -> None:
        # An answer is queued whatever happens (a probe that raises counts as silence), so the
        # loop never waits for one that will not come.
        reachable = False
        try:
            reachable = self._probe()
        finally:
            self._answers.put((tick, reachable))

    def answers(self) -> list[tuple[int, bool]]:
        """The answers that arrived since the last call, oldest first."""
        got: list[tuple[int, bool]] = []
        while True:
            try:
                got.append(self._answers.get_nowait())
            except queue.Empty:
                return got


def _bcn_delivered(err: KafkaError | None, _msg: Message) -> None:
    if err is not None:
        log.warning("BCN not delivered: %s", err)


class _QueueMetrics:
    """Per-queue figures the dispatcher is the authority for: depth, time in queue, purges.

    Label children are cached, so the hot path is a dict lookup and an observe per message.
    """

    def __init__(self) -> None:
        self._time_in_queue: dict[tuple[str, int], Histogram] = {}
        self._declared: set[str] = set()

    def declare(self, view: CatalogView) -> None:
        """Create every queue's depth and purge series at 0, so "none yet" reads as 0, not absent."""
        for name in view.queues:
            if name not in self._declared:
                self._declared.add(name)
                for reason in PURGE_REASONS:
                    PURGES.labels(name, reason)
        COMMITS.labels("applied")
        COMMITS.labels("refused")

    def export_depth(self, engine: Engine) -> None:
        depth = engine.depth
        for name in self._declared | depth.keys():
            QUEUE_DEPTH.labels(name).set(depth.get(name, 0))

    def observe(self, out: Outputs, now_ms: int) -> None:
        for info in out.received:
            key = (info.queue, info.priority)
            child = self._time_in_queue.get(key)
            if child is None:
                child = self._time_in_queue[key] = TIME_IN_QUEUE.labels(
                    info.queue, str(info.priority)
                )
            child.observe(max(0, now_ms - info.enqueued_ms) / 1000)
        for info in out.purged:
            PURGES.labels(info.queue, "conversation_closed").inc()
        for d in out.dead_letters:
            PURGES.labels(d.message.queue, "dead_letter").inc()


def _sent_ms(m: Message) -> int | None:
    """The request record's timestamp (the producer's create time): when the client sent it."""
    kind, ts = m.timestamp()
    return ts if kind != TIMESTAMP_NOT_AVAILABLE and ts > 0 else None


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


def value_queue(m: Message) -> str:
    """The queue a queue-topic record belongs to, from its topic name."""
    return (m.topic() or "").rsplit(".queue.", 1)[-1]


def _load_queue(engine: Engine, m: Message) -> None:
    key = (m.key() or b"").decode()
    try:
        value = parse_queue_record(m.value())
    except ProtocolError:
        return
    if key.startswith("commit/") and value is None:
        return  # an outcome's tombstone
    if isinstance(value, CommitOutcome):
        if value.applied and value.token:
            # Fences survive a restart for as long as the outcome is not compacted away.
            engine.fences.applied(value_queue(m), value.group, value.token)
        return
    msg: QueueMessage | None = value
    engine.load_queue_record(key, msg, m.partition() or 0)
