"""The transmission scheduler: conversation order, level shares, the max-wait bound, honor off."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ksb.errors import ConversationError
from ksb.settings import TransmitterSettings
from ksb.transmission.scheduler import (
    DEFAULT_WEIGHTS,
    Pending,
    Scheduled,
    TransmissionScheduler,
)

STRICT = {level: 1000**level for level in range(1, 11)}
"""Each level outweighs the one below by more than any test's backlog: strict priority order."""
FOREVER = 10**15
MAX_WAIT_MS = TransmitterSettings().max_wait_ms
"""Starvation prevention as a transmitter runs it by default."""


@dataclass(frozen=True)
class Plan:
    """A conversation: its level, destination and forwarded flag."""

    level: int
    destination: str
    forwarded: bool


plans = st.builds(
    Plan,
    level=st.integers(1, 10),
    destination=st.sampled_from(["east", "west", "north"]),
    forwarded=st.booleans(),
)


@st.composite
def workloads(draw: st.DrawFn, max_size: int = 120) -> list[Pending]:
    """Messages of a few conversations, enqueued in non-decreasing time, seq in send order."""
    convs = draw(st.lists(plans, min_size=1, max_size=8))
    picks = draw(st.lists(st.integers(0, len(convs) - 1), min_size=1, max_size=max_size))
    gaps = draw(st.lists(st.integers(0, 50), min_size=len(picks), max_size=len(picks)))
    seqs = Counter[int]()
    out: list[Pending] = []
    now = 0
    for i, (conv, gap) in enumerate(zip(picks, gaps, strict=True)):
        now += gap
        plan = convs[conv]
        out.append(
            Pending(
                message_id=f"m{i}",
                conversation_id=f"c{conv}",
                seq=seqs[conv],
                level=plan.level,
                destination=plan.destination,
                enqueued_ms=now,
                forwarded=plan.forwarded,
            )
        )
        seqs[conv] += 1
    return out


def drain(scheduler: TransmissionScheduler, now_ms: int) -> list[Scheduled]:
    out: list[Scheduled] = []
    while (taken := scheduler.next(now_ms)) is not None:
        out.append(taken)
    return out


def msg(
    mid: str,
    level: int = 5,
    conv: str | None = None,
    seq: int = 0,
    dest: str = "east",
    at: int = 0,
    forwarded: bool = False,
) -> Pending:
    return Pending(mid, conv or mid, seq, level, dest, at, forwarded)


# -- properties ------------------------------------------------------------------------------


@given(workloads(), st.booleans(), st.integers(0, 200), st.integers(1, 20))
@settings(max_examples=150, deadline=None)
def test_conversation_order_is_always_preserved(
    messages: list[Pending], honor: bool, max_wait_ms: int, step_ms: int
) -> None:
    scheduler = TransmissionScheduler(honor_broker_priority=honor, max_wait_ms=max_wait_ms)
    sent: list[Pending] = []
    now = 0
    pending = list(messages)
    while pending or len(scheduler):
        while pending and pending[0].enqueued_ms <= now:
            scheduler.add(pending.pop(0))
        taken = scheduler.next(now)
        if taken is not None:
            sent.append(taken.pending)
        now += step_ms
    assert sorted(sent, key=lambda p: p.message_id) == sorted(messages, key=lambda p: p.message_id)
    last_seq: dict[str, int] = {}
    for p in sent:
        assert last_seq.get(p.conversation_id, -1) < p.seq
        last_seq[p.conversation_id] = p.seq


@given(workloads())
@settings(max_examples=150, deadline=None)
def test_strict_weights_order_by_level_then_enqueue_order(messages: list[Pending]) -> None:
    scheduler = TransmissionScheduler(max_wait_ms=FOREVER, weights=STRICT)
    for p in messages:
        scheduler.add(p)
    sent = [s.pending for s in drain(scheduler, now_ms=messages[-1].enqueued_ms)]

    def key(p: Pending) -> tuple[int, int, int]:
        effective = 5 if p.forwarded else p.level
        return (-effective, p.enqueued_ms, messages.index(p))

    assert sent == sorted(messages, key=key)


@given(workloads())
@settings(max_examples=150, deadline=None)
def test_honor_off_sends_in_plain_enqueue_order(messages: list[Pending]) -> None:
    scheduler = TransmissionScheduler(honor_broker_priority=False, max_wait_ms=FOREVER)
    for p in messages:
        scheduler.add(p)
    taken = drain(scheduler, now_ms=messages[-1].enqueued_ms)
    assert [s.pending for s in taken] == messages
    assert {s.effective_level for s in taken} == {5}


@given(
    levels=st.lists(st.integers(1, 10), min_size=1, max_size=300),
    gaps=st.lists(st.integers(0, 30), min_size=300, max_size=300),
    n_convs=st.integers(1, 12),
    send_ms=st.integers(1, 10),
    max_wait_ms=st.integers(0, 500),
)
@settings(max_examples=200, deadline=None)
def test_no_message_waits_longer_than_max_wait_plus_one_send(
    levels: list[int], gaps: list[int], n_convs: int, send_ms: int, max_wait_ms: int
) -> None:
    """The bound proved in the module docstring, under its premise: at most one arrival per send."""
    arrivals: list[Pending] = []
    now = 0
    seqs = Counter[int]()
    for i, level in enumerate(levels):
        conv = i % n_convs
        now += send_ms + gaps[i]
        arrivals.append(msg(f"m{i}", level, f"c{conv}", seqs[conv], at=now))
        seqs[conv] += 1
    scheduler = TransmissionScheduler(max_wait_ms=max_wait_ms)
    waits: list[int] = []
    clock = 0
    while arrivals or len(scheduler):
        while arrivals and arrivals[0].enqueued_ms <= clock:
            scheduler.add(arrivals.pop(0))
        taken = scheduler.next(clock)
        if taken is not None:
            waits.append(taken.waited_ms)
        clock += send_ms
    assert max(waits) <= max_wait_ms + send_ms


# -- examples --------------------------------------------------------------------------------


def saturated(per_level: int, levels: range = range(1, 11)) -> TransmissionScheduler:
    scheduler = TransmissionScheduler(max_wait_ms=FOREVER)
    for level in levels:
        for i in range(per_level):
            scheduler.add(msg(f"L{level}-{i}", level, conv=f"L{level}-{i % 7}", seq=i // 7))
    return scheduler


def test_top_levels_get_most_capacity_under_saturation() -> None:
    scheduler = saturated(per_level=10_000)
    shares = Counter(s.effective_level for s in scheduler.take_batch(0, 10_000))
    total = sum(DEFAULT_WEIGHTS.values())
    for level in range(1, 11):
        expected = 10_000 * DEFAULT_WEIGHTS[level] / total
        assert abs(shares[level] - expected) <= 10, (level, shares[level], expected)
    assert shares[10] + shares[9] + shares[8] >= 8_700
    assert shares[1] >= 9  # starvation-free even without the max-wait rule


def test_shares_between_two_levels_follow_the_weight_ratio() -> None:
    close = Counter(s.effective_level for s in saturated(5000, range(9, 11)).take_batch(0, 3000))
    assert close == {10: 2000, 9: 1000}  # adjacent levels: a small advantage
    far = Counter(s.effective_level for s in saturated(6000, range(1, 11, 9)).take_batch(0, 5130))
    assert far == {10: 5120, 1: 10}  # widely separated levels: a large advantage


def test_a_higher_level_that_appears_is_served_at_once() -> None:
    scheduler = saturated(per_level=5000, levels=range(1, 2))
    scheduler.take_batch(0, 1000)
    scheduler.add(msg("urgent", 10))
    assert scheduler.next(0) == Scheduled(msg("urgent", 10), 10, False, 0)


def test_a_returning_low_level_gets_no_burst_of_credit_for_its_absence() -> None:
    scheduler = saturated(per_level=5000, levels=range(10, 11))
    scheduler.take_batch(0, 3000)  # level 1 absent meanwhile: it earns nothing for that
    for i in range(600):
        scheduler.add(msg(f"low{i}", 1, conv="low", seq=i))
    levels = Counter(s.effective_level for s in scheduler.take_batch(0, 1026))
    assert levels[1] <= 3


def test_an_overdue_message_is_sent_next_and_flagged() -> None:
    scheduler = TransmissionScheduler(max_wait_ms=10_000)
    scheduler.add(msg("old-low", 1, at=0))
    for i in range(5):
        scheduler.add(msg(f"high{i}", 10, at=9_000))
    assert scheduler.next(10_000).pending.message_id == "high0"  # type: ignore[union-attr]
    taken = scheduler.next(10_001)
    assert taken == Scheduled(msg("old-low", 1, at=0), 1, True, 10_001)
    assert not scheduler.next(10_002).starvation_exception  # type: ignore[union-attr]


def test_a_low_level_under_a_flood_of_high_priority_work_still_meets_the_max_wait() -> None:
    """One send per ms while 1.1 messages arrive per ms: level 1 alone would wait forever."""
    scheduler = TransmissionScheduler(max_wait_ms=10_000)
    low_waits: list[int] = []
    exceptions = 0
    for now in range(20_000):
        scheduler.add(msg(f"h{now}", 10, conv=f"h{now % 5}", seq=now // 5, at=now))
        if now % 10 == 0:
            scheduler.add(msg(f"l{now}", 1, conv="low", seq=now, at=now))
        taken = scheduler.next(now)
        assert taken is not None
        if taken.pending.level == 1:
            low_waits.append(taken.waited_ms)
        exceptions += taken.starvation_exception
    assert low_waits
    assert max(low_waits) <= 10_001
    assert exceptions > 0


def test_a_conversations_next_message_waits_for_its_head() -> None:
    scheduler = TransmissionScheduler(max_wait_ms=FOREVER)
    scheduler.add(msg("a1", 1, conv="a", seq=1))
    scheduler.add(msg("b0", 10, conv="b", seq=0))
    scheduler.add(msg("a0", 1, conv="a", seq=0))  # a late lower seq takes over as head
    assert [s.pending.message_id for s in drain(scheduler, 0)] == ["b0", "a0", "a1"]


def test_a_conversation_uses_its_heads_level() -> None:
    scheduler = TransmissionScheduler(max_wait_ms=FOREVER, weights=STRICT)
    scheduler.add(msg("a0", 2, conv="a", seq=0))
    scheduler.add(msg("a1", 10, conv="a", seq=1))
    scheduler.add(msg("b0", 5, conv="b", seq=0))
    assert [s.pending.message_id for s in drain(scheduler, 0)] == ["b0", "a0", "a1"]


def test_forwarded_messages_always_go_at_level_5() -> None:
    scheduler = TransmissionScheduler(max_wait_ms=FOREVER, weights=STRICT)
    scheduler.add(msg("fwd", 10, forwarded=True))
    scheduler.add(msg("six", 6))
    taken = drain(scheduler, 0)
    assert [(s.pending.message_id, s.effective_level) for s in taken] == [("six", 6), ("fwd", 5)]


def test_remove_forgets_a_message_and_unblocks_its_conversation() -> None:
    scheduler = TransmissionScheduler(max_wait_ms=MAX_WAIT_MS)
    scheduler.add(msg("a0", conv="a", seq=0))
    scheduler.add(msg("a1", conv="a", seq=1))
    scheduler.add(msg("a2", conv="a", seq=2))
    assert scheduler.remove("a1")
    assert not scheduler.remove("a1")
    assert scheduler.remove("a0")
    assert len(scheduler) == 1
    assert "a2" in scheduler
    assert [s.pending.message_id for s in drain(scheduler, 0)] == ["a2"]
    assert len(scheduler) == 0


def test_destination_filters_only_take_matching_messages() -> None:
    scheduler = TransmissionScheduler(max_wait_ms=FOREVER)
    scheduler.add(msg("e", 10, dest="east"))
    scheduler.add(msg("w1", 1, dest="west", conv="w", seq=0))
    scheduler.add(msg("w2", 1, dest="west", conv="w", seq=1))
    scheduler.add(msg("n", 3, dest="north"))
    assert scheduler.next(0, destinations={"west", "north"}).pending.message_id == "n"  # type: ignore[union-attr]
    batch = scheduler.take_batch(0, 5, destination="west")
    assert [s.pending.message_id for s in batch] == ["w1", "w2"]
    assert scheduler.next(0, destinations=set()) is None
    assert scheduler.take_batch(0, 5, destination="nowhere") == []
    assert [s.pending.message_id for s in drain(scheduler, 0)] == ["e"]


def test_an_overdue_message_for_another_destination_does_not_block_a_filtered_take() -> None:
    scheduler = TransmissionScheduler(max_wait_ms=10)
    scheduler.add(msg("west-old", 1, dest="west", at=0))
    scheduler.add(msg("east-new", 1, dest="east", at=100))
    taken = scheduler.next(100, destinations={"east"})
    assert taken == Scheduled(msg("east-new", 1, dest="east", at=100), 1, False, 0)


def test_waiting_view_reports_assigned_and_effective_levels() -> None:
    scheduler = TransmissionScheduler(honor_broker_priority=False, max_wait_ms=MAX_WAIT_MS)
    scheduler.add(msg("a", 9, at=100))
    scheduler.add(msg("b", 2, dest="west", at=50))
    rows = scheduler.waiting(1000)
    assert [
        (r.message_id, r.destination, r.level, r.effective_level, r.waited_ms) for r in rows
    ] == [
        ("b", "west", 2, 5, 950),
        ("a", "east", 9, 5, 900),
    ]


def test_next_on_an_empty_scheduler_is_none() -> None:
    assert TransmissionScheduler(max_wait_ms=MAX_WAIT_MS).next(0) is None


def test_bad_input_fails_with_a_reason() -> None:
    with pytest.raises(ConversationError, match="priority level 11"):
        msg("x", 11)
    scheduler = TransmissionScheduler(max_wait_ms=MAX_WAIT_MS)
    scheduler.add(msg("x"))
    with pytest.raises(ValueError, match="already waiting"):
        scheduler.add(msg("x"))
    with pytest.raises(ValueError, match="missing 1"):
        TransmissionScheduler(max_wait_ms=MAX_WAIT_MS, weights={level: 1 for level in range(2, 11)})
    with pytest.raises(ValueError, match="must be positive"):
        TransmissionScheduler(
            max_wait_ms=MAX_WAIT_MS, weights={level: level - 1 for level in range(1, 11)}
        )


def test_100k_messages_are_scheduled_quickly() -> None:
    scheduler = TransmissionScheduler(max_wait_ms=MAX_WAIT_MS)
    for i in range(100_000):
        scheduler.add(msg(f"m{i}", 1 + i % 10, conv=f"c{i % 1000}", seq=i // 1000, at=i))
    taken = scheduler.take_batch(100_000, 100_000)
    assert len(taken) == 100_000
    assert len(scheduler) == 0
