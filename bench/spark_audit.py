"""Spark audit benchmark: how soon an audit event shows in Prometheus, and how fast the job reads.

* **Audit lag**: the job as deployed, ``python -m ksb.spark`` as a child process (own instance,
  1 s trigger, 1 s SLA windows), its exporter scraped every second by a real Prometheus. Each probe
  is one ``commit`` audit event (`ksb.audit.AuditEvent`) on a queue name of its own, produced with
  ``event_ms`` = now; the lag is from that event time to the first instant query that returns its
  ``ksb_sla_messages`` series (polled every ``poll_ms``). So it spans the wait for the next trigger,
  the micro-batch, the wait for the next scrape and up to one poll.
* **Throughput**: ``events`` crafted audit events (enqueue, receive, commit per message over a few
  queues and many groups) in one instance's audit topic, read by one ``trigger(availableNow=True)``
  run of the job's query (`ksb.spark.job.AuditJob`, in this process; the SparkSession's start and a
  first availableNow run over a small topic of its own, which pays the cold JVM's class loading,
  code generation and Python worker start, overlap the lag phase's cold start and are timed
  apart), beside a plain confluent-kafka read_committed consume of the same topic, done first,
  before either Spark JVM starts.
  Events/s are given from the wall time of the run (query start to the query finished) and from
  the stream's own progress reports (rows over the micro-batches' trigger execution time), with
  the progress report's phase durations (addBatch, queryPlanning, walCommit, ...) summed over the
  run's micro-batches: where a micro-batch spends its time.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from prometheus_client import CollectorRegistry

from bench.stats import Phases
from devtools.deployment import Deployment, secure_instance
from devtools.local_prometheus import Prometheus
from devtools.localstack import free_port
from devtools.runner import ServiceProcess
from ksb.names import Names
from ksb.runtime import kafka
from ksb.security.principals import ADMIN, Role
from ksb.wire.audit import AuditEvent

__all__ = ["SparkOptions", "format_lines", "run_spark_audit"]

_LAG_METRIC = "ksb_sla_messages"
_LAG_QUEUE = "benchlag"
_SERVICE = "//bench/spark/Target"


@dataclass(frozen=True)
class SparkOptions:
    lag_probes: int = 40
    probe_gap_ms: int = 370
    """Not a multiple of the trigger or the scrape interval, so probes land at every phase."""
    warmup_probes: int = 3
    poll_ms: int = 50
    events: int = 200_000
    warmup_events: int = 2_000
    queues: int = 8
    groups_per_queue: int = 50
    start_timeout_s: float = 120.0
    run_timeout_s: float = 240.0


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


# --------------------------------------------------------------------------- audit lag
def _probe_event(instance: str, queue: str, event_ms: int) -> AuditEvent:
    return AuditEvent(
        kind="commit",
        event_ms=event_ms,
        instance=instance,
        queue=queue,
        service=_SERVICE,
        group=f"{queue}-g",
        priority=5,
        message_id=uuid.uuid4().hex,
        enqueued_ms=event_ms - 1,
        time_in_queue_ms=1,
        end_to_end_ms=2,
    )


class _LagProbes:
    """Produces probe events (as the stack's admin: only the instance's services may write its
    audit topic) and notes when each one's series first answers a query."""

    def __init__(self, settings: Deployment, prom: Prometheus, poll_ms: int) -> None:
        self._producer = kafka.producer(settings.as_principal(ADMIN))
        self._topic = Names(settings.instance).audit
        self._instance = settings.instance
        self._prom = prom
        self._poll_s = poll_ms / 1000
        self.sent: dict[str, int] = {}
        self.seen: dict[str, int] = {}

    def send(self, queue: str) -> None:
        event = _probe_event(self._instance, queue, _now_ms())
        self._producer.produce(self._topic, key=queue.encode(), value=event.to_json())
        self.sent[queue] = event.event_ms
        self._producer.flush(10)

    def poll(self) -> None:
        asked_ms = _now_ms()
        for r in self._prom.query(f'{_LAG_METRIC}{{queue=~"{_LAG_QUEUE}.*"}}'):
            queue = r["metric"].get("queue", "")
            if queue in self.sent and queue not in self.seen:
                self.seen[queue] = asked_ms

    def wait_seen(self, queues: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(q not in self.seen for q in queues):
            if time.monotonic() > deadline:
                missing = [q for q in queues if q not in self.seen]
                raise TimeoutError(f"{len(missing)} audit probes never showed in Prometheus")
            self.poll()
            time.sleep(self._poll_s)

    def close(self) -> None:
        self._producer.flush(10)


def _lag(
    base: Deployment,
    opts: SparkOptions,
    tmp: Path,
    log_dir: Path,
    before_measuring: Callable[[], None],
) -> dict[str, Any]:
    settings = base.model_copy(
        update={
            "instance": f"{base.instance}spark",
            "metrics_port": free_port(),
            "spark_trigger_ms": 250,
            "spark_window_s": 1,
            "spark_watermark_s": 5,
            "spark_checkpoint_dir": str(tmp / "lag" / "checkpoints"),
            "spark_output_dir": str(tmp / "lag" / "out"),
        }
    )
    settings = secure_instance(settings)
    job = ServiceProcess("spark", settings, log_dir / "spark-job.log", module="ksb.spark")
    prom = Prometheus(tmp / "prometheus", {"spark": settings.metrics_port})
    probes: _LagProbes | None = None
    marks: dict[str, float] = {}
    started = time.monotonic()
    try:
        job.start()
        prom.wait_ready()
        job.wait_ready("audit job running", timeout_s=opts.start_timeout_s)
        marks["job_start_s"] = time.monotonic() - started
        prom.wait_targets_up()
        probes = _LagProbes(settings, prom, opts.poll_ms)
        # The first micro-batches with data pay for Python workers and code generation.
        for i in range(opts.warmup_probes):
            probes.send(f"{_LAG_QUEUE}w{i}")
            probes.wait_seen([f"{_LAG_QUEUE}w{i}"], opts.start_timeout_s)
        marks["warmup_s"] = time.monotonic() - started - marks["job_start_s"]
        before_measuring()
        measured = [f"{_LAG_QUEUE}{i:04d}" for i in range(opts.lag_probes)]
        next_at = time.monotonic()
        for q in measured:
            while time.monotonic() < next_at:
                probes.poll()
                time.sleep(min(opts.poll_ms / 1000, max(0.0, next_at - time.monotonic())))
            probes.send(q)
            next_at += opts.probe_gap_ms / 1000
        probes.wait_seen(measured, 60)
        lags = sorted(probes.seen[q] - probes.sent[q] for q in measured)
    finally:
        if probes is not None:
            probes.close()
        prom.stop()
        job.stop(grace_s=30)
    return {
        "instance": settings.instance,
        "trigger_ms": settings.spark_trigger_ms,
        "window_s": settings.spark_window_s,
        "scrape_s": prom.scrape_s,
        "poll_ms": opts.poll_ms,
        "probes": len(lags),
        "p50_ms": _pct(lags, 50),
        "p95_ms": _pct(lags, 95),
        "max_ms": lags[-1] if lags else None,
        "min_ms": lags[0] if lags else None,
        "job_start_seconds": round(marks["job_start_s"], 2),
        "warmup_seconds": round(marks["warmup_s"], 2),
    }


def _pct(ordered: list[int], q: float) -> int | None:
    if not ordered:
        return None
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


# --------------------------------------------------------------------------- throughput
def _craft(settings: Deployment, events: int, opts: SparkOptions) -> int:
    """Produce ``events`` audit events (enqueue, receive, commit per message) to the topic, as
    the stack's admin: only the instance's services may write its audit topic (applications and
    its owner lost that right with the queue service, issue 39), and these events are the
    bench's, not any service's."""
    names = Names(settings.instance)
    kafka.ensure_topics(
        kafka.admin(settings), [kafka.TopicSpec(names.audit, 1), kafka.TopicSpec(names.sla, 1)]
    )
    p = kafka.producer(settings.as_principal(ADMIN))
    inst = settings.instance
    base = _now_ms() - events  # one event per ms, ending now
    n = 0
    msg = 0
    while n < events:
        queue = f"q{msg % opts.queues}"
        group = f"g{(msg // opts.queues) % opts.groups_per_queue}"
        level = 10 if msg % 3 == 0 else 1
        enq = base + n
        common: dict[str, Any] = {
            "instance": inst,
            "queue": queue,
            "group": group,
            "priority": level,
        }
        mid = f"m{msg}"
        batch = [
            AuditEvent(kind="enqueue", event_ms=enq, service=_SERVICE, message_id=mid, **common),
            AuditEvent(kind="receive", event_ms=enq + 1, reader="r1", count=1, **common),
            AuditEvent(
                kind="commit",
                event_ms=enq + 2,
                service=_SERVICE,
                message_id=mid,
                enqueued_ms=enq,
                time_in_queue_ms=1 + msg % 200,
                end_to_end_ms=3 + msg % 200,
                **common,
            ),
        ]
        for e in batch[: events - n]:
            while True:
                try:
                    p.produce(names.audit, key=queue.encode(), value=e.to_json())
                    break
                except BufferError:
                    p.poll(0.01)
            n += 1
        msg += 1
    if p.flush(60) != 0:
        raise TimeoutError("crafted audit events not delivered in time")
    return n


def _raw_consume(settings: Deployment, expected: int, timeout_s: float) -> dict[str, Any]:
    """confluent-kafka, read_committed, the whole audit topic from its beginning."""
    topic = Names(settings.instance).audit
    c = kafka.consumer(settings, read_committed=True)
    try:
        c.assign([TopicPartition(topic, 0, -2)])
        got = 0
        byte_count = 0
        started = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while got < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw consume read {got} of {expected} audit events")
            for m in c.consume(10_000, 0.5):
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(err)
                got += 1
                byte_count += len(m.value() or b"")
        seconds = time.perf_counter() - started
    finally:
        c.close()
    return {"events": got, "seconds": seconds, "per_s": got / seconds, "bytes": byte_count}


def _available_now(spark: Any, settings: Deployment, tmp: Path, timeout_s: float) -> dict[str, Any]:
    """One availableNow run of the job over the instance's whole audit topic."""
    from ksb.spark.exporter import SlaExporter
    from ksb.spark.job import AuditJob, JobConfig

    config = JobConfig(
        instance=settings.instance,
        bootstrap=settings.kafka_bootstrap,
        checkpoint_dir=tmp / settings.instance / "checkpoints",
        output_dir=tmp / settings.instance / "out",
    ).logged_in(settings.as_service(Role.SPARK))
    job = AuditJob(spark, config, exporter=SlaExporter(CollectorRegistry()))
    started = time.monotonic()
    queries = job.start(available_now=True)
    try:
        for q in queries:
            if not q.awaitTermination(int(timeout_s)):
                raise TimeoutError(f"{q.name} did not finish in {timeout_s:.0f}s")
            exc = q.exception()
            if exc is not None:
                raise exc
        wall_s = time.monotonic() - started
        per_query = {}
        for q in queries:
            progress = [p for p in q.recentProgress if p["numInputRows"]]
            rows = sum(int(p["numInputRows"]) for p in progress)
            busy_ms = sum(int(p["durationMs"].get("triggerExecution", 0)) for p in progress)
            phases: dict[str, int] = {}
            for p in progress:
                for phase, ms in p["durationMs"].items():
                    phases[phase] = phases.get(phase, 0) + int(ms)
            per_query[str(q.name).rsplit("_", 1)[-1]] = {
                "rows": rows,
                "batches": len(progress),
                "trigger_execution_s": busy_ms / 1000,
                "per_s": rows / (busy_ms / 1000) if busy_ms else None,
                "duration_ms": phases,
            }
    finally:
        job.stop()
    return {"wall_seconds": wall_s, "queries": per_query}


class _InProcessSpark:
    """The throughput run's SparkSession, started and warmed up in a background thread.

    The warm-up (a first availableNow run over a small topic of its own) pays the cold JVM's class
    loading, code generation and Python worker start, which are not what a running job pays per
    event. It overlaps the lag phase's own cold start and is over before any figure is measured.
    """

    def __init__(self, tmp: Path, opts: SparkOptions) -> None:
        self._tmp = tmp
        self._opts = opts
        self._spark: Any = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.session_s = 0.0
        self.warmup: dict[str, Any] = {}

    def start(self, warm: Deployment) -> None:
        self._thread = threading.Thread(
            target=self._warm, args=(warm,), name="bench-spark-warmup", daemon=True
        )
        self._thread.start()

    def _warm(self, warm: Deployment) -> None:
        from ksb.spark.session import build_session

        try:
            started = time.monotonic()
            self._spark = build_session(f"ksb-bench-{warm.instance}")
            self.session_s = time.monotonic() - started
            self.warmup = _available_now(self._spark, warm, self._tmp, self._opts.run_timeout_s)
        except BaseException as exc:
            self._error = exc

    def wait_warm(self) -> None:
        if self._thread is not None:
            self._thread.join(self._opts.start_timeout_s + self._opts.run_timeout_s)
            if self._thread.is_alive():
                raise TimeoutError("the in-process SparkSession did not warm up in time")
        if self._error is not None:
            raise RuntimeError("the in-process SparkSession failed to warm up") from self._error

    def run(self, settings: Deployment) -> dict[str, Any]:
        self.wait_warm()
        return _available_now(self._spark, settings, self._tmp, self._opts.run_timeout_s)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(self._opts.start_timeout_s + self._opts.run_timeout_s)
        if self._spark is not None:
            self._spark.stop()


def run_spark_audit(
    base: Deployment, opts: SparkOptions, tmp: Path, log_dir: Path
) -> dict[str, Any]:
    phase = Phases()

    tp = secure_instance(base.model_copy(update={"instance": f"{base.instance}sparktp"}))
    warm = secure_instance(base.model_copy(update={"instance": f"{base.instance}sparkwu"}))
    events = _craft(tp, opts.events, opts)
    _craft(warm, opts.warmup_events, opts)
    phase("produce")
    raw = _raw_consume(tp, events, opts.run_timeout_s)  # before either Spark JVM starts
    phase("raw_consume")
    spark = _InProcessSpark(tmp / "throughput", opts)
    spark.start(warm)
    try:
        lag = _lag(base, opts, tmp, log_dir, before_measuring=spark.wait_warm)
        phase("lag_and_warmup")
        run = spark.run(tp)
        phase("spark_run")
    finally:
        spark.close()
    return {
        "lag": lag,
        "throughput": {
            "instance": tp.instance,
            "events": events,
            "queues": opts.queues,
            "groups_per_queue": opts.groups_per_queue,
            "raw_consume": raw,
            "spark": {
                "session_start_seconds": round(spark.session_s, 2),
                "warmup_events": opts.warmup_events,
                "warmup_seconds": round(spark.warmup.get("wall_seconds", 0.0), 2),
                **run,
                "per_s_wall": events / run["wall_seconds"],
            },
            "ratio_spark_over_raw": events / run["wall_seconds"] / raw["per_s"],
        },
        "phase_seconds": phase.seconds,
    }


def format_lines(j: dict[str, Any]) -> list[str]:
    lag, tp = j["lag"], j["throughput"]
    spark, raw = tp["spark"], tp["raw_consume"]

    def ms(v: int | None) -> str:
        return "n/a" if v is None else f"{v:,} ms"

    qs = ", ".join(
        f"{name} {q['per_s']:,.0f}/s" if q["per_s"] else f"{name} n/a"
        for name, q in spark["queries"].items()
    )
    return [
        f"spark audit: lag from event time to the metric in Prometheus ({lag['probes']} probes, "
        f"trigger {lag['trigger_ms']} ms, scrape {lag['scrape_s']:g} s, poll {lag['poll_ms']} ms): "
        f"p50 {ms(lag['p50_ms'])}, p95 {ms(lag['p95_ms'])}, max {ms(lag['max_ms'])}; "
        f"job ready in {lag['job_start_seconds']:.1f} s",
        f"  throughput over {tp['events']:,} audit events (one availableNow run): "
        f"{spark['per_s_wall']:,.0f} events/s wall ({spark['wall_seconds']:.1f} s; per query from "
        f"progress: {qs}) vs raw confluent-kafka consume {raw['per_s']:,.0f} events/s "
        f"({tp['ratio_spark_over_raw']:.3f}x)",
        f"  (SparkSession start {spark['session_start_seconds']:.1f} s, then a warm-up run over "
        f"{spark['warmup_events']:,} events {spark['warmup_seconds']:.1f} s, not counted)",
        *(
            f"  {name} micro-batch phases (ms, summed): "
            + ", ".join(f"{k} {v:,}" for k, v in sorted(q.get("duration_ms", {}).items()) if v)
            for name, q in spark["queries"].items()
        ),
    ]
