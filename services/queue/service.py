"""The queue service: RECEIVE for every client of an instance, in any language, over gRPC.

One replica reads every queue topic of its instance from the beginning (`ksb.queue.fold`): each
queue's index is in memory (a few dozen bytes a message) and the records of ready messages in an
LMDB store on disk (`ksb.queue.bodies`), so a RECEIVE reads its bodies by key whatever order the
backlog was sent in. Every replica holds every queue, so each one can answer any RECEIVE in the
queue's own priority order; the group locks are in Redis, one holder per group whichever replica
took it. The calls are `services.queue.api`; the rules of RECEIVE, of leases and of rollbacks are
`services.queue.receiving` and `services.queue.rollbacks`.

What operators watch (the age of the oldest message, ready and locked groups, the longest held
lock, dead letters) is `services.queue.gauges`, computed at each scrape from this replica's state.

The loop here is the follower: a batch of queue records is folded into the indexes and written to
the store under one lock, commit outcomes release the locks they answer and wake the commits
waiting for them, and every RECEIVE waiting for work is woken. A new queue in the catalog is read
from its beginning when the catalog arrives. The store is rebuilt on every start by reading the
topics in order, never by seeking per message.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import redis
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition

from ksb.api.queue.v1 import queue_pb2_grpc as pb_grpc
from ksb.catalog.model import CatalogView
from ksb.clock import Clock
from ksb.dialog.permissions import Permissions
from ksb.queue.bodies import BodyStore
from ksb.queue.fold import Folded
from ksb.queue.outcomes import Outcomes
from ksb.runtime import kafka
from ksb.runtime.metrics import HEALTHY
from ksb.runtime.redis_client import redis_client
from ksb.runtime.service import Service, TickTask
from ksb.security.leases import read_lease_key
from ksb.settings import MIN_QUEUE_TIMEOUT_MS, QueueServiceSettings
from services.queue import gauges
from services.queue.api import QueueApi
from services.queue.dead_letters import DeadLetters
from services.queue.fencing import Fencing
from services.queue.logins import Logins
from services.queue.queues import Queues
from services.queue.receiving import Receiving
from services.queue.rollbacks import Rollbacks

__all__ = ["QueueService"]

log = logging.getLogger("ksb.queue")

FOLLOW_BATCH = 1000
"""Queue records folded per batch at most (one store transaction)."""
FOLLOW_PREFETCH_KB = 16384
"""What the follower reads ahead (librdkafka's 64 MiB default would hold the backlog twice)."""
STOP_GRACE_S = 2.0
"""How long calls in progress may take to finish once the service stops."""


class QueueService(Service):
    """One replica of an instance's queue service."""

    name = "queue"
    ready_at_open = False

    def __init__(self, settings: QueueServiceSettings, *, clock: Clock | None = None) -> None:
        super().__init__(settings, clock)
        self.settings: QueueServiceSettings = settings
        self.port = 0
        """Where this replica listens (the setting, or the free port it picked)."""
        self.outcomes = Outcomes(settings.outcome_memory)
        self._permissions = Permissions()
        self._queues: Queues | None = None
        self._receiving: Receiving | None = None
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None
        self._redis: redis.Redis | None = None
        self._server: grpc.Server | None = None
        self._dead_letters = DeadLetters(self.names, lambda: kafka.consumer(settings))

    @property
    def queues(self) -> Queues:
        assert self._queues is not None, "the service is not open"
        return self._queues

    def open(self) -> None:
        s = self.settings
        kafka.ensure_topics(kafka.admin(s), kafka.core_topics(self.names, s))
        seal = read_lease_key(s.lease_key_file)
        self._queues = Queues(
            BodyStore(
                Path(s.queue_store_dir),
                max_bytes=s.queue_store_max_bytes,
                readers=s.queue_workers + 8,
            )
        )
        self._redis = redis_client(s)
        self._producer = kafka.producer(s)
        prefetch: dict[str, Any] = {"queued.max.messages.kbytes": FOLLOW_PREFETCH_KB}
        self._consumer = kafka.consumer(s, **prefetch)
        fencing = Fencing(s, self._producer, self.outcomes)
        self._receiving = Receiving(
            s,
            self.queues,
            self._redis,
            seal,
            fencing,
            probe=lambda: kafka.consumer(s),
            clock=self.clock,
        )
        self.on_catalog(self.shell.read_catalog())
        api = QueueApi(
            Logins(s, self.clock),
            self._receiving,
            Rollbacks(s, self.queues, self._redis, self._producer),
            fencing,
            self.outcomes,
            lambda: self._permissions,
            commit_wait_ms=s.commit_wait_ms,
        )
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=s.queue_workers, thread_name_prefix="ksb-queue-call"),
            maximum_concurrent_rpcs=s.queue_workers * 4,
            options=[  # clients ping while a call waits (`ksb.sdk.queue_service`)
                ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_QUEUE_TIMEOUT_MS),
                ("grpc.http2.max_ping_strikes", 0),
            ],
        )
        gauges.watch(
            gauges.QueueGauges(
                self._receiving.replica,
                self.queues,
                self._receiving.held,
                self.clock,
                disabled=lambda: [q.name for q in self.catalog.catalog.queues if q.disabled],
                dead_letters=self._dead_letters.counts,
                sla_targets_ms=lambda: self.catalog.catalog.sla_targets_ms,
            )
        )
        pb_grpc.add_QueueServiceServicer_to_server(api, self._server)
        self.port = self._server.add_insecure_port(f"{s.queue_host}:{s.queue_port}")
        self._server.start()
        HEALTHY.labels(self.name).set(1)
        self.ready.set()
        log.info(
            "queue service %s listening on %s:%d", self._receiving.replica, s.queue_host, self.port
        )

    def on_catalog(self, view: CatalogView) -> None:
        """New queues are read from their beginning; the grants are the new version's."""
        s = self.settings
        self._permissions = Permissions.of(view.catalog, s.instance, s.owner_names)
        self._dead_letters.watch(view.catalog.queues)
        if self._consumer is None:
            return
        added = []
        for q in view.catalog.queues:
            if self.queues.add(q.name, q.partitions) is not None:
                topic = self.names.queue(q.name)
                added += [TopicPartition(topic, p, -2) for p in range(q.partitions)]
        if added:
            self._consumer.incremental_assign(added)
        log.info("catalog v%d applied (%d new queue partitions to read)", view.version, len(added))

    def tick_tasks(self) -> Iterable[TickTask]:
        return (TickTask(1, "dead_letters", self._dead_letters.poll),)

    def step(self) -> None:
        """Fold one batch of queue records; wait up to ~50 ms for one."""
        assert self._consumer is not None and self._receiving is not None
        msgs = kafka.consume_batch(self._consumer, FOLLOW_BATCH, 0.05)
        if not msgs:
            return
        out = Folded()
        with self.queues.cond:
            for m in msgs:
                self._fold(m, out)
            self.queues.write(out)
            self.queues.cond.notify_all()
        for outcome in out.outcomes:
            self.outcomes.read(outcome)
        if out.outcomes:
            self._receiving.on_outcomes(out.outcomes)

    def _fold(self, m: Message, out: Folded) -> None:
        topic = m.topic() or ""
        fold = self.queues.get(self.names.queue_of(topic))
        err = m.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                fold.end_of(m.partition() or 0, m.offset() or 0)
            else:
                kafka.log_consumer_error(m, log)
            return
        fold.fold(m.key(), m.value(), m.partition() or 0, m.offset() or 0, out)

    def close(self) -> None:
        HEALTHY.labels(self.name).set(0)
        if self._receiving is not None:
            gauges.unwatch(self._receiving.replica)
        self._dead_letters.close()
        if self._server is not None:
            self._server.stop(STOP_GRACE_S).wait(STOP_GRACE_S + 1)
        if self._receiving is not None:
            self._receiving.close()
        if self._consumer is not None:
            self._consumer.close()
        if self._producer is not None:
            self._producer.flush(5)
        if self._queues is not None:
            self.queues.store.close()
        if self._redis is not None:
            self._redis.close()
