"""The audit job's pure per-queue state: histogram percentiles, SLA windows, backlog age, the
combined queue audit and how its rows are split into the job's outputs."""

from __future__ import annotations

import math
import random
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ksb.spark.backlog_age import TIERS, BacklogAge
from ksb.spark.histogram import EXACT_BELOW, bucket_of, lower_bound, percentiles
from ksb.spark.ordering import ROW_COLUMNS
from ksb.spark.queue_audit import EVENT_FIELDS, OUTPUT_COLUMNS, AuditSettings, QueueAudit
from ksb.spark.sinks import OUTPUTS, row_key, split_rows
from ksb.spark.sla import SLA_COLUMNS, SlaWindows

# --------------------------------------------------------------------------- histogram


def test_small_values_are_exact_and_percentiles_are_nearest_rank() -> None:
    hist: dict[int, int] = {}
    for v in range(10, 101, 10):  # 10, 20, ..., 100
        hist[bucket_of(v)] = hist.get(bucket_of(v), 0) + 1
    assert percentiles(hist, (0.5, 0.95, 0.99)) == [50, 100, 100]
    assert percentiles({}, (0.5,)) == [None]
    assert percentiles({bucket_of(7): 3}, (0.0, 1.0)) == [7, 7]


@given(st.integers(min_value=0, max_value=10**12))
def test_a_bucket_holds_its_value_within_a_thousandth(value: int) -> None:
    low = lower_bound(bucket_of(value))
    assert low <= value
    if value < EXACT_BELOW:
        assert low == value
    else:
        assert (value - low) / value < 1 / 1024


@given(st.lists(st.integers(min_value=0, max_value=10**9), min_size=2, max_size=50))
def test_buckets_keep_the_order_of_values(values: list[int]) -> None:
    ordered = sorted(values)
    buckets = [bucket_of(v) for v in ordered]
    assert buckets == sorted(buckets)


def test_percentiles_match_sorting_within_the_bucket_error() -> None:
    rng = random.Random(7)
    values = [int(rng.lognormvariate(6, 2)) for _ in range(5_000)]
    hist: dict[int, int] = {}
    for v in values:
        hist[bucket_of(v)] = hist.get(bucket_of(v), 0) + 1
    ordered = sorted(values)
    for q, got in zip((0.5, 0.95, 0.99), percentiles(hist, (0.5, 0.95, 0.99)), strict=True):
        want = ordered[math.ceil(q * len(ordered)) - 1]
        assert got is not None and got <= want and want - got <= want / 1024


# --------------------------------------------------------------------------- SLA windows


def _sla() -> SlaWindows:
    return SlaWindows(window_ms=10_000, watermark_ms=30_000, targets={5: 75})


def test_a_window_counts_kinds_percentiles_breaches_and_readers() -> None:
    w = _sla()
    for i in range(1, 11):
        w.add("enqueue", 1_000 + i, "//s", 5, None, None, None)
        w.add("receive", 1_100 + i, "//s", 5, None, None, f"r{i % 2}")
        w.add("commit", 1_200 + i, "//s", 5, 10 * i, 10 * i + 1, None)
    w.add("purge", 1_500, "//s", 5, 3, None, None)
    w.add("dead_letter", 1_501, "//s", 5, 4, None, None)
    [row] = w.drain_rows("Q")
    assert set(row) == set(SLA_COLUMNS)
    assert (row["window_start_ms"], row["window_end_ms"]) == (0, 10_000)
    assert (row["enqueued"], row["received"], row["receives"]) == (10, 10, 10)
    assert (row["purged"], row["dead_lettered"], row["readers"]) == (1, 1, 2)
    assert (row["tiq_p50_ms"], row["tiq_p95_ms"], row["tiq_p99_ms"]) == (50, 100, 100)
    assert (row["tiq_max_ms"], row["e2e_p50_ms"]) == (100, 51)
    assert (row["breaches"], row["target_ms"]) == (3, 75)
    assert w.drain_rows("Q") == []  # nothing touched since


def test_rows_are_absolute_and_final_windows_drop_late_events() -> None:
    w = _sla()
    w.add("commit", 1_000, "//s", 5, 10, None, None)
    w.drain_rows("Q")
    w.add("commit", 2_000, "//s", 5, 20, None, None)
    [row] = w.drain_rows("Q")
    assert row["received"] == 2  # the window's figure so far, not the batch's
    w.add("commit", 45_000, "//s", 5, 1, None, None)  # the watermark moves past window 0
    w.drain_rows("Q")
    assert {k[0] for k in w.series} == {40_000}
    w.add("commit", 3_000, "//s", 5, 1, None, None)
    assert w.drain_rows("Q") == [] and w.late == 1


def test_sla_state_survives_a_round_trip() -> None:
    w = _sla()
    w.add("receive", 1_000, "//s", 5, None, None, "r1")
    w.add("commit", 1_001, "//s", 5, 70, 80, None)
    back = SlaWindows.from_state(
        w.to_state(), window_ms=10_000, watermark_ms=30_000, targets={5: 75}
    )
    back.add("commit", 1_002, "//s", 5, 90, 95, None)
    [row] = back.drain_rows("Q")
    assert (row["received"], row["breaches"], row["readers"], row["tiq_max_ms"]) == (2, 1, 1, 90)


# --------------------------------------------------------------------------- backlog age


def test_the_oldest_ready_message_is_tracked_through_removals() -> None:
    a = BacklogAge()
    a.add(1_000)
    a.add(2_000, 2)
    assert a.oldest_ms() == 1_000 and a.count() == 3
    a.remove(1_000)
    assert a.oldest_ms() == 2_000
    a.remove(None)  # unknown enqueue time: the oldest goes
    assert a.count() == 1
    a.remove(99_999)  # not held: the oldest goes too
    assert a.oldest_ms() is None
    a.remove(None)  # nothing left: nothing happens
    assert a.count() == 0


def test_old_entries_coarsen_and_stay_findable() -> None:
    a = BacklogAge()
    for t in range(0, 20_000, 5):
        a.add(t)
    a.compact(now_ms=2_000_000)
    assert len(a.tiers[0]) == 0 and len(a.tiers[1]) == 0
    assert sum(a.tiers[2].values()) == 4_000 and len(a.tiers[2]) == 1
    a.remove(12_345)  # found in the minute it coarsened into
    assert a.count() == 3_999 and a.oldest_ms() == 0
    assert BacklogAge.from_state(a.to_state()).tiers == a.tiers
    assert TIERS[0][0] < TIERS[1][0] < TIERS[2][0]


# --------------------------------------------------------------------------- queue audit


def _columns(events: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {f: [e.get(f) for e in events] for f in EVENT_FIELDS}


def test_one_batch_feeds_ordering_and_sla_and_the_state_round_trips() -> None:
    settings = AuditSettings(window_ms=10_000, watermark_ms=30_000, sla_targets_ms={5: 1})
    audit = QueueAudit.new(settings)
    batch = [
        {"kind": "enqueue", "event_ms": 1_000, "group": "lo", "priority": 1, "service": "//s"},
        {"kind": "enqueue", "event_ms": 1_001, "group": "hi", "priority": 5, "service": "//s"},
        {"kind": "receive", "event_ms": 1_002, "group": "lo", "priority": 1, "reader": "r"},
        {
            "kind": "commit",
            "event_ms": 1_003,
            "group": "lo",
            "priority": 1,
            "service": "//s",
            "enqueued_ms": 1_000,
            "time_in_queue_ms": 3,
        },
    ]
    assert audit.apply(_columns(batch)) == 4
    rows = audit.drain_rows("Q")
    assert all(set(r) == set(OUTPUT_COLUMNS) for r in rows)
    kinds = [r["row"] for r in rows]
    # SLA series: (//s, 1), (//s, 5) and the RECEIVE, which names no service, under ("", 1).
    assert kinds.count("inversions") == 1 and kinds.count("sla") == 3
    [backlog] = [r for r in rows if r["row"] == "backlog"]
    assert (backlog["ready_messages"], backlog["oldest_enqueued_ms"]) == (1, 1_000)
    assert backlog["oldest_age_ms"] == 3

    back = QueueAudit.from_json(audit.to_json(), settings)
    commit_hi = {
        "kind": "commit",
        "event_ms": 1_004,
        "group": "hi",
        "priority": 5,
        "service": "//s",
        "enqueued_ms": 1_001,
        "time_in_queue_ms": 3,
    }
    back.apply(_columns([commit_hi]))
    rows = back.drain_rows("Q")
    [sla5] = [r for r in rows if r["row"] == "sla" and r["priority"] == 5]
    assert (sla5["enqueued"], sla5["received"], sla5["breaches"]) == (1, 1, 1)
    [backlog] = [r for r in rows if r["row"] == "backlog"]
    assert (backlog["ready_messages"], backlog["oldest_enqueued_ms"]) == (0, None)


def test_rows_split_into_the_two_outputs_with_their_own_columns() -> None:
    audit = QueueAudit.new(AuditSettings())
    audit.apply(_columns([{"kind": "enqueue", "event_ms": 5, "group": "g", "priority": 5}]))
    out = split_rows(audit.drain_rows("Q"))
    assert [r["row"] for r in out["ordering"]] == ["backlog"]
    assert all(tuple(r) == ROW_COLUMNS for r in out["ordering"])
    assert all(tuple(r) == SLA_COLUMNS for r in out["sla"]) and len(out["sla"]) == 1
    assert set(OUTPUTS) == {"sla", "ordering"}
    assert row_key("sla", out["sla"][0]) == "sla|Q||5|0"
