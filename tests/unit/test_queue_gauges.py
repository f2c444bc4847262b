"""The queue service's gauges: what a scrape reads from a replica's indexes and its own locks."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from ksb.clock import ManualClock
from ksb.queue.bodies import BodyStore
from ksb.queue.fold import Folded
from ksb.queue.held import HeldLocks
from ksb.wire.protocol import QueueMessage, dumps
from services.queue import gauges
from services.queue.gauges import QueueGauges, looks
from services.queue.queues import Queues

START = 1_700_000_000_000


def _message(n: int, group: str, enqueued_ms: int, priority: int = 5) -> QueueMessage:
    return QueueMessage(
        message_id=f"{group}-h:{n}",
        queue="Q",
        status=1,
        priority=priority,
        queuing_order=n,
        conversation_group_id=group,
        conversation_handle=f"{group}-h",
        conversation_id=f"{group}-h",
        message_sequence_number=n,
        service_name="//s",
        service_contract_name="//c",
        message_type_name="//m",
        validation="N",
        enqueued_ms=enqueued_ms,
        body="b",
    )


@pytest.fixture
def queues(tmp_path: Path) -> Iterator[Queues]:
    q = Queues(BodyStore(tmp_path / "store", max_bytes=1 << 24, readers=4))
    try:
        yield q
    finally:
        q.store.close()


def _fold(queues: Queues, *messages: QueueMessage) -> None:
    fold = queues.get("Q")
    out = Folded()
    for offset, m in enumerate(messages):
        fold.fold(m.message_id.encode(), dumps(m), 0, offset, out)
    queues.write(out)


def _gauges(
    queues: Queues,
    held: HeldLocks,
    clock: ManualClock,
    disabled: Collection[str] = (),
    dead: Mapping[str, int] | None = None,
    targets: Mapping[int, int] | None = None,
) -> QueueGauges:
    return QueueGauges(
        "r1", queues, held, clock, lambda: disabled, lambda: dead or {}, lambda: targets or {}
    )


def test_a_stalled_queue_ages_and_a_held_lock_ages_with_it(queues: Queues) -> None:
    clock = ManualClock(START)
    queues.add("Q", 1)
    _fold(
        queues,
        _message(1, "g1", START - 3_000),
        _message(2, "g1", START - 2_000),
        _message(3, "g2", START - 1_000),
    )
    held = HeldLocks(ttl_ms=30_000)
    held.took("Q", "g1", 7, clock.now_ms())
    (look,) = looks(_gauges(queues, held, clock))
    assert (look.messages, look.groups, look.locked_groups, look.locked_messages) == (3, 2, 1, 2)
    assert look.oldest_age_s == 3.0 and look.lock_held_max_s == 0.0
    # Nothing is received and the reader renews its lock: both figures grow, scrape after scrape.
    clock.advance(10)
    held.renewed("Q", "g1", 7, clock.now_ms())
    (look,) = looks(_gauges(queues, held, clock))
    assert look.oldest_age_s == 13.0 and look.lock_held_max_s == 10.0
    # A lock that is not renewed lapses with its lease: the group counts as ready again.
    clock.advance(31)
    (look,) = looks(_gauges(queues, held, clock))
    assert (look.locked_groups, look.locked_messages, look.lock_held_max_s) == (0, 0, 0.0)


def test_receipts_drain_the_queue_and_are_counted(queues: Queues) -> None:
    clock = ManualClock(START)
    fold = queues.add("Q", 1)
    assert fold is not None
    _fold(queues, _message(1, "g1", START - 500))
    out = Folded()
    fold.fold(b"g1-h:1", None, 0, 1, out)  # its receipt (a tombstone)
    (look,) = looks(_gauges(queues, HeldLocks(30_000), clock))
    assert (look.messages, look.oldest_age_s, look.drained) == (0, 0.0, 1)


def test_disabled_queues_and_dead_letters_come_from_their_sources(queues: Queues) -> None:
    clock = ManualClock(START)
    queues.add("Q", 1)
    queues.add("P", 1)
    g = _gauges(queues, HeldLocks(30_000), clock, disabled=["P"], dead={"Q": 4})
    by_name = {look.queue: look for look in looks(g)}
    assert (by_name["P"].disabled, by_name["Q"].disabled) == (True, False)
    assert (by_name["Q"].dead_letters, by_name["P"].dead_letters) == (4, 0)


def test_the_collector_exports_every_watched_replica_until_unwatched(queues: Queues) -> None:
    clock = ManualClock(START)
    queues.add("Q", 1)
    _fold(queues, _message(1, "g1", START - 2_500))
    gauges.watch(_gauges(queues, HeldLocks(30_000), clock))
    try:
        labels = {"queue": "Q", "replica": "r1"}
        assert REGISTRY.get_sample_value("ksb_queue_oldest_ready_age_seconds", labels) == 2.5
        assert REGISTRY.get_sample_value("ksb_queue_messages", labels) == 1
        assert REGISTRY.get_sample_value("ksb_queue_drained_total", labels) == 0
    finally:
        gauges.unwatch("r1")
    assert REGISTRY.get_sample_value("ksb_queue_messages", {"queue": "Q", "replica": "r1"}) is None


def test_sla_overdue_is_the_worst_level_past_its_target(queues: Queues) -> None:
    """Targets are per level: a level-8 message 4 s old is 1 s past a 3 s target, while a
    level-5 message 9 s old is within its 10 s; a level without a target is never overdue."""
    clock = ManualClock(START)
    queues.add("Q", 1)
    _fold(
        queues,
        _message(1, "g1", START - 9_000, priority=5),
        _message(2, "g2", START - 4_000, priority=8),
        _message(3, "g3", START - 60_000, priority=2),
    )
    g = _gauges(queues, HeldLocks(30_000), clock, targets={8: 3_000, 5: 10_000})
    (look,) = looks(g)
    assert look.sla_overdue_s == 1.0 and look.oldest_age_s == 60.0
    clock.advance(5)
    assert looks(g)[0].sla_overdue_s == 6.0  # level 8: 9 s old, 3 s target (level 5: 4 past)
    (look,) = looks(_gauges(queues, HeldLocks(30_000), clock))
    assert look.sla_overdue_s == 0.0  # no targets in the catalog
