"""A zombie commit: a reader whose commit reaches the dispatcher after its lease has lapsed and
a newer holder of the same group has committed (a process paused between its lease check and its
produce, or a commit record stuck in a stalled connection).

The zombie RECEIVEs a group on B's target queue as any reader does, notes its fencing token, and
then stops (its client is closed without a rollback, so nothing renews the lease). Once the
queue topic shows a commit applied for that group under a newer token, it sends the commit it
would have sent: the same receipt, its old token, as one ``commit`` request record. The
dispatcher must refuse it (``stale_token``), whatever else it names; if no newer holder commits in
time, the zombie sends nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from confluent_kafka import Consumer, TopicPartition

from devtools.deployment import Deployment
from ksb.names import Names
from ksb.runtime import kafka
from ksb.sdk.client import KsbClient
from ksb.wire.partitioning import partition_for
from ksb.wire.protocol import CommitOutcome, CommitRequest, Receipt, dumps, parse_queue_record

__all__ = ["zombie_commit"]


def zombie_commit(settings: Deployment, queue: str, partitions: int, timeout_s: float = 30) -> str:
    """Run one zombie on `queue`; returns what became of it: ``stale_refused``,
    ``refused: <reason>``, ``applied`` (a violation when a newer token was applied before), or
    ``skipped: <why>``."""
    names = Names(settings.instance)
    topic = names.queue(queue)
    with KsbClient(settings) as client:
        tx = client.transaction()
        msgs = tx.receive(queue, waitfor_ms=5_000)
        group = tx.group
        if not msgs or group is None:
            tx.rollback()
            return "skipped: nothing to receive"
        token, lease = tx.token, tx.lease
        ids = tuple(m.message_id for m in msgs)
        # The client closes with the transaction open: nothing renews or releases the lease.
    partition = partition_for(group, partitions)
    consumer = kafka.consumer(settings)
    try:
        consumer.assign([TopicPartition(topic, partition, -2)])

        def newer(o: CommitOutcome) -> bool:
            return o.group == group and o.applied and o.token > token

        if not _wait_outcome(consumer, newer, timeout_s):
            return "skipped: no newer holder committed in time"
        req = CommitRequest(
            reader="chaos-zombie",
            receipt=Receipt(queue=queue, group=group, message_ids=ids, token=token, lease=lease),
        )
        producer = kafka.producer(settings)
        failed: list[str] = []
        producer.produce(
            names.requests_for(settings.sender),
            key=group.encode(),
            value=dumps(req),
            on_delivery=lambda err, _msg: failed.append(str(err)) if err is not None else None,
        )
        if producer.flush(30) != 0 or failed:
            return f"skipped: commit not stored ({', '.join(failed) or 'flush timed out'})"
        found: list[CommitOutcome] = []

        def mine(o: CommitOutcome) -> bool:
            if o.request_id == req.request_id:
                found.append(o)
                return True
            return False

        if not _wait_outcome(consumer, mine, timeout_s):
            return "skipped: no outcome in time"
    finally:
        consumer.close()
    outcome = found[0]
    if outcome.applied:
        return "applied"
    if outcome.reason.startswith("stale_token"):
        return "stale_refused"
    return f"refused: {outcome.reason}"


def _wait_outcome(
    consumer: Consumer, match: Callable[[CommitOutcome], bool], timeout_s: float
) -> bool:
    """Read on until an outcome `match` accepts (True), or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for m in consumer.consume(500, 0.2):
            if m.error() is not None:
                continue
            value = parse_queue_record(m.value())
            if isinstance(value, CommitOutcome) and match(value):
                return True
    return False
