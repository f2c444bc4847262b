"""/healthz: 503 with the reason while a component reports itself unhealthy, 200 otherwise."""

from __future__ import annotations

import threading
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from ksb.runtime.metrics import (
    HEALTHY,
    NOT_UP,
    health_problems,
    metrics_server,
    process_health,
    register_health_check,
    unregister_health_check,
)
from tests.healthz import get, serving_healthz


@pytest.fixture
def component() -> Iterator[str]:
    """A component of its own: the gauge and the checks are process-wide."""
    name = f"svc-{uuid.uuid4().hex[:8]}"
    yield name
    if any(s.labels["service"] == name for f in HEALTHY.collect() for s in f.samples):
        HEALTHY.remove(name)


@pytest.fixture
def healthz(component: str) -> Iterator[str]:
    """The URL of /healthz on a server that only judges `component`."""
    with serving_healthz(component) as url:
        yield url


def test_the_gauge_at_zero_or_a_check_with_a_reason_is_a_problem() -> None:
    assert health_problems({}, {}) == {}
    assert health_problems({"a": 1.0, "b": 1.0}, {"a": None}) == {}
    assert health_problems({"a": 0.0, "b": 1.0}, {}) == {"a": NOT_UP}
    # The check's reason wins over the gauge's, because it says why.
    assert health_problems({"a": 0.0}, {"a": "broker not started"}) == {"a": "broker not started"}
    # Up, but its own check objects; a check with no gauge sample yet counts too.
    assert health_problems({"a": 1.0}, {"a": "stuck", "b": "no catalog"}) == {
        "a": "stuck",
        "b": "no catalog",
    }
    assert health_problems({"a": 0.0}, {"a": ""}) == {"a": NOT_UP}


def test_process_health_reads_the_gauge_and_the_checks_of_the_named_components(
    component: str,
) -> None:
    assert process_health([component]) == {}  # nothing said yet: healthy
    HEALTHY.labels(component).set(0)
    assert process_health([component]) == {component: NOT_UP}
    assert component in process_health()  # None: every component of the process
    HEALTHY.labels(component).set(1)

    def check() -> str | None:
        return "no catalog applied"

    register_health_check(component, check)
    try:
        assert process_health([component]) == {component: "no catalog applied"}
        assert process_health(["someone-else"]) == {}
    finally:
        unregister_health_check(component, check)
    assert process_health([component]) == {}


def test_a_check_that_raises_is_a_problem_not_a_pass(component: str) -> None:
    def broken() -> str | None:
        raise RuntimeError("lost its state")

    register_health_check(component, broken)
    try:
        assert process_health([component]) == {
            component: "health check raised RuntimeError: lost its state"
        }
    finally:
        unregister_health_check(component, broken)


def test_unregistering_leaves_a_newer_check_in_place(component: str) -> None:
    def old() -> str | None:
        return "old instance"

    def new() -> str | None:
        return "new instance"

    register_health_check(component, old)
    register_health_check(component, new)
    unregister_health_check(component, old)  # the old instance stopping after the new one started
    try:
        assert process_health([component]) == {component: "new instance"}
    finally:
        unregister_health_check(component, new)


class Broker:
    """Stands in for a dispatcher's `BrokerStart.problem`."""

    def __init__(self, reason: str) -> None:
        self.reason: str | None = reason

    def problem(self) -> str | None:
        return self.reason


def test_healthz_answers_503_with_the_reason_then_200(component: str, healthz: str) -> None:
    assert get(healthz) == (200, {"status": "ok"})
    HEALTHY.labels(component).set(0)
    assert get(healthz) == (503, {"status": "unhealthy", "problems": {component: NOT_UP}})

    broker = Broker(f"broker of {component} not started (no_catalog, attempt 3): apply one")
    register_health_check(component, broker.problem)
    try:
        assert get(healthz) == (
            503,
            {"status": "unhealthy", "problems": {component: broker.reason}},
        )
        HEALTHY.labels(component).set(1)
        assert get(healthz)[0] == 503  # up, but its check still objects
        broker.reason = None
        assert get(healthz) == (200, {"status": "ok"})
    finally:
        unregister_health_check(component, broker.problem)  # an equal bound method removes it
    assert process_health([component]) == {}
    HEALTHY.labels(component).set(0)
    assert get(healthz)[0] == 503  # stopping: the gauge alone is enough


def test_metrics_label_every_sample_with_the_broker_instance(component: str) -> None:
    """/metrics adds ``ksb_instance``; the registry, which the code reads, stays as it was."""
    HEALTHY.labels(component).set(1)
    server = metrics_server(0, instance="demo-b")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    samples = [line for line in text.splitlines() if line.startswith("ksb_")]
    assert samples and all('ksb_instance="demo-b"' in line for line in samples)
    mine = [line for line in samples if f'service="{component}"' in line]
    assert len(mine) == 1 and mine[0].endswith(" 1.0")
    assert REGISTRY.get_sample_value("ksb_service_up", {"service": component}) == 1
