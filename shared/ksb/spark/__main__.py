"""``python -m ksb.spark``: run the audit job against the instance in the KSB_* settings.

It creates the SLA output topic, serves /metrics on ``KSB_METRICS_PORT`` and runs until SIGTERM or
Ctrl-C, then stops its queries at a micro-batch boundary (the checkpoint is then clean).
The catalog's ``sla_targets_ms`` are read at start: restart the job to pick up new targets.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path

from ksb.errors import KsbError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.catalog_store import load_catalog
from ksb.runtime.metrics import serve_metrics
from ksb.settings import KsbSettings, SparkSettings

log = logging.getLogger("ksb.spark")


def _targets(settings: KsbSettings) -> dict[int, int]:
    try:
        return dict(load_catalog(settings).sla_targets_ms)
    except KsbError as exc:
        log.warning("no catalog (%s): no SLA targets, breaches are not counted", exc)
        return {}


def _path(value: str) -> Path:
    """Relative paths are taken from the working directory, as a deployment would give them."""
    return Path(value).resolve()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from ksb.spark.exporter import SlaExporter
    from ksb.spark.job import AuditJob, JobConfig
    from ksb.spark.session import build_session

    s = SparkSettings.from_env()
    names = Names(s.instance)
    kafka.ensure_topics(
        kafka.admin(s), [*kafka.core_topics(names, s), kafka.TopicSpec(names.sla, 1)]
    )
    config = JobConfig(
        instance=s.instance,
        bootstrap=s.kafka_bootstrap,
        checkpoint_dir=_path(s.spark_checkpoint_dir) / s.instance,
        output_dir=_path(s.spark_output_dir) / s.instance,
        window_s=s.spark_window_s,
        watermark_s=s.spark_watermark_s,
        trigger_ms=s.spark_trigger_ms,
        sla_targets_ms=_targets(s),
    ).logged_in(s)
    port = serve_metrics(s.metrics_port, host=s.metrics_host, instance=s.instance)
    # Local mode by default (inside `make run`); docker-compose points it at its Spark cluster.
    spark = build_session(
        f"ksb-audit-{s.instance}",
        master=s.spark_master,
        jars_dir=_path(s.spark_jars),
        conf={"spark.driver.host": s.spark_driver_host},
    )
    job = AuditJob(spark, config, exporter=SlaExporter())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    job.start()
    log.info("audit job running for %s (metrics on port %s)", s.instance, port or "off")
    try:
        while not stop.wait(1.0):
            for q in job.queries:
                exc = q.exception()
                if exc is not None:
                    raise exc
    finally:
        job.stop()
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
