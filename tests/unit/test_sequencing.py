"""Exactly-once, in-order delivery between instances: the receive window."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ksb.clock import ManualClock
from ksb.dialog.sequencing import ReceiveWindow

NOW = 1_000
"""Arrival time where a test does not purge (arrival times matter only to the purge)."""


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
    window: ReceiveWindow[str] = ReceiveWindow(max_buffered=n + 1)
    delivered: list[str] = []
    for seq in order:
        delivered.extend(window.offer(seq, f"m{seq}", NOW))
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
    window: ReceiveWindow[int] = ReceiveWindow(max_buffered=max_buffered)
    delivered: list[int] = []
    rounds = 0
    while window.ack_seq < n:
        rounds += 1
        assert rounds <= n + 1, "no progress"
        for seq in order:
            if seq > window.ack_seq:  # the sender repeats only what is not acknowledged
                delivered.extend(window.offer(seq, seq, NOW))
    assert delivered == list(range(n + 1))
    assert window.buffered <= max_buffered


def test_an_early_arrival_waits_for_the_gap_and_the_ack_covers_only_contiguous_seqs() -> None:
    window: ReceiveWindow[str] = ReceiveWindow()
    assert window.ack_seq == -1
    assert window.offer(1, "b", NOW) == []
    assert window.offer(2, "c", NOW) == []
    assert (window.buffered, window.ack_seq) == (2, -1)
    assert window.offer(0, "a", NOW) == ["a", "b", "c"]
    assert (window.buffered, window.ack_seq, window.next_seq) == (0, 2, 3)


def test_duplicates_of_delivered_and_of_buffered_seqs_are_dropped_and_counted() -> None:
    window: ReceiveWindow[str] = ReceiveWindow()
    window.offer(0, "a", NOW)
    window.offer(2, "c", NOW)
    assert window.offer(0, "a again", NOW) == []
    assert window.offer(2, "c again", NOW) == []
    assert window.duplicates == 2
    assert window.offer(1, "b", NOW) == ["b", "c"]  # the first copy of 2 wins


def test_a_full_buffer_refuses_early_arrivals_but_never_the_next_expected_seq() -> None:
    window: ReceiveWindow[str] = ReceiveWindow(max_buffered=2)
    window.offer(1, "b", NOW)
    window.offer(2, "c", NOW)
    assert window.offer(3, "d", NOW) == []
    assert (window.buffered, window.refused) == (2, 1)
    assert window.offer(0, "a", NOW) == ["a", "b", "c"]
    assert window.offer(3, "d", NOW) == ["d"]


def test_a_window_can_resume_after_seqs_delivered_before_a_restart() -> None:
    window: ReceiveWindow[str] = ReceiveWindow(next_seq=5)
    assert window.ack_seq == 4
    assert window.offer(4, "old", NOW) == []
    assert window.offer(5, "f", NOW) == ["f"]


def test_negative_seqs_and_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="max_buffered"):
        ReceiveWindow(max_buffered=-1)
    with pytest.raises(ValueError, match="next_seq"):
        ReceiveWindow(next_seq=-1)
    with pytest.raises(ValueError, match="start at 0"):
        ReceiveWindow[str]().offer(-1, "x", NOW)


def test_purge_drops_only_buffered_arrivals_old_enough() -> None:
    clock = ManualClock()
    window: ReceiveWindow[str] = ReceiveWindow()
    window.offer(2, "c", clock.now_ms())
    clock.advance(4)
    window.offer(3, "d", clock.now_ms())
    clock.advance(6)  # seq 2 has waited 10 s, seq 3 only 6 s
    assert window.drop_older_than(clock.now_ms(), 10_000) == [2]
    assert (window.buffered, window.purged) == (1, 1)
    assert window.offer(0, "a", clock.now_ms()) == ["a"]
    assert (
        window.offer(2, "c", clock.now_ms()) == []
    )  # the gap at 1 is still open: buffered again, not delivered
    assert window.offer(1, "b", clock.now_ms()) == ["b", "c", "d"]
    assert window.drop_older_than(clock.now_ms() + 60_000, 10_000) == []
