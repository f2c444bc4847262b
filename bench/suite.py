"""One benchmark run: its own stack, the raw baseline, KSB through 1, 2 and 4 dispatcher
processes, the exactly-once peer without KSB, failover, the other sections on the same stack, the
backlog; then, with that stack stopped, security on and off on stacks of its own: KSB end to
end (bench/security_e2e.py), then a producer and the stacks' starts (bench/security.py).

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
from bench.backlog import BacklogOptions, run_backlog
from bench.cross_instance import CrossOptions, run_cross_instance
from bench.failover import FailoverOptions, run_failover
from bench.peer import PeerOptions, ratios_over_peer, run_peer
from bench.priorities import PriorityOptions, run_priorities
from bench.raw_kafka import run_raw
from bench.readers import ReaderOptions, run_readers
from bench.scaling import ScalingOptions, cpu_ms_per_message, ratios, run_label, run_scaling
from bench.security import SecurityOptions, run_security
from bench.security_e2e import SecurityE2eOptions, run_security_e2e
from bench.spark_audit import SparkOptions, run_spark_audit
from bench.stats import CpuMeter, Phases, jit_settle, peak_rss_kb
from bench.targets import all_targets
from bench.transmission import SchedulerOptions, run_scheduler
from bench.txn_hop import run_txn_hops
from devtools.deployment import Deployment, secure_instance, stack_fields
from devtools.localstack import start_stack
from ksb.security.principals import ADMIN

__all__ = ["Options", "run"]

log = logging.getLogger("bench")


@dataclass(frozen=True)
class Options:
    raw_messages: int
    raw_runs: int
    """Loaded runs of raw Kafka; the median one's figures are the baseline."""
    body_bytes: int
    probes: int
    timeout_s: float
    log_dir: Path
    scaling: ScalingOptions
    """Raw Kafka's peer: KSB through 1, 2 and 4 dispatchers (bench/scaling.py)."""
    redis_nodes: int = 1
    """Above 1, the stack's Redis is a Redis Cluster of that many primaries."""
    peer: PeerOptions | None = None
    """The exactly-once pipeline without KSB beside raw Kafka (bench/peer.py); None skips it."""
    readers: ReaderOptions | None = None
    """The load RECEIVEd by several reader processes on one queue (bench/readers.py)."""
    failover: FailoverOptions | None = None
    """One of three dispatchers SIGKILLed under load (bench/failover.py); None skips it."""
    backlog: BacklogOptions | None = None
    """A million messages queued, then drained (bench/backlog.py); None skips it."""
    security: SecurityOptions | None = None
    """Secured against plaintext stacks (bench/security.py), after this run's stack has stopped;
    None skips it."""
    security_e2e: SecurityE2eOptions | None = None
    """KSB end to end on a secured and a plaintext stack side by side (bench/security_e2e.py),
    after this run's stack has stopped; None skips it."""
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
    load_at_start = os.getloadavg()
    rss_kb: dict[str, int | None] = {}
    phase = Phases(log)

    peer: dict[str, Any] | None = None
    sections: dict[str, dict[str, Any] | None] = {
        "readers": None,
        "failover": None,
        "activation": None,
        "cross_instance": None,
        "priorities": None,
        "spark_audit": None,
        "backlog": None,
        "security_e2e": None,
        "security": None,
    }
    with tempfile.TemporaryDirectory(prefix="ksb-bench-") as tmp:
        workdir = Path(tmp)
        stack = start_stack(workdir / "stack", redis_nodes=opts.redis_nodes)
        phase("stack_start")
        try:
            settings = secure_instance(
                Deployment.model_validate(
                    {
                        "instance": f"bench{uuid.uuid4().hex[:8]}",
                        "kafka_bootstrap": stack.kafka_bootstrap,
                        "redis_url": stack.redis_url,
                        "redis_cluster": stack.redis_cluster,
                        **stack_fields(stack.security),
                    }
                )
            )
            phase("secure")
            # Raw Kafka's topics are nobody's (no instance's ACLs): the admin may write them.
            admin = settings.as_principal(ADMIN)
            stack_pids = {"kafka": stack.kafka_pid, **stack.redis_node_pids}
            raw_meters: list[CpuMeter] = []

            def raw_mark(starting: bool) -> None:
                """Each loaded run of raw Kafka gets a meter of its own."""
                if starting:
                    pids = {"kafka": stack.kafka_pid, "client": None}
                    raw_meters.append(CpuMeter(pids, jvm="kafka"))
                raw_meters[-1].mark(starting)

            raw = run_raw(
                admin,
                messages=opts.raw_messages,
                body_bytes=opts.body_bytes,
                probes=opts.probes,
                timeout_s=opts.timeout_s,
                warmup_messages=opts.raw_messages // 2,
                runs=opts.raw_runs,
                on_load=raw_mark,
                settle=(lambda: jit_settle(stack.kafka_pid)) if opts.scaling.settle_jit else None,
            )
            raw_cpu = raw_meters[raw.chosen]
            raw_j = {
                **raw.as_json(),
                "cpu_s": raw_cpu.spent_s,
                "cpu_ms_per_message": {
                    **{n: c * 1000 / raw.rate.messages for n, c in raw_cpu.spent_s.items()},
                    **raw_cpu.jit_ms_per_message(raw.rate.messages),
                    "all": cpu_ms_per_message(raw_cpu.spent_s, raw.rate.messages),
                },
            }
            rss_kb["bench_after_raw"] = peak_rss_kb()
            phase("raw")
            scaling = run_scaling(settings, opts.scaling, workdir, stack_pids)
            phase("scaling")
            # After the scaling runs: their transactions have warmed the broker's transaction
            # paths, which a fresh JVM runs several times slower (p50 17 -> 12 -> 7 ms in three
            # runs of 120 hops back to back on one broker).
            txn_hop = run_txn_hops(
                admin,
                probes=opts.probes,
                body_bytes=opts.body_bytes,
                timeout_s=opts.timeout_s,
            )
            phase("txn_hop")
            if opts.peer is not None:  # after the scaling runs too: on as warm a broker
                peer_opts = opts.peer
                peer = _section(lambda: run_peer(admin, peer_opts, workdir, stack_pids))
                phase("peer")
            if opts.readers is not None:
                reader_opts = opts.readers
                sections["readers"] = _section(
                    lambda: run_readers(settings, reader_opts, workdir, stack_pids)
                )
                phase("readers")
            if opts.failover is not None:
                failover_opts = opts.failover
                sections["failover"] = _section(
                    lambda: run_failover(settings, failover_opts, workdir)
                )
                phase("failover")
            if opts.activation is not None:
                activation_opts = opts.activation
                sections["activation"] = _section(
                    lambda: run_activation(settings, activation_opts, workdir).as_json()
                )
                phase("activation")
            if opts.cross_instance is not None:
                cross_opts = opts.cross_instance
                sections["cross_instance"] = _section(
                    lambda: run_cross_instance(settings, cross_opts, workdir, raw=raw_j)
                )
                phase("cross_instance")
            if opts.priorities is not None:
                receive_opts, scheduler_opts = opts.priorities
                sections["priorities"] = _section(
                    lambda: {
                        "receive": run_priorities(settings, receive_opts, workdir),
                        "transmission_scheduler": run_scheduler(scheduler_opts),
                    }
                )
                phase("priorities")
            if opts.spark is not None:
                spark_opts = opts.spark
                sections["spark_audit"] = _section(
                    lambda: run_spark_audit(settings, spark_opts, workdir / "spark", workdir)
                )
                phase("spark")
            if opts.backlog is not None:  # last: it leaves a large queue behind on the broker
                backlog_opts = opts.backlog
                sections["backlog"] = _section(lambda: run_backlog(settings, backlog_opts, workdir))
                phase("backlog")
        finally:
            _keep_logs(workdir, opts.log_dir)
            rss_kb["kafka"] = peak_rss_kb(stack.kafka_pid)
            rss_kb["redis"] = peak_rss_kb(stack.redis_pid)
            stack.stop()
            phase("stop")
    if opts.security_e2e is not None:  # stacks of its own, with this one's stopped
        e2e_opts = opts.security_e2e
        with tempfile.TemporaryDirectory(prefix="ksb-bench-security-e2e-") as tmp:
            sections["security_e2e"] = _section(lambda: run_security_e2e(e2e_opts, Path(tmp)))
            _keep_logs(Path(tmp), opts.log_dir / "security-e2e")
        phase("security_e2e")
    if opts.security is not None:  # stacks of its own, with this one's stopped
        security_opts = opts.security
        sections["security"] = _section(lambda: run_security(security_opts))
        phase("security")
    rss_kb["bench"] = peak_rss_kb()
    load_at_end = os.getloadavg()
    s = opts.scaling
    results: dict[str, Any] = {
        "config": {
            "raw_messages": opts.raw_messages,
            "raw_runs": opts.raw_runs,
            "body_bytes": opts.body_bytes,
            "probes": opts.probes,
            "dispatcher_counts": list(s.counts),
            "shards": s.shards,
            "redis_nodes": opts.redis_nodes,
            "cpus": _cpus(),
            "python": platform.python_version(),
            "load_average_at_start": [round(v, 2) for v in load_at_start],
            "load_average_at_end": [round(v, 2) for v in load_at_end],
        },
        "raw": raw_j,
        "txn_hop": txn_hop,
        "scaling": scaling,
        "ratio_ksb_over_raw": {run_label(r): ratios(r, raw_j) for r in scaling["runs"]},
        "peer": peer,
        "ratio_ksb_over_peer": {run_label(r): ratios_over_peer(r, peer) for r in scaling["runs"]}
        if peer is not None and "error" not in peer
        else None,
        **sections,
        "peak_rss_kb": rss_kb,
        "phase_seconds": phase.seconds,
        "wall_seconds": time.monotonic() - started,
    }
    results["targets"] = [t.as_json() for t in all_targets(results)]
    return results


def _keep_logs(workdir: Path, log_dir: Path) -> None:
    """Every service log of the run (not the stack's own) into ``log_dir``, by the same path."""
    for path in workdir.rglob("*.log"):
        rel = path.relative_to(workdir)
        if rel.parts[0] in ("stack", "stacks", "spark"):
            continue
        dest = log_dir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)


def _section(run_it: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run an optional section; a failure is reported in its place, not lost with every figure."""
    try:
        return run_it()
    except Exception as exc:
        log.exception("bench section failed")
        return {"error": f"{type(exc).__name__}: {exc}"}


def _cpus() -> int:
    return len(os.sched_getaffinity(0))
