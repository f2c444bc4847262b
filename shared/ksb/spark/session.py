"""Build the one SparkSession the audit job (and its tests) use, with the Kafka connector jars.

The connector comes from Maven Central through `make .cache/spark/jars/.fetched` (infra/spark/pom.xml),
not from `spark.jars.packages`, so a run never resolves dependencies at start-up and works offline.
Local mode, a small shuffle, no UI: the job is one small stream, and a default of 200 shuffle
partitions would make every micro-batch schedule 200 tasks. In local mode the shuffle is not
compressed either: its files never leave the machine, and compressing them cost CPU the job's
micro-batches need (the audit job's profile, docs/audit.md).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from pyspark.sql import SparkSession

from ksb.errors import KsbError

__all__ = ["build_session", "spark_jars"]


def spark_jars(jars_dir: Path | None = None) -> list[Path]:
    """The connector jars in `jars_dir` (``KSB_SPARK_JARS``; by default .cache/spark/jars under the
    working directory, where `make` fetches them); fail fast with the fix."""
    folder = jars_dir or Path(".cache") / "spark" / "jars"
    jars = sorted(folder.glob("*.jar"))
    if not any(j.name.startswith("spark-sql-kafka-0-10_") for j in jars):
        raise KsbError(
            f"the Spark Kafka connector is not in {folder}: run `make .cache/spark/jars/.fetched` "
            "(or set KSB_SPARK_JARS to a folder of its jars)"
        )
    return jars


def build_session(
    app_name: str = "ksb-audit",
    *,
    master: str = "local[2]",
    jars_dir: Path | None = None,
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A SparkSession with the connector on its classpath; Python workers use this interpreter."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.appName(app_name)
        .master(master)
        .config("spark.jars", ",".join(str(j) for j in spark_jars(jars_dir)))
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.streaming.noDataMicroBatches.enabled", "true")
        .config(
            "spark.driver.bindAddress", "0.0.0.0" if not master.startswith("local") else "127.0.0.1"
        )
        .config("spark.driver.host", "127.0.0.1")
    )
    if master.startswith("local"):
        builder = builder.config("spark.shuffle.compress", "false")
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    return session
