"""The exactly-once hop's lines in `make bench`: each width's latency, and each KSB run's
one-at-a-time p50 against two of the narrowest hops."""

from __future__ import annotations

from typing import Any

from bench.txn_hop import format_lines


def _run(dispatchers: int, p50_ms: float) -> dict[str, Any]:
    return {
        "dispatchers": dispatchers,
        "max_queue_depth": 0,
        "latency_unloaded": {"p50_ms": p50_ms},
    }


def test_each_run_is_set_against_two_of_the_narrowest_hops() -> None:
    hops = {
        "probes": 100,
        "widths": {"4": {"p50_ms": 9.0, "p99_ms": 20.0}, "1": {"p50_ms": 5.0, "p99_ms": 12.0}},
    }
    head, against = format_lines(hops, {"runs": [_run(1, 15.0), _run(4, 10.0)]})
    assert "100 one at a time" in head
    assert "4 partition(s) p50 9.00 ms, p99 20.00 ms; 1 partition(s) p50 5.00 ms" in head
    assert against.endswith(
        "two 1-partition hops (10.00 ms): 1 dispatcher(s) 1.5x, 4 dispatcher(s) 1.0x"
    )


def test_a_hop_without_a_figure_compares_nothing() -> None:
    hops = {"probes": 0, "widths": {"1": {"p50_ms": float("nan"), "p99_ms": float("nan")}}}
    head, against = format_lines(hops, {"runs": [_run(1, 15.0)]})
    assert "nan" not in head and "1 partition(s) p50 n/a, p99 n/a" in head
    assert against.endswith("(n/a): n/a")


def test_the_latency_to_receive_is_set_against_one_of_the_widest_hops() -> None:
    hops = {
        "probes": 100,
        "widths": {"1": {"p50_ms": 5.0, "p99_ms": 12.0}, "4": {"p50_ms": 8.0, "p99_ms": 20.0}},
    }
    run = {**_run(2, 20.0), "latency_delivered": {"p50_ms": 12.0}}
    lines = format_lines(hops, {"runs": [run]})
    assert len(lines) == 3
    assert lines[2].endswith("one 4-partition hop (8.00 ms): 2 dispatcher(s) 1.5x")


def test_runs_without_a_latency_to_receive_add_no_line() -> None:
    hops = {"probes": 100, "widths": {"1": {"p50_ms": 5.0, "p99_ms": 12.0}}}
    assert len(format_lines(hops, {"runs": [_run(1, 15.0)]})) == 2
