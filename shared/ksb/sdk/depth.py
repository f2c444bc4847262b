"""Queue-depth back-pressure in the client: a SEND waits while its target queue is deep.

The in-flight limit (`ksb.sdk.inflight`) bounds the requests the dispatchers have not applied
yet; it does not bound what they have applied and nobody has received. A sender faster than the
target queue's readers still piles messages up there, and each new one waits behind the pile:
seconds of queue under load, and more bodies than a reader's cache holds (`ksb.sdk.bodies`), so
RECEIVE reads them back from Kafka and falls further behind. With
`ClientSettings.max_queue_depth`, a SEND of this client on a dialog it began waits while the
target service's queue holds that many unreceived messages, as its dispatchers last wrote them
(`ksb.wire.depth`). The queue is counted shard by shard, each shard holding up to its share of
the limit: a shard whose dispatcher is gone (its count stands still until the shard moves) holds
back only the SENDs to that shard, and no count needs adding up across dispatchers.

It is a rule of the SDK's sender, as the in-flight limit is: a producer that is not the SDK is not
slowed down, a SEND inside a `Transaction` (a reply, committed with what it received) never waits
(the reader would wait on readers, perhaps on itself), and a SEND on a dialog this client did not
begin has no target it knows. A queue may hold more than the limit by the SENDs in flight when it
was reached. After `ClientSettings.backpressure_timeout_s` of waiting, the SEND fails with
`BackpressureTimeout` naming the queue: no reader is keeping up.

`QueueDepths` is the pure rule; `DepthWatch` reads the topic on a thread of its own, from the
first SEND that could wait (a client that never sends on a dialog it began reads nothing).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from confluent_kafka import KafkaError, Message, TopicPartition

from ksb.clock import Clock, SystemClock
from ksb.errors import BackpressureTimeout, ProtocolError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.settings import ClientSettings
from ksb.wire.depth import QueueDepth, parse_depth
from ksb.wire.partitioning import shard_of

__all__ = ["DepthWatch", "QueueDepths"]

log = logging.getLogger("ksb.sdk.depth")

REMEMBERED = 100_000
"""Dialogs whose target a client remembers at most (the oldest are forgotten first: a SEND on a
forgotten one does not wait)."""
_FETCH_WAIT_MS = 50
"""An idle watch asks the broker for news this often; under load records come with every
transaction and a fetch returns at once."""


class QueueDepths:
    """The depth of every queue per shard, and the targets of the dialogs this client began."""

    def __init__(self, limit: int, shards: int, capacity: int = REMEMBERED) -> None:
        self.limit = limit
        """Unreceived messages a target queue may hold before a SEND waits; 0: no limit."""
        self.shards = shards
        self.share = -(-limit // shards)
        """What each shard of a queue may hold: the limit split evenly, rounded up."""
        self._capacity = capacity
        self._depth: dict[tuple[str, int], int] = {}
        self._queue_of: dict[str, str] = {}
        """service -> queue, from the records (a sender names services, not queues)."""
        self._targets: dict[str, str] = {}
        """handle -> the target service of a dialog this client began."""

    def began(self, handle: str, service: str) -> None:
        if self.limit <= 0:
            return
        self._targets[handle] = service
        if len(self._targets) > self._capacity:
            del self._targets[next(iter(self._targets))]

    def target(self, handle: str) -> str | None:
        """The service a SEND on `handle` goes to, if this client began the dialog."""
        return self._targets.get(handle)

    def update(self, record: QueueDepth) -> None:
        self._depth[(record.queue, record.shard)] = record.depth
        for service in record.services:
            self._queue_of[service] = record.queue

    def over(self, service: str, group: str) -> tuple[str, int] | None:
        """(queue, depth) when a SEND to `service` in `group` must wait, else None. A queue no
        record has named yet has nothing waiting."""
        queue = self._queue_of.get(service)
        if queue is None or self.limit <= 0:
            return None
        depth = self._depth.get((queue, shard_of(group, self.shards)), 0)
        return (queue, depth) if depth >= self.share else None


class DepthWatch:
    """Follows the ``depth`` topic and holds SENDs while their target queue is over its share."""

    def __init__(self, settings: ClientSettings, *, clock: Clock | None = None) -> None:
        self.rule = QueueDepths(settings.max_queue_depth, settings.request_partitions)
        self.timeout_ms = int(settings.backpressure_timeout_s * 1000)
        self._settings = settings
        self._clock = clock or SystemClock()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._caught_up = False
        """The topic was read to its end once: until then every SEND that could wait does."""
        self.waited_ms = 0
        """Time SENDs spent waiting here, in total: how much back-pressure there was."""

    def before_send(self, handle: str, group: str) -> None:
        """Return once a SEND on `handle` (in `group`) may go, or raise `BackpressureTimeout`."""
        service = self.rule.target(handle)
        if service is None:
            return
        self._start()
        start = self._clock.now_ms()
        with self._cond:
            while True:
                over = self.rule.over(service, group) if self._caught_up else None
                if self._caught_up and over is None:
                    break
                waited = self._clock.now_ms() - start
                if waited >= self.timeout_ms:
                    self.waited_ms += waited
                    raise BackpressureTimeout(self._why(service, over))
                self._cond.wait(min(0.05, (self.timeout_ms - waited) / 1000))
            self.waited_ms += self._clock.now_ms() - start

    def _why(self, service: str, over: tuple[str, int] | None) -> str:
        if over is None:
            return f"queue depths not read from Kafka in {self.timeout_ms} ms"
        queue, depth = over
        return (
            f"queue {queue!r} of service {service!r} still holds {depth} unreceived messages in "
            f"this dialog's shard after {self.timeout_ms} ms (limit {self.rule.limit}, "
            f"{self.rule.share} a shard): is a reader keeping up?"
        )

    # ----------------------------------------------------------------- the thread
    def _start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="ksb-depth", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        topic = Names(self._settings.instance).depth
        conf: dict[str, Any] = {"fetch.wait.max.ms": _FETCH_WAIT_MS}
        c = kafka.consumer(self._settings, **conf)
        try:
            c.assign([TopicPartition(topic, 0, -2)])
            while not self._stop.is_set():
                self._read(kafka.consume_batch(c, 1000, 0.1))
        except Exception:  # a dead watch must not hold SENDs: they time out with its reason
            log.exception("queue depth watch failed")
        finally:
            c.close()

    def _read(self, msgs: list[Message]) -> None:
        if not msgs:
            return
        with self._cond:
            for m in msgs:
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        self._caught_up = True
                    else:
                        kafka.log_consumer_error(m, log)
                    continue
                try:
                    self.rule.update(parse_depth(m.value()))
                except ProtocolError as exc:
                    log.warning("skipping bad queue depth record: %s", exc)
            self._cond.notify_all()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
