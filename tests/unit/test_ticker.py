"""The periodic timer and the pure maintenance rules, all in milliseconds."""

from __future__ import annotations

import logging

import pytest

from ksb.clock import ManualClock
from ksb.runtime.ticker import Ticker, TickSchedule, idle_to_close, stale
from ksb.transmission.suppression import Suppression

START = 1_000_000


def make_ticker(max_catch_up: int = 1) -> tuple[Ticker, dict[str, list[int]]]:
    seen: dict[str, list[int]] = {"every": [], "second": [], "fifth": []}
    ticker = Ticker(START, TickSchedule(tick_ms=5000), max_catch_up=max_catch_up)
    ticker.every(1, "every", seen["every"].append)
    ticker.every(2, "second", seen["second"].append)
    ticker.every(5, "fifth", seen["fifth"].append)
    return ticker, seen


def test_nothing_runs_before_the_first_tick() -> None:
    ticker, _ = make_ticker()
    assert ticker.poll(START + 4999) == []
    assert ticker.next_due_ms == START + 5000


def test_tasks_run_on_every_first_second_and_fifth_tick() -> None:
    ticker, seen = make_ticker()
    clock = ManualClock(START)
    for _ in range(10):
        clock.advance(5)
        ticker.poll(clock.now_ms())
    assert seen["every"] == list(range(1, 11))
    assert seen["second"] == [2, 4, 6, 8, 10]
    assert seen["fifth"] == [5, 10]


def test_poll_returns_the_names_that_ran_in_registration_order() -> None:
    ticker, _ = make_ticker()
    assert ticker.poll(START + 5000) == ["every"]
    assert ticker.poll(START + 10_000) == ["every", "second"]


def test_a_missed_tick_is_caught_up() -> None:
    ticker, seen = make_ticker()
    assert ticker.poll(START + 10_000) == ["every", "every", "second"]
    assert seen["every"] == [1, 2]


def test_a_long_stall_runs_at_most_one_extra_tick_and_realigns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ticker, seen = make_ticker(max_catch_up=1)
    with caplog.at_level(logging.WARNING, logger="ksb.runtime.ticker"):
        ticker.poll(START + 60_000)
    assert seen["every"] == [1, 2]
    assert ticker.tick == 2
    assert ticker.next_due_ms == START + 65_000
    assert "dropped 10 missed tick(s)" in caplog.text
    assert ticker.poll(START + 64_999) == []


def test_max_catch_up_zero_runs_only_the_due_tick() -> None:
    ticker, seen = make_ticker(max_catch_up=0)
    ticker.poll(START + 30_000)
    assert seen["every"] == [1]
    assert ticker.next_due_ms == START + 35_000


def test_a_failing_task_is_logged_and_does_not_stop_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[int] = []

    def broken(tick: int) -> None:
        raise RuntimeError("boom")

    ticker = Ticker(START)
    ticker.every(1, "broken", broken)
    ticker.every(1, "after", ran.append)
    with caplog.at_level(logging.ERROR, logger="ksb.runtime.ticker"):
        assert ticker.poll(START + 5000) == ["after"]
        assert ticker.poll(START + 10_000) == ["after"]
    assert ran == [1, 2]
    assert "'broken' failed on tick 1" in caplog.text


@pytest.mark.parametrize("n", [0, -1])
def test_every_rejects_non_positive_n(n: int) -> None:
    with pytest.raises(ValueError, match="n must be >= 1"):
        Ticker(START).every(n, "x", lambda tick: None)


def test_every_rejects_a_duplicate_name() -> None:
    ticker = Ticker(START)
    ticker.every(1, "x", lambda tick: None)
    with pytest.raises(ValueError, match="already registered"):
        ticker.every(2, "x", lambda tick: None)


def test_suppression_after_disconnect_lasts_15_seconds() -> None:
    s = Suppression()
    s.on_disconnect("b", 1000)
    assert s.is_suppressed("b", 15_999)
    assert not s.is_suppressed("b", 16_000)


def test_suppression_restarts_after_each_failed_connect() -> None:
    s = Suppression()
    s.on_failed_connect("b", 0)
    assert s.is_suppressed("b", 59_999)
    assert not s.is_suppressed("b", 60_000)
    s.on_failed_connect("b", 60_000)
    assert s.is_suppressed("b", 119_999)
    assert s.suppressed_until("b") == 120_000


def test_a_disconnect_does_not_shorten_a_failed_connect_back_off() -> None:
    s = Suppression()
    s.on_failed_connect("b", 0)
    s.on_disconnect("b", 1000)
    assert s.is_suppressed("b", 59_999)


def test_a_connection_clears_suppression() -> None:
    s = Suppression()
    s.on_failed_connect("b", 0)
    s.on_connected("b")
    assert not s.is_suppressed("b", 1)


def test_due_lists_pending_destinations_that_are_not_suppressed() -> None:
    s = Suppression(after_disconnect_ms=1000)
    s.on_disconnect("down", 0)
    s.on_failed_connect("dead", 0)
    assert s.due(["up", "down", "dead"], 500) == ["up"]
    assert s.due(["up", "down", "dead"], 1000) == ["up", "down"]


def test_idle_to_close_picks_connections_idle_for_the_full_interval() -> None:
    last = {"a": 0, "b": 10_000, "c": 50_000}
    assert idle_to_close(last, 100_000, 90_000) == ["a", "b"]


def test_stale_picks_entries_at_least_max_age_old() -> None:
    arrivals = {("dialog", 1): 0, ("dialog", 2): 5_000, ("dialog", 3): 9_999}
    assert stale(arrivals, 15_000, 10_000) == [("dialog", 1), ("dialog", 2)]
    assert stale({}, 0, 10_000) == []
