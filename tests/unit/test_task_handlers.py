"""Task handlers: failing tasks are survived, dead handlers are restarted on the next tick."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
import redis
from prometheus_client import REGISTRY

from ksb.catalog.model import CatalogView, parse_catalog
from ksb.catalog.queue_status import effective
from ksb.clock import ManualClock
from ksb.runtime.redis_client import redis_client
from ksb.runtime.task_handlers import (
    HandlersStopped,
    TaskHandlers,
    TaskQueueFull,
    default_handler_count,
    handlers_to_restart,
)
from ksb.runtime.ticker import Ticker
from ksb.settings import ActivationSettings
from ksb.wire.queue_status import QueueStatus
from services.activation import ActivationService, poisoning
from services.activation.poisoning import Poisoning


class HandlerKilled(BaseException):
    """Escapes `except Exception`, as SystemExit or a bug in a C extension's callback would."""


@pytest.fixture
def service() -> str:
    """A service label of its own, so the process-wide counters start at 0 for each test."""
    return f"svc-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def pool(service: str) -> Iterator[TaskHandlers]:
    handlers = TaskHandlers(service, 3)
    handlers.start()
    try:
        yield handlers
    finally:
        handlers.stop(2)


def sample(name: str, service: str) -> float:
    return REGISTRY.get_sample_value(name, {"service": service}) or 0.0


def wait_until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_default_is_twice_the_cpus() -> None:
    assert default_handler_count(4) == 8
    assert default_handler_count(None) == 2
    assert default_handler_count(0) == 2


def test_only_dead_slots_are_restarted_and_none_while_stopping() -> None:
    assert handlers_to_restart([True, False, True, False], stopping=False) == [1, 3]
    assert handlers_to_restart([True, True], stopping=False) == []
    assert handlers_to_restart([False, False], stopping=True) == []


def test_size_defaults_to_twice_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert TaskHandlers("x").size == 6
    with pytest.raises(ValueError, match="size"):
        TaskHandlers("x", 0)


def test_tasks_run_on_the_handlers(pool: TaskHandlers) -> None:
    done: list[int] = []
    lock = threading.Lock()

    def task(i: int) -> Callable[[], None]:
        def run() -> None:
            with lock:
                done.append(i)

        return run

    for i in range(20):
        pool.submit(f"t{i}", task(i))
    wait_until(lambda: len(done) == 20)
    assert sorted(done) == list(range(20))
    assert pool.alive == 3


def test_a_failing_task_is_logged_and_its_handler_goes_on(
    pool: TaskHandlers, service: str, caplog: pytest.LogCaptureFixture
) -> None:
    def fail() -> None:
        raise RuntimeError("boom")

    done = threading.Event()
    with caplog.at_level(logging.ERROR, logger="ksb.runtime.task_handlers"):
        for _ in range(5):
            pool.submit("fail", fail)
        pool.submit("after", done.set)
        assert done.wait(5)
    assert pool.alive == 3
    assert sample("ksb_async_task_failures_total", service) == 5
    assert sample("ksb_task_handler_restarts_total", service) == 0
    assert "task 'fail' failed" in caplog.text


def test_a_dead_handler_is_restarted_on_the_next_tick(
    pool: TaskHandlers, service: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock(start_ms=0)
    ticker = Ticker(clock.now_ms(), tick_ms=5000)
    ticker.every(1, "task_handlers", pool.on_tick)

    def die() -> None:
        raise HandlerKilled("escapes the task's except Exception")

    with caplog.at_level(logging.WARNING, logger="ksb.runtime.task_handlers"):
        pool.submit("die", die)
        wait_until(lambda: pool.alive == 2)
        clock.advance(4.999)
        assert ticker.poll(clock.now_ms()) == []  # no tick yet: still one handler short
        assert pool.alive == 2
        clock.advance(0.001)
        assert ticker.poll(clock.now_ms()) == ["task_handlers"]
    assert pool.alive == 3
    assert sample("ksb_task_handler_restarts_total", service) == 1
    assert sample("ksb_task_handlers", service) == 3
    assert "died (HandlerKilled" in caplog.text
    assert "was not running on tick 1; restarting it" in caplog.text
    # The restarted handler takes work like the others.
    done = threading.Event()
    pool.submit("after", done.set)
    assert done.wait(5)
    clock.advance(5)
    ticker.poll(clock.now_ms())
    assert sample("ksb_task_handler_restarts_total", service) == 1


def test_a_handler_that_did_not_start_is_started_on_the_next_check(
    monkeypatch: pytest.MonkeyPatch, service: str
) -> None:
    real_start = threading.Thread.start
    failures = [f"ksb-{service}-task-0"]

    def flaky_start(thread: threading.Thread) -> None:
        if thread.name in failures:  # only this pool's first handler, only once
            failures.remove(thread.name)
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", flaky_start)
    handlers = TaskHandlers(service, 2)
    try:
        handlers.start()
        assert handlers.alive == 1
        assert handlers.check(1) == [0]
        assert handlers.alive == 2
        assert sample("ksb_task_handler_restarts_total", service) == 1
    finally:
        handlers.stop(2)


def test_stop_drains_what_is_queued_then_refuses_more(service: str) -> None:
    handlers = TaskHandlers(service, 1)
    handlers.start()
    gate = threading.Event()
    done: list[int] = []

    def block() -> None:
        gate.wait(5)

    def record(i: int) -> Callable[[], None]:
        return lambda: done.append(i)

    handlers.submit("block", block)
    for i in range(3):
        handlers.submit(f"t{i}", record(i))
    gate.set()
    assert handlers.stop(5) == 0
    assert done == [0, 1, 2]
    assert handlers.alive == 0
    assert handlers.check(9) == []  # stopped handlers stay stopped
    with pytest.raises(HandlersStopped):
        handlers.submit("late", lambda: None)


def test_a_full_queue_refuses_instead_of_blocking_the_caller(service: str) -> None:
    handlers = TaskHandlers(service, 1, max_pending=2)
    handlers.start()
    gate = threading.Event()
    started = threading.Event()

    def block() -> Any:
        started.set()
        gate.wait(5)

    try:
        handlers.submit("block", block)
        assert started.wait(5)
        handlers.submit("a", lambda: None)
        handlers.submit("b", lambda: None)
        with pytest.raises(TaskQueueFull):
            handlers.submit("c", lambda: None)
    finally:
        gate.set()
        handlers.stop(5)


def test_the_activation_service_restarts_a_dead_handler_on_its_next_tick() -> None:
    """The wiring, not the pool: the service's own ticker checks its handlers on every tick."""
    clock = ManualClock(start_ms=0)
    settings = ActivationSettings(
        instance="unit", tick_ms=5000, redis_url="redis://127.0.0.1:1/0", task_handlers=2
    )
    # Building the service touches neither Kafka nor Redis (the client connects on first use).
    act = ActivationService(settings, clock=clock, redis_client=redis_client(settings))
    act.shell.start_ticker()  # what the shell does once the service is open
    act.handlers.start()
    try:
        restarts = sample("ksb_task_handler_restarts_total", "activation")

        def die() -> None:
            raise HandlerKilled("escapes the task's except Exception")

        act.handlers.submit("die", die)
        wait_until(lambda: act.handlers.alive == 1)
        clock.advance(4.999)
        assert act.ticker.poll(clock.now_ms()) == []
        assert act.handlers.alive == 1
        clock.advance(0.001)
        assert act.ticker.poll(clock.now_ms()) == ["task_handlers", "queue_monitors"]
        assert act.handlers.alive == 2
        assert sample("ksb_task_handler_restarts_total", "activation") == restarts + 1
    finally:
        act.handlers.stop(2)


def test_a_redis_failure_in_a_queue_check_does_not_end_the_activation_service(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by the chaos harness: every Redis kill ended the activation service."""
    settings = ActivationSettings(
        instance="unit", redis_url="redis://127.0.0.1:1/0", activation_check_ms=10
    )
    act = ActivationService(
        settings, clock=ManualClock(start_ms=0), redis_client=redis_client(settings)
    )
    checked: list[str] = []

    def check(w: Any, _tick: bool) -> bool:
        checked.append(w.queue.name)
        if w.queue.name == "Q1":
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
        return False

    watches = {n: SimpleNamespace(queue=SimpleNamespace(name=n)) for n in ("Q1", "Q2")}
    monkeypatch.setattr(act, "watches", watches)
    monkeypatch.setattr(act, "_check", check)
    act.step()
    act.step()
    assert checked == ["Q1", "Q2", "Q1", "Q2"]
    assert "queue Q1 not checked this time" in caplog.text


class _Pipeline:
    """A Redis pipeline that fails while `failing` holds, and records what it ran (whether it
    was a MULTI first)."""

    def __init__(self, owner: _MirrorRedis, transaction: bool) -> None:
        self._owner = owner
        self._calls: list[tuple[Any, ...]] = [("multi",)] if transaction else []

    def delete(self, *keys: str) -> None:
        self._calls.append(("delete", *keys))

    def set(self, key: str, value: int) -> None:
        self._calls.append(("set", key, value))

    def hset(self, key: str, mapping: dict[str, int]) -> None:
        self._calls.append(("hset", key, dict(mapping)))

    def execute(self) -> None:
        if self._owner.failing:
            raise redis.TimeoutError("Timeout reading from socket")
        self._owner.ran.append(self._calls)


def _activation(settings: ActivationSettings, fake: _MirrorRedis) -> ActivationService:
    """An activation service over `fake` Redis, made as `open` makes it (no Kafka, no queue
    service: nothing it is given here calls them)."""
    act = ActivationService(settings, clock=ManualClock(start_ms=0), redis_client=cast(Any, fake))
    act._redis = cast(Any, fake)
    producer = cast(Any, SimpleNamespace(produce=lambda *a, **k: None, flush=lambda t: 0))
    act._producer = producer
    act._poisoning = Poisoning(
        settings, cast(Any, fake), producer, act.handlers, clock=act.clock, audit=act._audit
    )
    return act


class _MirrorRedis:
    def __init__(self) -> None:
        self.failing = True
        self.ran: list[list[tuple[Any, ...]]] = []

    def pipeline(self, transaction: bool = True) -> _Pipeline:
        return _Pipeline(self, transaction)


def test_a_redis_failure_mirroring_the_catalog_is_mended_on_the_next_monitor_tick(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by the chaos harness: a Redis stall during a catalog change ended the service, and a
    Redis restarted empty kept no dead-letter policy until the next catalog."""
    settings = ActivationSettings(instance="unit", activation_check_ms=10)
    fake = _MirrorRedis()
    act = _activation(settings, fake)
    view = CatalogView(
        parse_catalog(
            {
                "queues": [
                    {"name": "Off", "status": "OFF"},
                    {"name": "Poisoned", "dead_letter": {"max_rollbacks": 3}},
                ]
            }
        )
    )
    act._catalog = view
    act._mirror(view)  # Redis stalled: logged, not raised
    assert fake.ran == []
    assert "not mirrored into Redis this time" in caplog.text
    fake.failing = False
    act.step()  # no monitor tick yet: nothing written
    assert fake.ran == []
    act._note_monitor_tick(1)
    act.step()
    names = act.names
    assert fake.ran == [
        [
            ("multi",),
            ("delete", names.dead_letter_policy_key),
            ("hset", names.dead_letter_policy_key, {"Poisoned": 3}),
        ],
        [
            ("set", names.disabled_key("Off"), 1),
            ("delete", names.disabled_key("Poisoned")),
        ],
    ]


def test_a_poisoned_queue_stays_in_the_mirror_until_its_status_record_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The mirror written on every tick must not let a poisoned queue be received from between
    its status record's write and this service reading it back. The record is the queue's own,
    not a catalog version: the activation service may not write the catalog."""
    settings = ActivationSettings(instance="unit", activation_check_ms=10)
    fake = _MirrorRedis()
    fake.failing = False
    act = _activation(settings, fake)
    on = parse_catalog({"version": 4, "queues": [{"name": "Q"}]})
    written: list[QueueStatus] = []
    monkeypatch.setattr(poisoning, "write_queue_status", lambda _s, status: written.append(status))
    act._catalog = CatalogView(on)
    act.poisoning._disabling["Q"] = False  # as `poisoned` marks it
    act.poisoning._disable("Q", "5 rollbacks in a row")
    [status] = written
    assert status.disabled and status.queue == "Q" and "5 rollbacks in a row" in status.reason

    def disabled_now() -> list[str]:
        """The queues the next tick's mirror writes as disabled."""
        fake.ran.clear()
        act._note_monitor_tick(1)
        act.step()
        return [c[1] for c in fake.ran[-1] if c[0] == "set"]

    flag = act.names.disabled_key("Q")
    assert disabled_now() == [flag]  # written, not yet read back: still disabled
    held = {"Q": status.reason}
    act.on_catalog(CatalogView(effective(on, held), held))
    assert act.poisoning.disabling() == set()
    assert disabled_now() == [flag]  # the status record says OFF
    act.on_catalog(CatalogView(on))  # enabled again: ALTER QUEUE ... WITH STATUS = ON
    assert disabled_now() == []
