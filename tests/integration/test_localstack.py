"""The local stack is a real broker and a real Redis, with working transactions.

These are the properties every other integration test silently relies on; when they break,
this file says so directly instead of as a timeout somewhere else. They log in as the stack's
``admin`` (a super user): they test the broker, not KSB's ACLs (`test_security` does).
"""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from ksb.runtime.redis_client import redis_client
from tests.conftest import Stack

pytestmark = pytest.mark.integration


def _kafka(stack: Stack) -> dict[str, str | int | float | bool]:
    """Where the stack's Kafka is, logged in as its admin."""
    return {"bootstrap.servers": stack.kafka_bootstrap, **stack.security.login().librdkafka()}


def _create_topic(stack: Stack, name: str, partitions: int) -> None:
    admin = AdminClient(_kafka(stack))
    futures = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    futures[name].result(timeout=30)


def _consume_all(
    stack: Stack, topic: str, group: str, *, isolation: str, expect: int, wait_s: float = 10.0
) -> list[Message]:
    """Read from the start until `expect` records arrived, then a short settle to catch extras."""
    consumer = Consumer(
        {
            **_kafka(stack),
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": isolation,
        }
    )
    consumer.subscribe([topic])
    got: list[Message] = []
    deadline = time.monotonic() + wait_s
    settle_until: float | None = None
    try:
        while time.monotonic() < deadline:
            if settle_until is not None and time.monotonic() >= settle_until:
                break
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                raise AssertionError(f"consumer error: {err}")
            got.append(msg)
            if len(got) >= expect and settle_until is None:
                settle_until = time.monotonic() + 1.0
    finally:
        consumer.close()
    return got


def test_topic_with_three_partitions_round_trips_a_record(stack: Stack, unique: str) -> None:
    topic = f"t-{unique}"
    _create_topic(stack, topic, 3)

    admin = AdminClient(_kafka(stack))
    meta = admin.list_topics(topic=topic, timeout=10)
    assert len(meta.topics[topic].partitions) == 3

    producer = Producer({**_kafka(stack), "acks": "all"})
    producer.produce(topic, key=b"k", value=b"hello", partition=2)
    assert producer.flush(10) == 0

    got = _consume_all(stack, topic, f"g-{unique}", isolation="read_uncommitted", expect=1)
    assert [(m.partition(), m.key(), m.value()) for m in got] == [(2, b"k", b"hello")]


def test_read_committed_sees_committed_and_not_aborted(stack: Stack, unique: str) -> None:
    topic = f"tx-{unique}"
    _create_topic(stack, topic, 3)
    producer = Producer({**_kafka(stack), "transactional.id": f"txn-{unique}"})
    producer.init_transactions(15)

    producer.begin_transaction()
    producer.produce(topic, key=b"a", value=b"aborted")
    producer.flush(10)
    producer.abort_transaction(15)

    producer.begin_transaction()
    producer.produce(topic, key=b"c", value=b"committed")
    producer.commit_transaction(15)

    got = _consume_all(stack, topic, f"g-{unique}", isolation="read_committed", expect=1)
    assert [m.value() for m in got] == [b"committed"]

    # The aborted record is physically in the log; only isolation hides it.
    raw = _consume_all(stack, topic, f"raw-{unique}", isolation="read_uncommitted", expect=2)
    assert sorted(m.value() or b"" for m in raw) == [b"aborted", b"committed"]


def test_redis_ping_set_get(stack: Stack, unique: str) -> None:
    client = redis_client(stack.admin())
    try:
        assert client.ping() is True
        assert client.set(f"k-{unique}", b"v") is True
        assert client.get(f"k-{unique}") == b"v"
    finally:
        client.close()
