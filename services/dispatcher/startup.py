"""Starting a dispatcher's broker, and retrying a start that failed.

A start checks what the broker needs (the core topics, a valid catalog, every queue's and
dead-letter's topic, the same shard count on every sharded topic), then fences any older
incarnation with ``init_transactions`` and builds the `Pipeline`; the shards themselves come with
the group's assignment and are rebuilt then (`services.dispatcher.rebalance`).

A start that fails (no valid catalog applied yet, missing topics, Kafka unreachable) leaves the
process up with health 0, /healthz answering 503 with the reason, the reason in the
``ksb_broker_info`` metric, the log and a BCN (`services.dispatcher.notifications`, published from
the task handlers). It is retried every ``broker_retry_every`` (5th) tick, or on the next tick
after a new catalog record (`ksb.dialog.broker_start`), or, when Kafka was unreachable, on the next
tick after a probe finds it answering again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaException, TopicPartition
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
from ksb.dialog.permissions import Permissions
from ksb.dialog.shards import Ownership
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.metrics import BROKER_START_FAILURES, BROKER_STATUS, HEALTHY
from ksb.runtime.task_handlers import TaskHandlers
from ksb.security.leases import read_lease_key
from ksb.settings import DispatcherSettings
from ksb.wire.protocol import BrokerNotification
from services.dispatcher.isolation import Isolation
from services.dispatcher.journal import TXN_PRODUCER, JournaledProducer
from services.dispatcher.notifications import BcnPublisher, KafkaProbe
from services.dispatcher.pipeline import Counts, Pipeline
from services.dispatcher.queue_metrics import QueueMetrics
from services.dispatcher.rebalance import ShardKeeper, coordinator_shards
from services.dispatcher.rebuild import LOADER_CONF
from services.dispatcher.routing import Router
from services.dispatcher.watchdog import Watchdog
from services.dispatcher.writer import OutputWriter

__all__ = ["START_TIMEOUT_S", "Startup", "permissions_of"]

START_TIMEOUT_S = 10.0
"""How long one start attempt waits for Kafka's metadata before it counts as failed."""

log = logging.getLogger("ksb.dispatcher")


def permissions_of(settings: DispatcherSettings, view: CatalogView) -> Permissions:
    """Who may do what under a catalog version (`ksb.dialog.permissions`)."""
    return Permissions.of(view.catalog, settings.instance, settings.owner_names)


class Startup:
    """The broker's start attempts: their schedule, what they report, and what they build."""

    def __init__(
        self,
        settings: DispatcherSettings,
        *,
        member: str,
        clock: Clock,
        handlers: TaskHandlers,
        kafka_probe: Callable[[], bool],
        read_catalog: Callable[[], CatalogView],
        watchdog: Watchdog,
        queue_metrics: QueueMetrics,
        counts: Counts,
    ) -> None:
        self.settings = settings
        self.names = Names(settings.instance)
        self.member = member
        self.clock = clock
        self.broker = BrokerStart(settings.instance, retry_every=settings.broker_retry_every)
        self._bcn = BcnPublisher(settings, self.names, handlers)
        self._kafka_probe = KafkaProbe(handlers, kafka_probe)
        self._read_catalog = read_catalog
        self._watchdog = watchdog
        self._queue_metrics = queue_metrics
        self._counts = counts
        self._isolation = Isolation(refuse_after=settings.poison_failures)
        """Failures counted against records outlive a start-over (a new producer and consumer
        redo the same records)."""
        self._catalog_probe: Consumer | None = None
        self._catalog_end: int | None = None

    def try_start(self, tick: int) -> Pipeline | None:
        """One start attempt on `tick`; a failure is reported (log, metrics, BCN), not raised."""
        self.broker.attempt(tick)
        self._catalog_moved()  # the baseline: a catalog record from now on makes a change
        try:
            pipeline = self.start()
        except Exception as exc:
            failure = failure_from_exception(exc)
            if failure.code == "start_error":  # not a configuration problem: keep the traceback
                log.exception("start attempt %d raised", self.broker.attempts)
            self.publish(self.broker.on_failed(failure, self.clock.now_ms()))
            BROKER_START_FAILURES.labels("dispatcher", failure.code).inc()
            self.export_status()
            log.warning(
                "broker not started (attempt %d, %s): %s; retrying every %d ticks",
                self.broker.attempts,
                failure.code,
                failure.reason,
                self.broker.retry_every,
            )
            return None
        self._close_catalog_probe()
        self.publish(self.broker.on_started(pipeline.engine.catalog.version, self.clock.now_ms()))
        self.export_status()
        log.info(
            "dispatcher ready (instance %s, catalog v%d, %d shards, member %s)",
            self.settings.instance,
            pipeline.engine.catalog.version,
            pipeline.engine.ownership.shards,
            self.member,
        )
        return pipeline

    def start(self) -> Pipeline:
        """Start the broker, or raise what keeps it from starting (`BrokerNotStarted`, Kafka's).
        The pipeline it returns has joined the dispatchers' group."""
        s = self.settings
        admin = kafka.admin(s)
        kafka.ensure_topics(admin, kafka.core_topics(self.names, s), timeout_s=START_TIMEOUT_S)
        view = self._read_catalog()
        shards = self._shard_count(admin)
        problem = start_problem(s.instance, view.version, self._missing_topics(admin, view.catalog))
        if problem is not None:
            raise BrokerNotStarted(problem)
        producer = JournaledProducer(
            kafka.producer_conf(
                s,
                transactional_id=f"{self.names.dispatcher_txn_id}.{self.member}",
                txn_timeout_ms=s.txn_timeout_ms,
                extra=TXN_PRODUCER,
            )
        )
        producer.init_transactions(60)
        # Audit events go through the transactional producer: they commit with what they describe.
        audit = Audit(KafkaAudit(producer, self.names))
        engine = Engine(
            view,
            instance=s.instance,
            max_body_bytes=s.max_body_bytes,
            max_output_bytes=s.max_output_bytes,
            ownership=Ownership(shards, owned=()),
        )
        engine.permissions = permissions_of(s, view)
        engine.leases = read_lease_key(s.lease_key_file)
        engine.depth_every_ms = s.depth_every_ms
        held = coordinator_shards(
            lambda: kafka.admin(s), self.names.dispatcher_group, self.names.relay
        )
        keeper = ShardKeeper(
            self.names,
            engine,
            lambda: kafka.consumer(s, **LOADER_CONF),
            lambda: engine.catalog,
            held,
        )
        pipeline = Pipeline(
            settings=s,
            names=self.names,
            clock=self.clock,
            member=self.member,
            producer=producer,
            engine=engine,
            writer=OutputWriter(producer, self.names, shards, audit),
            router=Router(self.names, shards),
            shards=keeper,
            audit=audit,
            watchdog=self._watchdog,
            queue_metrics=self._queue_metrics,
            counts=self._counts,
            isolation=self._isolation,
        )
        self._queue_metrics.declare(view)
        pipeline.subscribe()
        return pipeline

    def _shard_count(self, admin: AdminClient) -> int:
        """The instance's shard count: the relay topic's partitions (the requests topics and
        ``inbound`` must have as many; a mismatch is a broker that cannot start)."""
        topics = admin.list_topics(timeout=START_TIMEOUT_S).topics
        shards = len(topics[self.names.relay].partitions)
        own_inbound = self.names.inbound_from(self.names.instance)
        for name in (self.names.requests, own_inbound, self.names.endpoints):
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

    def tick(self, tick: int) -> Pipeline | None:
        """The every-5th-tick retry (and the next tick after a new catalog record or Kafka's
        return) of a broker that has not started; the pipeline when this tick started it."""
        if self.broker.started:
            return None
        for sent_tick, reachable in self._kafka_probe.answers():
            if self.broker.on_probe(sent_tick, reachable):
                log.info("Kafka answers again; retrying the broker start on tick %d", tick)
        if self._catalog_moved():
            self.broker.note_configuration_change()
        if self.broker.due(tick):
            return self.try_start(tick)
        if self.broker.probe_due(tick) and self._kafka_probe.submit(tick):
            self.broker.probe_sent(tick)
        return None

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

    def export_status(self) -> None:
        status = self.broker.status()
        HEALTHY.labels("dispatcher").set(1 if self.broker.started else 0)
        BROKER_STATUS.labels("dispatcher").info({k: str(v) for k, v in status.items()})

    def publish(self, bcn: BrokerNotification | None) -> None:
        if bcn is not None:
            self._bcn.publish(bcn)

    def close(self) -> None:
        self._close_catalog_probe()
        self._bcn.close()
