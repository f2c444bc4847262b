"""The dispatcher's watchdog: a Kafka transaction call that outlives its limit ends the process."""

from __future__ import annotations

import pytest

from services.dispatcher.watchdog import Watchdog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_call_past_its_limit_ends_the_process_and_one_within_it_does_not() -> None:
    clock, ended = Clock(), []
    dog = Watchdog(120, clock=clock, on_stuck=lambda: ended.append(True))
    assert not dog.check()  # no call running
    with dog.guard("send_offsets_to_transaction"):
        clock.now = 120
        assert not dog.check() and not ended
        clock.now = 121
        assert dog.overdue() == "send_offsets_to_transaction blocked for 121 s"
        assert dog.check() and ended == [True]


def test_a_call_that_returned_is_not_watched_any_more() -> None:
    clock, ended = Clock(), []
    dog = Watchdog(1, clock=clock, on_stuck=lambda: ended.append(True))
    with pytest.raises(RuntimeError), dog.guard("commit_transaction"):
        raise RuntimeError("the call failed")
    clock.now = 1_000
    assert not dog.check() and not ended
