"""Failover: one of three dispatchers SIGKILLed under load; do the other shards keep flowing, and
how soon do the lost ones deliver again?

The e2e load (bench/e2e.py) runs through a pool of dispatcher processes on an instance of its own
(its target queue co-partitioned with the shards). Once a share of the messages has been delivered
one member is SIGKILLed. Every delivery (a commit outcome that says applied) is timed and mapped to
its dialog's shard (`ksb.wire.partitioning.shard_of` of the dialog's handle, its group), and the shards
to the member that owned them before the kill (`DispatcherPool.owned`). From those:

* the longest gap between deliveries on the shards the killed member did NOT own, from the last
  one before the kill to their last one (beside the longest gap in the seconds before the kill:
  what this machine's jitter gives anyway), and apart, of any such shard the rebalance moved from
  one survivor to another (the consumer group's assignor balances the survivors' shares);
* the lost shards' resumption: their first delivery after their longest silence, minus the kill
  time (bounded by the session timeout, then each new owner's rebuild of its share, which the
  survivors' logs time);
* exactly once and in order over the whole run, as everywhere.

It runs once per back-pressure limit: 0 (off: the sender hands its whole load to Kafka first, so
the dispatchers alone decide what flows) and the SDK's default. One client's in-flight limit is
shared by every shard, so requests stuck on the lost shards can fill it and hold the sender.
"""

from __future__ import annotations

import itertools
import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.e2e import Tally, bench_catalog, fault_at, run_ksb
from bench.queues import DEFAULT_REPLICAS, running_queues
from bench.scaling import sharded_instance
from bench.stats import now_ns
from devtools.deployment import Deployment
from devtools.dispatchers import DispatcherPool
from ksb.runtime.catalog_store import apply_catalog
from ksb.wire.partitioning import shard_of

__all__ = ["FailoverOptions", "delivery_gaps", "format_lines", "run_failover"]

log = logging.getLogger("bench.failover")

_ASSIGNED = re.compile(r"shards \[([0-9, ]*)\] assigned: (\d+) records read in ([0-9.]+)s")
_BEFORE_S = 5.0
"""The jitter baseline: the longest gap in this many seconds before the kill."""


@dataclass(frozen=True)
class FailoverOptions:
    dispatchers: int = 3
    shards: int = 6
    messages: int = 60_000
    dialogs: int = 1_000
    body_bytes: int = 1024
    receivers: int = 2
    window: int = 64
    rate: int = 2_000
    """The sender's pace (msg/s), below what the three dispatchers apply: steady traffic that
    still has most of its run ahead of it when the lost shards resume."""
    kill_at: float = 0.3
    """The kill comes once this share of the messages has been delivered."""
    victim: str = "d2"
    limits: tuple[int, ...] = (0, 2_000)
    """`max_inflight_requests` of each run (0: back-pressure off)."""
    timeout_s: float = 300.0
    queue_replicas: int = DEFAULT_REPLICAS


def run_failover(base: Deployment, opts: FailoverOptions, workdir: Path) -> dict[str, Any]:
    runs = [_run_one(base, opts, limit, workdir) for limit in opts.limits]
    return {"config": asdict(opts), "runs": runs}


def _run_one(base: Deployment, opts: FailoverOptions, limit: int, workdir: Path) -> dict[str, Any]:
    settings = sharded_instance(base, f"f{limit}", opts.shards, max_inflight_requests=limit)
    apply_catalog(settings, bench_catalog(opts.shards))
    tally = Tally(expected=opts.messages, keep_times=True)
    kill: dict[str, Any] = {}
    logs = workdir / f"failover-{limit}"
    with (
        running_queues(settings, logs, opts.queue_replicas) as (settings, _queues),
        DispatcherPool(settings, logs) as pool,
    ):
        pool.start(opts.dispatchers)

        def kill_victim(_tally: Tally) -> None:
            kill["owned"] = pool.owned()
            kill["logged"] = {n: len(p.log_text()) for n, p in pool.members.items()}
            kill["ns"] = now_ns()
            kill["delivered"] = tally.delivered
            pool.kill(opts.victim)
            pool.wait_settled(120)
            kill["settled_ns"] = now_ns()

        with fault_at(tally, opts.kill_at, kill_victim) as failures:
            result = run_ksb(
                settings,
                dialogs=opts.dialogs,
                messages=opts.messages,
                body_bytes=opts.body_bytes,
                receivers=opts.receivers,
                window=opts.window,
                top=None,
                probes=0,
                timeout_s=opts.timeout_s,
                tally=tally,
                rate=opts.rate,
            )
        owned_after = pool.owned()
        logged_at_end = {n: len(p.log_text()) for n, p in pool.members.items()}
        pool.stop()
        applied = {name: a.records for name, a in pool.applied().items()}
    if failures:
        raise RuntimeError("the kill failed") from failures[0]
    rebuilds = _rebuilds(pool, opts.victim, kill["logged"], logged_at_end)
    lost = kill["owned"][opts.victim]
    before = {s: n for n, shards in kill["owned"].items() for s in shards}
    after = {s: n for n, shards in owned_after.items() for s in shards}
    moved = sorted(s for s in before if s not in lost and after.get(s) != before[s])
    shard = [shard_of(h, opts.shards) for h in tally.handles]
    live = sorted(t for t, d in tally.times if shard[d] not in lost)
    kept = sorted(t for t, d in tally.times if shard[d] not in lost and shard[d] not in moved)
    gone = sorted(t for t, d in tally.times if shard[d] in lost)
    k = kill["ns"]
    live_gap = delivery_gaps(live, k)
    lost_gap = delivery_gaps(gone, k)
    return {
        "max_inflight_requests": limit,
        "owned_before_kill": {n: sorted(s) for n, s in kill["owned"].items()},
        "killed": opts.victim,
        "killed_at_delivered": kill["delivered"],
        "settled_after_kill_s": (kill["settled_ns"] - k) / 1e9,
        "rebuilds": rebuilds,
        "other_shards": {
            "max_gap_after_kill_ms": live_gap["max_gap_ms"],
            "max_gap_before_kill_ms": _max_gap_ms(
                [t for t in live if k - _BEFORE_S * 1e9 <= t < k]
            ),
            "last_delivery_after_kill_s": (live[-1] - k) / 1e9 if live else None,
            "messages": len(live),
            "kept_max_gap_after_kill_ms": delivery_gaps(kept, k)["max_gap_ms"],
            "moved": [
                {
                    "shard": s,
                    "from": before[s],
                    "to": after.get(s),
                    "max_gap_after_kill_ms": delivery_gaps(
                        sorted(t for t, d in tally.times if shard[d] == s), k
                    )["max_gap_ms"],
                }
                for s in moved
            ],
        },
        "lost_shards": {
            "shards": sorted(lost),
            "resumed_after_kill_s": (lost_gap["resumed_ns"] - k) / 1e9
            if lost_gap["resumed_ns"] is not None
            else None,
            "silence_ms": lost_gap["max_gap_ms"],
            "messages": len(gone),
        },
        "applied": applied,
        "throughput": result.rate.as_json(),
        "refused_commits": result.refused,
        "verified_exactly_once_in_order": result.verified,
        "problems": list(result.problems),
    }


def _max_gap_ms(times: list[int]) -> float | None:
    if len(times) < 2:
        return None
    return max(b - a for a, b in itertools.pairwise(times)) / 1e6


def delivery_gaps(times: list[int], kill_ns: int) -> dict[str, Any]:
    """The longest silence in ascending delivery ``times`` that ends after ``kill_ns`` (counted
    from the last delivery before it), and when it ended (None without a delivery after it)."""
    before = [t for t in times if t <= kill_ns]
    after = [t for t in times if t > kill_ns]
    if not after:
        return {"max_gap_ms": None, "resumed_ns": None}
    series = [before[-1] if before else kill_ns, *after]
    gap, end = max((b - a, b) for a, b in itertools.pairwise(series))
    return {"max_gap_ms": gap / 1e6, "resumed_ns": end}


def _rebuilds(
    pool: DispatcherPool, victim: str, start: dict[str, int], end: dict[str, int]
) -> list[dict[str, Any]]:
    """The shards each survivor logged taking between the kill and the end of the run (its log's
    length at each), with the records it rebuilt them from and how long that took."""
    out = []
    for name, proc in pool.members.items():
        if name == victim:
            continue
        logged = proc.log_text()[start.get(name, 0) : end.get(name)]
        for shards, records, seconds in _ASSIGNED.findall(logged):
            out.append(
                {
                    "member": name,
                    "shards": [int(s) for s in shards.split(",")],
                    "records": int(records),
                    "seconds": float(seconds),
                }
            )
    return out


def _opt(v: float | None, fmt: str, unit: str) -> str:
    return "n/a" if v is None else f"{v:{fmt}}{unit}"


def format_lines(r: dict[str, Any]) -> list[str]:
    cfg = r["config"]
    lines = [
        f"failover: {cfg['dispatchers']} dispatchers, {cfg['shards']} shards, "
        f"{cfg['messages']:,} x {cfg['body_bytes']} B over {cfg['dialogs']:,} dialogs sent at "
        f"{cfg.get('rate', 0):,} msg/s; {cfg['victim']} SIGKILLed once {cfg['kill_at']:.0%} were "
        "delivered"
    ]
    for run in r["runs"]:
        other, lost = run["other_shards"], run["lost_shards"]
        limit = run["max_inflight_requests"]
        rebuilt = ", ".join(
            f"{b['member']} took {b['shards']} ({b['records']:,} records in {b['seconds']:.2f} s)"
            for b in run["rebuilds"]
        )
        lines += [
            f"  back-pressure {'off' if not limit else f'{limit:,} in flight'}: killed "
            f"{run['killed']} (shards {lost['shards']}) after {run['killed_at_delivered']:,} "
            f"deliveries; the group settled {run['settled_after_kill_s']:.2f} s later; {rebuilt}",
            f"    other shards: longest gap in deliveries "
            f"{_opt(other['max_gap_after_kill_ms'], ',.0f', ' ms')} after the kill "
            f"({_opt(other['max_gap_before_kill_ms'], ',.0f', ' ms')} in the {_BEFORE_S:.0f} s "
            f"before it), their last delivery "
            f"{_opt(other['last_delivery_after_kill_s'], '.2f', ' s')} after the kill"
            + "".join(
                f"; shard {m['shard']} moved {m['from']} -> {m['to']} as the group rebalanced "
                f"(its gap {_opt(m['max_gap_after_kill_ms'], ',.0f', ' ms')})"
                for m in other["moved"]
            )
            + (
                f"; on the shards that stayed with their owner "
                f"{_opt(other['kept_max_gap_after_kill_ms'], ',.0f', ' ms')}"
                if other["moved"]
                else ""
            ),
            f"    killed one's shards: delivering again {_opt(lost['resumed_after_kill_s'], '.2f', ' s')}"
            f" after the kill (silent {_opt(lost['silence_ms'], ',.0f', ' ms')}); "
            f"{run['throughput']['per_s']:,.0f} msg/s over the run; exactly once and in order: "
            + (
                f"yes ({run['refused_commits']} refused)"
                if run["verified_exactly_once_in_order"]
                else f"NO {run['problems'][:3]}"
            ),
        ]
    return lines
