"""The human table and the JSON file of one run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.activation import format_lines as activation_lines
from bench.priorities import format_lines as priority_lines
from bench.spark_audit import format_lines as spark_lines
from bench.transmission import format_lines as scheduler_lines

__all__ = ["format_table", "write_json"]


def _ms(v: float) -> str:
    return f"{v:,.2f} ms"


def _mb(kb: int | None) -> str:
    return "n/a" if kb is None else f"{kb / 1024:,.0f} MB"


def format_table(r: dict[str, Any]) -> str:
    raw, ksb, ratio, cfg = r["raw"], r["ksb"], r["ratio_ksb_over_raw"], r["config"]
    rows = [
        (
            "messages",
            f"{raw['throughput']['messages']:,}",
            f"{ksb['throughput']['messages']:,}",
            "",
        ),
        (
            "throughput",
            f"{raw['throughput']['per_s']:,.0f} msg/s",
            f"{ksb['throughput']['per_s']:,.0f} msg/s",
            f"{ratio['throughput']:.3f}x",
        ),
    ]
    for label, key, kind in (
        ("p50 latency (loaded)", "latency_loaded", "p50_ms"),
        ("p99 latency (loaded)", "latency_loaded", "p99_ms"),
        ("p50 latency (1 at a time)", "latency_unloaded", "p50_ms"),
        ("p99 latency (1 at a time)", "latency_unloaded", "p99_ms"),
    ):
        ratio_key = f"{key}_{kind[:3]}"
        rows.append((label, _ms(raw[key][kind]), _ms(ksb[key][kind]), f"{ratio[ratio_key]:.1f}x"))
    widths = [
        max(len(row[i]) for row in [*rows, ("", "raw kafka", "KSB", "KSB/raw")]) for i in range(4)
    ]
    header = ("", "raw kafka", "KSB", "KSB/raw")
    lines = [
        f"bench: {cfg['messages']:,} KSB messages over {cfg['dialogs']:,} dialogs, "
        f"{cfg['body_bytes']} B bodies, {cfg['target_partitions']} queue partitions, "
        f"{cfg['receivers']} receiver threads x window {cfg['window']}, {cfg['cpus']} CPUs",
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w)
            for i, (h, w) in enumerate(zip(header, widths, strict=True))
        ),
    ]
    for row in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    lines.append(
        f"KSB commits: {ksb['commits']:,} ({ksb['messages_per_commit']:.1f} msg/commit), "
        f"refused {ksb['refused_commits']}, lock lost {ksb['lock_lost']}; "
        f"sender done in {ksb['send_seconds']:.2f}s; exactly once and in order: "
        f"{'yes' if ksb['verified_exactly_once_in_order'] else 'NO'}"
    )
    for problem in ksb["problems"]:
        lines.append(f"  problem: {problem}")
    rss = r["peak_rss_kb"]
    lines.append("peak RSS: " + ", ".join(f"{name} {_mb(kb)}" for name, kb in rss.items()))
    loaded = (
        f"p50 latency {ratio['latency_loaded_p50']:.1f}x, p99 {ratio['latency_loaded_p99']:.1f}x"
    )
    alone = f"p50 {ratio['latency_unloaded_p50']:.1f}x, p99 {ratio['latency_unloaded_p99']:.1f}x"
    lines.append(
        f"ratio KSB/raw: throughput {ratio['throughput']:.3f}x, {loaded} (1 at a time: {alone})"
    )
    if r.get("activation") is not None:
        lines.extend(activation_lines(r["activation"]))
    prio = r.get("priorities")
    if prio is not None:
        if "error" in prio:
            lines.append(f"priorities: FAILED: {prio['error']}")
        else:
            lines.extend(priority_lines(prio["receive"]))
            lines.extend(scheduler_lines(prio["transmission_scheduler"]))
    spark = r.get("spark_audit")
    if spark is not None:
        if "error" in spark:
            lines.append(f"spark audit: FAILED: {spark['error']}")
        else:
            lines.extend(spark_lines(spark))
    return "\n".join(lines)


def write_json(r: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=2) + "\n")
