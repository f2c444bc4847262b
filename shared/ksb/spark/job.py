"""The audit job: one streaming query over ``ksb.<instance>.audit`` (Spark's Kafka source).

The topic is read once, and each record's JSON parsed once against a schema of only the fields
the audit uses. Events are grouped by queue into one `applyInPandasWithState` operator that keeps
each queue's `QueueAudit` (`ksb.spark.queue_audit`) in the state store and feeds it the queue's
events in the order they were produced (one queue's events share one partition of the topic):

* **ordering**: inversion counts per window and (high, low) pair, running totals, activation
  reaction times and a backlog snapshot (ready messages and groups, locked groups, the oldest
  ready message's enqueue time and age), by the rules of `ksb.spark.ordering`;
* **sla**: event-time windows per service and priority with a watermark (`ksb.spark.sla`): counts,
  time-in-queue and end-to-end percentiles, breaches of the catalog's per-level targets, purged /
  dead-lettered / refused / rolled-back counts and distinct readers.

foreachBatch fans each micro-batch out to Parquet, ``ksb.<instance>.sla`` and the Prometheus
exporter (`ksb.spark.sinks`). Rows carry absolute values for their window (update mode), never
deltas, so a replayed batch rewrites the same figures instead of adding them twice; the checkpoint
holds the Kafka offsets and the state.

Why one query and not one per output (as the job first had): each query is its own Kafka read,
JSON parse, plan, offset log and trigger, and on a small machine the two competed for the same
cores. Why the SLA windows are computed in the same Python operator rather than by Spark's
windowed aggregation: Structured Streaming allows only one stateful operator per update-mode query
besides chains in append mode, and a watermark on the query made every data batch followed by a
second, empty one to move it. docs/audit.md has the profile these choices come from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
from confluent_kafka import Producer
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from ksb.names import Names
from ksb.runtime.credentials import kafka_login
from ksb.runtime.kafka import client_security
from ksb.settings import KsbSettings
from ksb.spark.exporter import SlaExporter
from ksb.spark.queue_audit import EVENT_FIELDS, OUTPUT_COLUMNS, AuditSettings, QueueAudit
from ksb.spark.sinks import BatchSinks

__all__ = ["EVENT_SCHEMA", "OUTPUT_SCHEMA", "AuditJob", "JobConfig"]

log = logging.getLogger("ksb.spark")

_EVENT_TYPES: dict[str, DataType] = {
    "v": IntegerType(),
    "kind": StringType(),
    "event_ms": LongType(),
    "queue": StringType(),
    "service": StringType(),
    "group": StringType(),
    "priority": IntegerType(),
    "count": IntegerType(),
    "enqueued_ms": LongType(),
    "time_in_queue_ms": LongType(),
    "end_to_end_ms": LongType(),
    "targeted": BooleanType(),
    "starvation_exception": BooleanType(),
    "reader": StringType(),
}
EVENT_SCHEMA = StructType([StructField(name, t) for name, t in _EVENT_TYPES.items()])
"""The audit event fields (docs/audit.md) the job reads; the parser skips every other field."""
_RECORD_SCHEMA = StructType([*EVENT_SCHEMA.fields, StructField("events", ArrayType(EVENT_SCHEMA))])
"""A record is one event, or (``kind`` ``batch``) a dispatcher transaction's events of a queue."""
assert set(EVENT_FIELDS) <= set(_EVENT_TYPES)

_STRINGS = {"row", "queue", "kind", "service"}
_INTS = {"high", "low", "priority"}
OUTPUT_SCHEMA = StructType(
    [
        StructField(
            c,
            StringType() if c in _STRINGS else IntegerType() if c in _INTS else LongType(),
        )
        for c in OUTPUT_COLUMNS
    ]
)
_STATE_SCHEMA = StructType([StructField("audit", StringType())])


@dataclass(frozen=True)
class JobConfig:
    """What one run of the job reads, where it keeps its state and writes, and its windows."""

    instance: str
    bootstrap: str
    checkpoint_dir: Path
    output_dir: Path
    window_s: int = 10
    watermark_s: int = 30
    trigger_ms: int = 1_000
    sla_targets_ms: Mapping[int, int] = field(default_factory=dict)
    write_kafka: bool = True
    min_partitions: int | None = None
    """Spark tasks to split each micro-batch's offsets into (Kafka source ``minPartitions``);
    None: the session's default parallelism, so reading and parsing use every core even when
    the audit topic has one partition."""
    kafka_login: Mapping[str, str] = field(default_factory=dict)
    """The job's Kafka login as librdkafka properties (its ``sla`` producer)."""
    java_login: Mapping[str, str] = field(default_factory=dict)
    """The same login as Java client properties (Spark's Kafka source)."""

    @property
    def names(self) -> Names:
        return Names(self.instance)

    def logged_in(self, settings: KsbSettings) -> JobConfig:
        """This configuration with the login of the process `settings` belong to."""
        return replace(
            self,
            kafka_login=client_security(settings, settings.kafka_bootstrap),
            java_login=kafka_login(settings, settings.kafka_bootstrap).java(),
        )

    @property
    def audit_settings(self) -> AuditSettings:
        return AuditSettings(
            window_ms=self.window_s * 1000,
            watermark_ms=self.watermark_s * 1000,
            sla_targets_ms=dict(self.sla_targets_ms),
        )


class AuditJob:
    """Starts, runs and stops the query; the SparkSession is the caller's (one per process)."""

    def __init__(
        self, spark: SparkSession, config: JobConfig, *, exporter: SlaExporter | None = None
    ) -> None:
        self.spark = spark
        self.config = config
        self.exporter = exporter
        self.queries: list[StreamingQuery] = []
        self._sinks: BatchSinks | None = None

    # ----------------------------------------------------------------- the source
    def events(self) -> DataFrame:
        """Audit events from the topic's beginning (on a first run), committed records only."""
        reader = self.spark.readStream.format("kafka")
        for key, value in self.config.java_login.items():
            reader = reader.option(f"kafka.{key}", value)
        reader = (
            reader.option("kafka.bootstrap.servers", self.config.bootstrap)
            # The consumer group's name, so an ACL can name it (`ksb.security.kafka_acls`).
            .option("groupIdPrefix", f"{self.config.names.prefix}.spark")
            .option("subscribe", self.config.names.audit)
            .option("startingOffsets", "earliest")
            # The dispatcher writes its events in transactions: never count an aborted one.
            .option("kafka.isolation.level", "read_committed")
            # Retention may delete events the job has not read (it was down): go on, do not fail.
            .option("failOnDataLoss", "false")
            # Fewer, larger fetches when catching up (the consumer's default is 1 MiB).
            .option("kafka.max.partition.fetch.bytes", str(8 << 20))
        )
        splits = self.config.min_partitions
        if splits is None:
            splits = self.spark.sparkContext.defaultParallelism
        if splits > 1:
            reader = reader.option("minPartitions", str(splits))
        parsed = reader.load().select(
            F.from_json(F.col("value").cast("string"), _RECORD_SCHEMA).alias("r"),
            "partition",
            "offset",
        )
        one = F.array(F.struct(*(F.col(f"r.{c}").alias(c) for c in _EVENT_TYPES)))
        events = F.when(F.col("r.kind") == "batch", F.col("r.events")).otherwise(one)
        flat = parsed.where(F.col("r.v") == 1).select(
            F.posexplode(events).alias("pos", "e"), "partition", "offset"
        )
        return flat.where(F.col("e.v") == 1).select(
            # Events left out their queue when it is empty (transmit, acknowledge, suppression).
            F.coalesce(F.col("e.queue"), F.lit("")).alias("queue"),
            *(f"e.{c}" for c in EVENT_FIELDS if c not in ("targeted", "starvation_exception")),
            F.coalesce(F.col("e.targeted"), F.lit(False)).alias("targeted"),
            F.coalesce(F.col("e.starvation_exception"), F.lit(False)).alias("starvation_exception"),
            "partition",
            "offset",
            "pos",
        )

    # ----------------------------------------------------------------- the one stateful step
    def audit_frame(self, events: DataFrame) -> DataFrame:
        return events.groupBy("queue").applyInPandasWithState(
            audit_function(self.config.audit_settings),
            OUTPUT_SCHEMA,
            _STATE_SCHEMA,
            "update",
            GroupStateTimeout.NoTimeout,
        )

    def _batch(self, df: DataFrame, batch_id: int) -> None:
        assert self._sinks is not None
        self._sinks.write(batch_id, df.toArrow().to_pylist())

    # ----------------------------------------------------------------- running
    def start(self, *, available_now: bool = False) -> list[StreamingQuery]:
        producer = None
        if self.config.write_kafka:
            producer = Producer(
                {
                    "bootstrap.servers": self.config.bootstrap,
                    "linger.ms": 5,
                    "acks": "all",
                    **self.config.kafka_login,
                }
            )
        self._sinks = BatchSinks(
            self.config.output_dir,
            self.config.names.sla,
            producer=producer,
            exporter=self.exporter,
        )
        writer = (
            self.audit_frame(self.events())
            .writeStream.queryName(f"ksb_{self.config.instance}_audit")
            .outputMode("update")
            .option("checkpointLocation", str(self.config.checkpoint_dir / "audit"))
            .foreachBatch(self._batch)
        )
        if available_now:
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime=f"{self.config.trigger_ms} milliseconds")
        self.queries.append(writer.start())
        return self.queries

    def run_available_now(self, timeout_s: int | None = None) -> None:
        """Process everything in the topic now, then stop (tests, batch catch-up)."""
        self.start(available_now=True)
        try:
            for q in self.queries:
                q.awaitTermination(timeout_s)
                exc = q.exception()
                if exc is not None:
                    raise exc
        finally:
            self.stop()

    def stop(self) -> None:
        for q in self.queries:
            if q.isActive:
                q.stop()
        self.queries.clear()
        if self._sinks is not None and self._sinks.producer is not None:
            # Spark's callback server keeps the sinks (and so this job) alive: drop the producer
            # here, or its librdkafka threads outlive the job.
            self._sinks.producer.flush(10)
            self._sinks.producer = None


AuditFunction = Callable[
    [tuple[Any, ...], Iterator[pd.DataFrame], GroupState], Iterator[pd.DataFrame]
]


def audit_function(settings: AuditSettings) -> AuditFunction:
    """The per-queue function Spark runs in its Python workers (pickled with ``settings`` only)."""

    def audit_queue(
        key: tuple[Any, ...], batches: Iterator[pd.DataFrame], state: GroupState
    ) -> Iterator[pd.DataFrame]:
        (queue,) = key
        audit = (
            QueueAudit.from_json(state.get[0], settings)
            if state.exists
            else QueueAudit.new(settings)
        )
        frames = [b for b in batches if len(b)]
        if frames:
            pdf = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
            pdf = pdf.sort_values(["partition", "offset", "pos"], kind="stable")
            audit.apply({f: column_values(pdf[f]) for f in EVENT_FIELDS})
        state.update((audit.to_json(),))
        yield pd.DataFrame(audit.drain_rows(str(queue)), columns=list(OUTPUT_COLUMNS))

    return audit_queue


def column_values(series: pd.Series) -> list[Any]:
    """A pandas column as Python values with None for nulls (integer columns with nulls arrive
    as floats with NaN)."""
    values: list[Any] = series.tolist()
    if series.dtype.kind == "f":
        return [None if v != v else int(v) for v in values]
    if series.dtype.kind == "O":
        return [None if v is None or v != v else v for v in values]
    return values
