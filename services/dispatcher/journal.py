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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

__all__ = [
    "ABORT_TIMEOUT_S",
    "NOT_A_MEMBER",
    "STALE_EPOCH",
    "TXN_CALL_TIMEOUT_S",
    "TXN_PRODUCER",
    "WRITE_AGAIN_ATTEMPTS",
    "JournaledProducer",
    "Rewrite",
    "worth_writing_again",
    "write_again",
    "write_again_or_give_up",
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

REPORTS_WAIT_S = 1.0
"""How long a failed transaction waits for the delivery reports that say why, when Kafka's
answer was only that the transaction had already failed (``_STATE``): a reason, and the record
it names, come in a report still queued (`services.dispatcher.recovery`)."""

WRITE_AGAIN_ATTEMPTS = 2
"""How often a refused transaction is written again before its shards are rebuilt instead. A
write-again was seen to fail with OUT_OF_ORDER_SEQUENCE_NUMBER ("skipped sequence numbers,
requires epoch bump": 4 of 31 in the failover runs of 2026-11-26), which cost that dispatcher a
rebuild of every shard it held, about 2.5 s of their traffic, in the middle of another member's
failover. librdkafka mends that error by bumping the producer epoch in the abort that follows it
(librdkafka pull requests 3577 and 4058), so one more attempt after that abort starts clean."""

TXN_PRODUCER: dict[str, Any] = {"linger.ms": 1, "retry.backoff.ms": 5, "retry.backoff.max.ms": 100}
"""The transactional producer's own settings. A transaction begun while the coordinator is
still writing the previous one's commit markers is refused CONCURRENT_TRANSACTIONS and asked
again after ``retry.backoff.ms``: librdkafka's 100 ms stood the dispatcher still for a tenth of
a second in 7 % of the transactions of `make bench`'s load (librdkafka's eos debug log), and in
one-at-a-time traffic after every transaction that came right after another."""


class JournaledProducer(Producer):
    """A transactional producer that remembers what the open transaction produced and the
    offsets it sent (None until it sends some), and which consumed record each output came
    from, so that a record Kafka refuses is pinned on the record that asked for it
    (`services.dispatcher.isolation`)."""

    def __init__(self, conf: dict[str, Any]) -> None:
        super().__init__(
            {**conf, "on_delivery": self._delivered, "delivery.report.only.error": True}
        )
        self.journal: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.offsets: list[TopicPartition] | None = None
        self.source: Any = None
        """The consumed record whose outputs are being produced (None: the transaction's own,
        such as timers, endpoint records and audit events)."""
        self._sources: dict[tuple[str, bytes | None], Any] = {}
        self.refused: list[tuple[Any, KafkaError]] = []
        """The sources of the open transaction's outputs Kafka refused, with its reason."""
        self.opened_at: float | None = None
        """When the open transaction began (`time.monotonic`), None when none is open: a commit
        that failed leaves it open until its abort (`services.dispatcher.gauges` exports it)."""

    def begin_transaction(self, *args: Any) -> None:
        self.journal, self.offsets = [], None
        self._sources, self.refused = {}, []
        self.opened_at = time.monotonic()
        super().begin_transaction(*args)

    def commit_transaction(self, timeout: float = -1) -> None:
        super().commit_transaction(timeout)
        self.opened_at = None

    def abort_transaction(self, timeout: float = -1) -> None:
        super().abort_transaction(timeout)
        self.opened_at = None

    def produce(self, *args: Any, **kwargs: Any) -> None:
        self.journal.append((args, kwargs))
        if self.source is not None:
            key = kwargs.get("key")
            self._sources[(args[0], key if isinstance(key, bytes) else None)] = self.source
        super().produce(*args, **kwargs)

    def _delivered(self, err: KafkaError | None, msg: Any) -> None:
        """Only failures are reported (``delivery.report.only.error``)."""
        if err is not None:
            self.refused.append((self._sources.get((msg.topic(), msg.key())), err))

    def send_offsets_to_transaction(
        self, offsets: list[TopicPartition], group_metadata: Any, *args: Any
    ) -> None:
        self.offsets = offsets
        super().send_offsets_to_transaction(offsets, group_metadata, *args)


def write_again(
    producer: JournaledProducer, group_metadata: Callable[[], Any], timeout_s: float
) -> KafkaError | None:
    """Commit the records and offsets of a transaction refused for its group epoch, and aborted
    since, in a new one with the consumer's current group metadata. None when written; else what
    failed (a `KafkaError._STATE` one when the refused transaction sent no offsets: nothing a
    stale epoch could have refused). The abort is the caller's, with the abort's own time limit
    (`ABORT_TIMEOUT_S`)."""
    records, offsets = producer.journal, producer.offsets
    if offsets is None:
        return KafkaError(KafkaError._STATE, "the refused transaction sent no offsets")
    try:
        producer.begin_transaction()
        for args, kwargs in records:
            producer.produce(*args, **kwargs)
        producer.send_offsets_to_transaction(offsets, group_metadata(), timeout_s)
        producer.commit_transaction(timeout_s)
    except KafkaException as exc:
        err: KafkaError = exc.args[0]
        log.warning("transaction not written again (%s)", err)
        return err
    log.info("transaction refused for a stale group epoch written again (%d records)", len(records))
    return None


def worth_writing_again(err: KafkaError) -> bool:
    """May a write-again that failed with `err` be tried once more, after its abort? Only when
    the abort is all it needs: not for a producer that is broken, nor for a member the group has
    moved on without (it rejoins), nor for a transaction with nothing to write."""
    return err.txn_requires_abort() and not err.fatal() and err.code() not in NOT_A_MEMBER


@dataclass(frozen=True)
class Rewrite:
    """How `write_again_or_give_up` ended."""

    failure: KafkaError | None = None
    """What the last attempt failed with, aborted since: recover from it as from any failed
    transaction. None: the transaction is written."""
    stuck: bool = False
    """An abort did not end: start over with a new producer."""


def write_again_or_give_up(
    write: Callable[[], KafkaError | None],
    abort: Callable[[], bool],
    attempts: int = WRITE_AGAIN_ATTEMPTS,
) -> Rewrite:
    """`write` (a `write_again`) up to `attempts` times while its failures are
    `worth_writing_again`, with `abort` (False: it did not end) after each one."""
    failure: KafkaError | None = None
    for _ in range(attempts):
        failure = write()
        if failure is None:
            return Rewrite()
        if not abort():
            return Rewrite(failure, stuck=True)
        if not worth_writing_again(failure):
            break
    return Rewrite(failure)
