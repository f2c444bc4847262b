"""RECEIVE ordering rules of the queue index, including random mixes (hypothesis)."""

from __future__ import annotations

import itertools
import tracemalloc

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from ksb.catalog.model import DIALOG_TIMER, ERROR
from ksb.queue.index import QueueIndex, order_key
from ksb.wire.protocol import QueueMessage

_order = itertools.count(1)


def msg(group: str, conv: str, seq: int, priority: int = 5, mtype: str = "M") -> QueueMessage:
    return QueueMessage(
        message_id=f"{conv}-{seq}-{mtype}",
        queue="Q",
        status=1,
        priority=priority,
        queuing_order=next(_order),
        conversation_group_id=group,
        conversation_handle=conv,
        conversation_id=conv,
        message_sequence_number=seq,
        service_name="S",
        service_contract_name="C",
        message_type_name=mtype,
        validation="N",
        enqueued_ms=0,
    )


def test_highest_priority_group_first_then_arrival_order() -> None:
    ix = QueueIndex("Q")
    ix.add(msg("g1", "a", 0, priority=3))
    ix.add(msg("g2", "b", 0, priority=7))
    ix.add(msg("g3", "c", 0, priority=7))
    assert list(ix.candidates()) == ["g2", "g3", "g1"]
    assert list(ix.candidates(exclude={"g2"})) == ["g3", "g1"]


def test_group_priority_is_max_of_conversations_with_ready_messages() -> None:
    ix = QueueIndex("Q")
    ix.add(msg("g1", "low", 0, priority=2))
    ix.add(msg("g1", "high", 0, priority=9))
    ix.add(msg("g2", "mid", 0, priority=5))
    assert list(ix.candidates()) == ["g1", "g2"]
    ix.remove("high-0-M")  # the high conversation has nothing left: g1 falls to 2
    assert list(ix.candidates()) == ["g2", "g1"]


def test_a_receive_naming_a_conversation_not_read_yet_waits_for_it_alone() -> None:
    """Found by CI: a RECEIVE WHERE conversation_handle on a cold reader locked the best other
    group and came back empty while the named conversation's message was still being read."""
    ix = QueueIndex("Q")
    ix.add(msg("g1", "a", 0, priority=9))
    assert ix.lock_candidates(set(), 4, handle="b") == []
    ix.add(msg("g2", "b", 0))
    assert ix.lock_candidates(set(), 4, handle="b") == ["g2"]
    assert ix.lock_candidates({"g2"}, 4, handle="b") == []
    assert ix.lock_candidates(set(), 4, group="g3") == []
    assert ix.lock_candidates(set(), 1) == ["g1"]
    assert ix.lock_candidates({"g1"}, 4) == ["g2"]


def test_within_group_highest_conversation_first_each_in_sequence() -> None:
    ix = QueueIndex("Q")
    for seq in (1, 0, 2):
        ix.add(msg("g", "low", seq, priority=1))
    for seq in (1, 0):
        ix.add(msg("g", "high", seq, priority=8))
    taken = [(m.conversation_handle, m.message_sequence_number) for m in ix.take("g")]
    assert taken == [("high", 0), ("high", 1), ("low", 0), ("low", 1), ("low", 2)]
    assert len(ix.take("g", top=3)) == 3
    assert [m.conversation_handle for m in ix.take("g", handle="low")] == ["low"] * 3


def test_dialog_timer_then_error_before_other_messages() -> None:
    ix = QueueIndex("Q")
    ix.add(msg("g", "c", 0))
    ix.add(msg("g", "c", 5, mtype=ERROR))
    ix.add(msg("g", "c", -1, mtype=DIALOG_TIMER))
    assert [m.order_class for m in ix.take("g")] == [0, 1, 2]  # DialogTimer, Error, the rest
    assert [m.message_sequence_number for m in ix.take("g")] == [-1, 5, 0]


def test_receipt_removes_and_empty_group_disappears() -> None:
    ix = QueueIndex("Q")
    m = msg("g", "c", 0)
    ix.apply(m.message_id, m, partition=0, offset=10)
    assert ix.ready_groups == 1 and ix.positions[0] == 11
    ix.apply(m.message_id, None, partition=0, offset=11)
    assert ix.ready_groups == 0 and ix.ready_messages == 0
    assert list(ix.candidates()) == []


# ---------------------------------------------------------------------- properties
_messages = st.lists(
    st.tuples(
        st.integers(0, 5),  # group
        st.integers(0, 3),  # conversation within group
        st.integers(1, 10),  # conversation priority
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(_messages, st.randoms(use_true_random=False))
def test_receive_order_holds_for_random_mixes(
    spec: list[tuple[int, int, int]], rnd: object
) -> None:
    ix = QueueIndex("Q")
    conv_level: dict[str, int] = {}
    seqs: dict[str, int] = {}
    msgs = []
    for g, c, level in spec:
        conv = f"g{g}c{c}"
        level = conv_level.setdefault(conv, level)  # a conversation keeps its level
        seq = seqs.get(conv, 0)
        seqs[conv] = seq + 1
        msgs.append(msg(f"g{g}", conv, seq, priority=level))
    import random

    shuffled = list(msgs)
    assert isinstance(rnd, random.Random)
    rnd.shuffle(shuffled)  # arrival order differs from send order
    for m in shuffled:
        ix.add(m)
    waiting = {m.message_id: m for m in msgs}
    # Drain like successive RECEIVEs without WHERE: each returns one whole group.
    last_group_level = 11
    received = 0
    while ix.ready_groups:
        group = next(ix.candidates())
        level = ix.level_of(group)
        expected = max(m.priority for m in waiting.values() if m.conversation_group_id == group)
        assert level == expected
        # no other ready group has a higher level than the one RECEIVE picked
        assert all(ix.level_of(g) <= level for g in ix.candidates())
        assert level <= last_group_level  # no arrivals: successive picks never rise
        batch = ix.take(group)
        assert {m.conversation_group_id for m in batch} == {group}
        # conversations by level descending; within a conversation, sequence order
        levels = [m.priority for m in batch]
        assert levels == sorted(levels, reverse=True)
        per_conv: dict[str, list[int]] = {}
        for r in batch:
            per_conv.setdefault(r.conversation_handle, []).append(r.message_sequence_number)
        assert all(s == sorted(s) for s in per_conv.values())
        for r in batch:
            assert ix.remove(r.message_id) == r
            del waiting[r.message_id]
        received += len(batch)
        last_group_level = level
    assert received == len(msgs)


def test_equal_levels_come_in_queuing_order_whatever_the_arrival_order() -> None:
    """Readers fold a queue's partitions in any interleaving; all must agree on the order."""
    early, late = msg("g-early", "a", 0), msg("g-late", "b", 0)
    ix = QueueIndex("Q")
    ix.apply(late.message_id, late, partition=1, offset=0)
    ix.apply(early.message_id, early, partition=0, offset=0)
    assert list(ix.candidates()) == ["g-early", "g-late"]


def test_equal_levels_come_oldest_first_across_dispatchers_whose_counters_differ() -> None:
    """Each shard's owner counts queuing orders on its own, so two dispatchers' numbers do not
    compare: the enqueue time does (found by the failover bench, where a reader draining a
    backlog served every group of one dispatcher before any older group of the other)."""
    ix = QueueIndex("Q")
    busy = msgspec.structs.replace(msg("g-busy", "a", 0), queuing_order=90_000, enqueued_ms=1_000)
    idle = msgspec.structs.replace(msg("g-idle", "b", 0), queuing_order=7, enqueued_ms=1_001)
    older = msgspec.structs.replace(msg("g-older", "c", 0), queuing_order=91_000, enqueued_ms=999)
    for m in (idle, busy, older):
        ix.add(m)
    assert list(ix.candidates()) == ["g-older", "g-busy", "g-idle"]
    tie = msgspec.structs.replace(msg("g-tie", "d", 0), queuing_order=89_999, enqueued_ms=1_000)
    ix.add(tie)  # the same millisecond: the queuing order (of one owner) decides
    assert list(ix.candidates()) == ["g-older", "g-tie", "g-busy", "g-idle"]


def test_a_groups_older_message_read_late_moves_the_group_up_and_receipts_leave_no_lane() -> None:
    """The index keeps each level's groups per partition in age order as they change (RECEIVE
    walks them instead of sorting every ready group): an older message read after a newer one
    of the same group makes the group older; a level, a partition emptied by receipts is gone."""
    ix = QueueIndex("Q")
    newer = msgspec.structs.replace(msg("g-a", "a", 1), enqueued_ms=2_000)
    other = msgspec.structs.replace(msg("g-b", "b", 0), enqueued_ms=1_500)
    older = msgspec.structs.replace(msg("g-a", "a2", 0), enqueued_ms=1_000)
    ix.add(newer)
    ix.add(other)
    assert list(ix.candidates()) == ["g-b", "g-a"]
    ix.add(older)
    assert list(ix.candidates()) == ["g-a", "g-b"]
    ix.add(msg("g-c", "c", 0, priority=9))
    for m in (newer, other, older):
        ix.remove(m.message_id)
    assert list(ix.candidates()) == ["g-c"]
    ix.remove(msg("g-c", "c", 0, priority=9).message_id)
    assert list(ix.candidates()) == [] and ix._lanes == {}


def _at(ix: QueueIndex, group: str, enqueued_ms: int, partition: int, priority: int = 5) -> None:
    m = msgspec.structs.replace(msg(group, f"{group}-c", 0, priority), enqueued_ms=enqueued_ms)
    ix.apply(m.message_id, m, partition, enqueued_ms)


def _receive(ix: QueueIndex, exclude: set[str] | frozenset[str] = frozenset()) -> str:
    """One RECEIVE without WHERE and its commit: the first candidate's messages taken, then gone."""
    group = next(ix.candidates(exclude))
    for r in ix.take(group):
        ix.remove(r.message_id)
    return group


def test_partitions_take_turns_within_a_level_each_oldest_first() -> None:
    ix = QueueIndex("Q")
    for i, t in enumerate((1, 2, 3)):
        _at(ix, f"a{i}", t, partition=0)
    _at(ix, "b0", 10, partition=1)
    _at(ix, "b1", 11, partition=1)
    # nothing served yet: the partition with the oldest group first, then turn by turn
    assert list(ix.candidates()) == ["a0", "b0", "a1", "b1", "a2"]
    assert _receive(ix) == "a0"
    assert list(ix.candidates()) == ["b0", "a1", "b1", "a2"]  # partition 0 just had its turn
    assert _receive(ix) == "b0"
    assert _receive(ix, exclude={"a1"}) == "a2"  # partition 0's turn; a1 is locked elsewhere
    assert list(ix.candidates()) == ["b1", "a1"]
    _at(ix, "top", 20, partition=1, priority=9)
    assert next(ix.candidates()) == "top"  # levels still come first


def test_stalled_partitions_groups_come_after_their_level_taking_turns_too() -> None:
    ix = QueueIndex("Q")
    for name, t, p in (("s0", 1, 0), ("s1", 2, 0), ("t0", 3, 2), ("ok", 9, 1)):
        _at(ix, name, t, partition=p)
    stalled = {"s0", "s1", "t0"}
    assert list(ix.candidates(later=stalled.__contains__)) == ["ok", "s0", "t0", "s1"]


def test_a_partitions_backlog_does_not_hold_the_others_back() -> None:
    """The failover bench: a moved shard's backlog comes back all at once, older than anything
    else; by age alone a reader at capacity drained it before any other shard's new messages."""
    ix = QueueIndex("Q")
    for i in range(50):
        _at(ix, f"old{i}", i, partition=3)
    served: list[str] = []
    for step in range(40):  # each RECEIVE, a newer group arrives on each live partition
        for p in (0, 1, 2):
            _at(ix, f"new{p}-{step}", 100 + step, partition=p)
        served.append(_receive(ix))
    runs_of_old = [
        len(list(run)) for old, run in itertools.groupby(served, lambda g: "old" in g) if old
    ]
    assert max(runs_of_old) == 1  # the backlog gets its turn, never more than one in a row
    assert sum(runs_of_old) == 10  # one in four: the live partitions go on at their share


# ---------------------------------------------------------------------- compact rows
def dmsg(
    group: str, handle: str, n: int, seq: int, priority: int = 5, mtype: str = "M"
) -> QueueMessage:
    """A message named the way the dispatcher names them: ``<handle>:<n>``."""
    return msgspec.structs.replace(
        msg(group, handle, seq, priority, mtype), message_id=f"{handle}:{n}"
    )


def test_ids_of_the_dispatchers_form_are_rebuilt_and_records_found_by_position() -> None:
    ix = QueueIndex("Q")
    for n in range(3):
        ix.apply(f"h:{n}", dmsg("g", "h", n, n), partition=1, offset=100 + n)
    got = ix.take("g")
    assert [r.message_id for r in got] == ["h:0", "h:1", "h:2"]
    assert [(r.partition, r.offset) for r in got] == [(1, 100), (1, 101), (1, 102)]
    assert ix.find("h:1") == got[1] and "h:2" in ix and "h:3" not in ix
    assert ix.holds_at("h:1", 1, 101) and not ix.holds_at("h:1", 1, 102)
    assert ix.group_of("h") == "g" and ix.group_of("other") is None
    assert ix.apply("h:1", None, partition=1, offset=103) == got[1]
    assert [r.message_id for r in ix.take("g")] == ["h:0", "h:2"]


def test_a_record_read_twice_is_indexed_once() -> None:
    ix = QueueIndex("Q")
    assert ix.add(dmsg("g", "h", 0, 0), 0, 1)
    assert not ix.add(dmsg("g", "h", 0, 0), 0, 1)
    odd = msg("g", "h", 1)
    assert ix.add(odd, 0, 2) and not ix.add(odd, 0, 2)
    assert ix.ready_messages == 2


def test_ids_of_other_forms_are_kept_beside_the_rows() -> None:
    ix = QueueIndex("Q")
    ix.add(dmsg("g", "h", 0, 0), 0, 1)
    ix.add(msgspec.structs.replace(msg("g", "h", 1), message_id="h:01"), 0, 2)  # not rebuildable
    ix.add(msgspec.structs.replace(msg("g", "h", 2), message_id="other:7"), 0, 3)
    assert [r.message_id for r in ix.take("g")] == ["h:0", "h:01", "other:7"]
    assert ix.remove("other:7") is not None and ix.remove("h:01") is not None
    assert [r.message_id for r in ix.take("g")] == ["h:0"]


def test_take_skips_what_the_transaction_already_received_before_counting_top() -> None:
    ix = QueueIndex("Q")
    for n in range(5):
        ix.add(dmsg("g", "h", n, n), 0, n)
    got = ix.take("g", top=2, skip={"h:0", "h:1"})
    assert [r.message_id for r in got] == ["h:2", "h:3"]


def test_receipts_from_the_front_and_the_middle_keep_the_order() -> None:
    ix = QueueIndex("Q")
    for n in range(200):
        ix.add(dmsg("g", "h", n, n), 0, n)
    for n in range(150):  # past the compaction threshold
        ix.remove(f"h:{n}")
    ix.remove("h:170")
    got = [r.message_sequence_number for r in ix.take("g")]
    assert got == [s for s in range(150, 200) if s != 170]
    assert ix.take("g", top=1)[0].offset == 150


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "add", "remove"]),
            st.integers(0, 2),  # group
            st.integers(0, 2),  # conversation
            st.sampled_from(["M", "M", "M", ERROR, DIALOG_TIMER]),
        ),
        max_size=80,
    ),
    st.randoms(use_true_random=False),
)
def test_the_index_agrees_with_sorting_the_whole_messages(
    ops: list[tuple[str, int, int, str]], rnd: object
) -> None:
    """Whatever mix of arrivals and receipts, take() is the waiting messages sorted by the rule."""
    import random

    assert isinstance(rnd, random.Random)
    ix = QueueIndex("Q")
    waiting: dict[str, QueueMessage] = {}
    numbers: dict[str, int] = {}
    for op, g, c, mtype in ops:
        handle = f"g{g}c{c}"
        if op == "remove" and waiting:
            mid = rnd.choice(sorted(waiting))
            assert ix.remove(mid) is not None
            del waiting[mid]
            continue
        n = numbers[handle] = numbers.get(handle, -1) + 1
        seq = -1 if mtype == DIALOG_TIMER else n
        m = dmsg(f"g{g}", handle, n, seq, priority=c + 1, mtype=mtype)
        ix.add(m, partition=g, offset=len(numbers) * 1000 + n)
        waiting[m.message_id] = m
    assert ix.ready_messages == len(waiting)
    for group in {m.conversation_group_id for m in waiting.values()}:
        mine = [m for m in waiting.values() if m.conversation_group_id == group]
        by_conv = sorted(
            {m.conversation_handle for m in mine},
            key=lambda h: -next(m.priority for m in mine if m.conversation_handle == h),
        )
        expected = [
            m.message_id
            for h in by_conv
            for m in sorted((m for m in mine if m.conversation_handle == h), key=order_key)
        ]
        assert [r.message_id for r in ix.take(group)] == expected


def test_a_backlog_costs_the_index_tens_of_bytes_a_message() -> None:
    """A million waiting messages must not exhaust a reader: what the index keeps per message is
    fixed and small, whatever the bodies (which it does not keep)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ix = QueueIndex("Q")
        handles = [f"{i:08d}-0000-4000-8000-000000000000" for i in range(100)]
        for n in range(500):
            for i, h in enumerate(handles):
                ix.add(dmsg(h, h, n, n), partition=i % 4, offset=n * 100 + i)
        per_message = (tracemalloc.get_traced_memory()[0] - before) / ix.ready_messages
    finally:
        tracemalloc.stop()
    assert ix.ready_messages == 50_000
    assert per_message < 60, per_message
