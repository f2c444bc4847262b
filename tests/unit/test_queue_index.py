"""RECEIVE ordering rules of the queue index, including random mixes (hypothesis)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from ksb.catalog.model import DIALOG_TIMER, ERROR
from ksb.sdk.queue_index import QueueIndex
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
    assert [m.message_type_name for m in ix.take("g")] == [DIALOG_TIMER, ERROR, "M"]


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
    # Drain like successive RECEIVEs without WHERE: each returns one whole group.
    last_group_level = 11
    received = 0
    while ix.ready_groups:
        group = next(ix.candidates())
        level = ix.level_of(group)
        expected = max(m.priority for m in ix.messages.values() if m.conversation_group_id == group)
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
        for m in batch:
            per_conv.setdefault(m.conversation_handle, []).append(m.message_sequence_number)
        assert all(s == sorted(s) for s in per_conv.values())
        for m in batch:
            ix.remove(m.message_id)
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
