"""Exactly-once, in-order delivery between instances: the receive window and the retransmitter."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ksb.clock import ManualClock
from ksb.dialog.sequencing import Backoff, ReceiveWindow, Retransmitter


@st.composite
def arrivals(draw: st.DrawFn) -> tuple[int, list[int]]:
    """Seqs 0..n, each at least once, some several times, in any order: what a bad link delivers."""
    n = draw(st.integers(min_value=0, max_value=60))
    extra = draw(st.lists(st.integers(min_value=0, max_value=n), max_size=40))
    order = draw(st.permutations([*range(n + 1), *extra]))
    return n, order


@given(arrivals())
def test_any_arrival_order_delivers_each_seq_once_in_order(case: tuple[int, list[int]]) -> None:
    n, order = case
    window: ReceiveWindow[str] = ReceiveWindow(ManualClock(), max_buffered=n + 1)
    delivered: list[str] = []
    for seq in order:
        delivered.extend(window.offer(seq, f"m{seq}"))
    assert delivered == [f"m{seq}" for seq in range(n + 1)]
    assert window.ack_seq == n
    assert window.buffered == 0
    assert window.duplicates == len(order) - (n + 1)
    assert window.refused == 0


@given(arrivals(), st.integers(min_value=0, max_value=3))
def test_a_tiny_buffer_still_delivers_everything_once_when_the_sender_repeats(
    case: tuple[int, list[int]], max_buffered: int
) -> None:
    """Refusing early arrivals is safe: each retransmission round moves the window forward."""
    n, order = case
    window: ReceiveWindow[int] = ReceiveWindow(ManualClock(), max_buffered=max_buffered)
    delivered: list[int] = []
    rounds = 0
    while window.ack_seq < n:
        rounds += 1
        assert rounds <= n + 1, "no progress"
        for seq in order:
            if seq > window.ack_seq:  # the sender repeats only what is not acknowledged
                delivered.extend(window.offer(seq, seq))
    assert delivered == list(range(n + 1))
    assert window.buffered <= max_buffered


def test_an_early_arrival_waits_for_the_gap_and_the_ack_covers_only_contiguous_seqs() -> None:
    window: ReceiveWindow[str] = ReceiveWindow(ManualClock())
    assert window.ack_seq == -1
    assert window.offer(1, "b") == []
    assert window.offer(2, "c") == []
    assert (window.buffered, window.ack_seq) == (2, -1)
    assert window.offer(0, "a") == ["a", "b", "c"]
    assert (window.buffered, window.ack_seq, window.next_seq) == (0, 2, 3)


def test_duplicates_of_delivered_and_of_buffered_seqs_are_dropped_and_counted() -> None:
    window: ReceiveWindow[str] = ReceiveWindow(ManualClock())
    window.offer(0, "a")
    window.offer(2, "c")
    assert window.offer(0, "a again") == []
    assert window.offer(2, "c again") == []
    assert window.duplicates == 2
    assert window.offer(1, "b") == ["b", "c"]  # the first copy of 2 wins


def test_a_full_buffer_refuses_early_arrivals_but_never_the_next_expected_seq() -> None:
    window: ReceiveWindow[str] = ReceiveWindow(ManualClock(), max_buffered=2)
    window.offer(1, "b")
    window.offer(2, "c")
    assert window.offer(3, "d") == []
    assert (window.buffered, window.refused) == (2, 1)
    assert window.offer(0, "a") == ["a", "b", "c"]
    assert window.offer(3, "d") == ["d"]


def test_a_window_can_resume_after_seqs_delivered_before_a_restart() -> None:
    window: ReceiveWindow[str] = ReceiveWindow(ManualClock(), next_seq=5)
    assert window.ack_seq == 4
    assert window.offer(4, "old") == []
    assert window.offer(5, "f") == ["f"]


def test_negative_seqs_and_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="max_buffered"):
        ReceiveWindow(ManualClock(), max_buffered=-1)
    with pytest.raises(ValueError, match="next_seq"):
        ReceiveWindow(ManualClock(), next_seq=-1)
    with pytest.raises(ValueError, match="start at 0"):
        ReceiveWindow[str](ManualClock()).offer(-1, "x")


def test_purge_drops_only_buffered_arrivals_old_enough() -> None:
    clock = ManualClock()
    window: ReceiveWindow[str] = ReceiveWindow(clock)
    window.offer(2, "c")
    clock.advance(4)
    window.offer(3, "d")
    clock.advance(6)  # seq 2 has waited 10 s, seq 3 only 6 s
    assert window.drop_older_than(clock.now_ms(), 10_000) == [2]
    assert (window.buffered, window.purged) == (1, 1)
    assert window.offer(0, "a") == ["a"]
    assert window.offer(2, "c") == []  # the gap at 1 is still open: buffered again, not delivered
    assert window.offer(1, "b") == ["b", "c", "d"]
    assert window.drop_older_than(clock.now_ms() + 60_000, 10_000) == []


def test_backoff_doubles_from_one_second_up_to_a_minute() -> None:
    clock = ManualClock()
    sender = Retransmitter()
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
    sender = Retransmitter()
    sender.sent(0, 0)
    assert sender.due(300_000) == [0]
    assert sender.due(300_000) == []
    assert sender.next_due_ms == 302_000


def test_cumulative_acks_stop_retransmission_and_ignore_stale_acks() -> None:
    sender = Retransmitter()
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
    sender = Retransmitter()
    sender.sent(0, 0)
    with pytest.raises(ValueError, match="already sent"):
        sender.sent(0, 10)
    with pytest.raises(ValueError, match="start at 0"):
        sender.sent(-1, 0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"initial_ms": 0}, "initial_ms"), ({"factor": 0.5}, "factor"), ({"max_ms": 10}, "max_ms")],
)
def test_backoff_settings_are_checked(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Backoff(**kwargs)  # type: ignore[arg-type]


def test_backoff_never_overflows_for_a_peer_down_for_days() -> None:
    assert Backoff().delay_ms(100_000) == 60_000
