"""Integration fixtures: a broker instance per test (unique namespace) on the session's stack."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.deployment import Deployment
from devtools.runner import ServiceProcess
from ksb.catalog.model import Catalog, parse_catalog
from ksb.runtime.catalog_store import apply_catalog
from ksb.sdk.client import KsbClient
from services.dispatcher import Dispatcher
from tests.conftest import Stack

# A small catalog most tests share: a request/reply contract between two services.
BASIC_CATALOG: dict[str, Any] = {
    "message_types": [
        {"name": "//t/Request", "validation": "WELL_FORMED_JSON"},
        {"name": "//t/Reply", "validation": "NONE"},
        {"name": "//t/Ping", "validation": "EMPTY"},
        {
            "name": "//t/Order",
            "validation": "SCHEMA",
            "schema": {
                "type": "object",
                "required": ["qty"],
                "properties": {"qty": {"type": "integer", "minimum": 1}},
            },
        },
    ],
    "contracts": [
        {
            "name": "//t/Contract",
            "messages": [
                {"type": "//t/Request", "sent_by": "INITIATOR"},
                {"type": "//t/Reply", "sent_by": "TARGET"},
                {"type": "//t/Ping", "sent_by": "ANY"},
                {"type": "//t/Order", "sent_by": "INITIATOR"},
            ],
        }
    ],
    "queues": [
        {"name": "InitiatorQueue", "partitions": 1},
        {"name": "TargetQueue", "partitions": 2},
    ],
    "services": [
        {"name": "//t/Initiator", "queue": "InitiatorQueue"},
        {"name": "//t/Target", "queue": "TargetQueue", "contracts": ["//t/Contract", "DEFAULT"]},
    ],
}


@pytest.fixture
def settings(stack: Stack, unique: str) -> Deployment:
    return Deployment(
        instance=f"t{unique}",
        kafka_bootstrap=stack.kafka_bootstrap,
        redis_url=stack.redis_url,
        lock_ttl_ms=15_000,
        max_body_bytes=64 * 1024,
    )


@pytest.fixture
def catalog(settings: Deployment) -> Catalog:
    """The basic catalog, applied to this test's instance (tests may apply another one)."""
    return apply_catalog(settings, parse_catalog(BASIC_CATALOG))


class ThreadDispatcher:
    """A dispatcher in a thread of the test process: quick to start, stopped at the end."""

    def __init__(self, settings: Deployment) -> None:
        self.dispatcher = Dispatcher(settings)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.dispatcher.run, args=(self.stop_event,))
        self.thread.start()
        if not self.dispatcher.ready.wait(60):
            raise TimeoutError("dispatcher not ready")

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(30)


@pytest.fixture
def dispatcher(settings: Deployment, catalog: Catalog) -> Iterator[ThreadDispatcher]:
    d = ThreadDispatcher(settings)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def dispatcher_process(
    settings: Deployment, catalog: Catalog, tmp_path: Path
) -> Iterator[ServiceProcess]:
    """The dispatcher as a real child process, for tests that SIGKILL it."""
    proc = ServiceProcess("dispatcher", settings, tmp_path / "dispatcher.log").start()
    try:
        proc.wait_ready("dispatcher ready")
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(settings: Deployment) -> Iterator[KsbClient]:
    c = KsbClient(settings)
    try:
        yield c
    finally:
        c.close()
