"""A dispatcher transaction refused for a stale group epoch is written again, exactly once.

On a real broker: member A of a consumer group takes the group metadata, member B joins (the
coordinator moves a partition and bumps A's epoch), and A's transaction then carries the stale
metadata into its offsets commit, as a dispatcher's open transaction does when another member
joins or dies. Kafka refuses it; `write_again` commits the same records and offsets with A's
current metadata, and a read_committed reader sees each record once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, KafkaException, TopicPartition

from devtools.deployment import Deployment
from ksb.runtime import kafka
from services.dispatcher.journal import STALE_EPOCH, JournaledProducer, write_again
from tests.conftest import Stack

pytestmark = pytest.mark.integration

_DEADLINE_S = 30.0


def _member(admin: Deployment, group: str) -> Consumer:
    return kafka.group_consumer(admin, group=group, rebalance_timeout_ms=10_000, assignor="range")


def _poll_until(members: list[Consumer], done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + _DEADLINE_S
    while time.monotonic() < deadline:
        for c in members:
            c.poll(0.05)
        if done():
            return
    raise AssertionError("the group did not settle in time")


def _read_all(admin: Deployment, topic: str, expected: int) -> list[bytes]:
    reader = kafka.consumer(admin)
    reader.assign([TopicPartition(topic, 0, 0)])
    got: list[bytes] = []
    deadline = time.monotonic() + _DEADLINE_S
    while time.monotonic() < deadline and len(got) < expected:
        m = reader.poll(0.1)
        if m is not None and m.error() is None:
            got.append(m.value() or b"")
    time.sleep(0.5)  # anything beyond `expected` (a duplicate) would show here
    got += [m.value() or b"" for m in reader.consume(100, 0.5) if m.error() is None]
    reader.close()
    return got


def test_a_transaction_refused_for_a_stale_epoch_is_written_again_once(stack: Stack) -> None:
    admin = stack.admin()
    unique = uuid.uuid4().hex[:8]
    source, sink, group = f"journal-in-{unique}", f"journal-out-{unique}", f"journal-{unique}"
    kafka.ensure_topics(kafka.admin(admin), [kafka.TopicSpec(source, 2), kafka.TopicSpec(sink, 1)])
    a, b = _member(admin, group), _member(admin, group)
    try:
        _stale_epoch_then_again(admin, a, b, source, sink, unique)
    finally:
        a.close()
        b.close()


def _stale_epoch_then_again(
    admin: Deployment, a: Consumer, b: Consumer, source: str, sink: str, unique: str
) -> None:
    a.subscribe([source])
    _poll_until([a], lambda: len(a.assignment()) == 2)
    stale = a.consumer_group_metadata()
    b.subscribe([source])
    _poll_until([a, b], lambda: len(a.assignment()) == 1 and len(b.assignment()) == 1)
    time.sleep(1.0)  # a heartbeat or two: A holds its new epoch
    _poll_until([a, b], lambda: True)

    producer = JournaledProducer(kafka.producer_conf(admin, transactional_id=f"j-{unique}"))
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(3):
        producer.produce(sink, key=b"k", value=f"v{i}".encode())
    offsets = [TopicPartition(tp.topic, tp.partition, 7) for tp in a.assignment()]
    with pytest.raises(KafkaException) as refused:
        producer.send_offsets_to_transaction(offsets, stale, 10)
    assert refused.value.args[0].code() in STALE_EPOCH

    producer.abort_transaction(10)
    assert write_again(producer, a.consumer_group_metadata, 10) is None

    assert _read_all(admin, sink, 3) == [b"v0", b"v1", b"v2"]
    committed = a.committed(list(offsets), timeout=10)
    assert [tp.offset for tp in committed] == [7]
