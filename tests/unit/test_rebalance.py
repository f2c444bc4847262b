"""Taking shards from the consumer group, and the offsets every dispatcher transaction commits
(so that Kafka fences a member the group left behind)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_INVALID,
    KafkaError,
    KafkaException,
    TopicPartition,
)

from ksb.catalog.model import CatalogView, parse_catalog
from ksb.dialog.engine import Engine
from ksb.dialog.shards import Ownership
from ksb.names import Names
from services.dispatcher import rebalance
from services.dispatcher.rebalance import (
    AssignmentFailed,
    ShardKeeper,
    consumed_offsets,
    fencing_offsets,
    rewind_to,
)


def _pairs(tps: list[TopicPartition]) -> list[tuple[str, int, int]]:
    return [(tp.topic, tp.partition, tp.offset) for tp in tps]


def test_positions_read_since_assignment_are_committed_as_they_are() -> None:
    positions = [TopicPartition("relay", 0, 12), TopicPartition("requests", 0, 7)]
    assert _pairs(fencing_offsets(positions, {("relay", 0): 3})) == [
        ("relay", 0, 12),
        ("requests", 0, 7),
    ]


def test_a_timer_only_transaction_still_commits_offsets_the_generation_is_checked_on() -> None:
    """Nothing read since the shard came: its committed offsets go again (changing nothing)."""
    positions = [
        TopicPartition("relay", 1, OFFSET_INVALID),
        TopicPartition("inbound", 1, OFFSET_INVALID),
    ]
    committed = {("relay", 1): 40, ("relay", 0): 99}
    assert _pairs(fencing_offsets(positions, committed)) == [("relay", 1, 40)]


def test_a_partition_never_committed_nor_read_is_left_out() -> None:
    assert fencing_offsets([TopicPartition("relay", 2, OFFSET_INVALID)], {}) == []


def test_a_transaction_of_records_commits_only_the_partitions_they_came_from() -> None:
    """Each at the offset after its last record read; every other assigned partition keeps the
    offset committed before (an offset commit of every assigned partition per transaction was
    four to seven times as large)."""
    read = [("requests", 3, 10), ("relay", 3, 4), ("requests", 3, 11), ("requests", 5, 2)]
    assert _pairs(consumed_offsets(read, {3, 5})) == [
        ("requests", 3, 12),
        ("relay", 3, 5),
        ("requests", 5, 3),
    ]


def test_records_of_a_shard_given_up_meanwhile_are_not_committed() -> None:
    """The poll that read them also revoked their partition: committing it would name a
    partition the member no longer has."""
    read = [("requests", 3, 10), ("requests", 6, 8)]
    assert _pairs(consumed_offsets(read, {3})) == [("requests", 3, 11)]
    assert consumed_offsets([("requests", 6, 8)], {3}) == []


def test_after_a_failed_transaction_a_partition_without_a_committed_offset_starts_over() -> None:
    """Its first records may have been in the failed batch: where the consumer stood is past
    them."""
    committed = [TopicPartition("requests", 0, 17), TopicPartition("requests", 1, OFFSET_INVALID)]
    assert _pairs(rewind_to(committed)) == [
        ("requests", 0, 17),
        ("requests", 1, OFFSET_BEGINNING),
    ]


class _Consumer:
    """What the shard keeper asks of the group's consumer."""

    def __init__(self, committed: dict[tuple[str, int], int]) -> None:
        self.assigned: list[tuple[str, int]] = []
        self.paused: set[tuple[str, int]] = set()
        self.resumed: list[tuple[str, int]] = []
        self.sought: list[tuple[str, int, int]] = []
        self.stable = True
        """False: a previous owner's transaction holds the offsets (`committed` times out)."""
        self.asked = 0
        self.closing = False
        """True: `close` is destroying the handle (librdkafka answers _DESTROY)."""
        self._committed = committed

    def memberid(self) -> str:
        return "m1"

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned += [(tp.topic, tp.partition) for tp in partitions]

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused |= {(tp.topic, tp.partition) for tp in partitions}

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.paused -= {(tp.topic, tp.partition) for tp in partitions}
        self.resumed += [(tp.topic, tp.partition) for tp in partitions]

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(t, p) for t, p in self.assigned]

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        """Nothing read yet: librdkafka has no position for any of them."""
        return [TopicPartition(tp.topic, tp.partition, OFFSET_INVALID) for tp in partitions]

    def seek(self, tp: TopicPartition) -> None:
        assert (tp.topic, tp.partition) in self.resumed, "sought before it was resumed"
        self.sought.append((tp.topic, tp.partition, tp.offset))

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        self.asked += 1
        if self.closing:
            raise KafkaException(KafkaError(KafkaError._DESTROY))
        if self._committed is None or not self.stable:
            # Both ways a short probe runs out: librdkafka says which depending on whether its
            # request had left (the failover bench met the second under load).
            code = KafkaError._TIMED_OUT_QUEUE if self.asked % 2 else KafkaError._TIMED_OUT
            raise KafkaException(KafkaError(code))
        return [
            TopicPartition(
                tp.topic, tp.partition, self._committed.get((tp.topic, tp.partition), -1001)
            )
            for tp in partitions
        ]


class _Loader:
    """The consumer a rebuild reads through (`load_shard` is replaced, so only closed)."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


NAMES = Names("u")


class _Threads:
    """Rebuild threads, run when the test says (`run`), or at once (`now`)."""

    def __init__(self, now: bool) -> None:
        self.now = now
        self.waiting: list[Callable[[], None]] = []

    def spawn(self, run: Callable[[], None]) -> None:
        if self.now:
            run()
        else:
            self.waiting.append(run)

    def run(self) -> None:
        while self.waiting:
            self.waiting.pop(0)()


class _World:
    """A shard keeper with its engine, what `load_shard` was asked to read, and its threads."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        held: set[int],
        clock: list[float] | None = None,
        threads_now: bool = True,
    ) -> None:
        self.loaded: list[int] = []
        self.stops: list[threading.Event | None] = []
        self.loaders: list[_Loader] = []
        self.threads = _Threads(threads_now)
        self.view = CatalogView(parse_catalog({}))

        def load_shard(
            _c: object,
            _n: Names,
            engine: Engine,
            _v: CatalogView,
            shard: int,
            stop: threading.Event | None = None,
        ) -> int:
            assert shard in engine.ownership.owned  # read into an engine made for the shard
            self.loaded.append(shard)
            self.stops.append(stop)
            return 10

        def loader() -> Any:
            self.loaders.append(_Loader())
            return self.loaders[-1]

        monkeypatch.setattr(rebalance, "load_shard", load_shard)
        self.engine = Engine(
            self.view, instance="u", max_body_bytes=1000, ownership=Ownership(4, owned=())
        )
        now = clock or [0.0]
        self.keeper = ShardKeeper(
            NAMES,
            self.engine,
            loader,
            lambda: self.view,
            lambda _member: set(held),
            now=lambda: now[0],
            spawn=self.threads.spawn,
        )


def _keeper(
    monkeypatch: pytest.MonkeyPatch, held: set[int], clock: list[float] | None = None
) -> tuple[ShardKeeper, Engine, list[int]]:
    w = _World(monkeypatch, held, clock)
    return w.keeper, w.engine, w.loaded


def _relay(*shards: int) -> list[TopicPartition]:
    return [TopicPartition(NAMES.relay, s) for s in shards]


def test_new_partitions_are_taken_at_once_then_owned_when_the_coordinator_agrees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member that owns nothing yet has nothing to keep flowing: it rebuilds in place."""
    w = _World(monkeypatch, held={0, 1, 3}, threads_now=False)
    consumer = _Consumer({(NAMES.relay, 1): 7})
    w.keeper.on_assign(cast(Any, consumer), _relay(0, 1))
    assert consumer.assigned == [(NAMES.relay, 0), (NAMES.relay, 1)]
    assert w.threads.waiting == []  # no thread
    assert w.loaded == [0, 1] and w.engine.ownership.owned == {0, 1}
    assert consumer.paused == set()
    assert [loader.closed for loader in w.loaders] == [True]
    assert _pairs(w.keeper.fencing_offsets([TopicPartition(NAMES.relay, 1, OFFSET_INVALID)])) == [
        (NAMES.relay, 1, 7)
    ]


def _record(topic: str, partition: int, offset: int) -> Any:
    return SimpleNamespace(topic=lambda: topic, partition=lambda: partition, offset=lambda: offset)


def test_a_transaction_commits_what_it_read_or_for_timers_alone_every_assigned_partition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = _World(monkeypatch, held={0, 1}, threads_now=False)
    consumer = _Consumer({(NAMES.relay, 0): 3, (NAMES.relay, 1): 7})
    w.keeper.on_assign(cast(Any, consumer), _relay(0, 1))
    read = [_record(NAMES.relay, 1, 7), _record(NAMES.relay, 1, 8)]
    assert _pairs(w.keeper.transaction_offsets(cast(Any, consumer), read)) == [(NAMES.relay, 1, 9)]
    # Timers alone: Kafka must still check the member's generation, on every partition it has.
    assert _pairs(w.keeper.transaction_offsets(cast(Any, consumer), [])) == [
        (NAMES.relay, 0, 3),
        (NAMES.relay, 1, 7),
    ]
    # Records only of a shard given up in the poll that read them: as for timers alone.
    stale = [_record(NAMES.relay, 2, 5)]
    assert len(w.keeper.transaction_offsets(cast(Any, consumer), stale)) == 2


def test_a_shard_is_rebuilt_beside_the_loop_while_the_owned_ones_flow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the failover bench: rebuilt inside the loop, a survivor's own shards stood
    still for the 0.6-0.9 s its new shard took to read."""
    w = _World(monkeypatch, held={0, 1}, threads_now=False)
    w.engine.ownership.owned.add(0)
    consumer = _Consumer({})
    w.keeper.on_assign(cast(Any, consumer), [*_relay(1), TopicPartition(NAMES.requests, 1)])
    for _ in range(3):  # the loop goes on: nothing of shard 1 is taken or read in it
        w.keeper.take_pending(cast(Any, consumer))
        assert w.loaded == [] and w.engine.ownership.owned == {0}
        assert consumer.paused == {(NAMES.relay, 1), (NAMES.requests, 1)}
    w.keeper.on_assign(cast(Any, consumer), [TopicPartition(NAMES.inbound_from("b"), 1)])
    assert (
        NAMES.inbound_from("b"),
        1,
    ) in consumer.paused  # a partition of the shard being rebuilt waits
    w.threads.run()
    assert w.loaded == [1] and w.engine.ownership.owned == {0}
    consumer._committed[(NAMES.requests, 1)] = 40
    w.keeper.take_pending(cast(Any, consumer))
    assert w.engine.ownership.owned == {0, 1} and consumer.paused == set()
    # Each resumed from its committed offset, or its beginning, sought after the resume: the
    # start librdkafka was given at assignment may be lost to the pause (`ShardKeeper._resume`).
    assert sorted(consumer.sought) == sorted(
        [
            (NAMES.relay, 1, OFFSET_BEGINNING),
            (NAMES.requests, 1, 40),
            (NAMES.inbound_from("b"), 1, OFFSET_BEGINNING),
        ]
    )


def test_a_shard_revoked_while_it_is_rebuilt_is_not_adopted_and_its_rebuild_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = _World(monkeypatch, held={0, 1, 2}, threads_now=False)
    w.engine.ownership.owned.add(0)
    consumer = _Consumer({})
    w.keeper.on_assign(cast(Any, consumer), _relay(1, 2))
    w.keeper.on_revoke(cast(Any, consumer), _relay(1))
    w.threads.run()  # the stopped rebuild's thread ends; what it read is never taken
    stop = w.stops[0]
    assert stop is not None and stop.is_set()
    w.keeper.take_pending(cast(Any, consumer))  # shard 2 is rebuilt again, alone
    assert w.engine.ownership.owned == {0} and (NAMES.relay, 2) in consumer.paused
    w.threads.run()
    w.keeper.take_pending(cast(Any, consumer))
    assert w.loaded[-1:] == [2] and w.engine.ownership.owned == {0, 2}
    assert (NAMES.relay, 2) not in consumer.paused


def test_a_shard_rebuilt_under_an_older_catalog_is_rebuilt_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = _World(monkeypatch, held={0, 3}, threads_now=False)
    w.engine.ownership.owned.add(0)
    consumer = _Consumer({})
    w.keeper.on_assign(cast(Any, consumer), _relay(3))
    w.view = w.engine.catalog = CatalogView(parse_catalog({"version": 2}))
    w.threads.run()
    w.keeper.take_pending(cast(Any, consumer))
    assert w.engine.ownership.owned == {0} and consumer.paused == {(NAMES.relay, 3)}
    w.keeper.take_pending(cast(Any, consumer))  # read again, under version 2
    w.threads.run()
    w.keeper.take_pending(cast(Any, consumer))
    assert w.loaded == [3, 3] and w.engine.ownership.owned == {0, 3}


def test_a_shard_whose_last_owner_died_in_a_transaction_waits_paused_while_owned_ones_flow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the failover bench: a member SIGKILLed inside a transaction leaves its offsets
    unstable until the transaction times out (10 s), and the survivors waited for that inside
    the assignment callback, so the shards they already owned stood still as long."""
    clock = [100.0]
    keeper, engine, loaded = _keeper(monkeypatch, held={0, 1}, clock=clock)
    engine.ownership.owned.add(0)
    consumer = _Consumer({(NAMES.relay, 1): 7})
    consumer.stable = False
    given = [*_relay(1), TopicPartition(NAMES.requests, 1)]
    keeper.on_assign(cast(Any, consumer), given)
    assert consumer.paused == {(NAMES.relay, 1), (NAMES.requests, 1)}
    assert loaded == [] and engine.ownership.owned == {0}

    keeper.take_pending(cast(Any, consumer))  # asked again only after STABLE_RETRY_S
    assert consumer.asked == 1
    clock[0] += rebalance.STABLE_RETRY_S
    keeper.take_pending(cast(Any, consumer))
    assert consumer.asked == 2 and engine.ownership.owned == {0}

    consumer.stable = True
    clock[0] += rebalance.STABLE_RETRY_S
    keeper.take_pending(cast(Any, consumer))
    keeper.take_pending(cast(Any, consumer))
    assert loaded == [1] and engine.ownership.owned == {0, 1} and consumer.paused == set()
    assert _pairs(keeper.fencing_offsets([TopicPartition(NAMES.relay, 1, OFFSET_INVALID)])) == [
        (NAMES.relay, 1, 7)
    ]


def test_a_shard_whose_offsets_never_settle_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    keeper, engine, loaded = _keeper(monkeypatch, held={2}, clock=clock)
    consumer = _Consumer({})
    consumer.stable = False
    keeper.on_assign(cast(Any, consumer), _relay(2))
    clock[0] = rebalance.STABLE_TIMEOUT_S
    with pytest.raises(AssignmentFailed, match=r"shards \[2\] not rebuilt"):
        keeper.take_pending(cast(Any, consumer))
    assert loaded == [] and engine.ownership.owned == set()
    keeper.take_pending(cast(Any, consumer))  # nothing waits any more
    assert consumer.asked == 2


def test_a_shard_given_while_the_consumer_closes_is_let_go_without_failing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the chaos harness: a rejoining member's `close` served a last assignment, and the
    probe of its offsets failed with the handle half destroyed; raising crashed the process."""
    keeper, engine, loaded = _keeper(monkeypatch, held={0})
    consumer = _Consumer({})
    consumer.closing = True
    keeper.on_assign(cast(Any, consumer), _relay(0))
    assert consumer.asked == 1 and loaded == [] and engine.ownership.owned == set()

    consumer.closing = False
    keeper.take_pending(cast(Any, consumer))  # nothing waits any more
    assert consumer.asked == 1


def test_a_waiting_shard_revoked_meanwhile_is_no_longer_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keeper, engine, loaded = _keeper(monkeypatch, held={3})
    consumer = _Consumer({})
    consumer.stable = False
    keeper.on_assign(cast(Any, consumer), _relay(3))
    keeper.on_revoke(cast(Any, consumer), _relay(3))
    consumer.stable = True
    keeper.take_pending(cast(Any, consumer))
    assert consumer.asked == 1 and loaded == [] and engine.ownership.owned == set()


def test_a_shard_the_coordinator_gave_away_while_it_was_rebuilt_is_not_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the chaos harness: after a broker restart a shard went to a second member while
    the first one was still rebuilding it, and both fired its timers."""
    keeper, engine, loaded = _keeper(monkeypatch, held={1})
    with pytest.raises(AssignmentFailed, match=r"shards \[0\] are no longer this member's"):
        keeper.on_assign(cast(Any, _Consumer({})), _relay(0, 1))
    assert loaded == [0, 1] and engine.ownership.owned == set()


def test_a_rebuild_kafka_does_not_answer_owns_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    keeper, engine, _loaded = _keeper(monkeypatch, held={0})
    with pytest.raises(AssignmentFailed, match="not rebuilt"):
        keeper.load(cast(Any, _Consumer(cast(Any, None))), _relay(0))
    assert engine.ownership.owned == set()


def test_a_rebuild_that_fails_on_its_thread_owns_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _World(monkeypatch, held={0}, threads_now=False)

    def broken(*_a: object, **_k: object) -> int:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT))

    monkeypatch.setattr(rebalance, "load_shard", broken)
    w.engine.ownership.owned.add(1)
    consumer = cast(Any, _Consumer({}))
    w.keeper.on_assign(consumer, _relay(0))
    w.threads.run()
    with pytest.raises(AssignmentFailed, match=r"shards \[0\] not rebuilt"):
        w.keeper.take_pending(consumer)
    assert w.engine.ownership.owned == {1} and [c.closed for c in w.loaders] == [True]


class _Described:
    """What `describe_consumer_groups` answers for one group: a future of its description."""

    def __init__(self, answer: object) -> None:
        self._answer = answer

    def result(self) -> object:
        if isinstance(self._answer, BaseException):
            raise self._answer
        return self._answer


class _Admin:
    def __init__(self, answer: object) -> None:
        self.answer = answer
        self.asked = 0

    def describe_consumer_groups(self, groups: list[str], **_kw: object) -> dict[str, _Described]:
        self.asked += 1
        return {g: _Described(self.answer) for g in groups}


def _description(member: str, shards: list[int]) -> object:
    parts = [TopicPartition(NAMES.relay, s) for s in shards]
    m = SimpleNamespace(member_id=member, assignment=SimpleNamespace(topic_partitions=parts))
    return SimpleNamespace(members=[m])


def test_a_coordinator_check_that_fails_asks_through_a_new_admin_client_next_time() -> None:
    timed_out = KafkaException(KafkaError(KafkaError._TIMED_OUT))
    admins = [_Admin(timed_out), _Admin(_description("m1", [0, 2]))]
    made: list[_Admin] = []

    def make() -> Any:
        made.append(admins[len(made)])
        return made[-1]

    held = rebalance.coordinator_shards(make, NAMES.dispatcher_group, NAMES.relay)
    with pytest.raises(KafkaException):
        held("m1")
    assert held("m1") == {0, 2}
    assert held("m1") == {0, 2}
    assert [a.asked for a in admins] == [1, 2]  # the failed client is never asked again
