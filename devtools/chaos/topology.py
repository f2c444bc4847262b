"""One round's broker instances and every process they run, each one a fault target.

Three instances on the harness's stack: **A** (the initiator services and their queue), **B** (the
target services, their queue with a dead-letter policy) and **F** (a forwarder only: the ``Fwd``
services' routes go through it both ways). A and B each run two dispatchers (the instance's
requests topics have ``shards`` partitions, shared between them by the consumer group), two queue
service replicas (``q1``, ``q2``: RECEIVE is theirs, each on a port of its own that it keeps across
restarts, every client given both as ``KSB_QUEUE_ADDRESSES`` so it moves on to the other when one
fails), a transmitter, a transport and an activation service; F runs its forwarder. Two reader
processes RECEIVE on each queue (`devtools.chaos.reader`). Every process logs in as its own principal
(`devtools.deployment`); the readers and the harness's own clients as the instance's owner.

A supervisor restarts any process that exits without the harness having stopped it, and counts
it as a crash (with the tail of its log): a service is expected to outlive the faults, and a
deployment would restart it anyway.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from devtools.chaos.hostile import mallory_catalog_part
from devtools.chaos.schedule import QUEUE_REPLICAS, READERS, SERVICES
from devtools.chaos.stack import ChaosStack
from devtools.chaos.workload import INITIATOR_QUEUE, TARGET_QUEUE, catalogs
from devtools.deployment import Deployment, secure_instance
from devtools.dispatchers import owned_in_log, shares_settled
from devtools.processes import REPO_ROOT, free_port
from devtools.queue_services import READY as QUEUE_READY
from devtools.runner import ServiceProcess
from ksb.catalog.model import Catalog, parse_catalog
from ksb.runtime.catalog_store import apply_catalog
from ksb.settings import ClientSettings, settings_env

__all__ = ["UNREACHABLE", "Crash", "Member", "ReaderProcess", "Topology"]

log = logging.getLogger("devtools.chaos")

UNREACHABLE = "127.0.0.1:1"
"""Where a cut route points: a port nothing listens on."""

FAST: dict[str, int] = {
    "tick_ms": 500,
    "view_every_ms": 200,
    "retry_initial_ms": 500,
    "retry_max_ms": 4_000,
    "suppress_after_disconnect_ms": 500,
    "suppress_after_failed_connect_ms": 1_000,
    "connect_timeout_ms": 1_000,
    "delivery_timeout_ms": 3_000,
    "forwarder_stale_ms": 20_000,
    "assignment_stall_ms": 3_000,
}
"""Housekeeping intervals short enough that a healed fault is noticed within seconds."""


class Member(Protocol):
    name: str

    def start(self) -> Member: ...
    def alive(self) -> bool: ...
    def kill(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def stop(self, grace_s: float = 10) -> None: ...
    def tail(self, lines: int = 30) -> str: ...


@dataclass
class ReaderProcess:
    """A reader (`devtools.chaos.reader`) as a child process; each start writes a new line file."""

    name: str
    settings: ClientSettings
    role: str
    queue: str
    directory: Path
    starts: int = 0
    proc: subprocess.Popen[bytes] | None = None
    files: list[Path] = field(default_factory=list)

    @property
    def log_path(self) -> Path:
        return self.directory / f"reader-{self.name}.log"

    def start(self) -> ReaderProcess:
        out = self.directory / f"reader-{self.name}.{self.starts}.jsonl"
        self.starts += 1
        self.files.append(out)
        with self.log_path.open("ab") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "devtools.chaos.reader", self.role, self.queue, str(out)],
                cwd=REPO_ROOT,
                env=settings_env(self.settings),
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal(self, sig: signal.Signals) -> None:
        if self.alive():
            assert self.proc is not None
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self, grace_s: float = 10) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class _Service:
    """A `ServiceProcess` under a stable name; started again as a new process after a kill."""

    name: str
    module: str
    settings: Deployment
    log_path: Path
    extra_env: dict[str, str]
    current: ServiceProcess | None = None

    def start(self) -> _Service:
        self.current = ServiceProcess(
            self.module.removeprefix("services."),
            self.settings,
            self.log_path,
            extra_env=self.extra_env,
        ).start()
        return self

    def _proc(self) -> ServiceProcess:
        assert self.current is not None, f"{self.name} was never started"
        return self.current

    def alive(self) -> bool:
        return self.current is not None and self.current.alive()

    def kill(self) -> None:
        self._proc().kill()

    def pause(self) -> None:
        self._proc().pause()

    def resume(self) -> None:
        self._proc().resume()

    def stop(self, grace_s: float = 10) -> None:
        if self.current is not None:
            self.current.resume()
            self.current.stop(grace_s)

    def tail(self, lines: int = 30) -> str:
        return self._proc().tail(lines)

    def log_text(self) -> str:
        return self._proc().log_text()


@dataclass(frozen=True)
class Crash:
    name: str
    at_s: float
    tail: str


class Topology:
    """The round's instances A, B and F, their services and readers."""

    def __init__(
        self,
        stack: ChaosStack,
        prefix: str,
        logs: Path,
        *,
        shards: int = 2,
        lock_ttl_ms: int = 3_000,
    ) -> None:
        self.stack = stack
        self.logs = logs
        self.shards = shards
        logs.mkdir(parents=True, exist_ok=True)
        common = {"lock_ttl_ms": lock_ttl_ms, "request_partitions": shards, **FAST}
        self.queue_ports = {name: free_port() for name in QUEUE_REPLICAS}
        """Each queue replica's port, kept across its restarts (its clients list them all)."""
        self.base = {
            side: stack.deployment(
                instance=f"{prefix}{side}",
                queue_addresses=",".join(
                    f"127.0.0.1:{port}"
                    for name, port in self.queue_ports.items()
                    if name.startswith(f"{side}.")
                ),
                **common,
            )
            for side in ("a", "b", "f")
        }
        ca, cb, cf = catalogs(
            self.base["a"].instance, self.base["b"].instance, self.base["f"].instance, 4
        )
        ca = _with_mallory(ca)
        self.catalogs: dict[str, Catalog] = {"a": ca, "b": cb, "f": cf}
        self.owner: dict[str, Deployment] = {}
        self.members: dict[str, Member] = {}
        self.down: set[str] = set()
        """Processes the harness has stopped or paused on purpose (not the supervisor's)."""
        self.crashes: list[Crash] = []
        self._lock = threading.RLock()
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None

    # ----------------------------------------------------------------- set-up
    def secure(self) -> None:
        """Every instance's principals, topics and ACLs (``ksb acl apply``), as after a Redis
        that lost its users; the owners' logins for the harness's own clients."""
        for side in ("b", "f", "a"):
            self.owner[side] = secure_instance(self.base[side], self.catalogs[side])

    def setup(self) -> None:
        self.secure()
        for side in ("b", "f", "a"):
            self.catalogs[side] = apply_catalog(self.owner[side], self.catalogs[side])

    def start(self, timeout_s: float = 180) -> None:
        for name in SERVICES:
            side, role = name.split(".")
            module = "services.dispatcher" if role.startswith("d") else f"services.{role}"
            deployment = self.base[side]
            if role.startswith("q"):
                module = "services.queue"
                deployment = deployment.model_copy(
                    update={
                        "queue_port": self.queue_ports[name],
                        "queue_store_dir": str(self.logs / f"store-{name}"),
                    }
                )
            # librdkafka's group lines in the dispatchers' logs: how a shard's owner came and went.
            extra = {"KSB_MEMBER": role, "KSB_KAFKA_DEBUG": "cgrp"} if role.startswith("d") else {}
            self.members[name] = _Service(
                name, module, deployment, self.logs / f"{name}.log", extra
            ).start()
        for name in READERS:
            side = name.split(".")[0]
            role, queue = (
                ("initiator", INITIATOR_QUEUE) if side == "a" else ("target", TARGET_QUEUE)
            )
            settings = self.owner[side].narrow(ClientSettings)
            self.members[name] = ReaderProcess(name, settings, role, queue, self.logs).start()
        deadline = time.monotonic() + timeout_s
        for name, m in self.members.items():
            marker = (
                "reader ready"
                if name in READERS
                else QUEUE_READY
                if name in QUEUE_REPLICAS
                else "ready"
            )
            self._wait_log(name, m, marker, deadline)
        for side in ("a", "b"):
            self.wait_settled(side, deadline)
        self._supervisor = threading.Thread(target=self._supervise, name="chaos-supervisor")
        self._supervisor.start()

    def _wait_log(self, name: str, m: Member, marker: str, deadline: float) -> None:
        """Until `m` logs `marker`; one that exits first (a broker still coming back from a
        fault) is counted as a crash and started again, as the supervisor would."""
        while True:
            text = m.log_text() if isinstance(m, _Service) else _read_member(m)
            if marker in text:
                return
            if not m.alive():
                self._restart_crashed(name, m)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready in time:\n{m.tail()}")
            time.sleep(0.1)

    def wait_settled(self, side: str, deadline: float) -> None:
        """Every shard of `side`'s requests owned by exactly one of its dispatchers, each with
        its fair share (`devtools.dispatchers.shares_settled`)."""
        while True:
            owned = {
                name: owned_in_log(m.log_text())
                for name, m in self.members.items()
                if name.startswith(f"{side}.d") and isinstance(m, _Service)
            }
            if shares_settled(owned, self.shards):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{side}'s dispatchers not settled: {owned}")
            time.sleep(0.1)

    # ----------------------------------------------------------------- faults
    def kill(self, name: str) -> None:
        with self._lock:
            self.down.add(name)
            self.members[name].kill()

    def restart(self, name: str) -> None:
        with self._lock:
            if self._stop.is_set():
                return  # the round is over: nothing is started again
            m = self.members[name]
            if not m.alive():
                m.start()
            self.down.discard(name)

    def pause(self, name: str) -> None:
        with self._lock:
            self.down.add(name)
            self.members[name].pause()

    def resume(self, name: str) -> None:
        with self._lock:
            self.members[name].resume()
            self.down.discard(name)

    def cut_link(self, side: str) -> None:
        """`side`'s direct route to the other instance points where nothing listens."""
        self._apply_routes(side, UNREACHABLE)

    def restore_link(self, side: str) -> None:
        self._apply_routes(side, "LOCAL")

    def _apply_routes(self, side: str, address: str) -> None:
        current = self.catalogs[side]
        data = current.model_dump(by_alias=True, exclude={"version", "applied_ms"})
        for route in data["routes"]:
            if route.get("via") is None:
                route["address"] = address
        self.catalogs[side] = apply_catalog(self.owner[side], parse_catalog(data))

    def reader_files(self, side: str) -> list[Path]:
        return [
            f
            for name, m in self.members.items()
            if name.startswith(f"{side}.r") and isinstance(m, ReaderProcess)
            for f in m.files
        ]

    # ----------------------------------------------------------------- supervision
    def _supervise(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                if self._stop.is_set():
                    return
                for name, m in self.members.items():
                    if name not in self.down and not m.alive():
                        self._restart_crashed(name, m)

    def _restart_crashed(self, name: str, m: Member) -> None:
        at = time.monotonic() - self._started
        self.crashes.append(Crash(name, at, m.tail(15)))
        log.warning("%s exited on its own at %.0fs; starting it again", name, at)
        m.start()

    def stop(self) -> None:
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(10)
        # All at once: one by one, a few that drain slowly would add up to minutes.
        threads = [
            threading.Thread(target=self._stop_one, args=(name, m), name=f"stop-{name}")
            for name, m in self.members.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)

    @staticmethod
    def _stop_one(name: str, m: Member) -> None:
        try:
            m.stop(10)
        except Exception:
            log.exception("stopping %s", name)

    def processes(self) -> Iterator[tuple[str, Member]]:
        yield from self.members.items()


def _with_mallory(catalog: Catalog) -> Catalog:
    """A's catalog with the hostile application's queue, service and grants
    (`devtools.chaos.hostile`)."""
    data = catalog.model_dump(by_alias=True, exclude={"version", "applied_ms"})
    for key, items in mallory_catalog_part().items():
        data[key] = [*data.get(key, []), *items]
    return parse_catalog(data)


def _read_member(m: Member) -> str:
    return _read(m.log_path) if isinstance(m, ReaderProcess) else ""


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
