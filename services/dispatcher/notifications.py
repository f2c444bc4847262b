"""What the dispatcher tells the world about its broker, off its transaction loop.

Broker configuration notifications (BCNs) go to ``ksb.<instance>.bcn`` from a task handler: a BCN
is not part of any dispatcher transaction (a failed start has none, and the catalog change it
reports was written by whoever applied it), and waiting for Kafka to acknowledge it, for seconds
while Kafka is down, must not stall the transaction loop or the retry ticks. The Kafka probe (a
metadata request that takes its whole time-out exactly when Kafka is down) runs there too, and its
answers come back to the loop on its next tick.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from ksb.errors import KsbError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.task_handlers import TaskHandlers, TaskQueueFull
from ksb.settings import KsbSettings
from ksb.wire.protocol import BrokerNotification, dumps

__all__ = ["BCN_FLUSH_S", "PROBE_TIMEOUT_S", "BcnPublisher", "KafkaProbe", "kafka_answers"]

BCN_FLUSH_S = 10.0
"""How long a task handler waits for Kafka to acknowledge BCNs before logging that they are late."""

PROBE_TIMEOUT_S = 1.0
"""How long the Kafka probe waits for metadata: short, so an answer is back before the next tick."""

log = logging.getLogger("ksb.dispatcher")


class BcnPublisher:
    """Publishes BCNs from a task handler, in the order the dispatcher raised them.

    The loop only appends to `_pending` and submits a drain; a drain takes the lock, produces every
    pending BCN in order and waits for the acknowledgement, so two handlers draining at once cannot
    reorder a "start_failed" after the "started" that followed it.
    """

    def __init__(self, settings: KsbSettings, names: Names, handlers: TaskHandlers) -> None:
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


def kafka_answers(settings: KsbSettings, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether Kafka answers a metadata request within `timeout_s`.

    A fresh admin client each time: a long-lived one backs its reconnects off for up to ten seconds
    and would notice Kafka's return late.
    """
    try:
        kafka.admin(settings).list_topics(timeout=timeout_s)
    except KafkaException:
        return False
    return True


class KafkaProbe:
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
