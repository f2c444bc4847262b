"""Integration fixtures: a broker instance per test (unique namespace) on the session's stack.

On the secured stack every test instance gets its own principals, topics and ACLs first (one
``ksb acl apply``, `devtools.deployment.secure_instance`): the services run as their own
least-privilege principals (`ThreadDispatcher` too), and the test's own clients as the
instance's owner, `settings`. `make_application` gives a test an application principal with
exactly the grants it names.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from devtools.deployment import Deployment, instance_plan, owner_of, secure_instance
from devtools.queue_services import ThreadQueueService, with_queues
from devtools.runner import ServiceProcess
from ksb.catalog.model import Catalog, Grant, parse_catalog
from ksb.runtime.catalog_store import apply_catalog, load_catalog
from ksb.sdk.client import KsbClient
from ksb.security.apply import remove_instance
from ksb.security.principals import Role
from services.dispatcher import Dispatcher
from tests.conftest import Stack
from tests.integration.support import wait_for

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
def settings(
    stack: Stack, unique: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    """This test's instance, secured, as its owner sees it (its services log in as their own),
    with its queue service running (one replica, in a thread), which clients made from these
    settings RECEIVE through."""
    base = stack.deployment(instance=f"t{unique}", lock_ttl_ms=15_000, max_body_bytes=64 * 1024)
    secured = secure_instance(base)
    queues = ThreadQueueService(secured, tmp_path_factory.mktemp("queue-store"))
    try:
        yield with_queues(secured, [queues.address])
    finally:
        queues.stop()
        if base.secured:  # its bindings go, so the cluster's list does not grow all session
            remove_instance(instance_plan(base), stack.admin(), wait=False)


@contextmanager
def serving(settings: Deployment, store: Path, **overrides: Any) -> Iterator[Deployment]:
    """A queue service of its own for `settings`' instance (one replica in a thread, with
    `overrides` such as a short ``lock_ttl_ms``): yields the settings its clients and services
    use, every field of `overrides` included (so a client renews as often as the TTL needs)."""
    tuned = settings.model_copy(update=overrides)
    queues = ThreadQueueService(tuned, store)
    try:
        yield with_queues(tuned, [queues.address])
    finally:
        queues.stop()


def secure(settings: Deployment, catalog: Catalog | None = None) -> Deployment:
    """Apply the instance's ACL plan again for `catalog` (default: the one applied last): after
    a catalog whose routes or grants the test relies on. Returns the owner's settings."""
    owner = settings.as_principal(owner_of(settings.instance))
    return secure_instance(settings, catalog or load_catalog(owner))


def make_application(settings: Deployment, name: str, grants: list[Grant]) -> Deployment:
    """A new application principal of this test's instance with exactly `grants` (SEND on
    services, RECEIVE on queues), added to the current catalog and applied as ACLs; returns the
    settings it logs in with. For the grant-level tests of the dispatcher, too."""
    owner = settings.as_principal(owner_of(settings.instance))
    current = load_catalog(owner)
    kept = [g for g in current.grants if g.principal != name]
    data = current.model_dump(by_alias=True, exclude={"version", "applied_ms"})
    data["grants"] = [g.model_dump() for g in (*kept, *grants)]
    updated = apply_catalog(owner, parse_catalog(data))
    secure_instance(settings, updated)
    return settings.as_principal(name)


@pytest.fixture
def catalog(settings: Deployment) -> Catalog:
    """The basic catalog, applied to this test's instance (tests may apply another one)."""
    return apply_catalog(settings, parse_catalog(BASIC_CATALOG))


class ThreadDispatcher:
    """A dispatcher in a thread of the test process: quick to start, stopped at the end."""

    def __init__(self, settings: Deployment) -> None:
        self.dispatcher = Dispatcher(settings.as_service(Role.DISPATCHER))
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.dispatcher.run, args=(self.stop_event,))
        self.thread.start()
        if not self.dispatcher.ready.wait(60):
            raise TimeoutError("dispatcher not ready")

    def wait_owning_every_shard(self, timeout_s: float = 30) -> None:
        """Until the dispatcher has joined its group and rebuilt every shard (it is alone)."""

        def owning_all() -> bool:
            engine = self.dispatcher.engine
            return engine is not None and len(engine.ownership.owned) == engine.ownership.shards

        wait_for("the dispatcher to own every shard", owning_all, timeout_s)

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
