"""Shared fixtures: the session-wide local stack and unique names.

The stack is started lazily, on the first test marked `integration`, so `pytest tests/unit`
never starts a JVM. One stack per session because a cold Kafka costs seconds; tests stay
independent by using `unique` names for topics, groups and transactional ids.

The stack is secured as by default (``KSB_STACK_SECURITY``: ``sasl``, or ``tls``/``plaintext``):
every test instance gets its own principals and ACLs (`tests.integration.conftest`), and a test
that needs the cluster's ``admin`` asks the stack for it (`Stack.admin`).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import ksb  # noqa: F401  (installed by `make setup` as an editable package)
except ModuleNotFoundError:  # a plain checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))

from devtools.deployment import Deployment, stack_fields
from devtools.localstack import start_stack
from devtools.stack_security import StackSecurity
from ksb.security.principals import ADMIN


@dataclass(frozen=True)
class Stack:
    """What the integration tests need of a stack: where Kafka and Redis answer, and how."""

    kafka_bootstrap: str
    redis_url: str
    security: StackSecurity

    def deployment(self, **fields: object) -> Deployment:
        """A deployment on this stack, logged in as nobody yet (see `secure_instance`)."""
        base: dict[str, object] = {
            "kafka_bootstrap": self.kafka_bootstrap,
            "redis_url": self.redis_url,
            **stack_fields(self.security),
        }
        return Deployment.model_validate({**base, **fields})

    def admin(self, **fields: object) -> Deployment:
        """The cluster's ``admin`` (a Kafka super user, Redis's unrestricted user)."""
        return self.deployment(**fields).as_principal(ADMIN)


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One Kafka + Redis for the whole session, as local processes, stopped at the end even
    after failures (docs/operations.md says why there is no container variant)."""
    running = start_stack(tmp_path_factory.mktemp("stack"))
    try:
        yield Stack(running.kafka_bootstrap, running.redis_url, running.security)
    finally:
        running.stop()


@pytest.fixture(autouse=True)
def _integration_stack(request: pytest.FixtureRequest) -> None:
    """Give every `integration` test the stack, even one that only needs its side effects.

    getfixturevalue keeps it lazy: a session with no integration test never starts it.
    """
    if request.node.get_closest_marker("integration") is not None:
        request.getfixturevalue("stack")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        help="long mode (make fuzz): 10,000 inputs per decoder fuzzer, more and longer "
        "sequences for the reference model of the engine",
    )


@pytest.fixture(scope="session")
def long_mode(request: pytest.FixtureRequest) -> bool:
    """Whether the run asked for the long mode of the fuzzers and the reference model."""
    return bool(request.config.getoption("long"))


@pytest.fixture
def unique() -> str:
    """A short random suffix so topics, groups and txn ids never collide between tests."""
    return uuid.uuid4().hex[:10]
