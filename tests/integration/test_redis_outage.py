"""Redis goes away under a reader: killed, then stalled. The SDK raises its own errors, never
redis-py's, and no message is lost or received twice.

Each test runs its instance on a Redis server of its own (the session's is shared with every
other test), secured like the stack's: the instance's ACL users are applied to it, and again after
it restarts empty. The dispatcher needs no Redis; the reader does for its group locks.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from devtools.deployment import Deployment, instance_plan, secure_instance
from devtools.processes import free_port, signal_group, wait_gone
from devtools.redis_node import redis_ready, start_redis
from ksb.activation.activated import run_task
from ksb.errors import KsbError, LockLost, LockStoreUnavailable
from ksb.runtime.redis_client import redis_client
from ksb.sdk.client import KsbClient, Transaction
from ksb.security.apply import remove_instance
from ksb.security.principals import Role
from ksb.settings import ActivatedTaskSettings
from ksb.wire.protocol import QueueMessage
from tests.conftest import Stack
from tests.integration.conftest import ThreadDispatcher, secure, serving
from tests.integration.support import check_exactly_once_in_order, queue_receipts, receive_all

pytestmark = pytest.mark.integration

INIT, TGT, CON = "//t/Initiator", "//t/Target", "//t/Contract"
Q = "TargetQueue"
DIALOGS, PER_DIALOG = 4, 3


@dataclass
class RedisNode:
    """A Redis server of this test's own, on a fixed port so that a restart keeps its URL."""

    root: Path
    port: int
    stack: Stack
    pid: int = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.pid = start_redis(self.root, self.port, self.stack.security).pid
        redis_ready(self.url, time.monotonic() + 30, self.stack.security)

    def kill(self) -> None:
        signal_group(self.pid, signal.SIGKILL)
        assert wait_gone(self.pid, time.monotonic() + 30), "Redis did not die"


@pytest.fixture
def redis_node(stack: Stack, tmp_path: Path) -> Iterator[RedisNode]:
    node = RedisNode(tmp_path / "redis", free_port(), stack)
    node.start()
    try:
        yield node
    finally:
        node.kill()


@pytest.fixture
def settings(
    stack: Stack, unique: str, redis_node: RedisNode, tmp_path: Path
) -> Iterator[Deployment]:
    """This test's instance on its own Redis (its queue service's: where the locks are); a short
    Redis timeout, so a stall fails fast. Every commit confirms its lock first
    (``lock_confirm_age_ms`` 0), so Redis's death shows at the commit: by default a lock granted
    moments ago commits on its lease alone, which the dispatcher checks, and is applied."""
    base = stack.deployment(
        instance=f"t{unique}",
        redis_url=redis_node.url,
        lock_ttl_ms=15_000,
        redis_timeout_ms=500,
        lock_confirm_age_ms=0,
    )
    with serving(secure_instance(base), tmp_path / "queue-store") as secured:
        yield secured
    if base.secured:
        remove_instance(instance_plan(base), stack.admin(redis_url=redis_node.url), wait=False)


def _send_all(client: KsbClient, settings: Deployment) -> None:
    """`DIALOGS` dialogs of `PER_DIALOG` requests each, all queued before the test goes on."""
    for d in range(DIALOGS):
        h = client.begin_dialog(INIT, TGT, CON)
        for n in range(PER_DIALOG):
            client.send(h, "//t/Request", json.dumps({"conv": d, "n": n}))
    client.flush()
    deadline = time.monotonic() + 30
    while sum(1 for m, _ in queue_receipts(settings, Q).values() if m) < DIALOGS * PER_DIALOG:
        assert time.monotonic() < deadline, "the requests were not queued in time"
        time.sleep(0.1)


def test_redis_killed_mid_transaction_gives_ksb_errors_and_loses_nothing(
    settings: Deployment, redis_node: RedisNode, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    """Two transactions hold groups when Redis dies: the commit fails with LockLost, the rollback
    succeeds, a new RECEIVE fails with LockStoreUnavailable. Once Redis is back (empty, its users
    applied again) every message is received exactly once, in order, the held ones included."""
    _send_all(client, settings)
    committing, rolling_back = client.transaction(), client.transaction()
    held = committing.receive(Q, waitfor_ms=5_000) + rolling_back.receive(Q, waitfor_ms=5_000)
    assert len(held) == 2 * PER_DIALOG, "two groups locked, each with its dialog's messages"

    redis_node.kill()
    with pytest.raises(LockLost, match="Redis"):
        committing.commit(10)
    rolling_back.rollback()  # gives the messages back; Redis's counts are skipped, not fatal
    refused = client.transaction()
    with pytest.raises(LockStoreUnavailable, match=Q):
        refused.receive(Q, waitfor_ms=200)
    assert refused.group is None, "a failed RECEIVE holds no group"
    refused.rollback()

    redis_node.start()
    secure(settings)  # a Redis restarted empty knows no users until the plan is applied again
    got = receive_all(client, Q, DIALOGS * PER_DIALOG, timeout_s=60)
    check_exactly_once_in_order([json.loads(m.message_body) for m in got], DIALOGS, PER_DIALOG)


def test_redis_stalled_fails_receive_after_the_timeout_then_recovers(
    settings: Deployment, redis_node: RedisNode, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    """A SIGSTOPped Redis keeps its connections open and answers nothing: RECEIVE fails with
    LockStoreUnavailable (a KsbError) after `redis_timeout_ms` instead of hanging, and the
    reader works again once Redis resumes."""
    _send_all(client, settings)
    signal_group(redis_node.pid, signal.SIGSTOP)
    try:
        stalled = client.transaction()
        with pytest.raises(KsbError) as caught:
            stalled.receive(Q, waitfor_ms=200)
        assert isinstance(caught.value, LockStoreUnavailable), caught.value
        stalled.rollback()
    finally:
        signal_group(redis_node.pid, signal.SIGCONT)
    got = receive_all(client, Q, DIALOGS * PER_DIALOG, timeout_s=60)
    check_exactly_once_in_order([json.loads(m.message_body) for m in got], DIALOGS, PER_DIALOG)


def test_an_activated_task_ends_cleanly_when_redis_dies_under_it(
    settings: Deployment, redis_node: RedisNode, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    """Redis dies while the task's procedure runs: the commit is not applied (LockLost), the next
    RECEIVE fails, and the task returns instead of crashing, its heartbeat and removal left to
    lapse. The messages are all there for the readers started once Redis is back."""
    _send_all(client, settings)
    batches: list[int] = []

    def procedure(_tx: Transaction, msgs: list[QueueMessage]) -> None:
        batches.append(len(msgs))
        if len(batches) == 1:
            redis_node.kill()

    # As the activation service starts it: logged in as that service's principal.
    task = settings.as_service(Role.ACTIVATION).narrow(ActivatedTaskSettings, activated_idle_ms=500)
    heartbeats = redis_client(task)
    try:
        with KsbClient(task) as tasks_client:
            processed = run_task(
                tasks_client, lambda: heartbeats, Q, procedure, "task-under-test", task
            )
    finally:
        heartbeats.close()
    assert batches == [PER_DIALOG] and processed == 0, (batches, processed)
    redis_node.start()
    secure(settings)
    got = receive_all(client, Q, DIALOGS * PER_DIALOG, timeout_s=60)
    check_exactly_once_in_order([json.loads(m.message_body) for m in got], DIALOGS, PER_DIALOG)
