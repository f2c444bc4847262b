"""Queue monitors on the real stack: internal activation, external events, poison handling."""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY
from typer.testing import CliRunner

from devtools.deployment import Deployment, owner_of
from ksb.catalog.model import parse_catalog
from ksb.cli import app
from ksb.errors import QueueDisabled
from ksb.names import Names
from ksb.runtime.catalog_store import apply_catalog, load_catalog, load_view
from ksb.runtime.redis_client import redis_client
from ksb.sdk.client import KsbClient
from ksb.security.principals import Role
from ksb.settings import CliSettings, settings_env
from services.activation import ActivationService
from tests.integration.conftest import BASIC_CATALOG, ThreadDispatcher
from tests.integration.support import read_topic, receive_all

pytestmark = pytest.mark.integration

I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741


def with_target_queue(**changes: Any) -> dict[str, Any]:
    cat = copy.deepcopy(BASIC_CATALOG)
    for q in cat["queues"]:
        if q["name"] == "TargetQueue":
            q.update(changes)
    return cat


class ThreadActivation:
    def __init__(self, settings: Deployment) -> None:
        self.service = ActivationService(settings.as_service(Role.ACTIVATION))
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.service.run, args=(self.stop_event,))
        self.thread.start()
        if not self.service.ready.wait(60):
            raise TimeoutError("activation service not ready")

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(30)


@pytest.fixture
def fast_settings(settings: Deployment) -> Deployment:
    return settings.model_copy(
        update={"tick_ms": 500, "activated_idle_ms": 800, "activation_empty_grace_ms": 1000}
    )


def start(
    settings: Deployment, catalog: dict[str, Any]
) -> tuple[ThreadDispatcher, ThreadActivation]:
    apply_catalog(settings, parse_catalog(catalog))
    return ThreadDispatcher(settings), ThreadActivation(settings)


@pytest.fixture
def stop_all() -> Iterator[list[Any]]:
    running: list[Any] = []
    yield running
    for r in reversed(running):
        r.stop()


def monitor_view(settings: Deployment, queue: str) -> dict[str, Any]:
    raw = redis_client(settings).hget(Names(settings.instance).monitors_key, queue)
    return json.loads(raw) if raw else {}


def test_internal_activation_starts_readers_that_reply_and_retire(
    fast_settings: Deployment, stop_all: list[Any]
) -> None:
    cat = with_target_queue(
        activation={
            "status": "ON",
            "procedure": "tests.integration.activation_procs:reply",
            "max_queue_readers": 2,
            "execute_as": owner_of(fast_settings.instance),
        }
    )
    stop_all.extend(start(fast_settings, cat))
    with KsbClient(fast_settings) as client:
        handles = [client.begin_dialog(I, T, C) for _ in range(10)]
        for h in handles:
            for i in range(3):
                client.send(h, "//t/Request", json.dumps({"i": i}))
        client.flush()
        replies = receive_all(client, "InitiatorQueue", 30, timeout_s=60)
    assert len(replies) == 30
    per_conv: dict[str, list[int]] = {}
    for m in replies:
        per_conv.setdefault(m.conversation_id, []).append(json.loads(m.message_body)["i"])
    assert all(v == [0, 1, 2] for v in per_conv.values()) and len(per_conv) == 10
    deadline = time.monotonic() + 20
    view = monitor_view(fast_settings, "TargetQueue")
    while time.monotonic() < deadline and view.get("running_tasks", 1) != 0:
        time.sleep(0.2)
        view = monitor_view(fast_settings, "TargetQueue")
    assert view["running_tasks"] == 0, view  # readers retire when the queue stays empty
    assert 1 <= view["activations"] <= 2 + 2


def test_backlog_on_one_conversation_does_not_start_a_third_reader(
    fast_settings: Deployment, stop_all: list[Any]
) -> None:
    cat = with_target_queue(
        activation={
            "status": "ON",
            "procedure": "tests.integration.activation_procs:slow_reply",
            "max_queue_readers": 5,
            "execute_as": owner_of(fast_settings.instance),
        }
    )
    stop_all.extend(start(fast_settings, cat))
    with KsbClient(fast_settings) as client:
        h = client.begin_dialog(I, T, C)
        stop_sending = time.monotonic() + 6
        i = 0
        while time.monotonic() < stop_sending:  # a steady backlog on ONE conversation
            client.send(h, "//t/Request", json.dumps({"i": i}))
            i += 1
            time.sleep(0.05)
        client.flush()
        replies = receive_all(client, "InitiatorQueue", i, timeout_s=60)
    assert [json.loads(m.message_body)["i"] for m in replies] == list(range(i))
    view = monitor_view(fast_settings, "TargetQueue")
    assert view["activations"] <= 2, view  # one reader works, one may wait; never a third


def test_external_activation_publishes_one_event_until_a_receive(
    fast_settings: Deployment, stop_all: list[Any]
) -> None:
    cat = copy.deepcopy(BASIC_CATALOG)
    cat["event_notifications"] = [{"name": "ext", "queue": "TargetQueue", "timeout_s": 60}]
    stop_all.extend(start(fast_settings, cat))
    names = Names(fast_settings.instance)
    with KsbClient(fast_settings) as client:
        for _ in range(5):
            client.send(client.begin_dialog(I, T, C), "//t/Request", "{}")
        client.flush()
        time.sleep(3)
        events = [json.loads(v) for _k, v in read_topic(fast_settings, names.activation) if v]
        assert [e["kind"] for e in events] == ["QUEUE_ACTIVATION"]
        assert events[0]["queue"] == "TargetQueue"
        assert len(receive_all(client, "TargetQueue", 1, timeout_s=10, top=1)) == 1
        time.sleep(2)  # the RECEIVE re-arms notifications: messages are still waiting
        events = [json.loads(v) for _k, v in read_topic(fast_settings, names.activation) if v]
        assert len(events) == 2


def test_five_rollbacks_in_a_row_disable_the_queue_and_lose_nothing(
    fast_settings: Deployment, stop_all: list[Any]
) -> None:
    cat = copy.deepcopy(BASIC_CATALOG)
    cat["event_notifications"] = [{"name": "ext", "queue": "TargetQueue", "timeout_s": 600}]
    stop_all.extend(start(fast_settings, cat))
    names = Names(fast_settings.instance)
    version = load_catalog(fast_settings).version
    with KsbClient(fast_settings) as client:
        client.send(client.begin_dialog(I, T, C), "//t/Request", json.dumps({"poison": True}))
        client.flush()
        for _ in range(5):
            tx = client.transaction()
            assert tx.receive("TargetQueue", waitfor_ms=5000)
            tx.rollback()
        r = redis_client(fast_settings)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not r.exists(names.disabled_key("TargetQueue")):
            time.sleep(0.1)
        with pytest.raises(QueueDisabled):
            client.transaction().receive("TargetQueue", waitfor_ms=100)
        # The status record and the event follow on a task handler, after RECEIVE stops;
        # re-enabling before the event could be overtaken by that record.
        kinds: list[str] = []
        while time.monotonic() < deadline and "BROKER_QUEUE_DISABLED" not in kinds:
            time.sleep(0.1)
            kinds = [
                json.loads(v)["kind"] for _k, v in read_topic(fast_settings, names.activation) if v
            ]
        assert "BROKER_QUEUE_DISABLED" in kinds
        # Disabled by its own record, not by a catalog version: the activation service may not
        # write the catalog (issue 38).
        assert load_catalog(fast_settings).version == version
        view = load_view(fast_settings)
        assert view.queues["TargetQueue"].status == "OFF"
        assert "5 rollbacks in a row" in view.held_off["TargetQueue"]
        # Re-enable as SQL Server does (ALTER QUEUE ... STATUS = ON): the message is still there.
        env = settings_env(fast_settings.narrow(CliSettings))
        enabled = CliRunner().invoke(
            app, ["sql", "ALTER QUEUE TargetQueue WITH STATUS = ON"], env=env
        )
        assert enabled.exit_code == 0 and "TargetQueue enabled again" in enabled.output
        while time.monotonic() < deadline + 15 and r.exists(names.disabled_key("TargetQueue")):
            time.sleep(0.1)
        got = receive_all(client, "TargetQueue", 1, timeout_s=15)
        assert json.loads(got[0].message_body) == {"poison": True}


def test_dead_letter_policy_moves_one_bad_message_and_keeps_the_queue_running(
    fast_settings: Deployment, stop_all: list[Any]
) -> None:
    cat = with_target_queue(dead_letter={"max_rollbacks": 3, "error_code": 500})
    stop_all.extend(start(fast_settings, cat))
    names = Names(fast_settings.instance)
    with KsbClient(fast_settings) as client:
        bad = client.begin_dialog(I, T, C)
        good = client.begin_dialog(I, T, C)
        client.send(bad, "//t/Request", json.dumps({"bad": True}))
        client.flush()
        for _ in range(3):
            tx = client.transaction()
            assert tx.receive("TargetQueue", waitfor_ms=5000)
            tx.rollback()
        client.send(good, "//t/Request", json.dumps({"bad": False}))
        client.flush()
        # The good message is delivered; the bad one is moved aside, not redelivered.
        got = receive_all(client, "TargetQueue", 1, timeout_s=15)
        deadline = time.monotonic() + 15
        dead: list[dict[str, Any]] = []
        while time.monotonic() < deadline and not dead:
            dead = [
                json.loads(v)
                for _k, v in read_topic(fast_settings, names.dead_letters("TargetQueue"))
                if v
            ]
            time.sleep(0.2)
        assert [json.loads(m.message_body) for m in got] == [{"bad": False}]
        assert len(dead) == 1 and json.loads(dead[0]["message"]["body"]) == {"bad": True}
        assert "rolled back" in dead[0]["reason"]
        # Its conversation was ended WITH ERROR: the initiator gets the Error.
        [err] = receive_all(client, "InitiatorQueue", 1, timeout_s=15)
        assert json.loads(err.message_body)["code"] == 500
        # `ksb dlq list` shows it and `ksb dlq replay` puts it back, ready to RECEIVE.
        env = settings_env(fast_settings.narrow(CliSettings))
        runner = CliRunner()
        listed = runner.invoke(app, ["dlq", "list", "TargetQueue", "--json"], env=env)
        assert listed.exit_code == 0, listed.output
        assert (
            json.loads(listed.output)[0]["message"]["message_id"]
            == dead[0]["message"]["message_id"]
        )
        replayed = runner.invoke(app, ["dlq", "replay", "TargetQueue"], env=env)
        assert replayed.exit_code == 0 and "replayed 1" in replayed.output
        [again] = receive_all(client, "TargetQueue", 1, timeout_s=15)
        assert json.loads(again.message_body) == {"bad": True}
        # Dead letters are the queue service's: a queue without activation has no monitor.
        monitors = runner.invoke(app, ["monitors", "--json"], env=env)
        assert json.loads(monitors.output) == []


class HandlerKilled(BaseException):
    """Escapes a task's `except Exception`: its handler thread dies, as after a bug in a callback."""


def test_a_dead_task_handler_is_restarted_by_the_running_service_on_its_next_tick(
    fast_settings: Deployment, stop_all: list[Any]
) -> None:
    act = ThreadActivation(fast_settings)  # no catalog: no monitors, only the loop and its ticks
    stop_all.append(act)
    handlers = act.service.handlers
    assert handlers.alive == handlers.size >= 2

    def restarts() -> float:
        return (
            REGISTRY.get_sample_value("ksb_task_handler_restarts_total", {"service": "activation"})
            or 0.0
        )

    before = restarts()

    def die() -> None:
        raise HandlerKilled("escapes the task's except Exception")

    handlers.submit("die", die)
    deadline = time.monotonic() + 5
    while handlers.alive == handlers.size and restarts() == before:
        assert time.monotonic() < deadline, "the handler did not die"
        time.sleep(0.005)
    died_tick = act.service.ticker.tick
    # The loop's next tick restarts it: within one tick, plus slack for a busy machine.
    deadline = time.monotonic() + fast_settings.tick_ms / 1000 + 1
    while handlers.alive < handlers.size:
        assert time.monotonic() < deadline, "the dead handler was not restarted"
        time.sleep(0.01)
    assert restarts() == before + 1
    assert act.service.ticker.tick <= died_tick + 2
    done = threading.Event()  # the restarted pool takes work again
    handlers.submit("after", done.set)
    assert done.wait(5)
