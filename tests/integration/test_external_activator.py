"""The external activator (faust) on the real stack: events in, reader commands out, within max."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.deployment import Deployment, owner_of
from devtools.runner import ServiceProcess
from ksb.catalog.model import parse_catalog
from ksb.names import Names
from ksb.runtime.catalog_store import apply_catalog
from ksb.runtime.redis_client import redis_client
from ksb.sdk.client import KsbClient
from tests.integration.conftest import BASIC_CATALOG, ThreadDispatcher, secure
from tests.integration.support import receive_all
from tests.integration.test_activation import ThreadActivation

pytestmark = pytest.mark.integration

I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741
MAX_READERS = 2
STARTED = re.compile(r"started reader (\S+) for (\S+) \(pid (\d+), (\d+) running, max (\d+)\)")
DONE = re.compile(r"task (TargetQueue-ext-\S+) done: (\d+) message")


@pytest.fixture
def fast_settings(settings: Deployment) -> Deployment:
    """Short tick and idle time, so readers retire within a second of the queue going empty."""
    return settings.model_copy(
        update={"tick_ms": 500, "activated_idle_ms": 800, "activation_empty_grace_ms": 1000}
    )


@pytest.fixture
def stop_all() -> Iterator[list[Any]]:
    running: list[Any] = []
    yield running
    for r in reversed(running):
        r.stop()


class TaskSetPeak:
    """Samples the queue's task set in Redis (each reader heartbeats its own task id into it).

    An independent witness of concurrency: it counts readers alive, not what the activator says.
    """

    def __init__(self, settings: Deployment, queue: str) -> None:
        self.redis = redis_client(settings)
        self.key = Names(settings.instance).tasks_key(queue)
        self.peak = 0
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.wait(0.02):
            live = self.redis.zrangebyscore(self.key, int(time.time() * 1000), "+inf")
            self.peak = max(self.peak, sum(1 for t in live if b"-ext-" in t))

    def stop(self) -> None:
        if not self.stop_event.is_set():
            self.stop_event.set()
            self.thread.join(5)
            self.redis.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_external_activator_starts_readers_that_reply_never_above_max(
    fast_settings: Deployment, stop_all: list[Any], tmp_path: Path
) -> None:
    cat = copy.deepcopy(BASIC_CATALOG)
    cat["event_notifications"] = [{"name": "ext", "queue": "TargetQueue", "timeout_s": 10}]
    apply_catalog(fast_settings, parse_catalog(cat))
    secure(fast_settings)  # the external activator's readers may RECEIVE from notified queues
    reader = (
        f"{shlex.quote(sys.executable)} -m ksb.activation.activated TargetQueue "
        "tests.integration.activation_procs:reply $ACTIVATED_TASK_ID"
    )
    config = tmp_path / "external_activator.yaml"
    # The readers log in as the instance's owner (its Kafka login only: the activator keeps
    # their heartbeats), never as the activator (issue 38).
    owner = owner_of(fast_settings.instance)
    login = {"kafka_password_file": fast_settings.as_principal(owner).kafka_password_file}
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "queues": {
                    "TargetQueue": {
                        "command": reader,
                        "min": 0,
                        "max": MAX_READERS,
                        "execute_as": owner,
                    },
                    # Not in the catalog, so no events: only `min` keeps it running, and only
                    # SIGTERM to the activator ends it.
                    "IdleQueue": {"command": "exec sleep 600", "min": 1, "max": 1},
                },
                "logins": {owner: login},
            }
        )
    )
    stop_all.append(ThreadDispatcher(fast_settings))
    stop_all.append(ThreadActivation(fast_settings))
    ext_settings = fast_settings.model_copy(update={"external_activator_config": str(config)})
    log_path = tmp_path / "external_activator.log"
    activator = ServiceProcess("external_activator", ext_settings, log_path).start()
    stop_all.append(activator)
    t0 = time.monotonic()
    activator.wait_ready("external_activator ready", timeout_s=60)
    ready_s = time.monotonic() - t0
    peak = TaskSetPeak(fast_settings, "TargetQueue")
    stop_all.append(peak)

    with KsbClient(fast_settings) as client:
        t1 = time.monotonic()
        handles = [client.begin_dialog(I, T, C) for _ in range(10)]
        for h in handles:
            for i in range(3):
                client.send(h, "//t/Request", json.dumps({"i": i}))
        client.flush()
        replies = receive_all(client, "InitiatorQueue", 30, timeout_s=60)
        replies_s = time.monotonic() - t1
    assert len(replies) == 30, activator.tail()
    per_conv: dict[str, list[int]] = {}
    for m in replies:
        per_conv.setdefault(m.conversation_id, []).append(json.loads(m.message_body)["i"])
    assert len(per_conv) == 10 and all(v == [0, 1, 2] for v in per_conv.values())

    # Every TargetQueue reader retires once the queue stays empty; their own logs (the commands
    # inherit the activator's stdout) account for all 30 requests.
    deadline = time.monotonic() + 20
    text = log_path.read_text()
    while time.monotonic() < deadline:
        text = log_path.read_text()
        started = [m for m in STARTED.finditer(text) if m[2] == "TargetQueue"]
        if started and len(DONE.findall(text)) == len(started):
            break
        time.sleep(0.2)
    started = [m for m in STARTED.finditer(text) if m[2] == "TargetQueue"]
    assert started, activator.tail()
    assert sum(int(n) for _tid, n in DONE.findall(text)) == 30, activator.tail(60)
    assert max(int(m[4]) for m in started) <= MAX_READERS
    assert all(int(m[5]) == MAX_READERS for m in started)
    peak.stop()
    assert 1 <= peak.peak <= MAX_READERS

    # The `min` reader was started and kept; SIGTERM ends the activator and every command.
    idle = [m for m in STARTED.finditer(text) if m[2] == "IdleQueue"]
    assert len(idle) == 1 and _pid_alive(int(idle[0][3]))
    t2 = time.monotonic()
    activator.stop(grace_s=20)
    stop_s = time.monotonic() - t2
    assert activator.proc is not None and activator.proc.returncode == 0, activator.tail()
    assert "external_activator stopped its readers" in log_path.read_text()
    time.sleep(0.2)
    assert not [m[3] for m in STARTED.finditer(log_path.read_text()) if _pid_alive(int(m[3]))]
    print(
        f"\nexternal activator: ready {ready_s:.1f}s, 30 replies {replies_s:.1f}s, "
        f"{len(started)} reader(s) started, peak {peak.peak}, stop {stop_s:.1f}s"
    )
