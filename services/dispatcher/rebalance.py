"""Following the consumer group: the shards this dispatcher is given and the ones it gives up.

Kafka's consumer group (KIP-848, ``range`` assignor) hands every dispatcher of an instance the
same partition numbers of every input topic; a partition number is a shard. Given a shard, a
dispatcher first asks Kafka for the shard's committed offsets: with ``read_committed`` that waits
until the previous owner's last transaction is committed or aborted (a paused member may still be
finishing one), so the state rebuilt next includes everything that transaction wrote. Then it
rebuilds the shard from the compacted topics (`services.dispatcher.rebuild`). Giving a shard up,
it forgets it: the transaction loop commits before it polls, so no open transaction holds work of
a shard that moves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from confluent_kafka import Consumer, TopicPartition

from ksb.catalog.model import CatalogView
from ksb.dialog.engine import Engine
from ksb.names import Names
from services.dispatcher.rebuild import load_shard

__all__ = ["ShardKeeper", "fencing_offsets"]

log = logging.getLogger("ksb.dispatcher")

STABLE_TIMEOUT_S = 120.0
"""How long a new owner waits for the previous owner's last transaction to end."""


class ShardKeeper:
    """Loads and forgets shards as the consumer group assigns and revokes their partitions."""

    def __init__(
        self,
        names: Names,
        engine: Engine,
        loader: Consumer,
        catalog: Callable[[], CatalogView],
    ) -> None:
        self._names = names
        self._engine = engine
        self._loader = loader
        self._catalog = catalog
        self.loads = 0
        self.last_load_s = 0.0
        self._committed: dict[tuple[str, int], int] = {}
        """Offsets committed for the assigned partitions when they were assigned."""

    @property
    def owned(self) -> set[int]:
        return self._engine.ownership.owned

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # The relay topic is the anchor: its partition s comes and goes with shard s (the other
        # topics are co-partitioned with it; a requests topic created later only adds partitions).
        new = sorted(
            {tp.partition for tp in partitions if tp.topic == self._names.relay} - self.owned
        )
        if not new:
            return
        started = time.monotonic()
        for tp in consumer.committed(partitions, timeout=STABLE_TIMEOUT_S):  # waits until stable
            if tp.offset >= 0:
                self._committed[(tp.topic, tp.partition)] = tp.offset
            else:
                self._committed.pop((tp.topic, tp.partition), None)
        read = 0
        view = self._catalog()
        for shard in new:
            read += load_shard(self._loader, self._names, self._engine, view, shard)
            self._engine.ownership.owned.add(shard)
        self.loads += 1
        self.last_load_s = time.monotonic() - started
        log.info(
            "shards %s assigned: %d records read in %.2fs; owning %s",
            new,
            read,
            self.last_load_s,
            sorted(self.owned),
        )

    def on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._drop(partitions, "revoked")

    def on_lost(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._drop(partitions, "lost (this member was fenced)")

    def fencing_offsets(self, positions: list[TopicPartition]) -> list[TopicPartition]:
        """The offsets the next transaction commits (`fencing_offsets`)."""
        return fencing_offsets(positions, self._committed)

    def _drop(self, partitions: list[TopicPartition], why: str) -> None:
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
