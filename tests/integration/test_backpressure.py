"""Back-pressure on real Kafka: a client never has more than its limit of requests unapplied by
the dispatchers, and one whose requests nobody applies fails clearly instead of queueing forever."""

from __future__ import annotations

import json
import time

import pytest
from confluent_kafka import TopicPartition

from devtools.deployment import Deployment
from ksb.catalog.model import Catalog
from ksb.errors import BackpressureTimeout
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.redis_client import redis_client
from ksb.sdk.client import KsbClient
from tests.integration.conftest import ThreadDispatcher
from tests.integration.support import receive_all

pytestmark = pytest.mark.integration

I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741


def test_without_a_dispatcher_a_client_stops_at_its_limit_then_resumes(
    settings: Deployment, catalog: Catalog
) -> None:
    limited = settings.model_copy(
        update={"max_inflight_requests": 5, "backpressure_timeout_s": 1.0}
    )
    with KsbClient(limited) as client:
        h = client.begin_dialog(I, T, C)
        for n in range(4):
            client.send(h, "//t/Request", json.dumps({"n": n}))
        client.flush()
        started = time.monotonic()
        with pytest.raises(BackpressureTimeout, match="is a dispatcher running"):
            client.send(h, "//t/Request", json.dumps({"n": 4}))
        assert time.monotonic() - started >= 0.9  # it waited its timeout out before failing
        d = ThreadDispatcher(limited)
        try:
            d.wait_owning_every_shard()  # joined and rebuilt: the client's 1 s is for applying
            client.send(h, "//t/Request", json.dumps({"n": 4}))  # waits until the five apply
            client.flush()
            got = receive_all(client, "TargetQueue", 5)
            assert [json.loads(m.message_body)["n"] for m in got] == [0, 1, 2, 3, 4]
        finally:
            d.stop()


def test_a_fast_sender_never_has_more_than_its_limit_unapplied(
    settings: Deployment, dispatcher: ThreadDispatcher
) -> None:
    limit = 20
    limited = settings.model_copy(update={"max_inflight_requests": limit})
    names = Names(settings.instance)
    probe = kafka.consumer(settings, group=names.dispatcher_group, read_committed=False)
    tp = TopicPartition(names.requests_for(settings.sender), 0)
    lags: list[int] = []
    try:
        with KsbClient(limited) as client:
            handles = [client.begin_dialog(I, T, C) for _ in range(3)]
            for n in range(300):
                client.send(handles[n % 3], "//t/Request", json.dumps({"n": n}))
                if n % 10 == 0:
                    _low, high = probe.get_watermark_offsets(tp, timeout=5, cached=False)
                    [committed] = probe.committed([tp], timeout=5)
                    lags.append(high - max(committed.offset, 0))
            assert client.backpressure.waited_ms > 0  # it was held back
            got = receive_all(client, "TargetQueue", 300, timeout_s=60)
            assert len(got) == 300
    finally:
        probe.close()
    assert max(lags) <= limit, lags


def test_a_commit_back_pressure_refuses_lets_its_group_go(
    settings: Deployment, catalog: Catalog
) -> None:
    limited = settings.model_copy(
        update={"max_inflight_requests": 2, "backpressure_timeout_s": 0.5}
    )
    d = ThreadDispatcher(limited)
    with KsbClient(limited) as client:
        h = client.begin_dialog(I, T, C)
        client.send(h, "//t/Request", json.dumps({"n": 0}))
        client.flush()
        tx = client.transaction()
        first = tx.receive("TargetQueue", waitfor_ms=10_000)
        assert len(first) == 1
        d.stop()
        for n in (1, 2):  # nobody applies these: the client is at its limit
            client.send(h, "//t/Request", json.dumps({"n": n}))
        with pytest.raises(BackpressureTimeout):
            tx.commit_async()
        assert client.describe() == "0 commits waiting"
        group = first[0].conversation_group_id
        locks = redis_client(limited)
        try:  # free for the next RECEIVE, not renewed
            holder = locks.hget(Names(limited.instance).lock_key("TargetQueue", group), "holder")
        finally:
            locks.close()
        assert not holder
        d = ThreadDispatcher(limited)
        try:
            d.wait_owning_every_shard()  # joined and rebuilt: the client's 0.5 s is for applying
            got = receive_all(client, "TargetQueue", 3)
            assert [json.loads(m.message_body)["n"] for m in got] == [0, 1, 2]
        finally:
            d.stop()
