"""A dispatcher started before its broker can start stays up, says why, and starts on a later tick.

The real case: docker-compose starts the dispatcher before anyone applied the catalog, or a catalog
record names queue topics that were never created, or Kafka is not answering yet. Ticks are 100 ms
here, so "every 5th tick" is half a second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import KafkaError, KafkaException
from prometheus_client import REGISTRY

from devtools.deployment import Deployment
from ksb.catalog.model import parse_catalog
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.catalog_store import apply_catalog
from ksb.sdk.client import KsbClient
from ksb.security.principals import Role
from ksb.settings import DispatcherSettings
from ksb.wire.protocol import BrokerNotification, parse_bcn
from services.dispatcher import Dispatcher
from services.dispatcher.notifications import kafka_answers
from services.dispatcher.pipeline import Pipeline
from tests.healthz import get, serving_healthz
from tests.integration.conftest import BASIC_CATALOG
from tests.integration.support import read_topic, receive_all

pytestmark = pytest.mark.integration

I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741
TICK_MS = 100


class StartingDispatcher:
    """A dispatcher thread that, unlike the `dispatcher` fixture, does not wait to be ready."""

    def __init__(self, settings: Deployment, dispatcher: Dispatcher | None = None) -> None:
        self.dispatcher = dispatcher or Dispatcher(
            settings.as_service(Role.DISPATCHER).narrow(DispatcherSettings, task_handlers=2)
        )
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.dispatcher.run, args=(self.stop_event,))
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "dispatcher did not stop"


@pytest.fixture
def fast(settings: Deployment) -> Deployment:
    return settings.model_copy(update={"tick_ms": TICK_MS})


@pytest.fixture
def starting(fast: Deployment) -> Iterator[StartingDispatcher]:
    d = StartingDispatcher(fast)
    try:
        yield d
    finally:
        d.stop()


def bcns(settings: Deployment) -> list[BrokerNotification]:
    return [parse_bcn(v) for _k, v in read_topic(settings, Names(settings.instance).bcn)]


def wait_bcn(
    settings: Deployment, match: Callable[[BrokerNotification], bool], *, timeout_s: float = 30
) -> BrokerNotification:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [b for b in bcns(settings) if match(b)]
        if found:
            return found[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"no matching BCN in {timeout_s}s; the topic has {bcns(settings)}")
        time.sleep(0.05)


@pytest.fixture
def healthz() -> Iterator[str]:
    """/healthz as `python -m services.dispatcher` serves it, judging the dispatcher only."""
    with serving_healthz("dispatcher") as url:
        yield url


def service_up() -> float | None:
    return REGISTRY.get_sample_value("ksb_service_up", {"service": "dispatcher"})


def deliver_one(settings: Deployment) -> None:
    with KsbClient(settings) as client:
        h = client.begin_dialog(I, T, C)
        client.send(h, "//t/Request", '{"n": 1}')
        client.flush()
        [got] = receive_all(client, "TargetQueue", 1)
    assert got.conversation_id == h and got.message_body == b'{"n": 1}'


def test_started_before_its_catalog_it_starts_within_ticks_of_the_apply(
    fast: Deployment, starting: StartingDispatcher, healthz: str
) -> None:
    d = starting.dispatcher
    failed = wait_bcn(fast, lambda b: b.event == "start_failed")
    assert failed.code == "no_catalog"
    assert failed.reason is not None and f"instance {fast.instance}" in failed.reason
    assert (failed.instance, failed.catalog_version, failed.attempt) == (fast.instance, 0, 1)
    assert starting.thread.is_alive() and not d.ready.is_set()
    assert service_up() == 0
    assert d.broker.status()["code"] == "no_catalog"
    code, body = get(healthz)
    assert code == 503 and body["status"] == "unhealthy", body
    reason = body["problems"]["dispatcher"]
    assert f"instance {fast.instance} not started (no_catalog, attempt" in reason
    assert "ksb catalog apply" in reason

    before = d.ticker.tick
    applied = apply_catalog(fast, parse_catalog(BASIC_CATALOG))
    after = d.ticker.tick
    assert d.ready.wait(30), d.broker.status()
    assert d.broker.started_tick is not None
    assert before <= d.broker.started_tick <= after + 5  # a new catalog: the next tick retries
    started = wait_bcn(fast, lambda b: b.event == "started")
    assert (started.catalog_version, started.code, started.reason) == (applied.version, None, None)
    assert started.attempt == d.broker.attempts
    assert service_up() == 1
    assert get(healthz) == (200, {"status": "ok"})

    deliver_one(fast)

    newer = apply_catalog(fast, parse_catalog(BASIC_CATALOG))
    changed = wait_bcn(fast, lambda b: b.event == "catalog_changed")
    assert changed.catalog_version == newer.version == applied.version + 1
    events = [b.event for b in bcns(fast)]
    assert events[-2:] == ["started", "catalog_changed"]
    assert set(events[:-2]) == {"start_failed"}


def test_missing_queue_topics_are_retried_every_fifth_tick(fast: Deployment) -> None:
    names = Names(fast.instance)
    admin = kafka.admin(fast)
    kafka.ensure_topics(admin, kafka.core_topics(names, fast))
    # A catalog record written as any producer (kcat) could, without creating the queue topics.
    catalog = parse_catalog(BASIC_CATALOG).model_copy(
        update={"version": 1, "applied_ms": int(time.time() * 1000)}
    )
    p = kafka.producer(fast)
    p.produce(names.catalog, key=b"catalog", value=catalog.model_dump_json(by_alias=True).encode())
    assert p.flush(30) == 0

    starting = StartingDispatcher(fast)
    try:
        d = starting.dispatcher
        failed = wait_bcn(fast, lambda b: b.event == "start_failed")
        assert failed.code == "missing_topics" and failed.catalog_version == 0
        assert failed.reason is not None and names.queue("TargetQueue") in failed.reason
        assert names.dead_letters("InitiatorQueue") in failed.reason
        wait_bcn(fast, lambda b: b.attempt >= 2)  # retried without any change...
        assert d.broker.last_attempt_tick is not None and d.broker.last_attempt_tick % 5 == 0

        queues = catalog.queues
        kafka.ensure_topics(admin, [kafka.queue_topic(names, q) for q in queues])
        kafka.ensure_topics(admin, [kafka.dead_letter_topic(names, q) for q in queues])
        assert d.ready.wait(30), d.broker.status()
        assert d.broker.started_tick is not None and d.broker.started_tick % 5 == 0
        started = wait_bcn(fast, lambda b: b.event == "started")
        assert started.catalog_version == 1
        deliver_one(fast)
    finally:
        starting.stop()


def test_a_start_kafka_failed_is_retried_on_the_tick_after_kafka_answers(fast: Deployment) -> None:
    """The 5th-tick retry is pushed out of reach (1000 ticks): only the Kafka probe can start it."""
    apply_catalog(fast, parse_catalog(BASIC_CATALOG))
    probes: list[bool] = []

    def probe() -> bool:
        # Silent for the first two probes, then the real question to the real Kafka.
        probes.append(len(probes) >= 2 and kafka_answers(fast))
        return probes[-1]

    d = Dispatcher(
        fast.as_service(Role.DISPATCHER).narrow(
            DispatcherSettings, task_handlers=2, broker_retry_every=1000
        ),
        kafka_probe=probe,
    )
    real_start = d.startup.start
    calls: list[int] = []

    def start() -> Pipeline:
        calls.append(1)
        if len(calls) == 1:  # Kafka does not answer the first attempt
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "all brokers down (simulated)"))
        return real_start()

    d.startup.start = start  # type: ignore[method-assign]
    starting = StartingDispatcher(fast, d)
    try:
        failed = wait_bcn(fast, lambda b: b.event == "start_failed")
        assert failed.code == "kafka_unavailable" and failed.attempt == 1
        assert d.ready.wait(15), d.broker.status()
        # Ticks 1 and 2 probe silence, tick 3 an answer, so tick 4 retries (a busy machine may
        # push the answer past a tick or two).
        assert probes[:3] == [False, False, True]
        assert d.broker.attempts == 2
        assert d.broker.started_tick is not None and 4 <= d.broker.started_tick <= 8
        assert wait_bcn(fast, lambda b: b.event == "started").attempt == 2
        deliver_one(fast)
    finally:
        starting.stop()
