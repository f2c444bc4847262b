"""The reader's stalled-partition rule: which groups RECEIVE tries first while a dispatcher is gone."""

from __future__ import annotations

from ksb.queue.index import QueueIndex
from ksb.queue.stalls import CommitStalls
from tests.unit.test_queue_index import msg

LEVELS = {"a": 5, "b": 5, "c": 5, "d": 3, "e": 3}
PARTS = {"a": 0, "b": 1, "c": 0, "d": 0, "e": 2}


def test_a_partition_falls_behind_when_a_later_commit_elsewhere_is_answered() -> None:
    st = CommitStalls(200)
    st.sent(0, 1_000)
    st.sent(1, 1_150)
    st.answered(1)
    assert st.stalled(1_300) == set()  # 150 ms apart: within the slack
    st.sent(1, 1_201)
    st.answered(1)
    assert st.stalled(1_300) == {0}


def test_a_slow_owner_that_answers_in_order_is_not_stalled() -> None:
    st = CommitStalls(200)
    for t in range(0, 1_000, 100):  # every commit waits 1 s, on both partitions alike
        st.sent(0, t)
        st.sent(1, t + 50)
    for _ in range(5):
        st.answered(0)
        st.answered(1)
        assert st.stalled(1_500) == set()


def test_with_no_answer_anywhere_ten_times_the_slack_stalls_a_partition() -> None:
    st = CommitStalls(200)
    st.sent(0, 0)
    assert st.stalled(1_999) == set()
    assert st.stalled(2_000) == {0}
    st.answered(0)
    assert st.stalled(10_000) == set()  # nothing in flight: never stalled


def index_of_levels() -> QueueIndex:
    ix = QueueIndex("Q")
    for n, group in enumerate(["a", "b", "c", "d", "e"]):
        ix.add(msg(group, group, 0, priority=LEVELS[group]), 0, n)
    return ix


def order(st: CommitStalls, now: int, limit: int = 10) -> list[str]:
    stalled = st.stalled(now)
    return index_of_levels().lock_candidates(
        set(), limit, later=lambda g: PARTS[g] in stalled if stalled else False
    )


def test_groups_on_stalled_partitions_go_behind_their_level_only() -> None:
    st = CommitStalls(200)
    st.sent(0, 0)
    assert order(st, 100) == ["a", "b", "c", "d", "e"]  # not stalled: best first as given
    # Partition 0 stalled: b goes before a and c, but a and c still before any lower level.
    assert order(st, 2_000) == ["b", "a", "c", "e", "d"]
    # Ahead of the limit: the front of a long backlog is no wall of stalled groups.
    assert order(st, 2_000, limit=1) == ["b"]


def test_a_level_all_on_stalled_partitions_keeps_its_place() -> None:
    st = CommitStalls(200)
    st.sent(0, 0)
    st.sent(1, 0)
    assert order(st, 2_000) == ["a", "b", "c", "e", "d"]


def test_zero_turns_the_rule_off() -> None:
    st = CommitStalls(0)
    st.sent(0, 0)
    st.sent(1, 500)
    st.answered(1)
    assert st.stalled(10**9) == set()
