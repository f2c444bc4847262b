"""The figures `make bench` builds its tables from: raw Kafka's baseline, the median of several
loaded runs (which run that is, and how the table says so); every KSB figure as a ratio over it;
and how long each part of a run took."""

from __future__ import annotations

from typing import Any

import pytest

from bench.backlog import format_lines as backlog_lines
from bench.backlog import replica_figures
from bench.peer import COLUMN, parse_ack, ratios_over_peer
from bench.queues import ReplicaMemory
from bench.raw_kafka import median_run
from bench.readers import WARM, check_deliveries
from bench.scaling import format_lines, ksb_runs_lines, median_ksb_run, raw_runs_note
from bench.security_e2e import SecurityE2eOptions
from bench.security_e2e import format_lines as security_e2e_lines
from bench.security_e2e import summarize as summarize_security
from bench.stats import Phases, ratio, run_ratios
from bench.targets import all_targets, issue39
from bench.targets import format_lines as target_lines
from devtools.stack_security import SecurityMode


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


def _latency(p50: float, p99: float) -> dict[str, float]:
    return {"p50_ms": p50, "p99_ms": p99}


def _table_run(per_s: float, cpu_all: float) -> dict[str, Any]:
    """A KSB run with every figure the scaling table prints."""
    return {
        **_ksb_run(per_s, 0.1),
        "max_queue_depth": 0,
        "latency_loaded": _latency(400.0, 900.0),
        "latency_unloaded": _latency(12.0, 30.0),
        "latency_delivered": _latency(6.0, 20.0),
        "cpu_ms_per_message": {"dispatchers": 0.1, "all": cpu_all, "queue_service": 0.05},
        "receive_errors": 0,
        "members": {"d1": {"messages": 20_000, "shards": [0, 1], "applied": 20_100, "cpu_s": 2.0}},
    }


def _peer() -> dict[str, Any]:
    return {
        "config": {
            "batch_max": 500,
            "messages": 20_000,
            "body_bytes": 1024,
            "keys": 1_000,
            "partitions": 8,
        },
        "throughput": {"per_s": 5_000.0},
        "throughput_runs": [4_900.0, 5_000.0, 5_400.0],
        "latency_loaded": _latency(200.0, 450.0),
        "latency_unloaded": _latency(10.0, 20.0),
        "latency_delivered": _latency(5.0, 10.0),
        "cpu_ms_per_message": {"workers": 0.08, "all": 0.25, "kafka": 0.15, "client": 0.02},
        "verified_exactly_once_in_order": True,
        "problems": [],
    }


def test_the_peer_is_a_column_beside_raw_kafka_and_every_ksb_run_is_set_against_it() -> None:
    raw = {
        "throughput": {"per_s": 50_000.0},
        "latency_loaded": _latency(100.0, 150.0),
        "latency_unloaded": _latency(1.0, 3.0),
        "cpu_ms_per_message": {"all": 0.04},
    }
    scaling = {
        "config": {
            "messages": 20_000,
            "body_bytes": 1024,
            "dialogs": 1_000,
            "shards": 8,
            "queue_partitions": 8,
            "receivers": 2,
            "window": 64,
            "queue_replicas": 2,
            "max_inflight_requests": 2_000,
        },
        "runs": [_table_run(4_000.0, 0.5)],
    }
    lines = format_lines(scaling, raw, _peer())
    head = next(line for line in lines if "raw kafka" in line)
    assert head.index("raw kafka") < head.index(COLUMN) < head.index("KSB 2 dispatcher(s)")
    row = next(line for line in lines if line.startswith("throughput"))
    assert row.split()[1:5] == ["50,000", "msg/s", "5,000", "msg/s"]
    cpu = next(line for line in lines if line.startswith("CPU per message, all processes"))
    assert "0.250 ms" in cpu
    over = lines[
        lines.index(next(line for line in lines if line.startswith("KSB over the EOS"))) + 1
    ]
    assert over.startswith("  2 dispatcher(s): throughput 0.80x, loaded p50 2.00x p99 2.00x")
    assert "1 at a time p50 1.20x, to RECEIVE p50 1.20x, CPU all processes 2.00x" in over
    assert "queue service" in " ".join(lines)
    # without a peer (a run with --no-peer, or results from before it) the table is as it was
    plain = format_lines(scaling, raw)
    assert COLUMN not in " ".join(plain) and not any("over the EOS" in x for x in plain)


def test_a_failed_peer_is_named_and_leaves_the_table_as_it_was() -> None:
    raw = {
        "throughput": {"per_s": 50_000.0},
        "latency_loaded": _latency(100.0, 150.0),
        "latency_unloaded": _latency(1.0, 3.0),
    }
    scaling = {
        "config": {
            "messages": 1,
            "body_bytes": 1,
            "dialogs": 1,
            "shards": 1,
            "queue_partitions": 1,
            "receivers": 1,
            "window": 1,
            "max_inflight_requests": 1,
        },
        "runs": [_table_run(4_000.0, 0.5)],
    }
    lines = format_lines(scaling, raw, {"error": "TimeoutError: peer: 20000 messages"})
    assert f"{COLUMN}: FAILED: TimeoutError: peer: 20000 messages" in lines


def test_ratios_over_the_peer_are_ksb_over_peer_figure_by_figure() -> None:
    got = ratios_over_peer(_table_run(5_500.0, 0.2), _peer())
    assert got["throughput"] == 1.1 and got["cpu_all"] == 0.8
    assert got["latency_loaded_p50"] == 2.0 and got["latency_delivered_p99"] == 2.0


def test_an_acknowledgement_carries_the_send_time_the_tag_and_when_worker_2_read_it() -> None:
    assert parse_ack(b"00000000000000001234 7:3 5678") == (1234, "7:3", 5678)


def test_every_message_once_and_each_dialogs_in_the_order_its_receives_returned() -> None:
    # (dialog, seq, sent, RECEIVE returned, outcome)
    rows = [
        (0, 0, 1, 10, 30),
        (0, 1, 2, 20, 25),  # the next holder's outcome came first: in order all the same
        (1, 0, 1, 15, 16),
        (1, 1, 2, 25, 26),
        (WARM, 0, 0, 5, 6),
    ]
    assert check_deliveries(rows, dialogs=2, per_dialog=2) == []
    twice = [*rows, (1, 1, 2, 31, 32)]
    assert check_deliveries(twice, 2, 2) == ["dialog 1: 3 messages of 2 (1 twice)"]
    assert check_deliveries(rows[1:], 2, 2) == ["dialog 0: 1 messages of 2 (1 missing)"]
    swapped = [(0, 0, 1, 20, 30), (0, 1, 2, 10, 25), *rows[2:]]
    assert check_deliveries(swapped, 2, 2) == ["dialog 0: received out of order"]


def _backlog(messages: int, burst: int, per_s: float) -> dict[str, Any]:
    look = {"rss_anon_kb": 60_000, "rss_file_kb": 90_000, "store_disk_bytes": 300 * 2**20}
    return {
        "config": {
            "messages": messages,
            "body_bytes": 1024,
            "dialogs": 1_000,
            "burst": burst,
            "dispatchers": 2,
            "shards": 4,
            "partitions": 4,
            "queue_replicas": 2,
            "cpus": 2,
            "top": 0,
        },
        "load_average_1m": {"start": 0.5, "end": 1.5},
        "push": {"applied_seconds": 20.0, "applied_per_s": messages / 20},
        "dispatchers": {},
        "queue_service": {
            "q1": {
                "base": look,
                "indexed": look,
                "drained": look,
                "bytes_per_queued_message": 150.0,
                "store_bytes_per_queued_message": 1_500.0,
            }
        },
        "reader": {"ready_seconds": 0.2},
        "drain": {
            "seconds": messages / per_s,
            "delivered": messages,
            "per_s": per_s,
            "receive_errors": 0,
            "problems": [],
        },
        "verified_exactly_once_in_order": True,
    }


def test_the_backlog_shows_each_replicas_memory_and_the_interleaved_drain_beside_the_other() -> (
    None
):
    r = _backlog(1_000_000, 0, 40_000.0)
    r["interleaved"] = {
        "interleaved": _backlog(200_000, 1, 10_000.0),
        "dialog_by_dialog": _backlog(200_000, 0, 40_000.0),
        "ratio_interleaved_over_dialog_by_dialog": 0.25,
    }
    lines = backlog_lines(r)
    q1 = next(line for line in lines if line.strip().startswith("queue q1"))
    assert q1.split()[2:5] == ["1,000,000", "59", "MB"] and "150" in q1.split()
    summary = next(line for line in lines if line.startswith("interleaved backlog"))
    assert "(1 to a dialog in turn)" in summary and summary.endswith(
        "drain 0.25x of dialog by dialog"
    )
    assert any("drained 200,000 in 20.0 s (10,000 msg/s" in line for line in lines)


def test_each_issue_39_target_is_met_missed_or_not_measured() -> None:
    results: dict[str, Any] = {
        "backlog": {
            "interleaved": {"messages": 200_000, "ratio_interleaved_over_dialog_by_dialog": 0.6}
        },
        "activation": {"first_receive_after_activation": {"p50_ms": 420, "count": 12}},
        "scaling": {
            "runs": [
                _table_run(4_000.0, 0.5),
                {**_table_run(2_000.0, 0.5), "max_queue_depth": 2_000},
            ]
        },
        "peer": _peer(),
    }
    got = {t.name: t for t in issue39(results)}
    assert got["interleaved backlog drain over dialog by dialog"].met is True
    assert got["next reader's first RECEIVE after activation, p50"].met is False
    # the depth-limited column is back-pressure on the readers, not the throughput target's
    throughput = got["end-to-end throughput, 2 receivers, each dispatcher count"]
    assert throughput.met is True and throughput.figure == "2 dispatcher(s) 4,000 msg/s"
    assert got["KSB throughput over the EOS peer, each column"].met is False
    assert got["CPU per message, all processes, 4 reader processes"].met is None
    lines = target_lines([t.as_json() for t in issue39(results)])
    assert (
        "  next reader's first RECEIVE after activation, p50: 420 ms over 12 readers "
        "(goal <= 300 ms): MISSED" in lines
    )


def test_security_on_and_off_end_to_end_is_each_modes_median_run_and_the_target_reads_it() -> None:
    opts = SecurityE2eOptions(runs=3)
    tries: dict[SecurityMode, list[dict[str, Any]]] = {
        "plaintext": [_table_run(r, 0.5) for r in (3_000.0, 3_200.0, 2_800.0)],
        "sasl": [_table_run(r, 0.6) for r in (2_700.0, 2_600.0, 3_100.0)],
    }
    result = summarize_security(opts, tries, {"plaintext": 20.0, "sasl": 21.0})
    assert result["runs"]["plaintext"]["throughput"]["per_s"] == 3_000.0
    assert result["runs"]["sasl"]["throughput"]["per_s"] == 2_700.0
    x = result["ratio_over_plaintext"]["sasl"]
    assert x["throughput"] == pytest.approx(0.9) and x["cpu_all"] == pytest.approx(1.2)
    assert set(result["ratio_over_plaintext"]) == {"sasl"}
    (target,) = [t for t in all_targets({"security_e2e": result}) if t.issue == 38]
    assert target.met is True and target.figure == "0.90x (2,700 against 3,000 msg/s)"
    lines = security_e2e_lines(result)
    sasl = next(line for line in lines if line.strip().startswith("sasl"))
    assert "2,700 msg/s (0.90x) (runs 2,700 / 2,600 / 3,100)" in sasl
    tries["sasl"] = [_table_run(r, 0.6) for r in (2_600.0, 2_600.0, 3_100.0)]
    slower = summarize_security(opts, tries, {"plaintext": None, "sasl": None})
    (target,) = [t for t in all_targets({"security_e2e": slower}) if t.issue == 38]
    assert target.met is False
    (target,) = [t for t in all_targets({"security_e2e": {"error": "x"}}) if t.issue == 38]
    assert target.met is None and target.figure == "not measured"
    printed = target_lines([t.as_json() for t in all_targets({})])
    assert printed[0] == "issue 38 target (this run):" and "issue 39 targets (this run):" in printed
