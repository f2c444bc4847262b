"""The human table and the JSON file of one run."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.activation import format_lines as activation_lines
from bench.backlog import format_lines as backlog_lines
from bench.cross_instance import format_lines as cross_lines
from bench.failover import format_lines as failover_lines
from bench.priorities import format_lines as priority_lines
from bench.readers import format_lines as reader_lines
from bench.scaling import format_lines as scaling_lines
from bench.security import format_lines as security_lines
from bench.security_e2e import format_lines as security_e2e_lines
from bench.spark_audit import format_lines as spark_lines
from bench.targets import format_lines as target_lines
from bench.transmission import format_lines as scheduler_lines
from bench.txn_hop import format_lines as hop_lines

__all__ = ["format_table", "write_json"]


def _mb(kb: int | None) -> str:
    return "n/a" if kb is None else f"{kb / 1024:,.0f} MB"


def _priorities(p: dict[str, Any]) -> list[str]:
    return [*priority_lines(p["receive"]), *scheduler_lines(p["transmission_scheduler"])]


_SECTIONS: tuple[tuple[str, str, Callable[[dict[str, Any]], list[str]]], ...] = (
    ("readers", "reader processes", reader_lines),
    ("failover", "failover", failover_lines),
    ("activation", "activation", activation_lines),
    ("cross_instance", "cross-instance", cross_lines),
    ("priorities", "priorities", _priorities),
    ("spark_audit", "spark audit", spark_lines),
    ("backlog", "backlog", backlog_lines),
    ("security_e2e", "KSB end to end, security on/off", security_e2e_lines),
    ("security", "security on/off", security_lines),
)
"""Optional sections in the order they are printed: (key, title, its lines)."""


def format_table(r: dict[str, Any]) -> str:
    cfg = r["config"]
    start, end = cfg["load_average_at_start"], cfg["load_average_at_end"]
    nodes = cfg.get("redis_nodes", 1)  # results written before the option have one
    redis = f"a Redis Cluster of {nodes} primaries" if nodes > 1 else "one Redis server"
    lines = [
        f"bench: {cfg['cpus']} CPUs, Python {cfg['python']}, {redis}; load average (1/5/15 min) "
        f"{'/'.join(map(str, start))} at start, {'/'.join(map(str, end))} at end "
        "(other work on the machine skews every figure)",
        *scaling_lines(r["scaling"], r["raw"], r.get("peer")),
    ]
    if r.get("txn_hop") is not None:
        lines.extend(hop_lines(r["txn_hop"], r["scaling"]))
    for key, title, format_lines in _SECTIONS:
        section = r.get(key)
        if section is None:
            continue
        if "error" in section:
            lines.append(f"{title}: FAILED: {section['error']}")
        else:
            lines.extend(format_lines(section))
    if r.get("targets"):
        lines.extend(target_lines(r["targets"]))
    rss = r["peak_rss_kb"]
    lines.append("peak RSS: " + ", ".join(f"{name} {_mb(kb)}" for name, kb in rss.items()))
    lines.append(
        "seconds per part: "
        + ", ".join(f"{name} {s:,.0f}" for name, s in r["phase_seconds"].items())
        + f"; whole run {r['wall_seconds'] / 60:,.1f} min"
    )
    return "\n".join(lines)


def write_json(r: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=2) + "\n")
