"""One look at a queue: what the queue service says is ready, and what its readers left in Redis.

The queue service holds the queue's index and the group locks (`services.queue`): its QueueState
call says how many messages are ready and how many ready groups nobody has locked (runnable work:
what a new reader could do). The readers' traces are in Redis, written by the queue service as it
serves them: the last RECEIVE, the last one that came back empty, the sessions waiting in a
RECEIVE, the rollbacks in a row, and the activated tasks' heartbeats. One call and one pipelined
Redis round trip a look.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from ksb.activation.events import Traces
from ksb.activation.monitor import QueueObservation
from ksb.api.queue.v1 import queue_pb2 as pb
from ksb.names import Names
from ksb.runtime.metrics import RUNNABLE_GROUPS, TASKS_RUNNING, WAITING_READERS
from ksb.sdk.queue_service import QueueServiceClient
from services.activation.watch import QueueWatch

__all__ = ["Looks"]


class Looks:
    """Looks at queues for their monitors."""

    def __init__(self, names: Names, redis_client: redis.Redis, queues: QueueServiceClient) -> None:
        self._names = names
        self._redis = redis_client
        self._queues = queues

    def look(self, w: QueueWatch) -> tuple[QueueObservation, Traces]:
        """The queue as the monitor decides on it, and its traces to compare with the last look
        (raises the SDK's error when the queue service does not answer, Redis's when Redis
        does not: the queue is looked at again next time)."""
        name = w.queue.name
        state: pb.QueueStateReply = self._queues.call(
            "QueueState", pb.QueueStateRequest(queue=name)
        )
        now_wall = int(time.time() * 1000)
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(self._names.activity_key(name))
        pipe.zcount(self._names.waiting_key(name), now_wall, "+inf")
        pipe.get(self._names.rollbacks_key(name))
        pipe.zremrangebyscore(self._names.tasks_key(name), "-inf", now_wall)
        pipe.zcard(self._names.tasks_key(name))
        activity, waiting, rollbacks, _expired, tasks = pipe.execute()
        activity = {_s(k): _s(v) for k, v in (activity or {}).items()}
        last_empty = int(activity.get("last_empty_ms", 0)) or None
        running = max(int(tasks), w.running())
        RUNNABLE_GROUPS.labels(name).set(state.runnable_groups)
        TASKS_RUNNING.labels(name).set(running)
        WAITING_READERS.labels(name).set(int(waiting))
        obs = QueueObservation(
            now_ms=now_wall,
            ready_groups=state.runnable_groups,
            ready_messages=state.ready_messages,
            waiting_receivers=int(waiting),
            running_tasks=running,
            last_empty_receive_ms=last_empty,
            max_queue_readers=w.queue.activation.max_queue_readers,
            activation_enabled=w.queue.activation.status == "ON" or w.notifier is not None,
            queue_enabled=w.queue.status == "ON",
        )
        traces = Traces(
            ready=state.ready_messages,
            receive_ms=int(activity.get("last_receive_ms", 0)),
            empty_ms=int(activity.get("last_empty_ms", 0)),
            rollbacks=int(rollbacks or 0),
        )
        return obs, traces


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
