"""An instance's queue service replicas, as child processes or as threads of the caller.

Every tool that runs an instance on this machine runs its queue service here: `make run`, the
benchmarks and the chaos harness as child processes (`QueueReplicas`, which the fault tests kill
and pause), the integration tests as a thread of the test process (`ThreadQueueService`, quick to
start). Each replica gets a port of its own and a store directory of its own; `addresses` is what
clients are given (``KSB_QUEUE_ADDRESSES``), every replica listed, so a client moves on to the
next when one fails.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from devtools.deployment import Deployment
from devtools.processes import free_port
from devtools.runner import ServiceProcess, stop_all
from ksb.security.principals import Role
from services.queue import QueueService

__all__ = ["QueueReplicas", "ThreadQueueService", "with_queues"]

D = TypeVar("D", bound=Deployment)

READY = "listening on"
"""What a replica logs once it takes calls."""


def with_queues(settings: D, addresses: list[str]) -> D:
    """`settings` whose clients reach the queue service at `addresses`."""
    return settings.model_copy(update={"queue_addresses": ",".join(addresses)})


@dataclass
class QueueReplicas:
    """The replicas of one instance's queue service, each a child process ``q1``, ``q2``, ..."""

    settings: Deployment
    log_dir: Path
    members: dict[str, ServiceProcess] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{self.ports[name]}" for name in self.members]

    def start(self, count: int, timeout_s: float = 60) -> QueueReplicas:
        for _ in range(count):
            self.add(wait=False)
        for proc in self.members.values():
            proc.wait_ready(READY, timeout_s)
        return self

    def add(self, *, wait: bool = True, timeout_s: float = 60) -> str:
        name = f"q{len(self.members) + 1}"
        port = free_port()
        replica = self.settings.model_copy(
            update={
                "queue_port": port,
                "queue_store_dir": str(self.log_dir / f"store-{name}"),
                "metrics_port": 0,
            }
        )
        proc = ServiceProcess("queue", replica, self.log_dir / f"queue-{name}.log")
        self.members[name], self.ports[name] = proc.start(), port
        if wait:
            proc.wait_ready(READY, timeout_s)
        return name

    def client_settings(self, settings: D) -> D:
        """`settings` whose clients reach these replicas."""
        return with_queues(settings, self.addresses)

    def stop(self) -> None:
        stop_all(list(self.members.values()))


class ThreadQueueService:
    """One replica in a thread of the calling process: quick to start, stopped at the end."""

    def __init__(self, settings: Deployment, store_dir: Path) -> None:
        replica = settings.model_copy(
            update={"queue_port": 0, "queue_store_dir": str(store_dir), "metrics_port": 0}
        )
        self.service = QueueService(replica.as_service(Role.QUEUE))
        self.stop_event = threading.Event()
        self.thread = threading.Thread(
            target=self.service.run, args=(self.stop_event,), name="queue-service"
        )
        self.thread.start()
        if not self.service.ready.wait(60):
            self.stop()
            raise TimeoutError("queue service not ready")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.service.port}"

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(30)
