"""The dispatcher: `ksb.dialog.engine.Engine` in Kafka transactions, run in the service shell.

This module is the shell's side: what runs on the ticks, health, catalog changes, and the choice
of what to do next. The parts are modules of their own: `startup` (starting the broker and
retrying a start that failed), `pipeline` (the batch loop: records in, one transaction out),
`recovery` (after a failed transaction), `rebalance` and `rebuild` (the shards the group gives
and takes). A crash at any point neither loses nor duplicates a message: every batch's outputs
and consumed offsets commit in one transaction, and whatever did not commit is redone from Kafka.

Periodic tasks (`ksb.runtime.ticker`, every ``tick_ms``), besides the shell's task-handler check:

* every tick, early arrivals from other instances older than ``inbound_stale_ms`` (10 s) are dropped
  (`ksb.dialog.remote`);
* a broker that has not started is retried (`services.dispatcher.startup`).

Between batches the loop also compares the shards its consumer holds with what the group
coordinator says of this member (asked every ``assignment_check_ms`` on a thread of its own) and
rejoins the group when they have disagreed for ``assignment_stall_ms``
(`services.dispatcher.assignment_watch`: a revocation or an assignment lost in a broker stall).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import KafkaException

from ksb.catalog.model import CatalogView
from ksb.clock import Clock
from ksb.dialog.broker_start import BrokerStart
from ksb.dialog.engine import Engine
from ksb.runtime import kafka
from ksb.runtime.metrics import HEALTHY
from ksb.runtime.service import Service, TickTask
from ksb.settings import DispatcherSettings
from services.dispatcher import gauges
from services.dispatcher.assignment_watch import (
    AssignmentWatch,
    CoordinatorTargets,
    coordinator_targets,
)
from services.dispatcher.notifications import BCN_FLUSH_S, kafka_answers
from services.dispatcher.pipeline import Counts, Pipeline
from services.dispatcher.queue_metrics import QueueMetrics
from services.dispatcher.rebalance import AssignmentFailed
from services.dispatcher.recovery import recover, rejoin
from services.dispatcher.startup import Startup, limits_of, permissions_of
from services.dispatcher.watchdog import Watchdog

__all__ = ["Dispatcher"]

log = logging.getLogger("ksb.dispatcher")


class Dispatcher(Service):
    """One broker instance's dispatcher (run any number; the group splits the shards, and a
    restarted member fences its own previous incarnation)."""

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
        self.member = settings.member or uuid.uuid4().hex[:12]
        """This dispatcher's name in the group and in its transactional id."""
        self.watchdog = Watchdog(settings.stuck_txn_s)
        self.counts = Counts()
        self._queue_metrics = QueueMetrics()
        self.startup = Startup(
            settings,
            member=self.member,
            clock=self.clock,
            handlers=self.handlers,
            kafka_probe=kafka_probe or (lambda: kafka_answers(settings)),
            read_catalog=self.shell.read_catalog,
            watchdog=self.watchdog,
            queue_metrics=self._queue_metrics,
            counts=self.counts,
        )
        self.pipeline: Pipeline | None = None
        """The started broker's loop (None until a start succeeds, and while starting over)."""
        self._watch = AssignmentWatch(settings.assignment_stall_ms / 1000)
        self._targets: CoordinatorTargets | None = None
        self._answers_seen = 0

    @property
    def broker(self) -> BrokerStart:
        return self.startup.broker

    @property
    def engine(self) -> Engine | None:
        return None if self.pipeline is None else self.pipeline.engine

    # ----------------------------------------------------------------- the shell's calls
    def open(self) -> None:
        """Try to start the broker at once; a failure is reported and retried on the ticks."""
        gauges.watch(self.member, self.look)
        self.try_start(0)

    def look(self) -> gauges.MemberLook:
        """This member for the metrics' scrape (`services.dispatcher.gauges`); read from the
        scrape's thread, so only whole values are read (the owned set is copied in one step)."""
        p = self.pipeline
        if p is None:
            return gauges.MemberLook(0, frozenset(), 0.0)
        opened = p.producer.opened_at
        open_s = 0.0 if opened is None else max(0.0, time.monotonic() - opened)
        ownership = p.engine.ownership
        return gauges.MemberLook(ownership.shards, frozenset(ownership.owned), open_s)

    def tick_tasks(self) -> Iterable[TickTask]:
        return (
            TickTask(1, "broker_start", self._broker_tick),
            TickTask(1, "purge_stale_inbound", self._purge_stale_inbound),
        )

    def health(self) -> str | None:
        return self.broker.problem()

    def log_fields(self) -> dict[str, Any]:
        return {**super().log_fields(), "member": self.member}

    def on_catalog(self, view: CatalogView) -> None:
        """A running broker takes a new catalog version, or a queue's new status, at once (a
        stopped one retries on its tick, which watches the catalog topic itself)."""
        engine = self.engine
        if engine is None or (
            view.version == engine.catalog.version and view.held_off == engine.catalog.held_off
        ):
            return
        engine.catalog = view
        engine.permissions = permissions_of(self.settings, view)
        engine.queue_limits = limits_of(self.settings, view)
        self._queue_metrics.declare(view)
        self.startup.publish(self.broker.on_catalog(view.version, self.clock.now_ms()))
        log.info("catalog v%d applied", view.version)

    def step(self) -> None:
        p = self.pipeline
        if p is None:
            wait_ms = self.shell.ticker.next_due_ms - self.clock.now_ms()
            time.sleep(max(0, min(wait_ms, 100)) / 1000)
            return
        try:
            try:
                p.apply_batch()
            except KafkaException as exc:
                if not recover(
                    p,
                    exc,
                    rebuilt=lambda: self._rebuilt(p),
                    limits_changed=lambda: self._limits_changed(p),
                ):
                    self._start_over()
                    return
            self._check_assignment(p)
        except AssignmentFailed as exc:
            log.warning("%s; rejoining the group", exc)
            self._watch.reset()
            rejoin(p)

    def _check_assignment(self, p: Pipeline) -> None:
        """Raise `AssignmentFailed` when this member and the coordinator have disagreed on a
        shard for ``assignment_stall_ms`` (`services.dispatcher.assignment_watch`)."""
        if self._targets is None or p.consumer is None:
            return
        self._targets.follow(p.consumer.memberid())
        answers, view = self._targets.latest()
        if answers == self._answers_seen:
            return  # nothing new: the consumer's assignment is not asked for every batch
        self._answers_seen = answers
        relay = p.names.relay
        held = {tp.partition for tp in p.consumer.assignment() if tp.topic == relay}
        overdue = self._watch.observe(time.monotonic(), held, view)
        if overdue:
            raise AssignmentFailed(
                f"shards {overdue}: this member holds {sorted(held)}, the coordinator sent it "
                f"{sorted(view.current) if view else '?'} and means it to have "
                f"{sorted(view.target) if view else '?'}, for "
                f"{self.settings.assignment_stall_ms} ms"
            )

    def close(self) -> None:
        HEALTHY.labels("dispatcher").set(0)
        gauges.unwatch(self.member)
        log.info(
            "dispatcher %s: %d applied in %d transactions",
            self.member,
            self.counts.applied,
            self.counts.transactions,
        )
        if self._targets is not None:
            self._targets.stop()
        if self.pipeline is not None:
            self.pipeline.close_consumer()
            self.pipeline.producer.flush(5)
            self.pipeline = None
        self.startup.close()

    # ----------------------------------------------------------------- start, and over again
    def try_start(self, tick: int) -> bool:
        """One start attempt on `tick` (`Startup.try_start`); True when the broker runs."""
        pipeline = self.startup.try_start(tick)
        if pipeline is None:
            return False
        self._started(pipeline)
        return True

    def _started(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        if self._targets is None:
            s = self.settings
            probe = coordinator_targets(
                lambda: kafka.admin(s),
                pipeline.names.dispatcher_group,
                pipeline.names.relay,
                timeout_s=s.assignment_stall_ms / 1000,
            )
            self._targets = CoordinatorTargets(probe, s.assignment_check_ms / 1000).start()
        self.ready.set()

    def _broker_tick(self, tick: int) -> None:
        pipeline = self.startup.tick(tick)
        if pipeline is not None:
            self._started(pipeline)

    def _purge_stale_inbound(self, _tick: int) -> None:
        """Every tick: early arrivals from other instances not picked up in time are dropped
        (their senders retransmit them), as Service Broker's dispatcher does every notification."""
        if self.engine is not None:
            self.engine.purge_windows(self.clock.now_ms(), self.settings.inbound_stale_ms)

    def _rebuilt(self, p: Pipeline) -> None:
        """Owned shards were rebuilt after a failed transaction: subscribers hear the catalog
        version the rebuilt state runs."""
        self.startup.publish(self.broker.on_catalog(p.engine.catalog.version, self.clock.now_ms()))

    def _limits_changed(self, p: Pipeline) -> bool:
        """Read the queue topics' size limits again (a lowered one makes Kafka refuse a
        transaction); whether they changed."""
        before = p.engine.queue_limits
        p.engine.queue_limits = limits_of(self.settings, p.engine.catalog)
        return p.engine.queue_limits != before

    def _start_over(self) -> None:
        """A new producer and consumer, and every owned shard rebuilt (`try_start`)."""
        if self.pipeline is not None:
            self.pipeline.shards.forget_pending()
            self.pipeline.close_consumer()
            self.pipeline = None
        self.try_start(self.ticker.tick)
