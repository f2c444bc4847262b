"""`python -m bench` (`make bench`): run the benchmarks, print the table, write the JSON."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from bench.activation import ActivationOptions
from bench.backlog import BacklogOptions
from bench.cross_instance import CrossOptions
from bench.failover import FailoverOptions
from bench.peer import PeerOptions
from bench.priorities import PriorityOptions
from bench.queues import DEFAULT_REPLICAS
from bench.readers import ReaderOptions
from bench.report import format_table, write_json
from bench.scaling import ScalingOptions
from bench.security import SecurityOptions
from bench.security_e2e import SecurityE2eOptions
from bench.spark_audit import SparkOptions
from bench.suite import Options, run
from bench.transmission import SchedulerOptions

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "var" / "bench" / "results.json"


def _counts(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(","))


def _options(argv: list[str] | None) -> tuple[Options, Path]:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small counts, for a CI smoke run")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the JSON")
    parser.add_argument("--timeout", type=float, help="seconds each phase may take (default 180)")
    g = parser.add_argument_group("raw Kafka and KSB by dispatcher count")
    g.add_argument("--messages", type=int, help="KSB messages per run (default 20000)")
    g.add_argument("--dialogs", type=int, help="KSB dialogs (default 1000)")
    g.add_argument("--raw-messages", type=int, help="raw Kafka messages (default: --messages)")
    g.add_argument(
        "--raw-runs",
        type=int,
        default=3,
        help="loaded runs of raw Kafka; the median one is the baseline (default 3)",
    )
    g.add_argument(
        "--ksb-runs",
        type=int,
        help="loaded runs of KSB per dispatcher count; each column is the median one "
        "(default 3, 1 with --quick)",
    )
    g.add_argument("--body-bytes", type=int, default=1024, help="message size (default 1024)")
    g.add_argument("--dispatchers", default="1,2,4", help="dispatcher counts (default 1,2,4)")
    g.add_argument("--shards", type=int, default=8, help="requests partitions (default 8)")
    g.add_argument(
        "--redis-nodes",
        type=int,
        default=1,
        help="Redis servers; above 1 a Redis Cluster of that many primaries (default 1)",
    )
    g.add_argument("--partitions", type=int, help="target queue partitions (default: --shards)")
    g.add_argument("--receivers", type=int, default=2, help="receiver threads (default 2)")
    g.add_argument("--window", type=int, default=64, help="commits in flight per receiver")
    g.add_argument("--top", type=int, default=0, help="RECEIVE TOP (n); 0 = the whole group")
    g.add_argument("--max-inflight", type=int, default=2_000, help="back-pressure (0: off)")
    g.add_argument(
        "--max-queue-depth",
        type=int,
        default=2_000,
        help="back-pressure on the readers: the target queue's depth a sender waits at, in the "
        "runs of --depth-dispatchers (default 2000)",
    )
    g.add_argument(
        "--depth-dispatchers",
        default="2",
        help="dispatcher counts run again with --max-queue-depth (default 2; '' for none)",
    )
    g.add_argument("--probes", type=int, help="one-at-a-time round trips (default 100)")
    g.add_argument(
        "--queue-replicas",
        type=int,
        default=DEFAULT_REPLICAS,
        help="queue service replicas (child processes) of every instance that RECEIVEs; its "
        f"clients list them all (default {DEFAULT_REPLICAS})",
    )
    g = parser.add_argument_group("sections (each on by default)")
    g.add_argument("--no-peer", action="store_true", help="skip the exactly-once peer without KSB")
    g.add_argument("--peer-runs", type=int, help="loaded runs of the peer (default 3, 1 quick)")
    g.add_argument("--no-readers", action="store_true", help="skip the reader processes section")
    g.add_argument(
        "--reader-processes", type=int, default=4, help="reader processes on one queue (4)"
    )
    g.add_argument("--no-failover", action="store_true", help="skip the failover section")
    g.add_argument("--failover-messages", type=int, help="messages per failover run (60000)")
    g.add_argument(
        "--failover-limits", help="back-pressure limit of each failover run (default 0,2000)"
    )
    g.add_argument("--no-backlog", action="store_true", help="skip the backlog section")
    g.add_argument("--backlog-messages", type=int, help="messages queued (default 1000000)")
    g.add_argument(
        "--backlog-burst",
        type=int,
        default=0,
        help="backlog messages SENT to a dialog in a row (default 0: dialog by dialog; 1: the "
        "hard case for the reader's read-back, far slower to drain)",
    )
    g.add_argument(
        "--backlog-drain-timeout", type=float, help="seconds the drain may take (default 900)"
    )
    g.add_argument(
        "--backlog-interleaved",
        type=int,
        help="messages of the interleaved drain (sent one at a time in turn over the dialogs) "
        "and of the dialog-by-dialog drain it is set against (default 200000; 0: skip)",
    )
    g.add_argument(
        "--no-security",
        action="store_true",
        help="skip both security on/off sections (KSB end to end, and a producer)",
    )
    g.add_argument(
        "--no-security-e2e",
        action="store_true",
        help="skip KSB end to end with security on and off (the producer's section still runs)",
    )
    g.add_argument(
        "--security-runs",
        type=int,
        help="KSB end-to-end runs per security mode (default 3, 1 with --quick)",
    )
    g.add_argument("--no-activation", action="store_true", help="skip the activation section")
    g.add_argument(
        "--activation-dialogs", type=int, help="groups in the activation burst (default 200)"
    )
    g.add_argument("--no-priority", action="store_true", help="skip the priorities section")
    g.add_argument("--no-spark", action="store_true", help="skip the Spark audit section")
    g.add_argument(
        "--no-cross-instance", action="store_true", help="skip the cross-instance section"
    )
    a = parser.parse_args(argv)
    messages = a.messages or (400 if a.quick else 20_000)
    dialogs = a.dialogs or (50 if a.quick else 1_000)
    if messages < dialogs:
        parser.error("--messages must be at least --dialogs")
    timeout_s = a.timeout or (60.0 if a.quick else 180.0)
    probes = a.probes if a.probes is not None else (10 if a.quick else 100)
    scaling = ScalingOptions(
        counts=_counts(a.dispatchers),
        shards=a.shards,
        queue_partitions=a.partitions or a.shards,
        messages=messages,
        dialogs=dialogs,
        body_bytes=a.body_bytes,
        receivers=a.receivers,
        window=a.window,
        top=a.top or None,
        probes=probes,
        max_inflight_requests=a.max_inflight,
        max_queue_depth=a.max_queue_depth,
        depth_counts=_counts(a.depth_dispatchers) if a.depth_dispatchers else (),
        timeout_s=timeout_s,
        warmup_messages=0 if a.quick else 40_000,
        settle_jit=not a.quick,
        runs=a.ksb_runs or (1 if a.quick else 3),
        queue_replicas=a.queue_replicas,
    )
    opts = Options(
        raw_messages=a.raw_messages or messages,
        raw_runs=a.raw_runs,
        body_bytes=a.body_bytes,
        probes=probes,
        timeout_s=timeout_s,
        log_dir=a.out.parent,
        scaling=scaling,
        redis_nodes=a.redis_nodes,
        peer=None
        if a.no_peer
        else PeerOptions(
            messages=messages,
            keys=dialogs,
            body_bytes=a.body_bytes,
            partitions=a.shards,
            probes=probes,
            runs=a.peer_runs or (1 if a.quick else 3),
            timeout_s=timeout_s,
            settle_jit=not a.quick,
        ),
        readers=None
        if a.no_readers
        else ReaderOptions(
            processes=a.reader_processes,
            messages=messages,
            dialogs=dialogs,
            body_bytes=a.body_bytes,
            window=max(1, a.window * a.receivers // a.reader_processes),
            shards=a.shards,
            partitions=a.partitions or a.shards,
            queue_replicas=a.queue_replicas,
            runs=a.ksb_runs or (1 if a.quick else 3),
            timeout_s=timeout_s,
            settle_jit=not a.quick,
        ),
        failover=None if a.no_failover else _failover_options(a),
        backlog=None if a.no_backlog else _backlog_options(a),
        security=None if a.no_security else _security_options(a.quick),
        security_e2e=None
        if a.no_security or a.no_security_e2e
        else SecurityE2eOptions(
            load=scaling, runs=a.security_runs or (1 if a.quick else 3), dispatchers=2
        ),
        activation=None
        if a.no_activation
        else ActivationOptions(
            rounds=1 if a.quick else 3,
            dialogs=a.activation_dialogs or 200,
            queue_replicas=a.queue_replicas,
        ),
        priorities=None if a.no_priority else _priority_options(a.quick, a.queue_replicas),
        spark=None if a.no_spark else _spark_options(a.quick),
        cross_instance=None if a.no_cross_instance else _cross_options(a),
    )
    return opts, a.out


def _failover_options(a: argparse.Namespace) -> FailoverOptions:
    d = FailoverOptions()
    return FailoverOptions(
        messages=a.failover_messages or (3_000 if a.quick else d.messages),
        dialogs=100 if a.quick else d.dialogs,
        body_bytes=a.body_bytes,
        receivers=a.receivers,
        window=a.window,
        limits=_counts(a.failover_limits) if a.failover_limits else ((0,) if a.quick else d.limits),
        queue_replicas=a.queue_replicas,
    )


def _backlog_options(a: argparse.Namespace) -> BacklogOptions:
    d = BacklogOptions()
    return BacklogOptions(
        messages=a.backlog_messages or (5_000 if a.quick else d.messages),
        dialogs=100 if a.quick else d.dialogs,
        body_bytes=a.body_bytes,
        burst=a.backlog_burst,
        timeout_s=600.0 if a.quick else d.timeout_s,
        drain_timeout_s=a.backlog_drain_timeout or (300.0 if a.quick else 900.0),
        queue_replicas=a.queue_replicas,
        compare_interleaved=(
            a.backlog_interleaved
            if a.backlog_interleaved is not None
            else (1_000 if a.quick else 200_000)
        ),
    )


def _security_options(quick: bool) -> SecurityOptions:
    """One stack start per mode (three): `python -m bench.security` alone does two each."""
    if quick:
        return SecurityOptions(starts=1, applies=2, records=2_000, trials=1, one_at_a_time=50)
    return SecurityOptions(starts=1)


def _priority_options(quick: bool, replicas: int) -> tuple[PriorityOptions, SchedulerOptions]:
    if not quick:
        return PriorityOptions(queue_replicas=replicas), SchedulerOptions()
    return (
        PriorityOptions(
            queue_replicas=replicas,
            idle_probes=20,
            backlog=500,
            backlog_groups=50,
            saturated_probes=30,
            throughput_messages=500,
            throughput_groups=50,
            throughput_rounds=1,
            timeout_s=60.0,
        ),
        SchedulerOptions(
            slots=10_000, backlog=1_000, conversations=100, throughput_messages=10_000
        ),
    )


def _spark_options(quick: bool) -> SparkOptions:
    if not quick:
        return SparkOptions()
    return SparkOptions(lag_probes=8, warmup_probes=2, events=10_000, warmup_events=500)


def _cross_options(a: argparse.Namespace) -> CrossOptions:
    """Its own counts (a few thousand messages: it starts four services), the suite's shape."""
    shape = {
        "body_bytes": a.body_bytes,
        "partitions": a.partitions or 4,
        "receivers": a.receivers,
        "window": a.window,
        "queue_replicas": a.queue_replicas,
    }
    if not a.quick:
        return CrossOptions(**shape)
    return CrossOptions(
        messages=200, dialogs=20, probes=10, backlog=100, backlog_dialogs=10, timeout_s=60, **shape
    )


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `finally` blocks that stop processes


def main(argv: list[str] | None = None) -> int:
    opts, out = _options(argv)
    signal.signal(signal.SIGTERM, _terminate)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    results = run(opts)
    write_json(results, out)
    print(format_table(results))
    print(f"results written to {out}")
    return 0 if verified(results) else 1


def verified(results: dict[str, Any]) -> bool:
    """Every run delivered exactly once and in order, and no section failed."""
    ok = all(r["verified_exactly_once_in_order"] for r in results["scaling"]["runs"])
    for key in (
        "peer",
        "readers",
        "failover",
        "activation",
        "cross_instance",
        "priorities",
        "spark_audit",
        "security_e2e",
    ):
        section = results.get(key)
        if section is not None and "error" in section:
            ok = False
    failover = results["failover"]
    if failover is not None and "runs" in failover:
        ok = ok and all(r["verified_exactly_once_in_order"] for r in failover["runs"])
    peer = results.get("peer")
    if peer is not None and not peer.get("verified_exactly_once_in_order", False):
        ok = False
    readers = results.get("readers")
    if readers is not None and not readers.get("verified_exactly_once_in_order", False):
        ok = False
    activation = results["activation"]
    if activation is not None and not activation.get("verified_exactly_once", False):
        ok = False
    cross = results["cross_instance"]
    if cross is not None and not cross.get("verified", False):
        ok = False
    backlog = results["backlog"]
    if backlog is not None and not backlog.get("verified_exactly_once_in_order", False):
        ok = False
    interleaved = (backlog or {}).get("interleaved")
    if interleaved is not None and not interleaved.get("verified_exactly_once_in_order", False):
        ok = False
    e2e = results.get("security_e2e")
    if e2e is not None and not e2e.get("verified_exactly_once_in_order", False):
        ok = False
    security = results["security"]
    return ok and not (security is not None and "error" in security)


if __name__ == "__main__":
    sys.exit(main())
