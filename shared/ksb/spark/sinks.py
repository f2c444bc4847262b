"""Where each micro-batch's rows go: Parquet, the ``ksb.<instance>.sla`` topic, Prometheus.

The job's one query hands every batch to `BatchSinks.write` (foreachBatch). Its rows are split
back into the two outputs the job has always had, ``sla`` and ``ordering``, each with its own
columns, so readers of the Parquet files and the topic see the same records as before the job was
made one query. Writes are idempotent per batch id: the Parquet file is named by it and replaced
when Spark replays the batch after a crash, and the topic is keyed per series and window, so the
latest record per key is current and a replay rewrites the same absolute figures.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from confluent_kafka import Producer

from ksb.spark.exporter import SlaExporter
from ksb.spark.queue_audit import ORDERING_COLUMNS, SLA_COLUMNS
from ksb.wire.sla import encode_sla_row

__all__ = ["OUTPUTS", "BatchSinks", "row_key", "split_rows"]

OUTPUTS: dict[str, tuple[str, ...]] = {"sla": SLA_COLUMNS, "ordering": ORDERING_COLUMNS}
"""Output name -> its columns (the Parquet folder and the ``type`` of a topic record)."""


def split_rows(rows: Iterable[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The job's rows as the two outputs, each row cut down to its output's columns."""
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in OUTPUTS}
    for r in rows:
        name = "sla" if r["row"] == "sla" else "ordering"
        out[name].append({c: r.get(c) for c in OUTPUTS[name]})
    return out


def row_key(name: str, r: Mapping[str, Any]) -> str:
    """A stable key per window and series: the topic can be compacted to the latest figures."""
    if name == "sla":
        return f"sla|{r['queue']}|{r['service']}|{r['priority']}|{r['window_start_ms']}"
    return "|".join(
        str(r.get(k))
        for k in ("row", "queue", "kind", "high", "low", "window_start_ms", "event_ms")
    )


class BatchSinks:
    """Writes one micro-batch to every output; the producer and exporter are optional."""

    def __init__(
        self,
        output_dir: Path,
        topic: str,
        *,
        producer: Producer | None = None,
        exporter: SlaExporter | None = None,
    ) -> None:
        self.output_dir = output_dir
        self.topic = topic
        self.producer = producer
        self.exporter = exporter

    def write(self, batch_id: int, rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
        """Every output of one batch; how many rows each got."""
        outputs = split_rows(rows)
        for name, out in outputs.items():
            if out:
                self._parquet(name, out, batch_id)
                self._kafka(name, out, batch_id)
        if self.producer is not None and any(outputs.values()):
            self.producer.flush(30)
        if self.exporter is not None:
            if outputs["sla"]:
                self.exporter.update_sla(outputs["sla"])
            if outputs["ordering"]:
                self.exporter.update_ordering(outputs["ordering"])
        return {name: len(out) for name, out in outputs.items()}

    def _parquet(self, name: str, rows: list[dict[str, Any]], batch_id: int) -> None:
        folder = self.output_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pylist([{**r, "batch_id": batch_id} for r in rows])
        final = folder / f"batch-{batch_id:010d}.parquet"
        tmp = folder / f".{final.name}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, final)  # a replayed batch replaces its file: nothing counted twice

    def _kafka(self, name: str, rows: list[dict[str, Any]], batch_id: int) -> None:
        if self.producer is None:
            return
        for r in rows:
            value = encode_sla_row(name, batch_id, r)
            self.producer.produce(self.topic, key=row_key(name, r).encode(), value=value)
