"""An activated task's start: nothing its first RECEIVE does not need, and its heartbeat.

The activation service waits for a task's first RECEIVE; redis (a fifth of a second of CPU to
import on this machine) is the heartbeat's, made in the heartbeat's own thread.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

from ksb.activation.activated import Heartbeat
from ksb.names import Names
from ksb.settings import ActivatedTaskSettings


def test_importing_the_task_imports_neither_redis_nor_a_settings_schema() -> None:
    code = (
        "import sys, ksb.activation.activated as a\n"
        "from ksb.settings import ActivatedTaskSettings as S\n"
        "print('redis' in sys.modules, S.__pydantic_complete__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "False"]


class FakeRedis:
    def __init__(self) -> None:
        self.beats: list[tuple[str, dict[str, int]]] = []
        self.removed: list[tuple[str, str]] = []
        self.beaten = threading.Event()

    def zadd(self, key: str, mapping: dict[str, int]) -> None:
        self.beats.append((key, mapping))
        self.beaten.set()

    def zrem(self, key: str, member: str) -> None:
        self.removed.append((key, member))


def test_the_heartbeat_connects_in_its_own_thread_beats_and_unregisters_on_stop() -> None:
    settings = ActivatedTaskSettings(instance="hb", activated_heartbeat_ms=10)
    fake = FakeRedis()
    connected_on: list[str] = []

    def connect() -> Any:
        connected_on.append(threading.current_thread().name)
        return fake

    beat = Heartbeat(connect, settings, "q1", "t1")
    beat.start()
    assert fake.beaten.wait(5)
    beat.stop()
    key = Names("hb").tasks_key("q1")
    assert connected_on == ["ksb-heartbeat"]
    assert fake.beats[0][0] == key and set(fake.beats[0][1]) == {"t1"}
    assert fake.removed == [(key, "t1")]


def test_a_task_whose_heartbeat_cannot_connect_goes_on_and_stops_cleanly() -> None:
    def connect() -> Any:
        raise ConnectionError("no Redis")

    beat = Heartbeat(connect, ActivatedTaskSettings(instance="hb"), "q1", "t1")
    beat.start()
    beat.stop()  # nothing to unregister, nothing raised
