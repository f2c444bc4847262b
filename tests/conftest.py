"""Shared fixtures: the session-wide local stack and unique names.

The stack is started lazily, on the first test marked `integration`, so `pytest tests/unit`
never starts a JVM. One stack per session because a cold Kafka costs seconds; tests stay
independent by using `unique` names for topics, groups and transactional ids.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import ksb  # noqa: F401  (installed by `make setup` as an editable package)
except ModuleNotFoundError:  # a plain checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))

from ksb.localstack import LocalStack, start_stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """One Kafka + Redis for the whole session, stopped at the end even after failures."""
    running = start_stack(tmp_path_factory.mktemp("stack"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(autouse=True)
def _integration_stack(request: pytest.FixtureRequest) -> None:
    """Give every `integration` test the stack, even one that only needs its side effects.

    getfixturevalue keeps it lazy: a session with no integration test never starts it.
    """
    if request.node.get_closest_marker("integration") is not None:
        request.getfixturevalue("stack")


@pytest.fixture
def unique() -> str:
    """A short random suffix so topics, groups and txn ids never collide between tests."""
    return uuid.uuid4().hex[:10]
