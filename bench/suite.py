"""One benchmark run: its own stack, the raw baseline, then KSB through a dispatcher process.

Every process started here is stopped on the way out, including after an error or a SIGTERM
(`__main__` turns SIGTERM into SystemExit so these `finally` blocks run).
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.activation import ActivationOptions, run_activation
from bench.cross_instance import LOG_NAMES as CROSS_LOG_NAMES
from bench.cross_instance import CrossOptions, run_cross_instance
from bench.e2e import bench_catalog, run_ksb
from bench.priorities import PriorityOptions, run_priorities
from bench.raw_kafka import run_raw
from bench.spark_audit import SparkOptions, run_spark_audit
from bench.stats import peak_rss_kb
from bench.transmission import SchedulerOptions, run_scheduler
from devtools.deployment import Deployment, secure_instance, stack_fields
from devtools.localstack import start_stack
from devtools.runner import ServiceProcess
from ksb.runtime.catalog_store import apply_catalog
from ksb.security.principals import ADMIN

__all__ = ["Options", "run"]

log = logging.getLogger("bench")


@dataclass(frozen=True)
class Options:
    messages: int
    dialogs: int
    raw_messages: int
    body_bytes: int
    partitions: int
    receivers: int
    window: int
    top: int | None
    probes: int
    timeout_s: float
    log_dir: Path
    activation: ActivationOptions | None = None
    """The activation section (bench/activation.py) on the same stack; None skips it."""
    priorities: tuple[PriorityOptions, SchedulerOptions] | None = None
    """The priorities section (bench/priorities.py, bench/transmission.py); None skips it."""
    spark: SparkOptions | None = None
    """The Spark audit section (bench/spark_audit.py); None skips it."""
    cross_instance: CrossOptions | None = None
    """The cross-instance section (bench/cross_instance.py); None skips it."""


def run(opts: Options) -> dict[str, Any]:
    """Run the benchmarks and return every figure as a JSON-able dict."""
    started = time.monotonic()
    # Other work on the machine skews every figure; the load average says how much there was.
    load_at_start = round(os.getloadavg()[0], 2)
    rss_kb: dict[str, int | None] = {}
    phases: dict[str, float] = {}
    mark = time.monotonic()

    def phase(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        phases[name] = round(now - mark, 2)
        mark = now

    with tempfile.TemporaryDirectory(prefix="ksb-bench-") as tmp:
        stack = start_stack(Path(tmp) / "stack")
        phase("stack_start")
        dispatcher: ServiceProcess | None = None
        activation: dict[str, Any] | None = None
        priorities: dict[str, Any] | None = None
        spark: dict[str, Any] | None = None
        cross: dict[str, Any] | None = None
        try:
            settings = secure_instance(
                Deployment.model_validate(
                    {
                        "instance": f"bench{uuid.uuid4().hex[:8]}",
                        "kafka_bootstrap": stack.kafka_bootstrap,
                        "redis_url": stack.redis_url,
                        **stack_fields(stack.security),
                    }
                )
            )
            phase("secure")
            raw = run_raw(
                settings.as_principal(ADMIN),  # its topic is nobody's: the admin may write it
                messages=opts.raw_messages,
                body_bytes=opts.body_bytes,
                probes=opts.probes,
                timeout_s=opts.timeout_s,
                warmup_messages=opts.raw_messages // 2,
            )
            rss_kb["bench_after_raw"] = peak_rss_kb()
            phase("raw")
            apply_catalog(settings, bench_catalog(opts.partitions))
            # A fresh log file: wait_ready looks for its marker anywhere in the file.
            log_path = Path(tmp) / "dispatcher.log"
            dispatcher = ServiceProcess("dispatcher", settings, log_path).start()
            dispatcher.wait_ready("dispatcher ready")
            assert dispatcher.proc is not None
            phase("dispatcher_start")
            ksb = run_ksb(
                settings,
                dialogs=opts.dialogs,
                messages=opts.messages,
                body_bytes=opts.body_bytes,
                receivers=opts.receivers,
                window=opts.window,
                top=opts.top,
                probes=opts.probes,
                timeout_s=opts.timeout_s,
            )
            rss_kb["dispatcher"] = peak_rss_kb(dispatcher.proc.pid)
            phase("ksb")
            if opts.activation is not None:
                dispatcher.stop()  # idle from here on: keep it out of the activation figures
                activation = run_activation(settings, opts.activation, Path(tmp)).as_json()
                phase("activation")
            dispatcher.stop()  # the later sections run their own: keep this one out of them
            if opts.cross_instance is not None:
                cross_opts, raw_j = opts.cross_instance, raw.as_json()
                cross = _section(
                    lambda: run_cross_instance(settings, cross_opts, Path(tmp), raw=raw_j)
                )
                phase("cross_instance")
            if opts.priorities is not None:
                receive_opts, scheduler_opts = opts.priorities
                priorities = _section(
                    lambda: {
                        "receive": run_priorities(settings, receive_opts, Path(tmp)),
                        "transmission_scheduler": run_scheduler(scheduler_opts),
                    }
                )
                phase("priorities")
            if opts.spark is not None:
                spark_opts = opts.spark
                spark = _section(
                    lambda: run_spark_audit(settings, spark_opts, Path(tmp) / "spark", Path(tmp))
                )
                phase("spark")
        finally:
            if dispatcher is not None:
                if dispatcher.proc is not None and "dispatcher" not in rss_kb:
                    rss_kb["dispatcher"] = peak_rss_kb(dispatcher.proc.pid)
                dispatcher.stop()
                opts.log_dir.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(dispatcher.log_path, opts.log_dir / "dispatcher.log")
            for name in (
                "activation.log",
                "act-dispatcher.log",
                "prio-dispatcher.log",
                "spark-job.log",
                *CROSS_LOG_NAMES,
            ):
                if (Path(tmp) / name).exists():
                    opts.log_dir.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(Path(tmp) / name, opts.log_dir / name)
            rss_kb["kafka"] = peak_rss_kb(stack.kafka_pid)
            rss_kb["redis"] = peak_rss_kb(stack.redis_pid)
            stack.stop()
            phase("stop")
    rss_kb["bench"] = peak_rss_kb()
    return {
        "config": {
            "raw_messages": opts.raw_messages,
            "messages": ksb.rate.messages,
            "dialogs": opts.dialogs,
            "body_bytes": opts.body_bytes,
            "target_partitions": opts.partitions,
            "receivers": opts.receivers,
            "window": opts.window,
            "top": opts.top,
            "probes": opts.probes,
            "cpus": _cpus(),
            "python": platform.python_version(),
            "load_average_1m_at_start": load_at_start,
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        },
        "raw": raw.as_json(),
        "ksb": ksb.as_json(),
        "ratio_ksb_over_raw": {
            "throughput": ksb.rate.per_s / raw.rate.per_s,
            "latency_loaded_p50": ksb.latency.p50_ms / raw.latency.p50_ms,
            "latency_loaded_p99": ksb.latency.p99_ms / raw.latency.p99_ms,
            "latency_unloaded_p50": ksb.probe.p50_ms / raw.probe.p50_ms,
            "latency_unloaded_p99": ksb.probe.p99_ms / raw.probe.p99_ms,
        },
        "activation": activation,
        "priorities": priorities,
        "spark_audit": spark,
        "cross_instance": cross,
        "peak_rss_kb": rss_kb,
        "phase_seconds": phases,
        "wall_seconds": time.monotonic() - started,
    }


def _section(run_it: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run an optional section; a failure is reported in its place, not lost with every figure."""
    try:
        return run_it()
    except Exception as exc:
        log.exception("bench section failed")
        return {"error": f"{type(exc).__name__}: {exc}"}


def _cpus() -> int:
    return len(os.sched_getaffinity(0))
