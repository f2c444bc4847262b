"""Activation under faults: the service killed, a task crashing, ALTER QUEUE while tasks run.

The procedures at the top run inside activated tasks (`python -m ksb.activation.activated`), which import this
module by its dotted path; they talk to the test through Redis keys under ``ksbtest:<instance>``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from typer.testing import CliRunner

from devtools.deployment import Deployment, owner_of
from devtools.runner import ServiceProcess
from ksb.catalog.model import parse_catalog
from ksb.cli import app
from ksb.errors import QueueDisabled
from ksb.names import Names
from ksb.runtime.catalog_store import apply_catalog, load_catalog
from ksb.runtime.redis_client import redis_client
from ksb.sdk.client import KsbClient, Transaction
from ksb.security.principals import ADMIN, Role
from ksb.settings import CliSettings, settings_env
from ksb.wire.protocol import QueueMessage
from tests.integration.conftest import BASIC_CATALOG, ThreadDispatcher, secure, serving
from tests.integration.support import (
    check_exactly_once_in_order,
    queue_receipts,
    read_topic,
    wait_for,
)
from tests.integration.test_activation import ThreadActivation, monitor_view, with_target_queue

pytestmark = pytest.mark.integration

I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741
QUEUE = "TargetQueue"
_PROCS = "tests.integration.test_activation_faults"


# --------------------------------------------------------------------------- procedures (in tasks)
HARNESS_DIR = "KSBTEST_HARNESS_DIR"
"""The test's own bookkeeping (the tasks' pids, which task crashed) is files in a directory of
the test's: a task is confined to its own principal's secrets and logs in to nothing of the
harness's, so it cannot write bookkeeping keys in Redis as the admin."""


def _harness() -> Path:
    return Path(os.environ[HARNESS_DIR])


@pytest.fixture(autouse=True)
def _harness_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Tasks inherit the test's environment: they find the harness's directory there."""
    path = tmp_path / "harness"
    (path / "pids").mkdir(parents=True)
    monkeypatch.setenv(HARNESS_DIR, str(path))
    return path


def _note_task() -> str:
    """Record this task's pid (so the test can clean up orphans) and return its task id."""
    (_harness() / "pids" / str(os.getpid())).touch()
    return os.environ.get("ACTIVATED_TASK_ID", "?")


def _pids(harness: Path) -> list[int]:
    return [int(p.name) for p in (harness / "pids").iterdir()]


def _crashed(harness: Path) -> dict[str, Any] | None:
    path = harness / "crashed"
    text = path.read_text() if path.exists() else ""
    return json.loads(text) if text.endswith("\n") else None


def _reply(tx: Transaction, m: QueueMessage, task: str) -> None:
    body = json.loads(m.message_body)
    tx.send(m.conversation_handle, "//t/Reply", json.dumps({**body, "task": task}))


def slow_reply(tx: Transaction, messages: list[QueueMessage]) -> None:
    """100 ms per message, then a reply naming the task that did it."""
    task = _note_task()
    time.sleep(0.1 * len(messages))
    for m in messages:
        _reply(tx, m, task)


def crash_once(tx: Transaction, messages: list[QueueMessage]) -> None:
    """The first task to meet the message marked ``crash`` dies at once (no rollback, no commit)."""
    task = _note_task()
    for m in messages:
        marker = json.dumps({"task": task, "group": m.conversation_group_id}) + "\n"
        if json.loads(m.message_body).get("crash"):
            try:  # the first task only: creating the file is the test-and-set
                fd = os.open(_harness() / "crashed", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                continue
            os.write(fd, marker.encode())
            os._exit(1)
    time.sleep(0.05 * len(messages))
    for m in messages:
        _reply(tx, m, task)


# --------------------------------------------------------------------------- fixtures and helpers
@pytest.fixture
def fast_settings(settings: Deployment) -> Deployment:
    return settings.model_copy(
        update={"tick_ms": 500, "activated_idle_ms": 800, "activation_empty_grace_ms": 1000}
    )


@pytest.fixture
def stop_all(_harness_dir: Path) -> Iterator[list[Any]]:
    """Things to stop at the end (last first), then any activated task still alive."""
    running: list[Any] = []
    yield running
    for r in reversed(running):
        r.stop()
    _end_orphan_tasks(_harness_dir)


def _end_orphan_tasks(harness: Path) -> None:
    """Tasks outlive a killed activation service; end the ones this test's procedures recorded."""
    for pid in _pids(harness):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"ksb.activation.activated" in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


@pytest.fixture
def r(settings: Deployment) -> Iterator[redis.Redis]:
    """The harness's view of Redis (its bookkeeping keys too): the stack's admin."""
    conn = redis_client(settings.as_principal(ADMIN))
    try:
        yield conn
    finally:
        conn.close()


def cli(settings: Deployment, *args: str) -> str:
    """`ksb` as the operator, who reads everything."""
    return _ksb(settings.as_service(Role.OPERATOR), *args)


def sql(settings: Deployment, statements: str) -> str:
    """`ksb sql` as the instance's owner: only the catalog's writers change it (issue 38)."""
    return _ksb(settings.as_principal(owner_of(settings.instance)), "sql", statements)


def _ksb(login: Deployment, *args: str) -> str:
    result = CliRunner().invoke(app, list(args), env=settings_env(login.narrow(CliSettings)))
    assert result.exit_code == 0, result.output
    return result.output


def live_tasks(r: redis.Redis, settings: Deployment) -> int:
    """Tasks with a live heartbeat, as the monitors and `ksb tasks` count them."""
    key = Names(settings.instance).tasks_key(QUEUE)
    return int(r.zcount(key, int(time.time() * 1000), "+inf"))


@dataclass
class TaskSampler:
    """Samples running tasks every 20 ms: the heartbeat set and the monitor's own count."""

    settings: Deployment
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> TaskSampler:
        self._thread = threading.Thread(target=self._run, name="task-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        r = redis_client(self.settings)
        monitors_key = Names(self.settings.instance).monitors_key
        try:
            while not self._stop.is_set():
                raw = r.hget(monitors_key, QUEUE)
                view: dict[str, Any] = json.loads(raw) if raw else {}
                self.samples.append(
                    (time.monotonic(), live_tasks(r, self.settings), view.get("running_tasks", 0))
                )
                self._stop.wait(0.02)
        finally:
            r.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    @property
    def most(self) -> int:
        return max((max(s[1], s[2]) for s in self.samples), default=0)


def send_backlog(client: KsbClient, dialogs: int, per_dialog: int) -> list[str]:
    """``per_dialog`` requests on each of ``dialogs`` conversations (one group each), at once."""
    handles = [client.begin_dialog(I, T, C) for _ in range(dialogs)]
    for n in range(per_dialog):
        for conv, h in enumerate(handles):
            client.send(h, "//t/Request", json.dumps({"conv": conv, "n": n}))
    client.flush()
    return handles


def collect_replies(
    client: KsbClient, count: int, timeout_s: float, every_s: Callable[[], None] | None = None
) -> list[dict[str, Any]]:
    """RECEIVE the replies on the initiator queue; ``every_s`` runs about once a second."""
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    next_call = time.monotonic()
    while len(got) < count and time.monotonic() < deadline:
        with client.transaction() as tx:
            got.extend(
                json.loads(m.message_body) for m in tx.receive("InitiatorQueue", waitfor_ms=300)
            )
        if every_s is not None and time.monotonic() >= next_call:
            every_s()
            next_call = time.monotonic() + 1
    return got


def assert_processed_once(
    settings: Deployment, replies: list[dict[str, Any]], dialogs: int, per: int
) -> None:
    check_exactly_once_in_order(replies, dialogs, per)
    receipts = queue_receipts(settings, QUEUE)
    assert len(receipts) == dialogs * per
    assert all(c == (1, 1) for c in receipts.values()), receipts


def activation(
    settings: Deployment, procedure: str, max_queue_readers: int, **queue: Any
) -> dict[str, Any]:
    """The target queue activated with `procedure`, its tasks running as the instance's owner
    (whose login the tools' activation host holds)."""
    return with_target_queue(
        activation={
            "status": "ON",
            "procedure": f"{_PROCS}:{procedure}",
            "max_queue_readers": max_queue_readers,
            "execute_as": owner_of(settings.instance),
        },
        **queue,
    )


def activate(settings: Deployment, procedure: str, max_queue_readers: int) -> None:
    """Apply `activation`'s catalog, then the ACLs it calls for (``ksb acl apply`` after a
    catalog change): the tasks' principal may then write its heartbeats."""
    secure(settings, parse_catalog(activation(settings, procedure, max_queue_readers)))
    apply_catalog(settings, parse_catalog(activation(settings, procedure, max_queue_readers)))


# --------------------------------------------------------------------------- the tests
def test_sigkilled_activation_service_counts_surviving_tasks_after_restart(
    fast_settings: Deployment, stop_all: list[Any], r: redis.Redis, tmp_path: Path
) -> None:
    """Tasks outlive the service; the restarted one counts their heartbeats: never a third."""
    dialogs, per = 40, 6  # 240 messages at 100 ms: about 12 s of work for two readers
    activate(fast_settings, "slow_reply", 2)
    stop_all.append(ThreadDispatcher(fast_settings))
    first = ServiceProcess("activation", fast_settings, tmp_path / "activation-1.log").start()
    stop_all.append(first)
    first.wait_ready("activation ready")
    sampler = TaskSampler(fast_settings).start()
    stop_all.append(sampler)
    tasks_seen: list[int] = []
    with KsbClient(fast_settings) as client:
        send_backlog(client, dialogs, per)
        wait_for("two tasks running", lambda: live_tasks(r, fast_settings) == 2, 60)
        wait_for("the tasks working", lambda: bool(_pids(_harness())), 30)
        first.kill()
        # The tasks are their own processes: they keep working and heartbeating.
        time.sleep(1.5)
        assert live_tasks(r, fast_settings) == 2
        second = ServiceProcess("activation", fast_settings, tmp_path / "activation-2.log").start()
        stop_all.append(second)
        second.wait_ready("activation ready")

        # The new monitor counts the two surviving tasks while messages wait in unlocked groups.
        def counted_survivors() -> bool:
            view = monitor_view(fast_settings, QUEUE)
            fresh = view.get("activations") == 0  # the new monitor's count starts at 0
            return fresh and view["running_tasks"] == 2 and view["runnable_groups"] > 0

        wait_for("the restarted monitor to count the survivors", counted_survivors, 10)

        def list_tasks() -> None:
            tasks_seen.append(len(json.loads(cli(fast_settings, "tasks", "--json"))))

        replies = collect_replies(client, dialogs * per, 90, every_s=list_tasks)
    sampler.stop()
    assert len(replies) == dialogs * per, f"{len(replies)} of {dialogs * per} replies"
    assert_processed_once(fast_settings, replies, dialogs, per)
    assert sampler.most == 2, f"at most {sampler.most} tasks ran at once"
    assert tasks_seen and max(tasks_seen) <= 2, tasks_seen
    assert monitor_view(fast_settings, QUEUE)["activations"] == 0
    workers = {reply["task"] for reply in replies}
    assert len(workers) == 2, workers  # the two first tasks did everything
    wait_for("tasks retire", lambda: live_tasks(r, fast_settings) == 0, 30)


def test_a_crashed_task_is_counted_out_and_its_group_is_processed_later(
    fast_settings: Deployment, stop_all: list[Any], r: redis.Redis, tmp_path: Path
) -> None:
    with serving(fast_settings, tmp_path / "q", lock_ttl_ms=2000, lock_renew_ms=500) as settings:
        _crashed_task_is_counted_out(settings, stop_all, r)


def _crashed_task_is_counted_out(settings: Deployment, stop_all: list[Any], r: redis.Redis) -> None:
    dialogs, per = 6, 3
    activate(settings, "crash_once", 2)
    stop_all.append(ThreadDispatcher(settings))
    act = ThreadActivation(settings)
    stop_all.append(act)
    names = Names(settings.instance)
    with KsbClient(settings) as client:
        handles = send_backlog(client, dialogs, per)
        client.send(handles[2], "//t/Request", json.dumps({"conv": 2, "n": per, "crash": True}))
        client.flush()
        wait_for("a task to crash", lambda: _crashed(_harness()) is not None, 60)
        crash = _crashed(_harness()) or {}
        # Counted out at once (the supervisor reaps it), not only when its heartbeat expires.
        tasks_key = names.tasks_key(QUEUE)
        counted_out = wait_for(
            "the crashed task counted out",
            lambda: (
                r.zscore(tasks_key, crash["task"]) is None
                and crash["task"] not in monitor_view(settings, QUEUE).get("tasks", [])
            ),
            15,
        )
        # Before its 5 s heartbeat could expire: the supervisor reaped it (margin for a busy CI).
        assert counted_out < 4.5, f"counted out after {counted_out:.2f}s"
        # Its group lock is held by nobody alive and expires after one TTL.
        lock_key = names.lock_key(QUEUE, crash["group"])
        wait_for("the lock to expire", lambda: not r.hget(lock_key, "holder"), 30)
        replies = collect_replies(client, dialogs * per + 1, 60)
    crashed_conv = [x for x in replies if x["conv"] == 2]
    assert [x["n"] for x in crashed_conv] == list(range(per + 1))
    assert crashed_conv[-1]["task"] != crash["task"]  # a later task did it
    bodies = [x for x in replies if not (x["conv"] == 2 and x["n"] == per)]
    check_exactly_once_in_order(bodies, dialogs, per)
    receipts = queue_receipts(settings, QUEUE)
    assert len(receipts) == dialogs * per + 1
    assert all(c == (1, 1) for c in receipts.values()), receipts
    assert act.service.watches[QUEUE].activations >= 2


def test_a_failing_task_is_started_again_later_and_later_until_the_queue_is_altered(
    fast_settings: Deployment, stop_all: list[Any]
) -> None:
    """A procedure that cannot be loaded: each task exits with status 2 as it starts. The
    monitor holds activation back 1.5 s after the first failure, 3 s after the second; the
    messages wait untouched, and once the queue names a procedure that works (which clears
    the hold) they are processed, each once."""
    settings = fast_settings.model_copy(update={"activation_retry_ms": 1500})
    activate(settings, "no_such_procedure", 2)
    stop_all.append(ThreadDispatcher(settings))
    act = ThreadActivation(settings)
    stop_all.append(act)

    def activations() -> int:
        w = act.service.watches.get(QUEUE)
        return 0 if w is None else w.activations

    with KsbClient(settings) as client:
        send_backlog(client, 2, 2)
        starts: list[float] = []
        deadline = time.monotonic() + 60
        while len(starts) < 3 and time.monotonic() < deadline:
            starts += [time.monotonic()] * (activations() - len(starts))
            time.sleep(0.01)
        assert len(starts) >= 3, f"{len(starts)} task(s) started in 60 s"
        # Lower bounds only: a slow machine makes the gaps longer, never shorter.
        assert starts[1] - starts[0] >= 1.5 and starts[2] - starts[1] >= 3.0, starts
        activate(settings, "slow_reply", 2)
        replies = collect_replies(client, 4, 60)
    assert_processed_once(settings, replies, 2, 2)


def test_alter_queue_readers_and_status_take_effect_at_once(
    fast_settings: Deployment, stop_all: list[Any], r: redis.Redis
) -> None:
    # No poison handling interference: this test's probing RECEIVEs roll back.
    settings = fast_settings.model_copy(update={"poison_rollbacks": 1000})
    dialogs, per = 30, 6
    activate(settings, "slow_reply", 2)
    stop_all.append(ThreadDispatcher(settings))
    act = ThreadActivation(settings)
    stop_all.append(act)
    sampler = TaskSampler(settings).start()
    stop_all.append(sampler)
    with KsbClient(settings) as client:
        send_backlog(client, dialogs, per)
        wait_for("two tasks running", lambda: live_tasks(r, settings) == 2, 60)
        sql(settings, f"ALTER QUEUE {QUEUE} WITH ACTIVATION (MAX_QUEUE_READERS = 3)")
        # Takes effect without a restart of anything (the bound is generous: no timed assertions).
        wait_for("a third task", lambda: live_tasks(r, settings) == 3, 30)
        # The view is a snapshot a task handler writes after the monitor acts, so it may trail
        # the third task's heartbeat by a check.
        wait_for(
            "the view's new bound",
            lambda: monitor_view(settings, QUEUE)["max_queue_readers"] == 3,
            5,
        )

        sql(settings, f"ALTER QUEUE {QUEUE} WITH STATUS = OFF")
        start = time.monotonic()
        while True:
            tx = client.transaction()
            try:
                tx.receive(QUEUE, waitfor_ms=50)
            except QueueDisabled:
                break
            finally:
                if not tx.done:
                    tx.rollback()  # messages received before the change go back untouched
            assert time.monotonic() - start < 30, "RECEIVE still works after STATUS = OFF"
        # The tasks stop at their next RECEIVE and the monitor starts none while the queue is OFF.
        wait_for("tasks stop", lambda: live_tasks(r, settings) == 0, 15)
        activations = act.service.watches[QUEUE].activations
        time.sleep(1.5)
        assert act.service.watches[QUEUE].activations == activations
        with pytest.raises(QueueDisabled):
            client.transaction().receive(QUEUE, waitfor_ms=100)
        # Part of the backlog is still there; STATUS = ON resumes it.
        replies = collect_replies(client, dialogs * per, 2)
        assert len(replies) < dialogs * per
        sql(settings, f"ALTER QUEUE {QUEUE} WITH STATUS = ON")
        replies += collect_replies(client, dialogs * per - len(replies), 90)
    sampler.stop()
    assert sampler.most == 3, f"at most {sampler.most} tasks ran at once"
    assert act.service.watches[QUEUE].activations > activations
    assert_processed_once(settings, replies, dialogs, per)


def test_poison_message_handling_off_keeps_the_queue_enabled(
    fast_settings: Deployment, stop_all: list[Any], r: redis.Redis
) -> None:
    cat = copy.deepcopy(BASIC_CATALOG)
    cat["event_notifications"] = [{"name": "ext", "queue": QUEUE, "timeout_s": 600}]
    apply_catalog(fast_settings, parse_catalog(cat))
    stop_all.append(ThreadDispatcher(fast_settings))
    act = ThreadActivation(fast_settings)
    stop_all.append(act)
    names = Names(fast_settings.instance)
    sql(fast_settings, f"ALTER QUEUE {QUEUE} WITH POISON_MESSAGE_HANDLING (STATUS = OFF)")
    wait_for(
        "the monitor to see the change",
        lambda: act.service.watches[QUEUE].queue.poison_message_handling == "OFF",
        10,
    )
    with KsbClient(fast_settings) as client:
        client.send(client.begin_dialog(I, T, C), "//t/Request", json.dumps({"poison": True}))
        client.flush()
        for _ in range(6):
            tx = client.transaction()
            assert tx.receive(QUEUE, waitfor_ms=5000)
            tx.rollback()
        assert int(r.get(names.rollbacks_key(QUEUE)) or 0) >= 5
        time.sleep(2)  # twenty monitor checks and four ticks
        assert not r.exists(names.disabled_key(QUEUE))
        assert {q.name: q.status for q in load_catalog(fast_settings).queues}[QUEUE] == "ON"
        events = [json.loads(v) for _k, v in read_topic(fast_settings, names.activation) if v]
        assert "BROKER_QUEUE_DISABLED" not in [e["kind"] for e in events]
        with client.transaction() as tx:
            got = tx.receive(QUEUE, waitfor_ms=5000)
        assert [json.loads(m.message_body) for m in got] == [{"poison": True}]
