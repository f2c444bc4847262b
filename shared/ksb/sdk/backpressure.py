"""Back-pressure in the client: the I/O half of `ksb.sdk.inflight`.

`KsbClient` calls `Backpressure.before_send` before it produces a request and reports each
delivery. While the client is over its limit (`ClientSettings.max_inflight_requests`), the caller's
thread asks Kafka how far the dispatchers' consumer group has committed (one consumer with the
group's id that never joins it, so it only reads offsets) and sleeps between questions; after
`ClientSettings.backpressure_timeout_s` it gives up with `BackpressureTimeout`. A question Kafka
does not answer (a broker restarting, a coordinator moving, a slow machine) is asked again at the
next interval: only the timeout ends the wait.

Only the SDK slows down this way: a request produced by any other Kafka client (kcat) is applied
whatever the queue in front of it (docs/protocol.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from confluent_kafka import Consumer, KafkaException, TopicPartition

from ksb.clock import Clock, SystemClock
from ksb.errors import BackpressureTimeout
from ksb.names import Names
from ksb.runtime import kafka
from ksb.sdk.inflight import InflightRequests, TopicPartitionKey
from ksb.settings import ClientSettings

__all__ = ["Backpressure", "CommittedOffsets", "OffsetQuery"]

log = logging.getLogger("ksb.sdk.backpressure")

OffsetQuery = Callable[[Sequence[TopicPartitionKey], float], dict[TopicPartitionKey, int]]
"""(partitions, timeout in seconds) -> the committed offset of each one that has one."""
_QUERY_TIMEOUT_S = 2.0


class CommittedOffsets:
    """The dispatchers' committed offsets, read with a consumer that never joins their group."""

    def __init__(self, settings: ClientSettings) -> None:
        self._settings = settings
        self._consumer: Consumer | None = None

    def __call__(
        self, partitions: Sequence[TopicPartitionKey], timeout_s: float
    ) -> dict[TopicPartitionKey, int]:
        if not partitions:
            return {}
        if self._consumer is None:  # made on first need: a client under its limit has none
            group = Names(self._settings.instance).dispatcher_group
            # read_uncommitted: the last committed offsets, not an error while a transaction
            # holds newer ones pending (those are not applied yet either).
            self._consumer = kafka.consumer(self._settings, group=group, read_committed=False)
        tps = [TopicPartition(t, p) for t, p in partitions]
        got = self._consumer.committed(tps, timeout=timeout_s)  # raises: `Backpressure` asks again
        return {
            (tp.topic, tp.partition): tp.offset for tp in got if tp.error is None and tp.offset >= 0
        }

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()


class Backpressure:
    """Holds a client's sends while too many of its requests wait to be applied."""

    def __init__(
        self, settings: ClientSettings, query: OffsetQuery, clock: Clock | None = None
    ) -> None:
        self.rule = InflightRequests(
            settings.max_inflight_requests, stalled_ms=settings.stalled_commit_ms
        )
        self.timeout_ms = int(settings.backpressure_timeout_s * 1000)
        self._query = query
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self.waited_ms = 0
        """Time callers spent waiting here, in total: how much back-pressure there was."""

    def before_send(self) -> None:
        """Return once one more request may be sent (counting it as sent), or raise."""
        with self._lock:
            if self.rule.room():
                self.rule.sent()
                return
        start = self._clock.now_ms()
        try:
            self._wait(start)
        finally:
            with self._lock:
                self.waited_ms += self._clock.now_ms() - start

    def _wait(self, start_ms: int) -> None:
        while True:
            with self._lock:
                now = self._clock.now_ms()
                if self.rule.room():
                    self.rule.sent()
                    return
                if now - start_ms >= self.timeout_ms:
                    raise BackpressureTimeout(
                        f"{self.rule.inflight} requests not applied by the dispatchers after "
                        f"{self.timeout_ms} ms (limit {self.rule.limit}): is a dispatcher running?"
                    )
                partitions = self.rule.queried(now) if self.rule.query_due(now) else None
            if partitions is None:
                self._clock.sleep(self.rule.query_every_ms / 1000)
                continue
            try:
                offsets = self._query(partitions, _QUERY_TIMEOUT_S)
            except KafkaException as exc:
                log.warning("committed offsets not read (%s); asking again", exc)
                continue
            with self._lock:
                self.rule.committed(offsets, self._clock.now_ms())

    def delivered(self, topic: str, partition: int, offset: int) -> None:
        with self._lock:
            self.rule.delivered(topic, partition, offset, self._clock.now_ms())

    def failed(self) -> None:
        with self._lock:
            self.rule.failed()
