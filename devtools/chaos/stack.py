"""The chaos harness's local stack: `devtools.localstack`'s Kafka and Redis, killed and restarted.

`start_stack` brings both up as usual; this keeps where they live (ports, data directory) so that
Kafka can be killed with SIGKILL and started again **on the same data** (log recovery after an
unclean shutdown included), Redis killed and started again **empty** on the same port, and either
stopped with SIGSTOP (its clients' connections stay open and nothing answers: a stalled network).
The harness owns these processes, so they are stopped here, never by the stack's atexit hook
(whose pids would be stale after a restart).
"""

from __future__ import annotations

import atexit
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from devtools.deployment import Deployment, stack_fields
from devtools.kafka_node import KafkaLayout, kafka_libs_dir, kafka_ready, start_kafka
from devtools.localstack import start_stack
from devtools.processes import LogTail, port_open, signal_group, stop_pids, wait_gone
from devtools.redis_node import persist_redis, redis_ready, start_redis
from devtools.stack_security import StackSecurity

__all__ = ["ChaosStack"]

_VOTERS = re.compile(r"controller\.quorum\.voters=1@127\.0\.0\.1:(\d+)")


class ChaosStack:
    """One Kafka and one Redis under `workdir`, with the faults the harness injects into them."""

    def __init__(self, workdir: Path, *, timeout_s: float = 180.0) -> None:
        self.timeout_s = timeout_s
        stack = start_stack(workdir, timeout_s=timeout_s, stop_at_exit=False)
        self.workdir = stack.workdir
        self.kafka_bootstrap = stack.kafka_bootstrap
        self.redis_url = stack.redis_url
        self.security: StackSecurity = stack.security
        self.kafka_pid = stack.kafka_pid
        self.redis_pid = stack.redis_pid
        props = (self.workdir / "kafka" / "server.properties").read_text()
        found = _VOTERS.search(props)
        assert found is not None, "no controller port in server.properties"
        self.kafka = KafkaLayout(
            root=self.workdir / "kafka",
            port=int(self.kafka_bootstrap.rsplit(":", 1)[1]),
            controller_port=int(found.group(1)),
            security=self.security,
        )
        self.redis_port = int(self.redis_url.rsplit(":", 1)[1].split("/")[0])
        self.broker_log = LogTail(self.kafka.logs / "server.log")
        """The broker's log as it grows, over every round (`devtools.chaos.remedy`)."""
        self._lock = threading.Lock()
        atexit.register(self.stop)

    def deployment(self, **fields: object) -> Deployment:
        """A deployment on this stack, logged in as nobody yet (see `secure_instance`)."""
        base: dict[str, object] = {
            "kafka_bootstrap": self.kafka_bootstrap,
            "redis_url": self.redis_url,
            **stack_fields(self.security),
        }
        return Deployment.model_validate({**base, **fields})

    # ----------------------------------------------------------------- Kafka
    def kill_kafka(self) -> None:
        """kill -9: no clean shutdown, no flushed segments."""
        with self._lock:
            signal_group(self.kafka_pid, signal.SIGKILL)
            wait_gone(self.kafka_pid, time.monotonic() + 30)

    def start_kafka(self) -> float:
        """Start the broker again on its data and ports; returns the seconds until it commits a
        transaction again."""
        started = time.monotonic()
        deadline = started + self.timeout_s
        with self._lock:
            proc = start_kafka(kafka_libs_dir(), self.kafka)
            self.kafka_pid = proc.pid
        _wait_port(proc, self.kafka.port, deadline, "Kafka")
        kafka_ready(self.kafka_bootstrap, deadline, self.security.login())
        return time.monotonic() - started

    def pause_kafka(self) -> None:
        signal_group(self.kafka_pid, signal.SIGSTOP)

    def resume_kafka(self) -> None:
        signal_group(self.kafka_pid, signal.SIGCONT)

    # ----------------------------------------------------------------- Redis
    def kill_redis(self) -> None:
        with self._lock:
            signal_group(self.redis_pid, signal.SIGKILL)
            wait_gone(self.redis_pid, time.monotonic() + 30)

    def persist_redis(self) -> None:
        """The append-only file on, holding everything Redis has now (for `start_redis` with
        ``keep_data``)."""
        persist_redis(self.redis_url, self.security, time.monotonic() + self.timeout_s)

    def start_redis(self, *, keep_data: bool = False) -> None:
        """A new Redis on the same port: empty (only ``admin`` can log in until the instances'
        ACL users are applied again), or with `keep_data` loaded from its append-only file
        (`persist_redis` before the kill) and keeping it on."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            proc = start_redis(
                self.workdir / "redis", self.redis_port, self.security, appendonly=keep_data
            )
            self.redis_pid = proc.pid
        _wait_port(proc, self.redis_port, deadline, "Redis")
        redis_ready(self.redis_url, deadline, self.security)

    def pause_redis(self) -> None:
        signal_group(self.redis_pid, signal.SIGSTOP)

    def resume_redis(self) -> None:
        signal_group(self.redis_pid, signal.SIGCONT)

    # ----------------------------------------------------------------- life cycle
    def stop(self, grace_s: float = 10.0) -> None:
        """Both processes: SIGCONT (a stopped process cannot act on SIGTERM), SIGTERM, SIGKILL."""
        with self._lock:
            pids = [p for p in (self.kafka_pid, self.redis_pid) if p > 1]
            self.kafka_pid = self.redis_pid = -1
        for pid in pids:
            signal_group(pid, signal.SIGCONT)
        stop_pids(pids, grace_s)

    def __enter__(self) -> ChaosStack:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def _wait_port(proc: subprocess.Popen[bytes], port: int, deadline: float, what: str) -> None:
    while not port_open(port):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting again")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not listen on port {port} again in time")
        time.sleep(0.05)
