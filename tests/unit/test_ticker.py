"""The periodic timer, in milliseconds."""

from __future__ import annotations

import logging

import pytest

from ksb.clock import ManualClock
from ksb.runtime.ticker import Ticker

START = 1_000_000
TICK_MS = 5000


def make_ticker(max_catch_up: int = 1) -> tuple[Ticker, dict[str, list[int]]]:
    seen: dict[str, list[int]] = {"every": [], "second": [], "fifth": []}
    ticker = Ticker(START, tick_ms=TICK_MS, max_catch_up=max_catch_up)
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

    ticker = Ticker(START, tick_ms=TICK_MS)
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
        Ticker(START, tick_ms=TICK_MS).every(n, "x", lambda tick: None)


def test_every_rejects_a_duplicate_name() -> None:
    ticker = Ticker(START, tick_ms=TICK_MS)
    ticker.every(1, "x", lambda tick: None)
    with pytest.raises(ValueError, match="already registered"):
        ticker.every(2, "x", lambda tick: None)
