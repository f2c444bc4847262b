"""What a dispatcher does after a failed transaction, or when the group has left it behind.

A failed transaction's work is dropped and redone from Kafka: the transaction is aborted, the owned
shards are rebuilt from their topics and the consumer goes back to their committed offsets (the
aborted batch changed the engine's state). Two failures have cheaper answers: a transaction
refused only for the group epoch it carried is written again with the current one
(`services.dispatcher.journal`), and a member the group no longer counts in gives its shards up
and joins afresh. A producer Kafka fenced, or one whose abort does not end, means starting over
with a new producer, whose ``init_transactions`` fences the old one; that is the start-up's
(`services.dispatcher.startup`), so `recover` only says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from confluent_kafka import KafkaError, KafkaException

from ksb.wire.fragments import Reassembler
from services.dispatcher.journal import (
    ABORT_TIMEOUT_S,
    NOT_A_MEMBER,
    REPORTS_WAIT_S,
    STALE_EPOCH,
    TXN_CALL_TIMEOUT_S,
    write_again,
    write_again_or_give_up,
)
from services.dispatcher.pipeline import Pipeline
from services.dispatcher.rebalance import rewind_to

__all__ = ["recover", "rejoin"]

log = logging.getLogger("ksb.dispatcher")


SIZE_FAULTS = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})
"""Kafka's answers to a record past its topic's limit: the limits may have changed."""


def recover(
    p: Pipeline,
    exc: KafkaException,
    *,
    rebuilt: Callable[[], None],
    limits_changed: Callable[[], bool],
) -> bool:
    """Deal with a failed transaction; False when the dispatcher must start over with a new
    producer. `rebuilt` is called once the owned shards were rebuilt from Kafka;
    `limits_changed` reads the queue topics' size limits again, and says whether they moved."""
    err = exc.args[0]
    log.warning("transaction failed (%s); its work is dropped and redone from Kafka", err)
    if err.code() == KafkaError._STATE:
        # Refused in a transaction that had already failed: why, and for which record, is in a
        # delivery report not yet served (the refusal itself blames the record that happened to
        # produce next). Without it nothing was counted, and a record Kafka always refuses
        # failed its batch forever (found by the fresh-clone CI's test_poison).
        p.producer.poll(REPORTS_WAIT_S)
        p.producer.refused = [r for r in p.producer.refused if r[1].code() != KafkaError._STATE]
    faults = {err.code()} | {e.code() for _, e in p.producer.refused}
    if faults & SIZE_FAULTS and limits_changed():
        # The redo refuses the message past the new limit before its transaction: no record
        # is to blame for what the dispatcher did not know.
        log.warning("queue topics' size limits changed; the batch is redone under them")
    else:
        _count_against_records(p, err)
    p.writer.discard()
    if err.fatal() or not _abort(p):
        return False
    if err.code() in STALE_EPOCH:
        rewrite = write_again_or_give_up(lambda: _write_again(p), lambda: _abort(p))
        if rewrite.failure is None:
            return True
        if rewrite.stuck:
            return False
        err = rewrite.failure
    if err.code() in NOT_A_MEMBER:
        rejoin(p)
    else:
        _reset(p)
        rebuilt()
    return True


def _count_against_records(p: Pipeline, err: KafkaError) -> None:
    """A failure a record can cause counts against the records whose outputs Kafka refused, as
    its delivery reports name them, or against every record of the transaction when none does
    (`services.dispatcher.isolation`). A report names its record only when it is the one
    record refused: Kafka refuses a whole produce request for one record past a topic's
    limit, and every record with an output in that request gets the same report (found by
    test_poison: 277 reports, of which 276 were innocent)."""
    named = {src: e for src, e in p.producer.refused if src is not None}
    if len(named) == 1:
        [(src, e)] = named.items()
        if p.isolation.failed([src], e.code(), e.str(), named=True):
            log.warning("record %s[%d]@%d: Kafka refused its output (%s)", *src, e.str())
        return
    if named:
        first = next(iter(named.values()))
        err = KafkaError(first.code(), first.str())
    if p.isolation.failed(p.open_records, err.code(), err.str(), named=False):
        log.warning(
            "its %d record(s) are applied one by one until it is found", len(p.open_records)
        )


def rejoin(p: Pipeline) -> None:
    """The group no longer counts this dispatcher in (it was paused past its session): its
    shards are someone else's now. Forget them and join afresh; the assignment it gets is
    rebuilt then, from what their new owners committed."""
    assert p.consumer is not None
    for shard in sorted(p.engine.ownership.owned):
        p.engine.drop_shard(shard)
    p.shards.forget_pending()
    try:
        p.consumer.close()
    except KafkaException as exc:
        # Leaving needs Kafka (committed offsets, the leave heartbeat); without it the old
        # member expires with its session instead (found by the chaos harness).
        log.warning("consumer not closed cleanly (%s); its membership expires", exc)
    p.pieces = Reassembler()
    p.subscribe()


def _write_again(p: Pipeline) -> KafkaError | None:
    """The transaction was refused only for the group epoch it carried: write it again with
    the current one instead of rebuilding the shards."""
    assert p.consumer is not None
    consumer = p.consumer
    with p.watchdog.guard("write_again"):
        failure = write_again(p.producer, consumer.consumer_group_metadata, TXN_CALL_TIMEOUT_S)
    if failure is None:
        p.counts.applied += p.batch
    return failure


def _abort(p: Pipeline) -> bool:
    """Abort whatever transaction is open, whatever the error was: a retriable one (an offsets
    commit that timed out while Kafka was down) leaves it open, and every later begin would fail
    in state InTransaction (found by the chaos harness). Nothing open is fine. False when the
    producer is fenced or broken for good, or its abort does not end in `ABORT_TIMEOUT_S` (why:
    its docstring): start over with a new producer, whose init_transactions fences this one and
    has the coordinator abort what it left open."""
    try:
        p.producer.abort_transaction(ABORT_TIMEOUT_S)
    except KafkaException as exc:
        err = exc.args[0]
        if err.fatal() or err.code() == KafkaError._TIMED_OUT:
            log.warning("abort not done (%s); starting over with a new producer", err)
            return False
        log.info("abort after a failed transaction: %s", err)
    return True


def _reset(p: Pipeline) -> None:
    """Owned shards rebuilt, consumer back at their committed offsets (shards still waiting for
    their last owner's transaction, `ShardKeeper.take_pending`, go on waiting)."""
    assert p.consumer is not None
    owned = set(p.engine.ownership.owned)
    assignment = [tp for tp in p.consumer.assignment() if tp.partition in owned]
    for shard in sorted(owned):
        p.engine.drop_shard(shard)
    relay = [tp for tp in assignment if tp.topic == p.names.relay]
    p.shards.load(p.consumer, relay)
    for tp in rewind_to(p.consumer.committed(assignment, timeout=60)):
        p.consumer.seek(tp)
    p.pieces = Reassembler()
