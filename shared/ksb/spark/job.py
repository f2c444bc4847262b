"""The audit job's two streaming queries over ``ksb.<instance>.audit`` (Spark's Kafka source).

* **ordering**: events grouped by queue into `applyInPandasWithState`, which runs each queue's
  `QueueOrdering` in the order the events were produced and keeps it in the state store; it emits
  inversion counts per window and (high, low) pair, running totals, activation reaction times and a
  backlog snapshot.
* **sla**: an event-time windowed aggregation with a watermark, per queue, service and priority:
  counts, time-in-queue and end-to-end percentiles, breaches of the catalog's per-level targets,
  purged / dead-lettered / refused / rolled-back counts and distinct readers.

Both write through foreachBatch to Parquet (one file per micro-batch, named by batch id and replaced
when Spark replays a batch after a crash), to ``ksb.<instance>.sla`` and to the Prometheus exporter.
Rows carry absolute values for their window (update mode), never deltas, so a replayed batch rewrites
the same figures instead of adding them twice; the checkpoints hold the Kafka offsets and the state.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from confluent_kafka import Producer
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from ksb.names import Names
from ksb.runtime.kafka import client_security
from ksb.security.credentials import kafka_login
from ksb.settings import KsbSettings
from ksb.spark.exporter import SlaExporter
from ksb.spark.ordering import ROW_COLUMNS, OrderingEvent, QueueOrdering

__all__ = ["AUDIT_SCHEMA", "AuditJob", "JobConfig"]

log = logging.getLogger("ksb.spark")

AUDIT_SCHEMA = StructType(
    [
        StructField("v", IntegerType()),
        StructField("kind", StringType()),
        StructField("event_ms", LongType()),
        StructField("instance", StringType()),
        StructField("queue", StringType()),
        StructField("service", StringType()),
        StructField("conversation_id", StringType()),
        StructField("conversation_handle", StringType()),
        StructField("group", StringType()),
        StructField("priority", IntegerType()),
        StructField("message_id", StringType()),
        StructField("message_ids", ArrayType(StringType())),
        StructField("count", IntegerType()),
        StructField("enqueued_ms", LongType()),
        StructField("time_in_queue_ms", LongType()),
        StructField("end_to_end_ms", LongType()),
        StructField("ready_priority", IntegerType()),
        StructField("targeted", BooleanType()),
        StructField("reader", StringType()),
        StructField("starvation_exception", BooleanType()),
        StructField("reason", StringType()),
    ]
)

ORDERING_SCHEMA = StructType(
    [
        StructField("row", StringType()),
        StructField("queue", StringType()),
        StructField("kind", StringType()),
        StructField("window_start_ms", LongType()),
        StructField("event_ms", LongType()),
        StructField("high", IntegerType()),
        StructField("low", IntegerType()),
        StructField("inversions", LongType()),
        StructField("starvation_exceptions", LongType()),
        StructField("reaction_ms", LongType()),
        StructField("ready_messages", LongType()),
        StructField("ready_groups", LongType()),
        StructField("locked_groups", LongType()),
    ]
)
assert tuple(f.name for f in ORDERING_SCHEMA.fields) == ROW_COLUMNS

_ORDERING_KINDS = (
    "enqueue",
    "receive",
    "transmit",
    "commit",
    "purge",
    "dead_letter",
    "acknowledge",
    "refused",
    "rollback",
    "queue_activation",
    "activation_start",
)


@dataclass(frozen=True)
class JobConfig:
    """What one run of the job reads, where it keeps its state and writes, and its windows."""

    instance: str
    bootstrap: str
    checkpoint_dir: Path
    output_dir: Path
    window_s: int = 10
    watermark_s: int = 30
    trigger_s: int = 5
    sla_targets_ms: Mapping[int, int] = field(default_factory=dict)
    write_kafka: bool = True
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


class AuditJob:
    """Starts, runs and stops the two queries; the SparkSession is the caller's (one per process)."""

    def __init__(
        self, spark: SparkSession, config: JobConfig, *, exporter: SlaExporter | None = None
    ) -> None:
        self.spark = spark
        self.config = config
        self.exporter = exporter
        self.queries: list[StreamingQuery] = []
        self._producer: Producer | None = None

    # ----------------------------------------------------------------- the source
    def events(self) -> DataFrame:
        """Audit events from the topic's beginning (on a first run), committed records only."""
        reader = self.spark.readStream.format("kafka")
        for key, value in self.config.java_login.items():
            reader = reader.option(f"kafka.{key}", value)
        raw = (
            reader.option("kafka.bootstrap.servers", self.config.bootstrap)
            # The consumer group's name, so an ACL can name it (`ksb.security.kafka_acls`).
            .option("groupIdPrefix", f"{self.config.names.prefix}.spark")
            .option("subscribe", self.config.names.audit)
            .option("startingOffsets", "earliest")
            # The dispatcher writes its events in transactions: never count an aborted one.
            .option("kafka.isolation.level", "read_committed")
            # Retention may delete events the job has not read (it was down): go on, do not fail.
            .option("failOnDataLoss", "false")
            .load()
        )
        parsed = raw.select(
            F.from_json(F.col("value").cast("string"), AUDIT_SCHEMA).alias("e"),
            "partition",
            "offset",
        )
        return (
            parsed.select("e.*", "partition", "offset")
            .where(F.col("v") == 1)
            .withColumn("event_time", F.timestamp_millis(F.col("event_ms")))
        )

    # ----------------------------------------------------------------- ordering audit
    def ordering_frame(self, events: DataFrame) -> DataFrame:
        window_ms = self.config.window_s * 1000
        slim = events.where(F.col("kind").isin(*_ORDERING_KINDS)).select(
            "queue",
            "kind",
            "event_ms",
            "group",
            "priority",
            "count",
            F.coalesce(F.col("targeted"), F.lit(False)).alias("targeted"),
            F.coalesce(F.col("starvation_exception"), F.lit(False)).alias("starvation_exception"),
            "partition",
            "offset",
        )

        def order_queue(
            key: tuple[Any, ...], batches: Iterator[pd.DataFrame], state: GroupState
        ) -> Iterator[pd.DataFrame]:
            (queue,) = key
            machine = (
                QueueOrdering.from_json(state.get[0])
                if state.exists
                else QueueOrdering(window_ms=window_ms)
            )
            frames = [b for b in batches if len(b)]
            if frames:
                pdf = pd.concat(frames).sort_values(["partition", "offset"], kind="stable")
                for e in pdf.itertuples(index=False):
                    machine.apply(
                        OrderingEvent(
                            kind=str(e.kind),
                            event_ms=int(e.event_ms),
                            group=None if pd.isna(e.group) else str(e.group),
                            priority=None if pd.isna(e.priority) else int(e.priority),
                            count=None if pd.isna(e.count) else int(e.count),
                            targeted=bool(e.targeted),
                            starvation_exception=bool(e.starvation_exception),
                        )
                    )
            state.update((machine.to_json(),))
            yield pd.DataFrame(machine.drain_rows(str(queue)), columns=list(ROW_COLUMNS))

        return slim.groupBy("queue").applyInPandasWithState(
            order_queue,
            ORDERING_SCHEMA,
            StructType([StructField("machine", StringType())]),
            "update",
            GroupStateTimeout.NoTimeout,
        )

    # ----------------------------------------------------------------- SLA windows
    def sla_frame(self, events: DataFrame) -> DataFrame:
        c = self.config
        commit = F.col("kind") == "commit"
        tiq = F.col("time_in_queue_ms")
        target = self._target(F.col("priority"))
        quantiles = F.array(F.lit(0.5), F.lit(0.95), F.lit(0.99))

        def n(kind: str) -> Column:
            return F.count(F.when(F.col("kind") == kind, True))

        grouped = (
            events.withWatermark("event_time", f"{c.watermark_s} seconds")
            .groupBy(
                F.window("event_time", f"{c.window_s} seconds").alias("window"),
                F.col("queue"),
                F.coalesce(F.col("service"), F.lit("")).alias("service"),
                F.coalesce(F.col("priority"), F.lit(0)).alias("priority"),
            )
            .agg(
                n("enqueue").alias("enqueued"),
                n("commit").alias("received"),
                n("receive").alias("receives"),
                n("rollback").alias("rollbacks"),
                n("refused").alias("refused"),
                n("purge").alias("purged"),
                n("dead_letter").alias("dead_lettered"),
                n("error").alias("errors"),
                F.count(F.when(commit & target.isNotNull() & (tiq > target), True)).alias(
                    "breaches"
                ),
                F.percentile_approx(F.when(commit, tiq), quantiles).alias("tiq"),
                F.percentile_approx(F.when(commit, F.col("end_to_end_ms")), quantiles).alias("e2e"),
                F.max(F.when(commit, tiq)).alias("tiq_max_ms"),
                F.approx_count_distinct(F.when(F.col("kind") == "receive", F.col("reader"))).alias(
                    "readers"
                ),
            )
        )
        return grouped.select(
            F.unix_millis(F.col("window.start")).alias("window_start_ms"),
            F.unix_millis(F.col("window.end")).alias("window_end_ms"),
            "queue",
            "service",
            "priority",
            "enqueued",
            "received",
            "receives",
            "rollbacks",
            "refused",
            "purged",
            "dead_lettered",
            "errors",
            "breaches",
            F.col("tiq")[0].alias("tiq_p50_ms"),
            F.col("tiq")[1].alias("tiq_p95_ms"),
            F.col("tiq")[2].alias("tiq_p99_ms"),
            "tiq_max_ms",
            F.col("e2e")[0].alias("e2e_p50_ms"),
            F.col("e2e")[1].alias("e2e_p95_ms"),
            F.col("e2e")[2].alias("e2e_p99_ms"),
            "readers",
            self._target(F.col("priority")).alias("target_ms"),
        )

    def _target(self, priority: Column) -> Column:
        """The catalog's time-in-queue target for a level, or null when it sets none."""
        targets = sorted(self.config.sla_targets_ms.items())
        if not targets:
            return F.lit(None).cast("long")
        (level, ms), rest = targets[0], targets[1:]
        expr = F.when(priority == level, F.lit(int(ms)))
        for level, ms in rest:
            expr = expr.when(priority == level, F.lit(int(ms)))
        return expr.cast("long")

    # ----------------------------------------------------------------- sinks
    def _sink(self, name: str, df: DataFrame, batch_id: int) -> list[dict[str, Any]]:
        rows = [r.asDict() for r in df.collect()]
        if not rows:
            return rows
        folder = self.config.output_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pylist([{**r, "batch_id": batch_id} for r in rows])
        final = folder / f"batch-{batch_id:010d}.parquet"
        tmp = folder / f".{final.name}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, final)  # a replayed batch replaces its file: nothing counted twice
        if self._producer is not None:
            topic = self.config.names.sla
            for r in rows:
                value = json.dumps({"type": name, "batch_id": batch_id, **r}, default=str)
                self._producer.produce(topic, key=_row_key(name, r).encode(), value=value.encode())
            self._producer.flush(30)
        return rows

    def _ordering_batch(self, df: DataFrame, batch_id: int) -> None:
        rows = self._sink("ordering", df, batch_id)
        if self.exporter is not None and rows:
            self.exporter.update_ordering(rows)

    def _sla_batch(self, df: DataFrame, batch_id: int) -> None:
        rows = self._sink("sla", df, batch_id)
        if self.exporter is not None and rows:
            self.exporter.update_sla(rows)

    # ----------------------------------------------------------------- running
    def start(self, *, available_now: bool = False) -> list[StreamingQuery]:
        if self.config.write_kafka and self._producer is None:
            self._producer = Producer(
                {
                    "bootstrap.servers": self.config.bootstrap,
                    "linger.ms": 20,
                    "acks": "all",
                    **self.config.kafka_login,
                }
            )
        events = self.events()
        ckpt = self.config.checkpoint_dir
        specs = (
            ("ordering", self.ordering_frame(events), self._ordering_batch),
            ("sla", self.sla_frame(events), self._sla_batch),
        )
        for name, frame, sink in specs:
            writer = (
                frame.writeStream.queryName(f"ksb_{self.config.instance}_{name}")
                .outputMode("update")
                .option("checkpointLocation", str(ckpt / name))
                .foreachBatch(sink)
            )
            if available_now:
                writer = writer.trigger(availableNow=True)
            else:
                writer = writer.trigger(processingTime=f"{self.config.trigger_s} seconds")
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
        if self._producer is not None:
            # Spark's callback server keeps the sinks (and so this job) alive: drop the producer
            # here, or its librdkafka threads outlive the job.
            self._producer.flush(10)
            self._producer = None


def _row_key(name: str, r: Mapping[str, Any]) -> str:
    """A stable key per window and series: the topic can be compacted to the latest figures."""
    if name == "sla":
        return f"sla|{r['queue']}|{r['service']}|{r['priority']}|{r['window_start_ms']}"
    return "|".join(
        str(r.get(k))
        for k in ("row", "queue", "kind", "high", "low", "window_start_ms", "event_ms")
    )
