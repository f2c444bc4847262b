"""The sending half of delivery between instances: what is sent again, and when."""

from __future__ import annotations

from itertools import pairwise

import pytest

from ksb.backoff import Backoff
from ksb.clock import ManualClock
from ksb.transmission.retransmit import Retransmitter

ONE_SECOND = Backoff(initial_ms=1_000, max_ms=60_000)
"""Retransmission from 1 s, doubling up to a minute."""


def test_backoff_doubles_from_one_second_up_to_a_minute() -> None:
    clock = ManualClock()
    sender = Retransmitter(ONE_SECOND)
    sender.sent(0, clock.now_ms())
    start = clock.now_ms()
    retransmitted_at: list[int] = []
    for _ in range(5 * 60 * 10):  # five minutes in 100 ms steps
        clock.advance(0.1)
        if sender.due(clock.now_ms()):
            retransmitted_at.append(clock.now_ms() - start)
    gaps = [b - a for a, b in pairwise([0, *retransmitted_at])]
    assert gaps[:6] == [1000, 2000, 4000, 8000, 16_000, 32_000]
    assert set(gaps[6:]) == {60_000}
    assert sender.attempts(0) == 1 + len(retransmitted_at)


def test_nothing_is_due_before_its_time_and_due_seqs_come_lowest_first() -> None:
    clock = ManualClock()
    sender = Retransmitter(Backoff(initial_ms=500, factor=3, max_ms=2000))
    now = clock.now_ms()
    sender.sent(1, now)
    sender.sent(0, now)
    sender.sent(2, now + 100)
    assert sender.next_due_ms == now + 500
    assert sender.due(now + 499) == []
    assert sender.due(now + 600) == [0, 1, 2]
    assert sender.next_due_ms == now + 600 + 1500
    assert sender.due(now + 2099) == []
    assert sender.due(now + 2100) == [0, 1, 2]
    assert sender.next_due_ms == now + 2100 + 2000  # 4500 capped at 2000


def test_a_late_caller_gets_one_retransmission_not_a_burst() -> None:
    sender = Retransmitter(ONE_SECOND)
    sender.sent(0, 0)
    assert sender.due(300_000) == [0]
    assert sender.due(300_000) == []
    assert sender.next_due_ms == 302_000


def test_cumulative_acks_stop_retransmission_and_ignore_stale_acks() -> None:
    sender = Retransmitter(ONE_SECOND)
    for seq in range(5):
        sender.sent(seq, 0)
    assert sender.unacked == 5
    assert sender.acked(2) == 3
    assert sender.acked(1) == 0  # an older ack overtaken by a newer one
    assert (sender.unacked, sender.acked_seq) == (2, 2)
    assert sender.due(1000) == [3, 4]
    assert sender.acked(4) == 2
    assert sender.due(10_000) == []
    assert sender.next_due_ms is None
    sender.sent(1, 20_000)  # already acknowledged: nothing to track
    assert sender.unacked == 0


def test_sending_a_seq_twice_without_an_ack_is_a_caller_bug() -> None:
    sender = Retransmitter(ONE_SECOND)
    sender.sent(0, 0)
    with pytest.raises(ValueError, match="already sent"):
        sender.sent(0, 10)
    with pytest.raises(ValueError, match="start at 0"):
        sender.sent(-1, 0)
