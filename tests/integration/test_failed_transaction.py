"""A dispatcher transaction that fails is redone from Kafka, and nothing it had read is skipped.

On a real broker: the dispatcher's first transaction with requests in it fails at its commit (a
time-out, as a stalled broker gives). The dispatcher aborts it, rebuilds its shards and goes back
to the committed offsets. The requests topic's partition had none committed yet (those requests
were the first ever written to it), so it must go back to the partition's beginning; before
`services.dispatcher.rebalance.rewind_to` the consumer stayed where the failed batch had left it
and the BEGIN and SEND in that batch were gone for good.
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from ksb.sdk.client import KsbClient
from tests.integration.conftest import ThreadDispatcher
from tests.integration.support import receive_all

pytestmark = pytest.mark.integration

I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741


def test_a_failed_first_transaction_is_redone_from_the_partitions_beginning(
    client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    dispatcher.wait_owning_every_shard()
    d = dispatcher.dispatcher
    assert d.pipeline is not None
    pipeline = d.pipeline
    producer = pipeline.producer
    failed: list[int] = []
    commit = producer.commit_transaction

    def fail_first_with_requests(*args: Any) -> None:
        if not failed and pipeline.batch > 0:
            failed.append(pipeline.batch)
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "injected commit time-out"))
        commit(*args)

    producer.commit_transaction = fail_first_with_requests  # type: ignore[method-assign, assignment]
    handle = client.begin_dialog(I, T, C)
    client.send(handle, "//t/Request", '{"first": true}')
    client.flush()
    got = receive_all(client, "TargetQueue", 1)
    assert failed, "no transaction with requests in it was failed"
    assert [m.message_body for m in got] == [b'{"first": true}']


def test_an_abort_that_does_not_end_in_time_starts_the_dispatcher_over(
    client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    """The abort after a failed commit times out (as one left running after a broker stall never
    ended): the dispatcher gives up on that producer and starts over with a new one, whose
    init_transactions has the coordinator abort what the old one left open; the requests are
    applied once, by the new one."""
    dispatcher.wait_owning_every_shard()
    d = dispatcher.dispatcher
    assert d.pipeline is not None
    pipeline = d.pipeline
    stuck = pipeline.producer
    hung: list[str] = []

    def fail_with_requests(*_args: Any) -> None:
        if pipeline.batch > 0:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "injected commit time-out"))

    def hang(*_args: Any) -> None:
        hung.append("abort")
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "injected: retry call to resume"))

    stuck.commit_transaction = fail_with_requests  # type: ignore[method-assign, assignment]
    stuck.abort_transaction = hang  # type: ignore[method-assign, assignment]
    handle = client.begin_dialog(I, T, C)
    client.send(handle, "//t/Request", '{"once": true}')
    client.flush()
    got = receive_all(client, "TargetQueue", 2, timeout_s=30)
    assert hung, "the dispatcher never tried to abort"
    assert [m.message_body for m in got] == [b'{"once": true}']
    assert d.pipeline is not None and d.pipeline.producer is not stuck
