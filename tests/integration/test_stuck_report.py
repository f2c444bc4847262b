"""The stuck-run report (`bench.stuck`): it names a partition an open transaction holds back,
which a ``read_committed`` reader cannot see past, until the transaction commits; a partition the
dispatchers' group has not consumed to its end; and the dialogs short of their messages beside
what their reader holds."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import TopicPartition

from bench.stuck import held_back, stuck_report, unconsumed
from ksb.names import Names
from ksb.runtime import kafka
from ksb.sdk.client import KsbClient
from tests.conftest import Stack
from tests.integration.conftest import ThreadDispatcher
from tests.integration.support import wait_for

pytestmark = pytest.mark.integration


def test_an_open_transaction_is_reported_until_it_commits(stack: Stack) -> None:
    admin = stack.admin()
    unique = uuid.uuid4().hex[:8]
    topic, quiet = f"stuck-{unique}", f"stuck-quiet-{unique}"
    kafka.ensure_topics(kafka.admin(admin), [kafka.TopicSpec(topic, 2), kafka.TopicSpec(quiet, 1)])
    producer = kafka.producer(admin, transactional_id=f"stuck-{unique}")
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"open", partition=1)
    producer.flush(10)
    assert held_back(admin, [topic, quiet]) == f"{topic}[1] 0/1"
    producer.commit_transaction(30)
    assert held_back(admin, [topic, quiet]) == "none"

    applier = kafka.consumer(admin, group=Names(admin.instance).dispatcher_group)
    applier.commit(offsets=[TopicPartition(topic, 1, 0)], asynchronous=False)
    assert unconsumed(admin, [topic, quiet]) == f"{topic}[1] 0/2"  # record and marker
    applier.commit(offsets=[TopicPartition(topic, 1, 2)], asynchronous=False)
    applier.close()
    assert unconsumed(admin, [topic, quiet]) == "none"


def test_the_report_names_a_dialog_short_and_what_its_reader_holds(
    client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    handle = client.begin_dialog("//t/Initiator", "//t/Target", "//t/Contract")
    client.send(handle, "//t/Request", "{}")
    client.flush()
    wait_for(
        "the message indexed",
        lambda: client.queue_state("TargetQueue").ready_messages == 1,
        20,
    )
    report = stuck_report(client, "TargetQueue", {0: (0, handle)})
    assert report.startswith(f"1 dialogs short: 0 at 0 ({handle}); reader: 0 commits waiting")
    assert "0 groups held, 1 messages ready" in report
    assert "held back by an open transaction: none; " in report
    assert report.endswith("not consumed by the dispatchers: none")
