"""KSB through 1, 2 and 4 dispatcher processes beside raw Kafka: what more members buy, what a
message costs in CPU, and how evenly the members share the work.

Each count runs the e2e load (bench/e2e.py: BEGIN + SEND round-robin over many dialogs, RECEIVE +
commit by reader threads, then one message at a time) on an instance of its own, so no run
rebuilds another's state, with the same shards (partitions of the requests topics,
`KsbSettings.request_partitions`) and a target queue co-partitioned with them (its partition count a
multiple of the shards, so a member's transactions touch only its own queue partitions). The SDK's
back-pressure is on (`ClientSettings.max_inflight_requests`).

CPU is utime + stime from /proc/<pid>/stat over the loaded phase alone (first BEGIN to the last
commit outcome) of each dispatcher, of the Kafka broker, of Redis and of this process (the SDK
clients), divided by the messages delivered; the raw baseline is measured the same way (broker and
this process), so "all processes" compares like with like. Messages per dispatcher are the messages
of the dialogs whose shards it owned (the pool has settled before the run and nothing changes it),
beside the records each member says it applied (requests and relayed records, warm-up and probes
included) when it stops.

Before the first count, ``warmup_messages`` go through KSB once, unmeasured, on an instance of
their own: the raw baseline warms the broker's produce and fetch paths the same way, and without
it the first count alone would pay the fresh JVM compiling transactions, compaction and group
code (the broker's JIT compiler threads took more CPU than its request handlers in such a run).
After 10,000 messages they still took 4-6 s of a 20,000-message count (about as much as the
request handlers), after 80,000 about 1 s, so the warm-up is 40,000, and the JIT compiler's share
of the broker's CPU is printed apart (`bench.stats.jit_seconds`): what is left of it is the
fresh broker's cost, not KSB's steady state.

Each count runs `ScalingOptions.runs` times (3; `--ksb-runs`), and its column is the median run
by throughput, as raw Kafka's is: what the broker's JIT compiler does meanwhile moves one run of
the same code by a third, and a column of one run could not tell a change from that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.e2e import KsbResult, Tally, bench_catalog, run_ksb
from bench.peer import COLUMN, table_column
from bench.peer import format_lines as peer_lines
from bench.queues import DEFAULT_REPLICAS, replica_pids, running_queues
from bench.raw_kafka import median_run
from bench.stats import CpuMeter, fmt_ms, jit_settle, peak_rss_kb, ratio, run_ratios
from devtools.deployment import Deployment, secure_instance
from devtools.dispatchers import DispatcherPool
from ksb.runtime.catalog_store import apply_catalog
from ksb.wire.partitioning import shard_of

__all__ = [
    "ScalingOptions",
    "cpu_ms_per_message",
    "format_lines",
    "ratios",
    "run_count",
    "run_label",
    "run_scaling",
    "sharded_instance",
    "warm_up",
]

log = logging.getLogger("bench.scaling")


@dataclass(frozen=True)
class ScalingOptions:
    counts: tuple[int, ...] = (1, 2, 4)
    """Dispatcher processes of each run."""
    shards: int = 8
    queue_partitions: int = 8
    messages: int = 20_000
    dialogs: int = 1_000
    body_bytes: int = 1024
    receivers: int = 2
    window: int = 64
    top: int | None = None
    probes: int = 100
    max_inflight_requests: int = 2_000
    """The sender's back-pressure limit (0 would turn it off)."""
    max_queue_depth: int = 2_000
    """The target queue's depth at which the sender waits for the readers, in the runs of
    `depth_counts` (the others have no such limit)."""
    depth_counts: tuple[int, ...] = (2,)
    """Dispatcher counts run again with `max_queue_depth` (back-pressure on the readers too)."""
    settle_jit: bool = True
    """Wait for the broker's JIT compilers to go idle before each measured run (and raw's)."""
    timeout_s: float = 180.0
    warmup_messages: int = 40_000
    """Messages through KSB (one dispatcher) before the first count, unmeasured (0: none)."""
    queue_replicas: int = DEFAULT_REPLICAS
    """Queue service replicas of each run's instance (the receivers' clients list them all)."""
    runs: int = 3
    """Loaded runs per dispatcher count, each on an instance of its own; the table shows the
    median one by throughput, as raw Kafka's column is its median of `Options.raw_runs`. One run
    of the same code moved from 2,864 to 4,287 msg/s between otherwise alike runs, mostly with
    what the broker's JIT compiler happened to be doing (0.07-0.15 ms per message)."""


def sharded_instance(base: Deployment, suffix: str, shards: int, **update: Any) -> Deployment:
    """A secured instance of its own (`base`'s name + `suffix`) with `shards` shards."""
    return secure_instance(
        base.model_copy(
            update={"instance": f"{base.instance}{suffix}", "request_partitions": shards, **update}
        )
    )


def cpu_ms_per_message(spent_s: dict[str, float], messages: int) -> float:
    return sum(spent_s.values()) * 1000 / messages if messages else float("nan")


def run_scaling(
    base: Deployment, opts: ScalingOptions, workdir: Path, stack_pids: dict[str, int]
) -> dict[str, Any]:
    """One e2e run per dispatcher count; ``stack_pids`` names the broker's and Redis's pids."""
    warmup_s = warm_up(base, opts, workdir)
    runs = []
    plan = [(n, 0) for n in opts.counts] + [(n, opts.max_queue_depth) for n in opts.depth_counts]
    for n, depth in plan:
        tries = []
        for attempt in range(opts.runs):
            if opts.settle_jit:
                waited = jit_settle(stack_pids["kafka"])
                log.info("scaling: the broker's JIT compilers idle after %.1f s", waited)
            tries.append(run_count(base, n, opts, workdir, stack_pids, depth, attempt))
        runs.append(median_ksb_run(tries))
    return {"config": asdict(opts), "warmup_s": warmup_s, "runs": runs}


def median_ksb_run(tries: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of one count's runs by throughput (of an even count the slower middle one, as
    raw Kafka's baseline takes the faster: neither flatters KSB), carrying every run's
    throughput and dispatcher CPU, every run's problems and refused commits: a run that lost or
    repeated a message fails the column whichever run is shown."""
    rates = [r["throughput"]["per_s"] for r in tries]
    shown = dict(tries[median_run(rates, faster=False)])
    shown["throughput_runs"] = rates
    shown["dispatcher_cpu_runs"] = [r["cpu_ms_per_message"]["dispatchers"] for r in tries]
    shown["verified_exactly_once_in_order"] = all(
        r["verified_exactly_once_in_order"] for r in tries
    )
    shown["refused_commits"] = sum(r["refused_commits"] for r in tries)
    shown["problems"] = [
        f"run {i + 1}: {p}" if len(tries) > 1 else p
        for i, r in enumerate(tries)
        for p in r["problems"]
    ]
    return shown


def warm_up(base: Deployment, opts: ScalingOptions, workdir: Path) -> float | None:
    """Run `opts.warmup_messages` through one dispatcher, unmeasured (on an instance of their
    own, under `workdir`); how long it took."""
    if opts.warmup_messages <= 0:
        return None
    settings = _instance(base, "w", opts, 0)
    started = time.monotonic()
    logs = workdir / "scaling-warmup"
    with (
        running_queues(settings, logs, opts.queue_replicas) as (settings, _queues),
        DispatcherPool(settings, logs) as pool,
    ):
        pool.start(1)
        _load(settings, opts, opts.warmup_messages, Tally(expected=opts.warmup_messages), probes=0)
    took = time.monotonic() - started
    log.info("scaling: broker warmed with %d KSB messages in %.1f s", opts.warmup_messages, took)
    return took


def _instance(base: Deployment, suffix: str, opts: ScalingOptions, depth: int) -> Deployment:
    """A secured instance of its own with the run's shards, back-pressure and catalog."""
    settings = sharded_instance(
        base,
        suffix,
        opts.shards,
        max_inflight_requests=opts.max_inflight_requests,
        max_queue_depth=depth,
    )
    apply_catalog(settings, bench_catalog(opts.queue_partitions))
    return settings


def _load(
    settings: Deployment,
    opts: ScalingOptions,
    messages: int,
    tally: Tally,
    *,
    probes: int,
    on_load: Callable[[bool], None] | None = None,
) -> KsbResult:
    """The e2e load of `opts` (bench/e2e.py) with `messages` over at most `opts.dialogs`."""
    return run_ksb(
        settings,
        dialogs=min(opts.dialogs, messages),
        messages=messages,
        body_bytes=opts.body_bytes,
        receivers=opts.receivers,
        window=opts.window,
        top=opts.top,
        probes=probes,
        timeout_s=opts.timeout_s,
        tally=tally,
        on_load=on_load,
    )


def run_count(
    base: Deployment,
    count: int,
    opts: ScalingOptions,
    workdir: Path,
    stack_pids: dict[str, int],
    depth: int = 0,
    attempt: int = 0,
) -> dict[str, Any]:
    """One measured run of `count` dispatchers (and `depth`'s queue-depth limit) on an instance
    of its own; ``stack_pids`` are the processes of the stack counted with the run's."""
    settings = _instance(base, f"x{count}d{depth}r{attempt}", opts, depth)
    tally = Tally(expected=opts.messages)
    logs = workdir / f"scaling-{count}-d{depth}-r{attempt}"
    with (
        running_queues(settings, logs, opts.queue_replicas) as (settings, queues),
        DispatcherPool(settings, logs) as pool,
    ):
        started = time.monotonic()
        pool.start(count)
        start_s = time.monotonic() - started
        owned = pool.owned()
        pids = {name: p.proc.pid for name, p in pool.members.items() if p.proc is not None}
        qpids = replica_pids(queues)
        meter = CpuMeter(
            {**pids, **qpids, **stack_pids, "client": None}, jvm="kafka", librdkafka=tuple(pids)
        )
        log.info("scaling: %d dispatcher(s) own %s", count, owned)
        result = _load(settings, opts, opts.messages, tally, probes=opts.probes, on_load=meter.mark)
        rss = {name: peak_rss_kb(pid) for name, pid in pids.items()}
        queue_rss = {name: peak_rss_kb(pid) for name, pid in qpids.items()}
        pool.stop()
        applied = pool.applied()
    delivered = result.rate.messages
    per_dialog = delivered // opts.dialogs
    shard_dialogs = [shard_of(h, opts.shards) for h in tally.handles]
    members = {
        name: {
            "shards": sorted(shards),
            "messages": per_dialog * sum(1 for s in shard_dialogs if s in shards),
            "applied": applied[name].records if name in applied else None,
            "transactions": applied[name].transactions if name in applied else None,
            "cpu_s": meter.spent_s.get(name),
            "peak_rss_kb": rss.get(name),
        }
        for name, shards in sorted(owned.items())
    }
    dispatcher_cpu = {n: s for n, s in meter.spent_s.items() if n in pids}
    queue_cpu = {n: s for n, s in meter.spent_s.items() if n in qpids}
    return {
        "dispatchers": count,
        "max_queue_depth": depth,
        "queue_replicas": len(qpids),
        "pool_start_s": start_s,
        **result.as_json(),
        "cpu_s": meter.spent_s,
        "queue_service_peak_rss_kb": queue_rss,
        "cpu_ms_per_message": {
            "dispatchers": cpu_ms_per_message(dispatcher_cpu, delivered),
            "queue_service": cpu_ms_per_message(queue_cpu, delivered),
            "dispatchers_librdkafka": meter.librdkafka_ms_per_message(delivered),
            **{
                n: meter.spent_s[n] * 1000 / delivered
                for n in (*stack_pids, "client")
                if n in meter.spent_s
            },
            **meter.jit_ms_per_message(delivered),
            "all": cpu_ms_per_message(meter.spent_s, delivered),
        },
        "members": members,
    }


def run_label(run: dict[str, Any]) -> str:
    """A run's name in the table: its dispatcher count, and its queue-depth limit if it had one."""
    depth = run.get("max_queue_depth")
    label = f"{run['dispatchers']} dispatcher(s)"
    return f"{label}, depth {depth:,}" if depth else label


def ratios(run: dict[str, Any], raw: dict[str, Any]) -> dict[str, float | None]:
    """A KSB run's figures over raw Kafka's (throughput up is good, the rest down)."""
    cpu = run["cpu_ms_per_message"]["all"]
    return {
        **run_ratios(run, raw),
        "cpu_all": ratio(cpu, raw.get("cpu_ms_per_message", {}).get("all")),
    }


def _warmed(cfg: dict[str, Any], seconds: float | None) -> str:
    if seconds is None:
        return ""
    return (
        f"; the broker warmed first with {cfg['warmup_messages']:,} KSB messages "
        f"({seconds:.0f} s, unmeasured, as raw Kafka is warmed before its run)"
    )


def raw_runs_note(raw: dict[str, Any]) -> str:
    """What the table's raw Kafka column is, when it is the median of several runs."""
    runs = raw.get("throughput_runs") or []
    if len(runs) < 2:
        return ""
    rates = ", ".join(f"{r:,.0f}" for r in runs)
    return f"; raw Kafka's figures are its median run of {len(runs)} ({rates} msg/s)"


def ksb_runs_lines(runs: list[dict[str, Any]]) -> list[str]:
    """Each KSB column's runs, when it is the median of several: how far apart they were."""
    if not runs or len(runs[0].get("throughput_runs") or []) < 2:
        return []
    lines = [
        f"each KSB column is its median run of {len(runs[0]['throughput_runs'])} by throughput:"
    ]
    for r in runs:
        rates = " / ".join(f"{t:,.0f}" for t in r["throughput_runs"])
        cpu = r["dispatcher_cpu_runs"]
        lines.append(
            f"  {run_label(r)}: {rates} msg/s; dispatcher CPU {min(cpu):.3f}-{max(cpu):.3f} ms"
        )
    return lines


def _count(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def _x(v: float | None, digits: int = 2) -> str:
    return "" if v is None else f" ({v:.{digits}f}x)"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]


def format_lines(
    s: dict[str, Any], raw: dict[str, Any], peer: dict[str, Any] | None = None
) -> list[str]:
    """The table: raw Kafka, the exactly-once peer (bench/peer.py) when it ran, then each
    dispatcher count, every figure with its ratio to raw; then each over the peer."""
    cfg, runs = s["config"], s["runs"]
    rx = [ratios(r, raw) for r in runs]
    raw_cpu = raw.get("cpu_ms_per_message", {})
    head = ["", "raw kafka", *(f"KSB {run_label(r)}" for r in runs)]
    rows: list[list[str]] = [head]
    rows.append(
        [
            "throughput",
            f"{raw['throughput']['per_s']:,.0f} msg/s",
            *(
                f"{r['throughput']['per_s']:,.0f} msg/s{_x(x['throughput'], 3)}"
                for r, x in zip(runs, rx, strict=True)
            ),
        ]
    )
    # (label, KSB's figure, raw Kafka's beside it: its one at a time is produce -> consume)
    for label, key, raw_key, kind in (
        ("p50 latency (loaded)", "latency_loaded", "latency_loaded", "p50_ms"),
        ("p99 latency (loaded)", "latency_loaded", "latency_loaded", "p99_ms"),
        ("p50 latency (1 at a time)", "latency_unloaded", "latency_unloaded", "p50_ms"),
        ("p99 latency (1 at a time)", "latency_unloaded", "latency_unloaded", "p99_ms"),
        ("  p50 to RECEIVE, no commit", "latency_delivered", "latency_unloaded", "p50_ms"),
        ("  p99 to RECEIVE, no commit", "latency_delivered", "latency_unloaded", "p99_ms"),
    ):
        rows.append(
            [
                label,
                fmt_ms(raw[raw_key][kind]),
                *(
                    f"{fmt_ms(r[key][kind])}{_x(x[f'{key}_{kind[:3]}'], 1)}"
                    for r, x in zip(runs, rx, strict=True)
                ),
            ]
        )
    one = runs[0]["cpu_ms_per_message"]["dispatchers"] if runs else None
    rows.append(
        [
            "dispatcher CPU per message",
            "-",
            *(
                f"{fmt_ms(r['cpu_ms_per_message']['dispatchers'], 3)}"
                + (
                    f" ({r['cpu_ms_per_message']['dispatchers'] / one:.2f}x of 1)"
                    if one and r is not runs[0]
                    else ""
                )
                for r in runs
            ),
        ]
    )
    rows.append(
        [
            "  of which librdkafka threads",
            "-",
            *(fmt_ms(r["cpu_ms_per_message"].get("dispatchers_librdkafka"), 3) for r in runs),
        ]
    )
    rows.append(
        [
            "CPU per message, all processes",
            fmt_ms(raw_cpu.get("all"), 3),
            *(
                f"{fmt_ms(r['cpu_ms_per_message']['all'], 3)}{_x(x['cpu_all'], 1)}"
                for r, x in zip(runs, rx, strict=True)
            ),
        ]
    )
    for part, label in (
        ("kafka", "  of which Kafka broker"),
        ("kafka_jit", "    of which its JIT compiler"),
        ("queue_service", "  of which queue service"),
        ("client", "  of which SDK clients"),
    ):
        rows.append(
            [
                label,
                fmt_ms(raw_cpu.get(part), 3),
                *(fmt_ms(r["cpu_ms_per_message"].get(part), 3) for r in runs),
            ]
        )
    rows.append(
        [
            "exactly once, in order",
            "",
            *(
                ("yes" if r["verified_exactly_once_in_order"] else "NO")
                + f", {r['refused_commits']} refused"
                + (f", {r['receive_errors']} RECEIVE retried" if r["receive_errors"] else "")
                for r in runs
            ),
        ]
    )
    if peer is not None and "error" not in peer:
        cells = table_column(peer)
        rows = [
            [r[0], r[1], COLUMN if i == 0 else cells.get(r[0], ""), *r[2:]]
            for i, r in enumerate(rows)
        ]
    lines = [
        f"raw Kafka and KSB by dispatcher count: {cfg['messages']:,} x {cfg['body_bytes']} B over "
        f"{cfg['dialogs']:,} dialogs, {cfg['shards']} shards, target queue "
        f"{cfg['queue_partitions']} partitions, {cfg['receivers']} receiver threads x window "
        f"{cfg['window']}, {cfg.get('queue_replicas', 0)} queue service replicas, back-pressure "
        f"{cfg['max_inflight_requests']:,} requests in flight"
        " (and, where the column says so, a target queue depth at which SENDs wait)"
        + _warmed(cfg, s.get("warmup_s"))
        + raw_runs_note(raw),
        *_table(rows),
        *ksb_runs_lines(runs),
        *(peer_lines(peer, runs, run_label) if peer is not None and "error" not in peer else []),
        *([f"{COLUMN}: FAILED: {peer['error']}"] if peer is not None and "error" in peer else []),
        "messages per dispatcher (those of its shards' dialogs; records applied from its log, "
        "warm-up and probes included; CPU over the loaded phase):",
    ]
    for r in runs:
        members = r["members"]
        counts = [m["messages"] for m in members.values()]
        spread = max(counts) / (sum(counts) / len(counts)) if counts and sum(counts) else None
        parts = [
            f"{name} {m['messages']:,} msgs [shards {','.join(map(str, m['shards']))}] "
            f"{_count(m['applied'])} applied in {_count(m.get('transactions'))} transactions "
            f"{m['cpu_s'] or 0:.1f} s CPU"
            for name, m in members.items()
        ]
        lines.append(
            f"  {run_label(r)}: "
            + "; ".join(parts)
            + (f"; max/mean {spread:.2f}" if spread is not None and len(counts) > 1 else "")
        )
    for r in runs:
        for problem in r["problems"]:
            lines.append(f"  problem ({run_label(r)}): {problem}")
    return lines
