"""The transmission queue under a memory budget: unclassify, re-register, never lose or reorder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ksb.transmission.queue import WAITING_FOR_MEMORY, held_size
from ksb.wire.protocol import InboundMessage
from tests.unit.factories import transmission_queue
from tests.unit.test_transport import T0, _ack, _msg

ONE = held_size(_msg(0))


def _topic(*convs_and_seqs: tuple[str, int]) -> list[tuple[int, InboundMessage]]:
    """The transmission topic as (offset, record), in the order the dispatcher wrote it."""
    return [(off, _msg(seq, conv)) for off, (conv, seq) in enumerate(convs_and_seqs)]


def test_a_record_over_budget_unclassifies_its_direction_and_later_ones_wait_too() -> None:
    q = transmission_queue(max_held_bytes=3 * ONE)
    topic = _topic(("a", 0), ("b", 0), ("a", 1), ("a", 2), ("b", 1), ("c", 0))
    held = [q.add(r, offset=off) for off, r in topic]
    assert held == [True, True, True, False, False, False]
    assert q.unclassified == 3
    rows = {(r["conversation_id"], r["seq"]): r for r in q.rows(T0, {})}
    assert rows[("a", 2)]["status"] == "WAITING_FOR_MEMORY"
    assert rows[("a", 2)]["last_failure"] == WAITING_FOR_MEMORY
    assert q.replay_from() is None  # memory has not come back yet


def test_acks_free_memory_and_reregistration_restores_each_direction_in_order() -> None:
    q = transmission_queue(max_held_bytes=3 * ONE)
    topic = _topic(("a", 0), ("b", 0), ("a", 1), ("a", 2), ("b", 1), ("a", 3), ("c", 0))
    for off, r in topic:
        q.add(r, offset=off)
    sent = q.take(T0, {"B"}, 10)
    assert [m.message_id for m in sent] == ["a-0", "b-0", "a-1"]
    q.ack(_ack(1, "a"))
    q.ack(_ack(0, "b"))
    assert q.held_bytes == 0
    start = q.replay_from()
    assert start == 3  # the earliest record set aside: a-2
    assert q.reregister([t for t in topic if t[0] >= start], lambda _r: None) == 3
    # Three fit; c-0 is set aside again, from its own offset.
    assert [m.message_id for m in q.take(T0 + 1, {"B"}, 10)] == ["a-2", "b-1", "a-3"]
    assert q.unclassified == 1 and q.replay_from() is None


def test_reregister_skips_what_was_acknowledged_meanwhile() -> None:
    q = transmission_queue(max_held_bytes=ONE)
    topic = _topic(("a", 0), ("a", 1), ("a", 2))
    for off, r in topic:
        q.add(r, offset=off)
    q.take(T0, {"B"}, 10)
    q.ack(_ack(1, "a"))  # a-1 had been delivered before a restart, say
    assert q.reregister(topic, lambda _r: None) == 1
    assert [m.message_id for m in q.take(T0, {"B"}, 10)] == ["a-2"]
    assert q.unclassified == 0


@settings(max_examples=150, deadline=None)
@given(
    writes=st.lists(st.sampled_from("abcd"), min_size=1, max_size=40),
    budget=st.integers(min_value=1, max_value=6),
    batch=st.integers(min_value=1, max_value=5),
)
def test_every_message_goes_out_once_in_order_whatever_the_budget(
    writes: list[str], budget: int, batch: int
) -> None:
    """Take, ack and re-register in a loop: each direction is sent exactly its records, in order."""
    next_seq: dict[str, int] = {}
    topic: list[tuple[int, InboundMessage]] = []
    for off, conv in enumerate(writes):
        seq = next_seq.get(conv, 0)
        next_seq[conv] = seq + 1
        topic.append((off, _msg(seq, conv)))
    q = transmission_queue(max_held_bytes=budget * ONE)
    for off, r in topic:
        q.add(r, offset=off)
    delivered: dict[str, list[int]] = {}
    for _round in range(10 * len(writes) + 10):
        for m in q.take(T0, {"B"}, batch):
            delivered.setdefault(m.conversation_id, []).append(m.seq)
            q.ack(_ack(m.seq, m.conversation_id))
        start = q.replay_from()
        if start is not None:
            q.reregister([t for t in topic if t[0] >= start], lambda _r: None)
        if len(q) == 0 and q.unclassified == 0:
            break
    assert delivered == {c: list(range(n)) for c, n in next_seq.items()}


def test_a_reread_that_breaks_off_keeps_every_direction_waiting() -> None:
    q = transmission_queue(max_held_bytes=2 * ONE)
    topic = _topic(("a", 0), ("a", 1), ("b", 0), ("a", 2), ("b", 1))
    for off, r in topic:
        q.add(r, offset=off)
    q.take(T0, {"B"}, 10)
    q.ack(_ack(1, "a"))

    def broken() -> Iterator[tuple[int, InboundMessage]]:
        yield topic[2]
        raise TimeoutError("broker went away")

    with pytest.raises(TimeoutError):
        q.reregister(broken(), lambda _r: None)
    # a (from a-2) and b both still wait; b-0 is held and will be skipped as known.
    assert q.unclassified == 2
    assert q.reregister(topic, lambda _r: None) == 1  # a-2 fits beside b-0; b-1 waits again
    assert sorted(m.message_id for m in q.take(T0, {"B"}, 10)) == ["a-2", "b-0"]
    assert q.unclassified == 1
