"""The figures `make bench` builds its tables from: raw Kafka's baseline, the median of several
loaded runs (which run that is, and how the table says so); every KSB figure as a ratio over it;
and how long each part of a run took."""

from __future__ import annotations

from typing import Any

import pytest

from bench.backlog import replica_figures
from bench.queues import ReplicaMemory
from bench.raw_kafka import median_run
from bench.scaling import ksb_runs_lines, median_ksb_run, raw_runs_note
from bench.stats import Phases, ratio, run_ratios


def test_the_median_run_is_the_middle_rate_wherever_it_ran() -> None:
    assert median_run([45_000.0, 22_000.0, 36_000.0]) == 2
    assert median_run([22_000.0, 36_000.0, 45_000.0]) == 1
    assert median_run([30_000.0]) == 0


def test_of_an_even_count_the_faster_middle_run_is_taken() -> None:
    # The faster of the two: a slower baseline would raise KSB's throughput ratio.
    assert median_run([40_000.0, 10_000.0, 30_000.0, 20_000.0]) == 2


def test_no_runs_is_an_error() -> None:
    with pytest.raises(ValueError):
        median_run([])


def test_the_table_names_every_run_behind_the_median() -> None:
    note = raw_runs_note({"throughput_runs": [44_790.4, 22_385.0, 35_125.9]})
    assert note == "; raw Kafka's figures are its median run of 3 (44,790, 22,385, 35,126 msg/s)"


def test_one_run_needs_no_note() -> None:
    assert raw_runs_note({"throughput_runs": [35_000.0]}) == ""
    assert raw_runs_note({}) == ""


def test_a_run_over_another_is_each_figure_divided_where_both_were_measured() -> None:
    top = {
        "throughput": {"per_s": 3_000.0},
        "latency_loaded": {"p50_ms": 300.0, "p99_ms": 900.0},
        "latency_unloaded": {"p50_ms": 15.0, "p99_ms": None},
    }
    bottom = {
        "throughput": {"per_s": 30_000.0},
        "latency_loaded": {"p50_ms": 150.0, "p99_ms": 300.0},
        "latency_unloaded": {"p50_ms": 1.5, "p99_ms": 4.0},
    }
    assert run_ratios(top, bottom) == {
        "throughput": 0.1,
        "latency_loaded_p50": 2.0,
        "latency_loaded_p99": 3.0,
        "latency_unloaded_p50": 10.0,
        "latency_unloaded_p99": None,
    }
    assert ratio(1.0, 0.0) is None and ratio(None, 2.0) is None


def test_the_latency_to_receive_is_set_against_the_other_runs_one_at_a_time() -> None:
    top = {
        "throughput": {"per_s": 3_000.0},
        "latency_loaded": {"p50_ms": 300.0, "p99_ms": 900.0},
        "latency_unloaded": {"p50_ms": 15.0, "p99_ms": 40.0},
        "latency_delivered": {"p50_ms": 6.0, "p99_ms": 20.0},
    }
    bottom = {
        "throughput": {"per_s": 30_000.0},
        "latency_loaded": {"p50_ms": 150.0, "p99_ms": 300.0},
        "latency_unloaded": {"p50_ms": 1.5, "p99_ms": 4.0},
    }
    got = run_ratios(top, bottom)
    assert got["latency_unloaded_p50"] == 10.0
    assert got["latency_delivered_p50"] == 4.0 and got["latency_delivered_p99"] == 5.0
    other = {**bottom, "latency_delivered": {"p50_ms": 3.0, "p99_ms": 10.0}}  # a KSB run
    got = run_ratios(top, other)
    assert got["latency_delivered_p50"] == 2.0 and got["latency_delivered_p99"] == 2.0


def test_each_part_of_a_run_is_timed_from_the_end_of_the_one_before() -> None:
    ticks = iter([100.0, 101.5, 101.5, 104.25])
    phase = Phases(clock=lambda: next(ticks))
    phase("stack_start")
    phase("secure")
    phase("raw")
    assert list(phase.seconds.items()) == [("stack_start", 1.5), ("secure", 0.0), ("raw", 2.75)]


def _ksb_run(per_s: float, cpu: float, problems: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "dispatchers": 2,
        "throughput": {"per_s": per_s},
        "cpu_ms_per_message": {"dispatchers": cpu},
        "verified_exactly_once_in_order": not problems,
        "refused_commits": 0,
        "problems": list(problems),
    }


def test_a_ksb_column_is_its_median_run_with_every_run_beside_it() -> None:
    shown = median_ksb_run([_ksb_run(4_287, 0.105), _ksb_run(2_864, 0.151), _ksb_run(3_516, 0.123)])
    assert (
        shown["throughput"]["per_s"] == 3_516
        and shown["cpu_ms_per_message"]["dispatchers"] == 0.123
    )
    assert shown["throughput_runs"] == [4_287, 2_864, 3_516]
    assert ksb_runs_lines([shown]) == [
        "each KSB column is its median run of 3 by throughput:",
        "  2 dispatcher(s): 4,287 / 2,864 / 3,516 msg/s; dispatcher CPU 0.105-0.151 ms",
    ]


def test_of_an_even_count_of_ksb_runs_the_slower_middle_one_is_shown() -> None:
    shown = median_ksb_run([_ksb_run(r, 0.1) for r in (4_000, 1_000, 3_000, 2_000)])
    assert shown["throughput"]["per_s"] == 2_000


def test_a_run_that_broke_exactly_once_fails_its_column_whichever_run_is_shown() -> None:
    shown = median_ksb_run(
        [
            _ksb_run(1_000, 0.1, ("dialog 7: seq 3 twice",)),
            _ksb_run(3_000, 0.1),
            _ksb_run(2_000, 0.1),
        ]
    )
    assert shown["throughput"]["per_s"] == 2_000
    assert shown["verified_exactly_once_in_order"] is False
    assert shown["problems"] == ["run 1: dialog 7: seq 3 twice"]


def test_one_ksb_run_needs_no_lines() -> None:
    assert ksb_runs_lines([median_ksb_run([_ksb_run(3_000, 0.1)])]) == []


def test_a_replicas_backlog_is_counted_per_message_its_own_memory_apart_from_its_stores() -> None:
    base = ReplicaMemory(
        rss_anon_kb=40_000, rss_file_kb=30_000, peak_rss_kb=70_000, store_disk_bytes=0
    )
    full = ReplicaMemory(
        rss_anon_kb=40_000 + 25_000,  # 25,000 kB over 100,000 messages: 256 B each
        rss_file_kb=30_000 + 50_000,
        peak_rss_kb=150_000,
        store_disk_bytes=120_000_000,
    )
    got = replica_figures({"base": base, "indexed": full}, 100_000)
    assert got["bytes_per_queued_message"] == 256.0
    assert got["file_bytes_per_queued_message"] == 512.0
    assert got["store_bytes_per_queued_message"] == 1_200.0
    assert got["indexed"]["rss_anon_kb"] == 65_000 and got["base"]["store_disk_bytes"] == 0


def test_a_replica_not_measured_at_both_ends_has_no_figure_per_message() -> None:
    gone = ReplicaMemory(
        rss_anon_kb=None, rss_file_kb=None, peak_rss_kb=None, store_disk_bytes=None
    )
    base = ReplicaMemory(rss_anon_kb=1, rss_file_kb=1, peak_rss_kb=2, store_disk_bytes=0)
    assert replica_figures({"base": base, "indexed": gone}, 10)["bytes_per_queued_message"] is None
    assert replica_figures({"base": base}, 10)["store_bytes_per_queued_message"] is None
