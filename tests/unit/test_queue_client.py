"""The SDK's queue service client without a replica: what it asks the service, and when.

A commit confirms its lock with a RenewLocks round trip only when the last grant or renewal is
older than `lock_confirm_age_ms`; the login read from the password file is reused for
`login_reuse_ms`. Calls are recorded by replacing `call`, the one place that reaches a replica.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ksb.api.queue.v1 import queue_pb2 as pb
from ksb.sdk.queue_service import QueueServiceClient
from ksb.settings import QueueClientSettings


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Recording(QueueServiceClient):
    """Answers RenewLocks with `held`, recording every call."""

    def __init__(self, settings: QueueClientSettings, clock: Clock) -> None:
        super().__init__(settings, clock=clock)
        self.calls: list[str] = []
        self.held = True

    def call(self, method: str, request: Any, *, wait_s: float = 0.0) -> Any:
        self.calls.append(method)
        assert method == "RenewLocks"
        return pb.RenewLocksReply(held=[self.held for _ in request.leases])


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def client(clock: Clock) -> Iterator[Recording]:
    c = Recording(QueueClientSettings(lock_renew_ms=5_000, lock_confirm_age_ms=2_500), clock)
    yield c
    c.close()


def test_a_lock_granted_a_moment_ago_is_committed_under_without_a_round_trip(
    client: Recording, clock: Clock
) -> None:
    client.hold("L", clock())
    clock.t += 2.4
    assert client.confirm("L") is True
    assert client.calls == []


def test_an_older_lock_is_renewed_before_the_commit_and_its_age_starts_again(
    client: Recording, clock: Clock
) -> None:
    client.hold("L", clock())
    clock.t += 2.5
    assert client.confirm("L") is True
    assert client.calls == ["RenewLocks"]
    clock.t += 1.0  # renewed 1 s ago: fresh again
    assert client.confirm("L") is True
    assert client.calls == ["RenewLocks"]


def test_a_lock_the_service_no_longer_holds_is_not_confirmed(
    client: Recording, clock: Clock
) -> None:
    client.hold("L", clock())
    clock.t += 3
    client.held = False
    assert client.confirm("L") is False
    clock.t += 0.1  # the renewal said lost: no freshness brings it back
    assert client.confirm("L") is False
    assert client.calls == ["RenewLocks"]


def test_age_counts_from_when_the_granting_call_was_sent(client: Recording, clock: Clock) -> None:
    sent = clock()
    clock.t += 2.0  # a RECEIVE that waited 2 s before its lock was granted
    client.hold("L", sent)
    clock.t += 0.6
    assert client.confirm("L") is True
    assert client.calls == ["RenewLocks"]


def test_zero_confirms_every_commit(clock: Clock) -> None:
    c = Recording(QueueClientSettings(lock_confirm_age_ms=0), clock)
    try:
        c.hold("L", clock())
        assert c.confirm("L") is True
        assert c.calls == ["RenewLocks"]
    finally:
        c.close()


def test_a_let_go_lease_is_not_confirmed(client: Recording, clock: Clock) -> None:
    client.hold("L", clock())
    client.let_go("L")
    assert client.confirm("L") is False


def _secured(password_file: Path, reuse_ms: int) -> QueueClientSettings:
    return QueueClientSettings(
        kafka_username="app",
        kafka_password_file=str(password_file),
        login_reuse_ms=reuse_ms,
    )


def test_the_login_is_reused_for_login_reuse_ms_then_read_again(
    tmp_path: Path, clock: Clock
) -> None:
    secret = tmp_path / "pw"
    secret.write_text("one\n")
    c = QueueServiceClient(_secured(secret, 1_000), clock=clock)
    try:
        assert dict(c.metadata) == {"ksb-principal": "app", "ksb-password": "one"}
        secret.write_text("two\n")  # rotated
        clock.t += 0.9
        assert dict(c.metadata)["ksb-password"] == "one"
        clock.t += 0.1
        assert dict(c.metadata)["ksb-password"] == "two"
    finally:
        c.close()


def test_zero_reads_the_password_file_on_every_call(tmp_path: Path, clock: Clock) -> None:
    secret = tmp_path / "pw"
    secret.write_text("one\n")
    c = QueueServiceClient(_secured(secret, 0), clock=clock)
    try:
        assert dict(c.metadata)["ksb-password"] == "one"
        secret.write_text("two\n")
        assert dict(c.metadata)["ksb-password"] == "two"
    finally:
        c.close()
