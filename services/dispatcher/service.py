"""The dispatcher's I/O shell around `ksb.dialog.engine.Engine`, run in the service shell.

It consumes the requests topic and writes each batch's outputs, endpoint changes and consumed offsets
in one Kafka transaction. On start, and after any failed transaction, it rebuilds the engine from
Kafka (`services.dispatcher.rebuild`) after fencing any older dispatcher with init_transactions, so
a crash at any point neither loses nor duplicates a message.

Periodic tasks (`ksb.runtime.ticker`, every ``tick_ms``), besides the shell's task-handler check:

* every tick, early arrivals from other instances older than ``inbound_stale_ms`` (10 s) are dropped
  (`ksb.dialog.remote`);
* a broker that failed to start (no valid catalog applied yet, missing queue topics, Kafka
  unreachable) is retried every ``broker_retry_every`` (5th) tick, or on the next tick after a new
  catalog record (`ksb.dialog.broker_start`), or, when Kafka was unreachable, on the next tick after
  a probe finds it answering again. Until then the process stays up with health 0, /healthz
  answers 503 with the reason, and the reason is in the ``ksb_broker_info`` metric, the log and a
  BCN (`services.dispatcher.notifications`, published from the task handlers).

The per-commit metrics stay inline on purpose: they are CPU work that a thread hop under the GIL
would only make slower.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient

from ksb.audit import Audit, KafkaAudit
from ksb.catalog.model import Catalog, CatalogView
from ksb.clock import Clock
from ksb.dialog.broker_start import (
    BrokerNotStarted,
    BrokerStart,
    StartFailure,
    failure_from_exception,
    start_problem,
)
from ksb.dialog.engine import Engine
from ksb.dialog.outputs import Outputs
from ksb.dialog.permissions import Permissions
from ksb.dialog.shards import Ownership
from ksb.errors import ProtocolError
from ksb.runtime import kafka
from ksb.runtime.metrics import (
    BROKER_START_FAILURES,
    BROKER_STATUS,
    COMMITS,
    ERRORS,
    HEALTHY,
    RELAYED,
    REQUESTS,
    TXN_SECONDS,
    Children,
)
from ksb.runtime.service import Service, TickTask
from ksb.settings import DispatcherSettings
from ksb.wire.fragments import Reassembler
from ksb.wire.protocol import (
    AnyRequest,
    BrokerNotification,
    CommitRequest,
    FragmentRecord,
    dumps,
)
from ksb.wire.relay import RelayRequest
from services.dispatcher.journal import (
    ABORT_TIMEOUT_S,
    NOT_A_MEMBER,
    STALE_EPOCH,
    TXN_CALL_TIMEOUT_S,
    TXN_PRODUCER,
    JournaledProducer,
    write_again,
    write_again_or_give_up,
)
from services.dispatcher.notifications import BCN_FLUSH_S, BcnPublisher, KafkaProbe, kafka_answers
from services.dispatcher.queue_metrics import QueueMetrics
from services.dispatcher.rebalance import (
    AssignmentFailed,
    ShardKeeper,
    coordinator_shards,
    rewind_to,
)
from services.dispatcher.rebuild import LOADER_CONF
from services.dispatcher.routing import Router, handed_over
from services.dispatcher.watchdog import Watchdog
from services.dispatcher.writer import OutputWriter

__all__ = ["START_TIMEOUT_S", "Dispatcher"]

START_TIMEOUT_S = 10.0
"""How long one start attempt waits for Kafka's metadata before it counts as failed."""

log = logging.getLogger("ksb.dispatcher")


class Dispatcher(Service):
    """One broker instance's dispatcher (run one; a second one fences the first)."""

    name = "dispatcher"
    ready_at_open = False
    drain_s = BCN_FLUSH_S

    def __init__(
        self,
        settings: DispatcherSettings,
        *,
        clock: Clock | None = None,
        kafka_probe: Callable[[], bool] | None = None,
    ) -> None:
        """`kafka_probe` says whether Kafka answers now (default `kafka_answers`); tests use it to
        simulate an outage, as they use `clock` to simulate time."""
        super().__init__(settings, clock)
        self.settings: DispatcherSettings = settings
        self.broker = BrokerStart(settings.instance, retry_every=settings.broker_retry_every)
        self._bcn = BcnPublisher(settings, self.names, self.handlers)
        self._kafka_probe = KafkaProbe(
            self.handlers, kafka_probe or (lambda: kafka_answers(settings))
        )
        self.member = settings.member or uuid.uuid4().hex[:12]
        """This dispatcher's name in the group and in its transactional id."""
        self._catalog_probe: Consumer | None = None
        self._catalog_end: int | None = None
        self._producer: JournaledProducer | None = None
        self._consumer: Consumer | None = None
        self._writer: OutputWriter | None = None
        self._router: Router | None = None
        self.shards: ShardKeeper | None = None
        self.engine: Engine | None = None
        self.audit = Audit()
        self.applied = 0
        """Requests and relayed records applied by this dispatcher (the bench compares members)."""
        self.transactions = 0
        """Transactions committed (the log says how many records each carried on average)."""
        self.watchdog = Watchdog(settings.stuck_txn_s)
        self._queue_metrics = QueueMetrics()
        self._requests, self._errors = Children(REQUESTS), Children(ERRORS)
        self._commits, self._relayed = Children(COMMITS), Children(RELAYED)
        self._pieces = Reassembler()
        """Fragments of large inbound messages (memory only: the origin resends what is lost)."""
        self._batch = 0
        """Records in the open transaction (counted as applied once it commits)."""

    # ----------------------------------------------------------------- the shell's calls
    def open(self) -> None:
        """Try to start the broker at once; a failure is reported and retried on the ticks."""
        self.try_start(0)

    def tick_tasks(self) -> Iterable[TickTask]:
        return (
            TickTask(1, "broker_start", self._broker_tick),
            TickTask(1, "purge_stale_inbound", self._purge_stale_inbound),
        )

    def health(self) -> str | None:
        return self.broker.problem()

    def on_catalog(self, view: CatalogView) -> None:
        """A running broker takes a new catalog version at once (a stopped one retries on its
        tick, which watches the catalog topic itself)."""
        if self.engine is None or view.version == self.engine.catalog.version:
            return
        self.engine.catalog = view
        self.engine.permissions = self._permissions(view)
        self._queue_metrics.declare(view)
        self._publish(self.broker.on_catalog(view.version, self.clock.now_ms()))
        log.info("catalog v%d applied", view.version)

    def _permissions(self, view: CatalogView) -> Permissions:
        return Permissions.of(view.catalog, self.settings.instance, self.settings.owner_names)

    def step(self) -> None:
        if not self.broker.started:
            wait_ms = self.shell.ticker.next_due_ms - self.clock.now_ms()
            time.sleep(max(0, min(wait_ms, 100)) / 1000)
            return
        try:
            try:
                self.apply_batch()
            except KafkaException as exc:
                self._recover(exc)  # which may rebuild the shards (`_reset`)
        except AssignmentFailed as exc:
            log.warning("%s; rejoining the group", exc)
            self._rejoin()

    def close(self) -> None:
        HEALTHY.labels("dispatcher").set(0)
        log.info(
            "dispatcher %s: %d applied in %d transactions",
            self.member,
            self.applied,
            self.transactions,
        )
        self._close_consumer()
        if self._producer is not None:
            self._producer.flush(5)
            self._producer = None
        self._close_catalog_probe()
        self._bcn.close()

    # ----------------------------------------------------------------- start-up
    def start(self) -> None:
        """Start the broker, or raise what keeps it from starting (`BrokerNotStarted`, Kafka's)."""
        s = self.settings
        admin = kafka.admin(s)
        kafka.ensure_topics(admin, kafka.core_topics(self.names, s), timeout_s=START_TIMEOUT_S)
        view = self.shell.read_catalog()
        shards = self._shard_count(admin)
        problem = start_problem(s.instance, view.version, self._missing_topics(admin, view.catalog))
        if problem is not None:
            raise BrokerNotStarted(problem)
        self._producer = JournaledProducer(
            kafka.producer_conf(
                s,
                transactional_id=f"{self.names.dispatcher_txn_id}.{self.member}",
                txn_timeout_ms=s.txn_timeout_ms,
                extra=TXN_PRODUCER,
            )
        )
        self._producer.init_transactions(60)
        # Audit events go through the transactional producer: they commit with what they describe.
        self.audit = Audit(KafkaAudit(self._producer, self.names))
        self.engine = Engine(
            view,
            instance=s.instance,
            max_body_bytes=s.max_body_bytes,
            ownership=Ownership(shards, owned=()),
        )
        self.engine.permissions = self._permissions(view)
        self.engine.depth_every_ms = s.depth_every_ms
        self._writer = OutputWriter(self._producer, self.names, shards, self.audit)
        self._router = Router(self.names, shards)
        held = coordinator_shards(
            lambda: kafka.admin(s), self.names.dispatcher_group, self.names.relay
        )
        self.shards = ShardKeeper(
            self.names, self.engine, lambda: kafka.consumer(s, **LOADER_CONF), self._view, held
        )
        self._pieces = Reassembler()
        self._queue_metrics.declare(view)
        self._subscribe()

    def _view(self) -> CatalogView:
        assert self.engine is not None
        return self.engine.catalog

    def _shard_count(self, admin: AdminClient) -> int:
        """The instance's shard count: the relay topic's partitions (the requests topics and
        ``inbound`` must have as many; a mismatch is a broker that cannot start)."""
        topics = admin.list_topics(timeout=START_TIMEOUT_S).topics
        shards = len(topics[self.names.relay].partitions)
        for name in (self.names.requests, self.names.inbound, self.names.endpoints):
            if name in topics and len(topics[name].partitions) != shards:
                raise BrokerNotStarted(
                    StartFailure(
                        "shards_mismatch",
                        f"topic {name} has {len(topics[name].partitions)} partitions, the relay "
                        f"{shards}: every sharded topic of instance {self.settings.instance} needs "
                        "the same count (KSB_REQUEST_PARTITIONS when they are created)",
                    )
                )
        return shards

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
        log.info(
            "dispatcher ready (instance %s, catalog v%d, %d shards, member %s)",
            self.settings.instance,
            self.engine.catalog.version,
            self.engine.ownership.shards,
            self.member,
        )
        return True

    def _purge_stale_inbound(self, _tick: int) -> None:
        """Every tick: early arrivals from other instances not picked up in time are dropped
        (their senders retransmit them), as Service Broker's dispatcher does every notification."""
        if self.engine is not None:
            self.engine.purge_windows(self.clock.now_ms(), self.settings.inbound_stale_ms)

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

    def _subscribe(self) -> None:
        assert self.shards is not None
        self._consumer = kafka.group_consumer(
            self.settings,
            group=self.names.dispatcher_group,
            rebalance_timeout_ms=self.settings.rebalance_timeout_ms,
            assignor=self.settings.group_assignor,
            **{"client.id": f"dispatcher-{self.member}"},
        )
        self._consumer.subscribe(
            [self.names.requests_pattern, self.names.relay, self.names.inbound],
            on_assign=self.shards.on_assign,
            on_revoke=self.shards.on_revoke,
            on_lost=self.shards.on_lost,
        )

    def _close_consumer(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    def _discard_clients(self) -> None:
        """Drop what a failed start attempt built, so the next attempt starts clean."""
        if self.shards is not None:
            self.shards.forget_pending()
        self._close_consumer()
        self._producer = None
        self.engine = None
        self.audit = Audit()

    # ----------------------------------------------------------------- the loop
    def apply_batch(self) -> int:
        """Handle one batch of records and due timers in one transaction; returns records seen."""
        assert self._consumer and self._producer and self.engine and self._writer
        assert self.shards is not None
        self.shards.take_pending(self._consumer)  # shards given while their last owner's txn ran
        now = self.clock.now_ms()
        deadline = self.engine.next_deadline_ms()
        # Never a zero wait: librdkafka counts the time inside a non-blocking poll, rebuilding
        # shards in the assignment callback included, against max.poll.interval.ms.
        wait_s = 0.1 if deadline is None else min(0.1, max(0.001, (deadline - now) / 1000))
        # Polling (and so any rebalance) happens here, never inside a transaction.
        msgs = kafka.consume_batch(self._consumer, self.settings.batch_max, wait_s)
        records = [m for m in msgs if _is_record(m)]
        now = self.clock.now_ms()
        if len(self._pieces):
            self._pieces.purge(now, self.settings.reassembly_stale_ms)
        deadline = self.engine.next_deadline_ms()
        if not records and (deadline is None or deadline > now):
            return 0
        started = time.perf_counter()
        p = self._producer
        p.begin_transaction()
        for m in records:
            self._write(self._handle(m, now), now)
        self._write(self.engine.tick(now), now)
        self._writer.flush(self.engine.changed_depths(now))
        offsets = self.shards.transaction_offsets(self._consumer, records)
        self._batch = len(records)
        if offsets:
            # With a time limit: without one, librdkafka waits forever while the coordinator
            # answers CONCURRENT_TRANSACTIONS after a broker restart (found by the chaos harness).
            with self.watchdog.guard("send_offsets_to_transaction"):
                p.send_offsets_to_transaction(
                    offsets, self._consumer.consumer_group_metadata(), TXN_CALL_TIMEOUT_S
                )
        with self.watchdog.guard("commit_transaction"):
            p.commit_transaction(TXN_CALL_TIMEOUT_S)
        self.applied += len(records)
        self.transactions += 1
        TXN_SECONDS.observe(time.perf_counter() - started)
        self._queue_metrics.export_depth(self.engine)
        return len(records)

    def _write(self, out: Outputs, now: int) -> None:
        assert self._writer is not None
        if out.received or out.purged or out.dead_letters:
            self._queue_metrics.observe(out, now)
        self._writer.write(out, now, self.settings.instance)

    def _handle(self, m: Message, now: int) -> Outputs:
        assert self.engine is not None and self._router is not None
        try:
            incoming = self._router.read(m)
            if incoming.elsewhere is not None:
                return handed_over(incoming.elsewhere)
            if incoming.relayed is not None:
                self._relayed[incoming.relayed.action.kind].inc()
                return self.engine.handle_relayed(incoming.relayed, now)
            request = incoming.request
            assert request is not None  # Incoming always holds one of the three
            if isinstance(request, FragmentRecord):
                joined = self._joined(request, m, now)
                if joined is None:
                    return Outputs()
                if isinstance(joined, RelayRequest):
                    return handed_over(joined)
                request = joined
        except ProtocolError as exc:
            self._errors[exc.code].inc()
            out = Engine.malformed(
                exc,
                topic=m.topic() or "",
                partition=m.partition() or 0,
                offset=m.offset() or 0,
                raw=m.value(),
            )
            out.principal = self._router.principal_of(m.topic() or "")
            return out
        self._requests[request.kind].inc()
        out = self.engine.handle(
            request, now, sent_ms=incoming.sent_ms, principal=incoming.principal
        )
        for e in out.errors:
            self._errors[e.code].inc()
        if isinstance(request, CommitRequest) and request.receipt is not None:
            self._commits["refused" if out.errors else "applied"].inc()
        return out

    def _joined(
        self, piece: FragmentRecord, m: Message, now: int
    ) -> AnyRequest | RelayRequest | None:
        """A fragment of a large inbound message: the whole message once its last piece is in
        (or, when it belongs to another shard, the relay to its owner), None until then."""
        assert self._router is not None
        if piece.to_instance != self.settings.instance:
            return None  # passing through: the forwarder's
        try:
            whole = self._pieces.offer(piece, now)
        except ValueError as exc:
            raise ProtocolError(f"fragments of {piece.message_id} do not join: {exc}") from exc
        if whole is not None and self._router.elsewhere(whole.key, m.partition() or 0):
            return self._router.to_owner(whole.key, dumps(whole), "inbound", None, None)
        return whole

    def _recover(self, exc: KafkaException) -> None:
        """A failed transaction: abort it, then rebuild the owned shards from Kafka and go back to
        their committed offsets (the aborted batch changed the engine's state); a dispatcher the
        group left behind rejoins instead. A producer Kafka fenced (its transaction timed out, or
        a newer one took its id) means starting over."""
        err = exc.args[0]
        log.warning("transaction failed (%s); its work is dropped and redone from Kafka", err)
        assert self._producer is not None and self._writer is not None
        self._writer.discard()
        if err.fatal() or not self._abort():
            self._start_over()
            return
        if err.code() in STALE_EPOCH:
            rewrite = write_again_or_give_up(self._write_again, self._abort)
            if rewrite.failure is None:
                return
            if rewrite.stuck:
                self._start_over()
                return
            err = rewrite.failure
        if err.code() in NOT_A_MEMBER:
            self._rejoin()
        else:
            self._reset()

    def _write_again(self) -> KafkaError | None:
        """The transaction was refused only for the group epoch it carried: write it again with
        the current one (`services.dispatcher.journal`) instead of rebuilding the shards."""
        assert self._producer is not None and self._consumer is not None
        with self.watchdog.guard("write_again"):
            failure = write_again(
                self._producer, self._consumer.consumer_group_metadata, TXN_CALL_TIMEOUT_S
            )
        if failure is None:
            self.applied += self._batch
        return failure

    def _abort(self) -> bool:
        """Abort whatever transaction is open, whatever the error was: a retriable one (an
        offsets commit that timed out while Kafka was down) leaves it open, and every later
        begin would fail in state InTransaction (found by the chaos harness). Nothing open is
        fine. False when the producer is fenced or broken for good, or its abort does not end in
        `ABORT_TIMEOUT_S` (why: its docstring): start over with a new producer, whose
        init_transactions fences this one and has the coordinator abort what it left open."""
        assert self._producer is not None
        try:
            self._producer.abort_transaction(ABORT_TIMEOUT_S)
        except KafkaException as exc:
            err = exc.args[0]
            if err.fatal() or err.code() == KafkaError._TIMED_OUT:
                log.warning("abort not done (%s); starting over with a new producer", err)
                return False
            log.info("abort after a failed transaction: %s", err)
        return True

    def _start_over(self) -> None:
        """A new producer and consumer, and every owned shard rebuilt (`try_start`)."""
        self._discard_clients()
        self.try_start(self.ticker.tick)

    def _rejoin(self) -> None:
        """The group no longer counts this dispatcher in (it was paused past its session): its
        shards are someone else's now. Forget them and join afresh; the assignment it gets is
        rebuilt then, from what their new owners committed."""
        assert self._consumer is not None and self.engine is not None
        for shard in sorted(self.engine.ownership.owned):
            self.engine.drop_shard(shard)
        if self.shards is not None:
            self.shards.forget_pending()
        try:
            self._consumer.close()
        except KafkaException as exc:
            # Leaving needs Kafka (committed offsets, the leave heartbeat); without it the old
            # member expires with its session instead (found by the chaos harness).
            log.warning("consumer not closed cleanly (%s); its membership expires", exc)
        self._pieces = Reassembler()
        self._subscribe()

    def _reset(self) -> None:
        """Owned shards rebuilt, consumer back at their committed offsets (shards still waiting
        for their last owner's transaction, `ShardKeeper.take_pending`, go on waiting)."""
        assert self._consumer is not None and self.engine is not None and self.shards is not None
        owned = set(self.engine.ownership.owned)
        assignment = [tp for tp in self._consumer.assignment() if tp.partition in owned]
        for shard in sorted(owned):
            self.engine.drop_shard(shard)
        relay = [tp for tp in assignment if tp.topic == self.names.relay]
        self.shards.load(self._consumer, relay)
        for tp in rewind_to(self._consumer.committed(assignment, timeout=60)):
            self._consumer.seek(tp)
        self._pieces = Reassembler()
        assert self.engine is not None
        self._publish(self.broker.on_catalog(self.engine.catalog.version, self.clock.now_ms()))


def _is_record(m: Message) -> bool:
    kafka.log_consumer_error(m, log)  # an end-of-partition marker is not worth a line
    return m.error() is None
