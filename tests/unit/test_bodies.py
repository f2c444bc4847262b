"""Where RECEIVE's bodies come from: the bounded record cache, the read-on-or-seek rule, decoding."""

from __future__ import annotations

import msgspec

from ksb.sdk.bodies import ENTRY_OVERHEAD_BYTES, BodyCache, messages_from, read_on
from ksb.sdk.queue_index import QueueIndex, pack_position, unpack_position
from ksb.wire.protocol import QueueMessage, dumps


def _message(n: int, body: str = "x") -> QueueMessage:
    return QueueMessage(
        message_id=f"h:{n}",
        queue="Q",
        status=1,
        priority=5,
        queuing_order=n,
        conversation_group_id="h",
        conversation_handle="h",
        conversation_id="c",
        message_sequence_number=n,
        service_name="S",
        service_contract_name="C",
        message_type_name="M",
        validation="N",
        enqueued_ms=0,
        body=body,
    )


def test_the_cache_keeps_the_newest_records_within_its_budget() -> None:
    cache = BodyCache(budget_bytes=3 * (100 + ENTRY_OVERHEAD_BYTES))
    for pos in range(5):
        cache.put(pos, b"r" * 100)
    assert [cache.get(p) is not None for p in range(5)] == [False, False, True, True, True]
    assert len(cache) == 3 and cache.bytes == 3 * (100 + ENTRY_OVERHEAD_BYTES)
    cache.discard(3)
    assert cache.get(3) is None and len(cache) == 2
    cache.discard(3)  # twice is fine
    assert cache.bytes == 2 * (100 + ENTRY_OVERHEAD_BYTES)


def test_a_zero_budget_or_an_unknown_position_keeps_nothing() -> None:
    off = BodyCache(0)
    off.put(1, b"r")
    assert len(off) == 0
    on = BodyCache(10_000)
    on.put(-1, b"r")
    assert len(on) == 0


def test_read_on_when_the_record_is_close_ahead_else_seek() -> None:
    assert read_on(100, 150, max_gap=100)
    assert read_on(100, 100, max_gap=100)
    assert not read_on(100, 201, max_gap=100)  # far ahead: a seek is cheaper
    assert not read_on(100, 99, max_gap=100)  # behind: only a seek goes back
    assert not read_on(None, 0, max_gap=100)  # not reading yet


def test_positions_pack_partition_and_offset() -> None:
    assert unpack_position(pack_position(7, 123_456_789_012)) == (7, 123_456_789_012)
    assert pack_position(0, -1) == -1 and unpack_position(-1) == (-1, -1)


def test_messages_come_in_the_refs_order_and_a_vanished_record_is_left_out() -> None:
    ix = QueueIndex("Q")
    for n in range(3):
        ix.add(_message(n), partition=0, offset=10 + n)
    refs = ix.take("h")
    records = {pack_position(0, 10): dumps(_message(0)), pack_position(0, 12): dumps(_message(2))}
    got = messages_from(refs, records)
    assert [m.message_id for m in got] == ["h:0", "h:2"]
    # a record that is another message (its key rewritten after compaction) is not returned
    records[pack_position(0, 11)] = dumps(msgspec.structs.replace(_message(1), message_id="h:9"))
    assert [m.message_id for m in messages_from(refs, records)] == ["h:0", "h:2"]
