"""The baseline: plain confluent-kafka produce and read_committed consume on one partition.

Same client settings as KSB's own (`ksb.runtime.kafka.request_producer` / `ksb.runtime.kafka.consumer`: idempotent,
acks=all, lz4, short fetch wait, and the SDK request producer's linger), so the gap to KSB is what
KSB adds, not a different tuning. (Until 2026-11-24 the baseline lingered 5 ms where the SDK
lingered 2, which flattered KSB's one-at-a-time ratio by about half.)
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

import ksb.runtime.kafka as kafka
from bench.stats import LatencySummary, Rate, make_body, now_ns, parse_body, summarize
from devtools.deployment import Deployment

__all__ = ["RawResult", "median_run", "run_raw"]

_WARMUP = 5


@dataclass(frozen=True)
class RawResult:
    rate: Rate
    latency: LatencySummary
    """Produce -> consume under full load (includes time queued behind earlier messages)."""
    probe: LatencySummary
    """Produce -> consume of one message at a time, nothing else in flight."""
    runs: tuple[float, ...] = ()
    """Every loaded run's throughput (msg/s), in the order run; `rate` and `latency` are the
    median one's."""
    chosen: int = 0
    """The index in `runs` of the median run."""

    def as_json(self) -> dict[str, Any]:
        return {
            "throughput": self.rate.as_json(),
            "throughput_runs": list(self.runs),
            "latency_loaded": self.latency.as_json(),
            "latency_unloaded": self.probe.as_json(),
        }


def median_run(rates: list[float], *, faster: bool = True) -> int:
    """The index of the median of `rates`; of an even count the faster middle one (`faster`),
    so that a baseline chosen between two never flatters KSB's ratios, or the slower one, for
    KSB's own column."""
    if not rates:
        raise ValueError("no runs")
    order = sorted(range(len(rates)), key=lambda i: rates[i])
    return order[len(rates) // 2 if faster else (len(rates) - 1) // 2]


class _Collector(threading.Thread):
    """Consumes the topic and records each message's produce -> consume latency."""

    def __init__(self, settings: Deployment, topic: str) -> None:
        super().__init__(name="bench-raw-consumer", daemon=True)
        self._consumer = kafka.consumer(settings, read_committed=True)
        self._consumer.assign([TopicPartition(topic, 0, -2)])  # -2: from the beginning
        self.latencies_ns: list[int] = []
        self.last_ns = 0
        self.seen = 0
        self.failure: BaseException | None = None
        self.stop = threading.Event()
        self.cond = threading.Condition()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                # consume(n, timeout) returns only when n messages are there or the timeout has
                # passed, so it would add up to `timeout` to every message's latency: block on
                # poll() for the first message, then take whatever else is already fetched.
                first = self._consumer.poll(0.05)
                if first is None:
                    continue
                msgs = [first, *self._consumer.consume(999, 0)]
                now = now_ns()
                got = 0
                for m in msgs:
                    err = m.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            continue
                        raise KafkaException(err)
                    sent, _tag = parse_body(m.value() or b"")
                    self.latencies_ns.append(now - sent)
                    got += 1
                if got:
                    with self.cond:
                        self.seen += got
                        self.last_ns = now
                        self.cond.notify_all()
        except BaseException as exc:  # reported by the producing side
            self.failure = exc
            with self.cond:
                self.cond.notify_all()
        finally:
            self._consumer.close()

    def reset(self) -> None:
        """Count from zero again (everything produced so far has been consumed)."""
        with self.cond:
            self.latencies_ns.clear()
            self.seen = 0

    def wait_for(self, count: int, timeout_s: float) -> None:
        with self.cond:
            if not self.cond.wait_for(
                lambda: self.seen >= count or self.failure is not None, timeout_s
            ):
                raise TimeoutError(f"raw consumer saw {self.seen} of {count} messages in time")
        if self.failure is not None:
            raise RuntimeError("raw consumer failed") from self.failure


def _produce(p: Producer, topic: str, value: bytes) -> None:
    while True:
        try:
            p.produce(topic, value=value, partition=0)
            p.poll(0)
            return
        except BufferError:  # local queue full: let librdkafka drain a little
            p.poll(0.01)


def run_raw(
    settings: Deployment,
    *,
    messages: int,
    body_bytes: int,
    probes: int,
    timeout_s: float,
    warmup_messages: int = 0,
    runs: int = 1,
    on_load: Callable[[bool], None] | None = None,
    settle: Callable[[], object] | None = None,
) -> RawResult:
    """Produce ``messages`` as fast as possible while a read_committed consumer follows, ``runs``
    times, then ``probes`` single round trips; the loaded figures are the median run's.

    One run of 20,000 messages lasts half a second on this machine, and its rate moved from
    22,000 to 45,000 msg/s between otherwise alike `make bench` runs, carrying every KSB ratio
    with it; the median of several is the steadier yardstick.

    ``warmup_messages`` go through first, unmeasured: a fresh JVM broker is several times slower
    until its JIT has compiled the produce and fetch paths, and the KSB run after this one would
    otherwise get a warm broker that the baseline did not have. ``on_load`` is called with True
    before each run's first message and with False once the consumer has them all; ``settle``
    after the warm-up (`bench.stats.jit_settle`)."""
    topic = f"bench.raw.{uuid.uuid4().hex[:8]}"
    kafka.ensure_topics(kafka.admin(settings), [kafka.TopicSpec(topic, 1)])
    collector = _Collector(settings, topic)
    collector.start()
    p = kafka.request_producer(settings)  # the SDK's, so the baseline lingers as KSB's client does
    try:
        # Warm up: connections, metadata and the first fetch are not what is being measured.
        for i in range(warmup_messages):
            _produce(p, topic, make_body(body_bytes, now_ns(), f"w{i}").encode())
        collector.wait_for(warmup_messages, timeout_s)
        if settle is not None:
            settle()
        for i in range(_WARMUP):
            _produce(p, topic, make_body(body_bytes, now_ns(), f"w{i}").encode())
            collector.wait_for(warmup_messages + i + 1, timeout_s)
        loaded_runs = [
            _loaded_run(p, collector, topic, messages, body_bytes, timeout_s, on_load)
            for _ in range(runs)
        ]
        chosen = median_run([rate.per_s for rate, _ in loaded_runs])
        rate, loaded = loaded_runs[chosen]
        collector.reset()
        for i in range(probes):
            _produce(p, topic, make_body(body_bytes, now_ns(), f"p{i}").encode())
            collector.wait_for(i + 1, timeout_s)
        probe = summarize(collector.latencies_ns)
    finally:
        collector.stop.set()
        collector.join(10)
        p.flush(5)
    return RawResult(
        rate=rate,
        latency=loaded,
        probe=probe,
        runs=tuple(r.per_s for r, _ in loaded_runs),
        chosen=chosen,
    )


def _loaded_run(
    p: Producer,
    collector: _Collector,
    topic: str,
    messages: int,
    body_bytes: int,
    timeout_s: float,
    on_load: Callable[[bool], None] | None,
) -> tuple[Rate, LatencySummary]:
    """``messages`` produced as fast as the producer takes them; their rate and latencies."""
    collector.reset()
    if on_load is not None:
        on_load(True)
    started = now_ns()
    for i in range(messages):
        _produce(p, topic, make_body(body_bytes, now_ns(), f"r{i}").encode())
    if p.flush(timeout_s) != 0:
        raise TimeoutError("raw producer could not deliver in time")
    collector.wait_for(messages, timeout_s)
    if on_load is not None:
        on_load(False)
    rate = Rate(messages, (collector.last_ns - started) / 1e9)
    return rate, summarize(collector.latencies_ns[:messages])
