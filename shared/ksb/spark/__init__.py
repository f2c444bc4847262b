"""The Spark Structured Streaming audit and SLA job (issue 6): ``python -m ksb.spark``.

`ordering` is pure and imports no Spark; `session`, `job` and `exporter` need pyspark (the `spark`
extra) and the Kafka connector jars that `make .cache/spark/jars/.fetched` puts in .cache/spark/jars.
"""

from __future__ import annotations

__all__: list[str] = []
