"""Following the consumer group: the shards this dispatcher is given and the ones it gives up.

Kafka's consumer group (KIP-848, KSB's sticky assignor or ``range``) hands every dispatcher of an
instance the same partition numbers of every input topic; a partition number is a shard. Given a
shard, a dispatcher first asks Kafka for the shard's committed offsets: with ``read_committed``
they are unstable until the previous owner's last transaction is committed or aborted (a paused
member may still be finishing one; one SIGKILLed inside a transaction leaves it to time out), so
the state rebuilt next includes everything that transaction wrote. Until then the shard's
partitions stay paused and the loop asks again between its transactions (`take_pending`), so the
shards the member already owns keep flowing. Then it rebuilds the shard from the compacted
topics on a thread of its own (`services.dispatcher.rebuild.ShardRebuild`), still paused, and
the loop adopts the rebuilt state between two transactions. Giving a shard up, it forgets it
(and stops its rebuild): the transaction loop commits before it polls, so no open transaction
holds work of a shard that moves.

Two members must never work on one shard at once: both would commit the same work. The group
coordinator promises that, but only as far as each member's heartbeats report what it owns. So a
member takes its new partitions the moment it is told of them (a rebuild takes seconds, and
heartbeats that report none of them meanwhile would tell the coordinator they were let go), and
once a shard is rebuilt it asks the coordinator whether the shard is still its own. If not (the
chaos harness caught a shard given to a second member while the first was rebuilding it, just
after a broker restart) it takes none of them and rejoins the group.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from typing import cast

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from ksb.catalog.model import CatalogView
from ksb.dialog.engine import Engine
from ksb.names import Names
from services.dispatcher.gauges import rebalanced
from services.dispatcher.rebuild import ShardRebuild, Spawn, load_shard

__all__ = [
    "AssignmentFailed",
    "ShardKeeper",
    "coordinator_shards",
    "fencing_offsets",
    "rewind_to",
]

log = logging.getLogger("ksb.dispatcher")

STABLE_TIMEOUT_S = 120.0
"""How long a new owner waits for the previous owner's last transaction to end."""
STABLE_PROBE_S = 0.05
"""How long one look at a waiting shard's committed offsets may block the loop."""
STABLE_RETRY_S = 0.1
"""How often a waiting shard's committed offsets are looked at."""
RESUME_TIMEOUT_S = 10.0
"""How long the loop may wait for the committed offsets a resumed partition is sought to."""


class AssignmentFailed(RuntimeError):
    """Shards just assigned cannot be taken safely (the coordinator no longer counts them as
    this member's, or Kafka did not answer): the dispatcher rejoins the group."""


HeldShards = Callable[[str], set[int]]
"""The shards the group coordinator counts as the given member's (by member id) now."""


class ShardKeeper:
    """Loads and forgets shards as the consumer group assigns and revokes their partitions."""

    def __init__(
        self,
        names: Names,
        engine: Engine,
        loader: Callable[[], Consumer],
        catalog: Callable[[], CatalogView],
        held: HeldShards,
        now: Callable[[], float] = time.monotonic,
        spawn: Spawn | None = None,
    ) -> None:
        """`loader` makes the (unsubscribed) consumer a rebuild reads through."""
        self._names = names
        self._engine = engine
        self._loader = loader
        self._catalog = catalog
        self._held = held
        self._spawn = spawn
        self._committed: dict[tuple[str, int], int] = {}
        """Offsets committed for the assigned partitions when their shard's rebuild began."""
        self._now = now
        self._pending: list[TopicPartition] = []
        """Partitions given, paused until their previous owner's last transaction has ended."""
        self._pending_since = 0.0
        self._next_try = 0.0
        self._rebuild: ShardRebuild | None = None
        """The rebuild running on its own thread, if any (one at a time)."""
        self._rebuilding: list[TopicPartition] = []
        """The partitions of its shards, paused until the loop adopts what it rebuilt."""

    @property
    def owned(self) -> set[int]:
        return self._engine.ownership.owned

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """The rebalance callback: take the partitions at once, paused until their shards are
        rebuilt (`take_pending`)."""
        log.info("partitions %s given; taking them", _named(partitions))
        rebalanced("assigned", partitions)
        consumer.incremental_assign(partitions)
        rebuilding = set(self._rebuild.shards) if self._rebuild is not None else set()
        waiting = rebuilding | {tp.partition for tp in self._pending} | self._new_shards(partitions)
        paused = [tp for tp in partitions if tp.partition in waiting]
        if not paused:
            return
        consumer.pause(paused)
        self._rebuilding += [tp for tp in paused if tp.partition in rebuilding]
        self._wait([tp for tp in paused if tp.partition not in rebuilding])
        self.take_pending(consumer)

    def _wait(self, partitions: list[TopicPartition]) -> None:
        if not partitions:
            return
        if not self._pending:
            self._pending_since = self._now()
        self._pending += partitions
        self._next_try = 0.0

    def take_pending(self, consumer: Consumer) -> None:
        """Called between transactions: adopt a finished rebuild; else start rebuilding the
        shards given and still paused once Kafka says their committed offsets are stable (the
        previous owner's last transaction has ended, or timed out if it died inside one).
        Asking is cheap and rate-limited, so the shards this member already owns keep flowing
        meanwhile instead of standing still for as long as a dead member's transaction takes to
        time out, or a rebuild takes to read."""
        if self._rebuild is not None:
            if self._rebuild.done():
                self._adopt(consumer)
            return
        now = self._now()
        if not self._pending or now < self._next_try:
            return
        try:
            committed = consumer.committed(self._pending, timeout=STABLE_PROBE_S)
        except KafkaException as exc:
            if exc.args[0].code() == KafkaError._DESTROY:
                # Given by an assignment that `close` itself served (the member rejoins): this
                # consumer is going, and the member the group gives them to next rebuilds them.
                # Found by the chaos harness, where raising here crashed the rejoining process.
                log.info("shards %s given while the consumer closes", self._pending_shards())
                self._pending = []
                return
            if _not_yet(exc.args[0]) and now - self._pending_since < STABLE_TIMEOUT_S:
                if self._next_try == 0.0:
                    log.info(
                        "shards %s wait for their previous owner's last transaction",
                        self._pending_shards(),
                    )
                self._next_try = now + STABLE_RETRY_S
                return
            shards = self._pending_shards()
            self._pending = []
            raise AssignmentFailed(f"shards {shards} not rebuilt: {exc.args[0]}") from exc
        partitions, self._pending = self._pending, []
        self._note_committed(committed)
        new = sorted(self._new_shards(partitions))
        if not new:
            self._resume(consumer, partitions)
            return
        self._start(consumer, new, partitions)

    def _start(self, consumer: Consumer, new: list[int], partitions: list[TopicPartition]) -> None:
        # A member that owns nothing yet (starting) has nothing to keep flowing: it rebuilds in
        # place, and saves a thread hop and a loop turn before its first shards apply.
        self._rebuild = self._rebuild_of(consumer, new, self._spawn if self.owned else _in_place)
        self._rebuilding = partitions
        if self._rebuild.done():
            self._adopt(consumer)
        else:
            log.info("shards %s being rebuilt beside the loop", new)

    def _rebuild_of(self, consumer: Consumer, new: list[int], spawn: Spawn | None) -> ShardRebuild:
        """A rebuild of shards `new` into an engine of their own, run by `spawn`."""
        member, view = consumer.memberid(), self._catalog()
        names, loader = self._names, self._loader

        def read(engine: Engine, shards: list[int], stop: threading.Event) -> int:
            c = loader()
            try:
                return sum(load_shard(c, names, engine, view, s, stop) for s in shards)
            finally:
                c.close()

        return ShardRebuild(
            new, self._engine.rebuilding(new), read, lambda: self._held(member), spawn
        )

    def _adopt(self, consumer: Consumer) -> None:
        """The rebuild has ended: own its shards and resume their partitions; a catalog that
        changed meanwhile has them rebuilt again, with the new one."""
        rebuild, partitions = self._end_rebuild()
        if self._own(rebuild, "assigned"):
            self._resume(consumer, partitions)
            return
        log.info("shards %s rebuilt under an older catalog; rebuilding them again", rebuild.shards)
        self._wait(partitions)

    def _resume(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Resume partitions paused since they were given, each from its committed offset (its
        beginning where none is), sought explicitly: librdkafka can drop the start of a
        partition paused right after it was assigned, as `on_assign` does (librdkafka issues
        2190 and 5591, both open), and the partition then never fetches again, with no error.
        A scale-out test hung that way once in CI: ownership settled, nothing failed, and the
        readers waited minutes for messages of one shard. A seek after resuming is librdkafka's
        own advice; its newer version makes the lost start stale whichever order they come in."""
        consumer.resume(partitions)
        try:
            committed = consumer.committed(partitions, timeout=RESUME_TIMEOUT_S)
        except KafkaException as exc:
            log.warning("partitions %s resumed without a seek: %s", _named(partitions), exc)
            return
        for tp in rewind_to(committed):
            try:
                consumer.seek(tp)
            except KafkaException as exc:
                log.warning("%s resumed without a seek: %s", _named([tp]), exc)

    def _own(self, rebuild: ShardRebuild, what: str) -> bool:
        """Own what an ended `rebuild` read, if the coordinator still counts its shards as this
        member's (else `AssignmentFailed`); False, owning nothing, if the catalog changed since."""
        new = rebuild.shards
        try:
            rebuilt, read, held = rebuild.result()
        except Exception as exc:
            raise AssignmentFailed(f"shards {new} not rebuilt: {exc}") from exc
        taken = [shard for shard in new if shard not in held]
        if taken:
            raise AssignmentFailed(
                f"shards {taken} are no longer this member's (the coordinator counts {sorted(held)})"
            )
        if rebuilt.catalog.version != self._catalog().version:
            return False
        self._engine.adopt(rebuilt)
        log.info(
            "shards %s %s: %d records read in %.2fs (%.2fs reading); owning %s",
            new,
            what,
            read,
            time.monotonic() - rebuild.started,
            rebuild.read_s,
            sorted(self.owned),
            extra={"shards": new},
        )
        return True

    def load(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Rebuild, inside the loop, the shards of assigned `partitions` this engine does not own
        yet (after a failed transaction: the loop has nothing else to do), waiting until their
        offsets are stable, and own them if the coordinator still counts them as this member's
        (else `AssignmentFailed`)."""
        new = sorted(self._new_shards(partitions))
        if not new:
            return
        try:
            committed = consumer.committed(partitions, timeout=STABLE_TIMEOUT_S)  # until stable
        except KafkaException as exc:
            raise AssignmentFailed(f"shards {new} not rebuilt: {exc.args[0]}") from exc
        self._note_committed(committed)
        self._own(self._rebuild_of(consumer, new, _in_place), "rebuilt")  # one catalog throughout

    def _note_committed(self, committed: list[TopicPartition]) -> None:
        for tp in committed:
            if tp.offset >= 0:
                self._committed[(tp.topic, tp.partition)] = tp.offset
            else:
                self._committed.pop((tp.topic, tp.partition), None)

    def _pending_shards(self) -> list[int]:
        return sorted({tp.partition for tp in self._pending})

    def forget_pending(self) -> None:
        """The consumer is gone (the member rejoins, or starts over): nothing waits any more,
        and a running rebuild is stopped."""
        self._pending = []
        if self._rebuild is not None:
            self._end_rebuild()[0].stop()

    def _new_shards(self, partitions: list[TopicPartition]) -> set[int]:
        # The relay topic is the anchor: its partition s comes and goes with shard s (the other
        # topics are co-partitioned with it; a requests topic created later only adds partitions).
        return {tp.partition for tp in partitions if tp.topic == self._names.relay} - self.owned

    def on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        rebalanced("revoked", partitions)
        self._drop(partitions, "revoked")

    def on_lost(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        rebalanced("lost", partitions)
        self._drop(partitions, "lost (this member was fenced)")

    def fencing_offsets(self, positions: list[TopicPartition]) -> list[TopicPartition]:
        """The offsets the next transaction commits (`fencing_offsets`)."""
        return fencing_offsets(positions, self._committed)

    def transaction_offsets(
        self, consumer: Consumer, records: list[Message]
    ) -> list[TopicPartition]:
        """What the next transaction commits: where its records came from (`consumed_offsets`);
        with none of an owned shard (a transaction of timers alone) every assigned partition's
        position (`fencing_offsets`), so that Kafka checks the member's generation before the
        timers' messages count."""
        read = consumed_offsets(_positions(records), self.owned)
        if read:
            return read
        return self.fencing_offsets(consumer.position(consumer.assignment()))

    def _drop(self, partitions: list[TopicPartition], why: str) -> None:
        dropped = {(tp.topic, tp.partition) for tp in partitions}
        self._pending = [tp for tp in self._pending if (tp.topic, tp.partition) not in dropped]
        self._stop_rebuild(dropped)
        for tp in partitions:
            self._committed.pop((tp.topic, tp.partition), None)
        gone = sorted(
            tp.partition
            for tp in partitions
            if tp.topic == self._names.relay and tp.partition in self.owned
        )
        for shard in gone:
            self._engine.drop_shard(shard)
        if gone:
            log.info(
                "shards %s %s; owning %s", gone, why, sorted(self.owned), extra={"shards": gone}
            )

    def _stop_rebuild(self, dropped: set[tuple[str, int]]) -> None:
        """A partition of the running rebuild's shards was taken back: stop it; the partitions
        still assigned wait again (paused) and are rebuilt afresh."""
        if self._rebuild is None:
            return
        if not any((tp.topic, tp.partition) in dropped for tp in self._rebuilding):
            return
        rebuild, partitions = self._end_rebuild()
        log.info("rebuild of shards %s stopped: partitions taken back", rebuild.shards)
        rebuild.stop()
        self._wait([tp for tp in partitions if (tp.topic, tp.partition) not in dropped])

    def _end_rebuild(self) -> tuple[ShardRebuild, list[TopicPartition]]:
        """The running rebuild and its shards' partitions, no longer this keeper's to watch."""
        assert self._rebuild is not None
        ended = self._rebuild, self._rebuilding
        self._rebuild, self._rebuilding = None, []
        return ended


def _in_place(run: Callable[[], None]) -> None:
    run()


def fencing_offsets(
    positions: list[TopicPartition], committed: Mapping[tuple[str, int], int]
) -> list[TopicPartition]:
    """The offsets a transaction commits: every assigned partition's position, or the offset
    committed when it was assigned where nothing has been read from it since.

    Every transaction commits offsets, even one that only fires timers: the offsets commit is
    what Kafka checks the member's generation on, so a dispatcher the group has moved on from
    (paused past its session, cut off while Kafka restarted) cannot commit the timers of shards
    that their new owner fires too (found by the chaos harness: a DialogTimer delivered twice
    after a broker kill). Committing an offset again changes nothing.
    """
    out: list[TopicPartition] = []
    for tp in positions:
        offset = tp.offset if tp.offset >= 0 else committed.get((tp.topic, tp.partition))
        if offset is not None:
            out.append(TopicPartition(tp.topic, tp.partition, offset))
    return out


def _positions(records: list[Message]) -> Iterator[tuple[str, int, int]]:
    """(topic, partition, offset) of each record (a record, unlike an event, has all three)."""
    for m in records:
        yield cast(str, m.topic()), cast(int, m.partition()), cast(int, m.offset())


def consumed_offsets(
    consumed: Iterable[tuple[str, int, int]], owned: Container[int]
) -> list[TopicPartition]:
    """The offsets a transaction that applied records commits: for each partition it read, of a
    shard this member owns, the offset after the last record read.

    Only those partitions: an offset committed again for every assigned one (all of an
    instance's requests topics, `relay` and `inbound`, times the shards) cost each transaction
    an offset commit of four to seven times as many partitions and a call for the consumer's
    assignment, which librdkafka answers from its main thread (0.4-2 ms under load). One
    partition is all Kafka needs to check the member's generation on (the whole request is
    refused for a stale one), and an offset not committed again stays where this member last
    committed it. A record of a shard no longer owned (given up in the poll that read it) is
    not committed, as its partition would not be in the assignment either.
    """
    last: dict[tuple[str, int], int] = {}
    for topic, partition, offset in consumed:
        if partition in owned:
            last[(topic, partition)] = offset + 1
    return [TopicPartition(t, p, o) for (t, p), o in last.items()]


def rewind_to(committed: list[TopicPartition]) -> list[TopicPartition]:
    """Where the consumer goes back to after a failed transaction: each partition's committed
    offset, or its beginning where none is committed yet (what ``auto.offset.reset=earliest``
    started it from). A partition whose first records were in the failed transaction has no
    committed offset; left where the consumer stood, those records were skipped for good."""
    return [
        TopicPartition(tp.topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_BEGINNING)
        for tp in committed
    ]


def coordinator_shards(make_admin: Callable[[], AdminClient], group: str, relay: str) -> HeldShards:
    """`HeldShards` from the coordinator's description of the group: the relay partitions in
    the member's current assignment (none when the group does not list the member).

    A description that fails drops the admin client, and the next one asks through a new one:
    after a broker kill and restart an admin client was seen to time out every request from
    then on, so its dispatcher failed every assignment and rejoined every 15 s for minutes
    while its shards stood still (chaos harness, seed 83156)."""
    admins: list[AdminClient] = []

    def held(member: str) -> set[int]:
        if not admins:
            admins.append(make_admin())
        try:
            desc = admins[0].describe_consumer_groups([group], request_timeout=15)[group].result()
        except KafkaException:
            admins.clear()
            raise
        for m in desc.members:
            if m.member_id == member:
                return {tp.partition for tp in m.assignment.topic_partitions if tp.topic == relay}
        return set()

    return held


_NOT_YET = frozenset({KafkaError._TIMED_OUT, KafkaError._TIMED_OUT_QUEUE})


def _not_yet(err: KafkaError) -> bool:
    """An answer that only says "ask again": the probe's short time limit ran out (while its
    request was still queued, too: the failover bench met that under load) or Kafka said so."""
    return err.code() in _NOT_YET or err.retriable()


def _named(partitions: list[TopicPartition]) -> str:
    return ", ".join(sorted(f"{tp.topic.rsplit('.', 1)[-1]}[{tp.partition}]" for tp in partitions))
