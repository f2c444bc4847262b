"""Following the consumer group: the shards this dispatcher is given and the ones it gives up.

Kafka's consumer group (KIP-848, KSB's sticky assignor or ``range``) hands every dispatcher of an
instance the same partition numbers of every input topic; a partition number is a shard. Given a
shard, a dispatcher first asks Kafka for the shard's committed offsets: with ``read_committed``
they are unstable until the previous owner's last transaction is committed or aborted (a paused
member may still be finishing one; one SIGKILLed inside a transaction leaves it to time out), so
the state rebuilt next includes everything that transaction wrote. Until then the shard's
partitions stay paused and the loop asks again between its transactions (`take_pending`), so the
shards the member already owns keep flowing. Then it rebuilds the shard from the compacted
topics (`services.dispatcher.rebuild`). Giving a shard up,
it forgets it: the transaction loop commits before it polls, so no open transaction holds work of
a shard that moves.

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
import time
from collections.abc import Callable, Mapping

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from ksb.catalog.model import CatalogView
from ksb.dialog.engine import Engine
from ksb.names import Names
from services.dispatcher.rebuild import load_shard

__all__ = ["AssignmentFailed", "ShardKeeper", "coordinator_shards", "fencing_offsets"]

log = logging.getLogger("ksb.dispatcher")

STABLE_TIMEOUT_S = 120.0
"""How long a new owner waits for the previous owner's last transaction to end."""
STABLE_PROBE_S = 0.05
"""How long one look at a waiting shard's committed offsets may block the loop."""
STABLE_RETRY_S = 0.1
"""How often a waiting shard's committed offsets are looked at."""


class AssignmentFailed(RuntimeError):
    """Shards just assigned cannot be taken safely (the coordinator no longer counts them as
    this member's, or Kafka did not answer): the dispatcher rejoins the group."""


HeldShards = Callable[[Consumer], set[int]]
"""The shards the group coordinator counts as the given member's now."""


class ShardKeeper:
    """Loads and forgets shards as the consumer group assigns and revokes their partitions."""

    def __init__(
        self,
        names: Names,
        engine: Engine,
        loader: Consumer,
        catalog: Callable[[], CatalogView],
        held: HeldShards,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._names = names
        self._engine = engine
        self._loader = loader
        self._catalog = catalog
        self._held = held
        self.loads = 0
        self.last_load_s = 0.0
        self._committed: dict[tuple[str, int], int] = {}
        """Offsets committed for the assigned partitions when they were assigned."""
        self._now = now
        self._pending: list[TopicPartition] = []
        """Partitions given, paused until their shard is loaded (`take_pending`)."""
        self._pending_since = 0.0
        self._next_try = 0.0

    @property
    def owned(self) -> set[int]:
        return self._engine.ownership.owned

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """The rebalance callback: take the partitions at once; load their shards now if their
        previous owner's last transaction has ended, else later (`take_pending`), paused."""
        log.info("partitions %s given; taking them", _named(partitions))
        consumer.incremental_assign(partitions)
        waiting = {tp.partition for tp in self._pending} | self._new_shards(partitions)
        paused = [tp for tp in partitions if tp.partition in waiting]
        if not paused:
            return
        consumer.pause(paused)
        if not self._pending:
            self._pending_since = self._now()
        self._pending += paused
        self._next_try = 0.0
        self.take_pending(consumer)

    def take_pending(self, consumer: Consumer) -> None:
        """Load the shards given and still paused, once Kafka says their committed offsets are
        stable (the previous owner's last transaction has ended, or timed out if it died inside
        one); called between transactions. Asking is cheap and rate-limited, so the shards this
        member already owns keep flowing meanwhile instead of standing still for as long as a
        dead member's transaction takes to time out."""
        now = self._now()
        if not self._pending or now < self._next_try:
            return
        try:
            committed = consumer.committed(self._pending, timeout=STABLE_PROBE_S)
        except KafkaException as exc:
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
        self._take(consumer, partitions, committed)
        consumer.resume(partitions)

    def load(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Rebuild the shards of assigned `partitions` this engine does not own yet, waiting
        until their offsets are stable, and own them if the coordinator still counts them as
        this member's (else `AssignmentFailed`)."""
        if not self._new_shards(partitions):
            return
        try:
            committed = consumer.committed(partitions, timeout=STABLE_TIMEOUT_S)  # until stable
        except KafkaException as exc:
            raise AssignmentFailed(f"shards not rebuilt: {exc.args[0]}") from exc
        self._take(consumer, partitions, committed)

    def _pending_shards(self) -> list[int]:
        return sorted({tp.partition for tp in self._pending})

    def forget_pending(self) -> None:
        """The consumer is gone (the member rejoins): nothing waits any more."""
        self._pending = []

    def _new_shards(self, partitions: list[TopicPartition]) -> set[int]:
        # The relay topic is the anchor: its partition s comes and goes with shard s (the other
        # topics are co-partitioned with it; a requests topic created later only adds partitions).
        return {tp.partition for tp in partitions if tp.topic == self._names.relay} - self.owned

    def _take(
        self,
        consumer: Consumer,
        partitions: list[TopicPartition],
        committed: list[TopicPartition],
    ) -> None:
        new = sorted(self._new_shards(partitions))
        if not new:
            return
        started = time.monotonic()
        try:
            for tp in committed:
                if tp.offset >= 0:
                    self._committed[(tp.topic, tp.partition)] = tp.offset
                else:
                    self._committed.pop((tp.topic, tp.partition), None)
            read = 0
            view = self._catalog()
            for shard in new:
                read += load_shard(self._loader, self._names, self._engine, view, shard)
            held = self._held(consumer)
        except KafkaException as exc:
            self._forget(new)
            raise AssignmentFailed(f"shards {new} not rebuilt: {exc.args[0]}") from exc
        taken = [shard for shard in new if shard not in held]
        if taken:
            self._forget(new)
            raise AssignmentFailed(
                f"shards {taken} are no longer this member's (the coordinator counts {sorted(held)})"
            )
        self._engine.ownership.owned.update(new)
        self.loads += 1
        self.last_load_s = time.monotonic() - started
        log.info(
            "shards %s assigned: %d records read in %.2fs; owning %s",
            new,
            read,
            self.last_load_s,
            sorted(self.owned),
        )

    def _forget(self, shards: list[int]) -> None:
        for shard in shards:
            self._engine.drop_shard(shard)

    def on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._drop(partitions, "revoked")

    def on_lost(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._drop(partitions, "lost (this member was fenced)")

    def fencing_offsets(self, positions: list[TopicPartition]) -> list[TopicPartition]:
        """The offsets the next transaction commits (`fencing_offsets`)."""
        return fencing_offsets(positions, self._committed)

    def _drop(self, partitions: list[TopicPartition], why: str) -> None:
        dropped = {(tp.topic, tp.partition) for tp in partitions}
        self._pending = [tp for tp in self._pending if (tp.topic, tp.partition) not in dropped]
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
            log.info("shards %s %s; owning %s", gone, why, sorted(self.owned))


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


def coordinator_shards(make_admin: Callable[[], AdminClient], group: str, relay: str) -> HeldShards:
    """`HeldShards` from the coordinator's description of the group: the relay partitions in
    the member's current assignment (none when the group does not list the member).

    A description that fails drops the admin client, and the next one asks through a new one:
    after a broker kill and restart an admin client was seen to time out every request from
    then on, so its dispatcher failed every assignment and rejoined every 15 s for minutes
    while its shards stood still (chaos harness, seed 83156)."""
    admins: list[AdminClient] = []

    def held(consumer: Consumer) -> set[int]:
        member = consumer.memberid()
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
