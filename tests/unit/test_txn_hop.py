"""The exactly-once hop's line in `make bench`: each KSB run's one-at-a-time p50 against two hops."""

from __future__ import annotations

from typing import Any

from bench.txn_hop import format_lines


def _run(dispatchers: int, p50_ms: float) -> dict[str, Any]:
    return {
        "dispatchers": dispatchers,
        "max_queue_depth": 0,
        "latency_unloaded": {"p50_ms": p50_ms},
    }


def test_each_run_is_set_against_two_hops() -> None:
    hop = {"probes": 100, "latency": {"p50_ms": 5.0, "p99_ms": 12.0}}
    (line,) = format_lines(hop, {"runs": [_run(1, 15.0), _run(4, 10.0)]})
    assert "100 one at a time: p50 5.00 ms, p99 12.00 ms" in line
    assert "two hops (10.00 ms): 1 dispatcher(s) 1.5x, 4 dispatcher(s) 1.0x" in line


def test_a_hop_without_a_figure_compares_nothing() -> None:
    hop = {"probes": 0, "latency": {"p50_ms": float("nan"), "p99_ms": None}}
    (line,) = format_lines(hop, {"runs": [_run(1, 15.0)]})
    assert "p50 nan ms" not in line and line.endswith("two hops (n/a): n/a")
