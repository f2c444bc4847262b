"""KSB's Redis keys: every key of one queue in one Redis Cluster slot, queues spread over slots.

A lock script touches a queue's disabled flag, activity and one lock and fence per candidate
group in one call; the batched extend and release touch many locks and the rollback counter. A
Redis Cluster runs a script only over keys of one slot, so all of a queue's keys must hash alike.
"""

from __future__ import annotations

from redis.crc import key_slot

from ksb.names import Names


def _queue_keys(names: Names, queue: str) -> list[str]:
    return [
        *(names.lock_key(queue, g) for g in ("g1", "other-group", "{odd}")),
        *(names.fence_key(queue, g) for g in ("g1", "other-group")),
        names.disabled_key(queue),
        names.activity_key(queue),
        names.waiting_key(queue),
        names.rollbacks_key(queue),
        names.message_rollbacks_key(queue),
        names.tasks_key(queue),
    ]


def test_a_queues_keys_share_one_slot() -> None:
    names = Names("inst")
    for queue in ("TargetQueue", "q", "orders:eu"):
        slots = {key_slot(k.encode()) for k in _queue_keys(names, queue)}
        assert len(slots) == 1, (queue, slots)


def test_queues_and_instances_spread_over_slots() -> None:
    slots = {key_slot(Names(i).lock_key(f"Q{n}", "g").encode()) for i in ("a",) for n in range(50)}
    assert len(slots) > 40
    same_queue = {key_slot(Names(i).lock_key("Q", "g").encode()) for i in ("a", "b")}
    assert len(same_queue) == 2  # the tag names the instance too


def test_a_group_id_in_braces_does_not_move_the_key() -> None:
    """Redis takes the first ``{...}``: the queue's tag, since the group comes after it."""
    names = Names("inst")
    assert key_slot(names.lock_key("Q", "{x}").encode()) == key_slot(b"inst/Q")
