"""A transaction written again, as it was, when Kafka refused it only for a stale group epoch.

Whenever the group coordinator changes a member's assignment it bumps the member's epoch, and an
offsets commit carrying the old epoch is refused (ILLEGAL_GENERATION, STALE_MEMBER_EPOCH). A
dispatcher whose transaction was open at that moment, because another member joined or died,
used to abort it and rebuild every shard it holds from Kafka (a second or more of standstill on
shards that never moved, in the middle of the very failover that should not touch them).

Nothing about that batch was wrong: the engine applied it, its outputs are known, and the
member still owns its partitions. A member gives a partition up only by acknowledging the
revocation from its rebalance callback, which runs in ``poll``, and the transaction loop never
polls with a transaction open; a member the group has expelled gets a different error
(UNKNOWN_MEMBER_ID, FENCED_MEMBER_EPOCH). So the same records and offsets are written again, in
a new transaction, with the group metadata the consumer holds now. Read_committed readers never
saw the aborted copy, so what they see is the batch exactly once. If the second attempt fails
too, the dispatcher recovers as from any failed transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

__all__ = [
    "ABORT_TIMEOUT_S",
    "NOT_A_MEMBER",
    "STALE_EPOCH",
    "TXN_CALL_TIMEOUT_S",
    "TXN_PRODUCER",
    "JournaledProducer",
    "write_again",
]

log = logging.getLogger("ksb.dispatcher")

STALE_EPOCH = frozenset({KafkaError.ILLEGAL_GENERATION, KafkaError.STALE_MEMBER_EPOCH})
"""The refusals that only say the group metadata is older than the member's epoch: the
transaction is written again (`write_again`), not its shards rebuilt. Rejoining on them, as the
dispatcher once did, gave every member a new id with no shards whenever one joined or left, and
every shard of the instance moved and stood still while it was rebuilt (the scale-out test)."""

NOT_A_MEMBER = frozenset({KafkaError.UNKNOWN_MEMBER_ID, KafkaError.FENCED_MEMBER_EPOCH})
"""The refusals that say the group has moved on without this member: it rejoins."""


TXN_CALL_TIMEOUT_S = 30.0
"""How long one transaction call may block the dispatcher's loop; a failure is recovered."""
ABORT_TIMEOUT_S = 10.0
"""How long an abort may take before the producer is replaced: well inside the poll interval
(`KSB_REBALANCE_TIMEOUT_MS`), so a member whose abort hangs does not lose its shards for it. An
abort left running ("retry call to resume") was seen never to end after a broker stall: each
retry blocked the loop past its poll interval, the member lost its shard, got it back and
blocked again, and the shard stood still for the rest of the run (chaos harness, seed 1454).
A refused transaction written again (`write_again`) is aborted under this limit too."""

TXN_PRODUCER: dict[str, Any] = {"linger.ms": 1, "retry.backoff.ms": 5, "retry.backoff.max.ms": 100}
"""The transactional producer's own settings. A transaction begun while the coordinator is
still writing the previous one's commit markers is refused CONCURRENT_TRANSACTIONS and asked
again after ``retry.backoff.ms``: librdkafka's 100 ms stood the dispatcher still for a tenth of
a second in 7 % of the transactions of `make bench`'s load (librdkafka's eos debug log), and in
one-at-a-time traffic after every transaction that came right after another."""


class JournaledProducer(Producer):
    """A transactional producer that remembers what the open transaction produced and the
    offsets it sent (None until it sends some)."""

    def __init__(self, conf: dict[str, Any]) -> None:
        super().__init__(conf)
        self.journal: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.offsets: list[TopicPartition] | None = None

    def begin_transaction(self, *args: Any) -> None:
        self.journal, self.offsets = [], None
        super().begin_transaction(*args)

    def produce(self, *args: Any, **kwargs: Any) -> None:
        self.journal.append((args, kwargs))
        super().produce(*args, **kwargs)

    def send_offsets_to_transaction(
        self, offsets: list[TopicPartition], group_metadata: Any, *args: Any
    ) -> None:
        self.offsets = offsets
        super().send_offsets_to_transaction(offsets, group_metadata, *args)


def write_again(
    producer: JournaledProducer, group_metadata: Callable[[], Any], timeout_s: float
) -> bool:
    """Commit the records and offsets of a transaction refused for its group epoch, and aborted
    since, in a new one with the consumer's current group metadata; False when that fails too,
    or when the refused transaction sent no offsets (nothing a stale epoch could have refused).
    The abort is the caller's, with the abort's own time limit (`ABORT_TIMEOUT_S`)."""
    records, offsets = producer.journal, producer.offsets
    if offsets is None:
        return False
    try:
        producer.begin_transaction()
        for args, kwargs in records:
            producer.produce(*args, **kwargs)
        producer.send_offsets_to_transaction(offsets, group_metadata(), timeout_s)
        producer.commit_transaction(timeout_s)
    except KafkaException as exc:
        log.warning("transaction not written again (%s)", exc.args[0])
        return False
    log.info("transaction refused for a stale group epoch written again (%d records)", len(records))
    return True
