"""The activation benchmark's procedure, in a module of its own (bench/activation.py runs the section).

An activated task imports its procedure's module before its first RECEIVE, so that import is a
part of the "first RECEIVE after activation" the section measures: this module imports no more
than a procedure of a user's would (Redis, the task's settings), not the bench's harness (the
activation service, the deployment tools, the queue service), which added 0.12-0.18 s to every
task's start on this machine.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import redis

from ksb.runtime.redis_client import redis_client
from ksb.sdk.client import Transaction
from ksb.security.principals import ADMIN
from ksb.settings import ActivatedTaskSettings, KsbSettings
from ksb.wire.protocol import QueueMessage

__all__ = ["HARNESS_LOGIN", "WORK_MS", "Keys", "harness_redis", "now_ms", "work"]

WORK_MS = 5
"""What the procedure takes per message."""


@dataclass(frozen=True)
class Keys:
    """The bench's own Redis keys (not KSB's), under the instance's name."""

    instance: str

    def _k(self, what: str) -> str:
        return f"bench:{self.instance}:activation:{what}"

    @property
    def activated(self) -> str:
        """Hash task id -> JSON {ms, reason, running}: written by the monitor when it starts one."""
        return self._k("activated")

    @property
    def exited(self) -> str:
        """Hash task id -> ms the monitor reaped it."""
        return self._k("exited")

    @property
    def first(self) -> str:
        """Hash task id -> ms of the task's first RECEIVE that returned messages."""
        return self._k("first")

    @property
    def last(self) -> str:
        """Hash task id -> ms the task finished its latest message."""
        return self._k("last")

    @property
    def processed(self) -> str:
        """Hash task id -> messages the task processed."""
        return self._k("processed")

    @property
    def seen(self) -> str:
        """Hash "dialog:seq" -> times the procedure processed that message."""
        return self._k("seen")

    @property
    def total(self) -> str:
        return self._k("total")

    def all(self) -> list[str]:
        return [self.activated, self.exited, self.first, self.last, self.processed, self.seen]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


HARNESS_LOGIN = "KSBBENCH_REDIS_ADMIN_PASSWORD_FILE"
"""The bench's own keys (``bench:``, outside KSB's namespace) are written with the harness's
login, the stack's admin, handed to its processes in this variable; their KSB work stays their
own principal's."""


def harness_redis(settings: KsbSettings) -> redis.Redis:
    if HARNESS_LOGIN in os.environ:
        settings = settings.model_copy(
            update={"redis_username": ADMIN, "redis_password_file": os.environ[HARNESS_LOGIN]}
        )
    return redis_client(settings)


@functools.cache
def _task_redis() -> tuple[redis.Redis, Keys]:
    settings = ActivatedTaskSettings.from_env()
    return harness_redis(settings), Keys(settings.instance)


def work(tx: Transaction, messages: list[QueueMessage]) -> None:
    """The activation procedure: ``WORK_MS`` per message, with the task's records around it."""
    del tx  # nothing to send: the commit of the RECEIVE is the whole effect
    r, keys = _task_redis()
    task = os.environ.get("ACTIVATED_TASK_ID", "?")
    r.hsetnx(keys.first, task, now_ms())
    time.sleep(WORK_MS * len(messages) / 1000)
    pipe = r.pipeline(transaction=False)
    for m in messages:
        pipe.hincrby(keys.seen, m.message_body.decode(), 1)
    pipe.hincrby(keys.processed, task, len(messages))
    pipe.incrby(keys.total, len(messages))
    pipe.hset(keys.last, task, now_ms())
    pipe.execute()
