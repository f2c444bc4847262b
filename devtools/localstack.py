"""The embedded local stack: a one-node KRaft Kafka and a Redis, as plain local processes.

Tests, the demo and the benchmarks need a real broker (transactions, consumer groups,
read_committed) and a real Redis, but must not depend on Docker or on anything already
running on the machine. So each run gets its own processes on free 127.0.0.1 ports and its
own data directories, and nothing is shared between runs.

Processes start in their own session so that a Ctrl-C in the terminal does not kill them
half-way through a test's teardown; an atexit hook stops them instead, so a Python process
that exits (normally or by an uncaught exception) leaves nothing behind.

Both are secured by default (SASL/SCRAM and ACLs in Kafka, ACL users in Redis; the secrets are
generated into the stack's work directory): see `devtools.stack_security` for the modes and
`ksb acl apply` for how an instance's principals are then made. The work directory is private
(0700) and both processes run with umask 077: queue records in Kafka's segments, Redis's ACL
file and every secret are readable by the stack's owner only (`STACK_UMASK`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.kafka_node import (
    KafkaLayout,
    format_kafka_storage,
    kafka_cluster_id,
    kafka_libs_dir,
    kafka_ready,
    start_kafka,
    write_kafka_properties,
)
from devtools.processes import (
    REPO_ROOT,
    STACK_UMASK,
    LocalStackError,
    free_port,
    is_alive,
    port_open,
    signal_group,
    stop_pids,
    tail,
    wait_gone,
)
from devtools.redis_node import form_cluster, redis_ready, start_redis
from devtools.stack_security import MODES, SecurityMode, StackSecurity, security_mode

__all__ = [
    "STACK_UMASK",
    "LocalStack",
    "LocalStackError",
    "free_port",
    "kafka_libs_dir",
    "running_stack",
    "start_stack",
]

LOG4J2_CONFIG = REPO_ROOT / "infra" / "local" / "log4j2.properties"
CLI_STACK_DIR = REPO_ROOT / "var" / "stack"
CLI_STACK_FILE = CLI_STACK_DIR / "stack.json"

STOP_GRACE_S = 10.0
LOG_TAIL_LINES = 60


@dataclass(frozen=True)
class LocalStack:
    """Addresses and pids of one running stack.

    Only pids are kept (not Popen objects) so that a stack started by `up` in one Python
    process can be stopped by `down` in another, from stack.json.
    """

    kafka_bootstrap: str
    redis_url: str
    workdir: Path
    kafka_pid: int
    redis_pid: int
    security_mode: SecurityMode = "sasl"
    other_kafka_pids: tuple[int, ...] = ()
    """The cluster's other Kafka nodes, when it has several (`start_stack`'s ``kafka_nodes``)."""
    other_redis_pids: tuple[int, ...] = ()
    """The Redis Cluster's other nodes, when it has several (``redis_nodes``, then their
    replicas); `redis_url` then names every node, comma-separated, the first first."""

    @property
    def redis_cluster(self) -> bool:
        """Redis runs as a cluster: clients need ``redis_cluster`` set."""
        return bool(self.other_redis_pids)

    @property
    def redis_node_pids(self) -> dict[str, int]:
        """Every Redis node's pid by its directory under the workdir (``redis``, ``redis-2``, ...),
        which is also how the bench names each one's CPU."""
        pids = (self.redis_pid, *self.other_redis_pids)
        return {_redis_dir(i): pid for i, pid in enumerate(pids)}

    def redis_pid_at(self, port: int) -> int:
        """The pid of the Redis node listening on `port` (each names its address in its
        process title), for tests that kill the node holding a given slot."""
        for pid in self.redis_node_pids.values():
            if f"127.0.0.1:{port}" in _cmdline(pid):
                return pid
        raise LocalStackError(f"no Redis node of this stack listens on port {port}")

    @property
    def kafka_pids(self) -> tuple[int, ...]:
        """Every Kafka node, the first (`kafka_pid`, ``kafka/``) first; node i+1 is in
        ``kafka-<i+1>/``."""
        return (self.kafka_pid, *self.other_kafka_pids)

    @property
    def security(self) -> StackSecurity:
        """The stack's mode and its secrets (under ``<workdir>/security``)."""
        return StackSecurity(self.security_mode, self.workdir / "security")

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop both processes: SIGTERM, then SIGKILL after `grace_s`.

        Safe to call more than once and on already-dead processes, because teardown paths
        (fixture finaliser, atexit, failed start) overlap. Both processes are signalled
        before waiting so their shutdowns overlap instead of adding up.
        """
        stop_pids([*self.kafka_pids, *self.redis_node_pids.values()], grace_s)
        _forget(self)

    def as_json(self) -> dict[str, Any]:
        """The stack.json shape, so other tools need no knowledge of this module."""
        return {
            "kafka_bootstrap": self.kafka_bootstrap,
            "redis_url": self.redis_url,
            "workdir": str(self.workdir),
            "kafka_pid": self.kafka_pid,
            "redis_pid": self.redis_pid,
            "security": self.security_mode,
            "other_kafka_pids": list(self.other_kafka_pids),
            "other_redis_pids": list(self.other_redis_pids),
        }


# --------------------------------------------------------------------------- processes


_live: dict[tuple[int, int], LocalStack] = {}
_live_lock = threading.Lock()


def _remember(stack: LocalStack) -> None:
    with _live_lock:
        _live[(stack.kafka_pid, stack.redis_pid)] = stack


def _forget(stack: LocalStack) -> None:
    with _live_lock:
        _live.pop((stack.kafka_pid, stack.redis_pid), None)


@atexit.register
def _stop_all_at_exit() -> None:
    """Last line of defence: a test run that crashes must not leave a JVM behind."""
    with _live_lock:
        stacks = list(_live.values())
    for stack in stacks:
        stack.stop(grace_s=3.0)


# --------------------------------------------------------------------------- public API


def start_stack(
    workdir: Path,
    *,
    timeout_s: float = 120.0,
    stop_at_exit: bool = True,
    security: SecurityMode | None = None,
    kafka_nodes: int = 1,
    redis_nodes: int = 1,
    redis_replicas: int = 0,
) -> LocalStack:
    """Start Kafka and Redis under `workdir` and return once both are usable.

    "Usable" means what the first test will do works: Kafka lists its brokers and commits a
    transaction, Redis answers PING (both as ``admin`` when secured). On any failure everything
    started here is stopped again and the error carries the tail of the Kafka log, because a
    bare timeout says nothing about why a JVM did not come up.

    `security` is the mode (default: ``KSB_STACK_SECURITY``, else ``sasl``).
    `stop_at_exit=False` is for `python -m devtools.localstack up`, whose whole point is that
    the processes outlive it. `kafka_nodes` above 1 starts a cluster of that many KRaft nodes,
    each broker and controller, replicating every topic (`replication_settings`);
    `redis_nodes` above 1, a Redis Cluster of that many primaries (`form_cluster`), each with
    `redis_replicas` replicas.
    """
    deadline = time.monotonic() + timeout_s
    workdir = workdir.resolve()
    workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(workdir, 0o700)
    libs = kafka_libs_dir()
    sec = StackSecurity(security_mode(security), workdir / "security")
    sec.generate()
    nodes = _kafka_layouts(workdir, sec, kafka_nodes)
    for k in nodes:
        k.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        k.data.mkdir(mode=0o700, parents=True, exist_ok=True)
        k.logs.mkdir(mode=0o700, parents=True, exist_ok=True)
    bootstrap = ",".join(k.bootstrap for k in nodes)
    cluster = redis_nodes > 1
    if redis_replicas and not cluster:
        raise LocalStackError("Redis replicas need a Redis Cluster (redis_nodes above 1)")
    redis_ports = [free_port() for _ in range(redis_nodes * (1 + redis_replicas))]
    scheme = "rediss" if sec.mode == "tls" else "redis"
    redis_urls = [f"{scheme}://127.0.0.1:{port}/0" for port in redis_ports]

    # Redis first: it is up in milliseconds and runs while the storage-format JVM starts.
    redis_procs = [
        start_redis(workdir / _redis_dir(i), port, sec, cluster=cluster)
        for i, port in enumerate(redis_ports)
    ]
    stack: LocalStack | None = None
    try:
        cluster_id = kafka_cluster_id()
        for k in nodes:
            write_kafka_properties(k)
            format_kafka_storage(libs, k, cluster_id)
        procs = [start_kafka(libs, k) for k in nodes]
        stack = LocalStack(
            kafka_bootstrap=bootstrap,
            redis_url=",".join(redis_urls),
            workdir=workdir,
            kafka_pid=procs[0].pid,
            redis_pid=redis_procs[0].pid,
            security_mode=sec.mode,
            other_kafka_pids=tuple(p.pid for p in procs[1:]),
            other_redis_pids=tuple(p.pid for p in redis_procs[1:]),
        )
        if stop_at_exit:
            _remember(stack)
        while not all(port_open(k.port) for k in nodes):
            for proc in procs:
                if proc.poll() is not None:
                    raise LocalStackError(f"Kafka exited with code {proc.returncode}")
            for rp in redis_procs:
                if rp.poll() is not None:
                    raise LocalStackError(f"redis-server exited with code {rp.returncode}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"Kafka did not listen on {bootstrap} in {timeout_s}s")
            time.sleep(0.05)
        kafka_ready(bootstrap, deadline, sec.login(), brokers=kafka_nodes)
        for url in redis_urls:
            redis_ready(url, deadline, sec)
        if cluster:
            form_cluster(redis_urls[:redis_nodes], deadline, sec, redis_urls[redis_nodes:])
    except BaseException as exc:
        if stack is not None:
            stack.stop(grace_s=2.0)
        else:
            for rp in redis_procs:
                signal_group(rp.pid, signal.SIGKILL)
                wait_gone(rp.pid, time.monotonic() + 5.0)
        if isinstance(exc, Exception):
            tails = "\n".join(k.log_tails() for k in nodes)
            raise LocalStackError(
                f"local stack failed to start in {workdir}: {exc}\n{tails}\n"
                f"--- redis ---\n{tail(workdir / 'redis' / 'redis.log', 20)}"
            ) from exc
        raise
    return stack


def _redis_dir(i: int) -> str:
    """Node 1 in ``redis/`` (where a one-node stack has always kept it), node i in ``redis-<i>/``."""
    return "redis" if i == 0 else f"redis-{i + 1}"


def _kafka_layouts(workdir: Path, sec: StackSecurity, count: int) -> list[KafkaLayout]:
    """Node 1 in ``kafka/`` (where a one-node stack has always kept it), node i in ``kafka-<i>/``,
    every node voting in the cluster's controller quorum."""
    ports = [(free_port(), free_port()) for _ in range(count)]
    voters = ",".join(f"{i}@127.0.0.1:{c}" for i, (_p, c) in enumerate(ports, start=1))
    return [
        KafkaLayout(
            root=workdir / ("kafka" if i == 1 else f"kafka-{i}"),
            port=port,
            controller_port=controller,
            security=sec,
            node_id=i,
            voters=voters,
        )
        for i, (port, controller) in enumerate(ports, start=1)
    ]


@contextlib.contextmanager
def running_stack(workdir: Path, security: SecurityMode | None = None) -> Iterator[LocalStack]:
    """A stack for the duration of a `with` block, stopped even if the block raises."""
    stack = start_stack(workdir, security=security)
    try:
        yield stack
    finally:
        stack.stop()


# --------------------------------------------------------------------------- CLI


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _load_cli_stack() -> LocalStack | None:
    try:
        data = json.loads(CLI_STACK_FILE.read_text())
    except FileNotFoundError:
        return None
    return LocalStack(
        kafka_bootstrap=data["kafka_bootstrap"],
        redis_url=data["redis_url"],
        workdir=Path(data["workdir"]),
        kafka_pid=int(data["kafka_pid"]),
        redis_pid=int(data["redis_pid"]),
        security_mode=security_mode(data.get("security", "sasl")),
        other_kafka_pids=tuple(int(p) for p in data.get("other_kafka_pids", [])),
        other_redis_pids=tuple(int(p) for p in data.get("other_redis_pids", [])),
    )


def _cli_alive(stack: LocalStack) -> dict[str, bool]:
    """Checks the command line too, so a recycled pid is never taken for our broker."""
    return {
        "kafka": is_alive(stack.kafka_pid) and "kafka.Kafka" in _cmdline(stack.kafka_pid),
        "redis": is_alive(stack.redis_pid) and "redis-server" in _cmdline(stack.redis_pid),
    }


def _cli_down() -> int:
    stack = _load_cli_stack()
    if stack is None:
        print(f"no stack recorded in {CLI_STACK_FILE}")
        return 0
    alive = _cli_alive(stack)
    # Only signal pids that are still ours; a stale stack.json must not kill a stranger.
    LocalStack(
        kafka_bootstrap=stack.kafka_bootstrap,
        redis_url=stack.redis_url,
        workdir=stack.workdir,
        kafka_pid=stack.kafka_pid if alive["kafka"] else -1,
        redis_pid=stack.redis_pid if alive["redis"] else -1,
        security_mode=stack.security_mode,
    ).stop()
    CLI_STACK_FILE.unlink(missing_ok=True)
    print("stack stopped")
    return 0


def _cli_up(timeout_s: float, security: SecurityMode) -> int:
    existing = _load_cli_stack()
    if existing is not None and any(_cli_alive(existing).values()):
        print(f"a stack is already running (see {CLI_STACK_FILE}); run `down` first")
        return 1
    if CLI_STACK_DIR.exists():
        shutil.rmtree(CLI_STACK_DIR)
    CLI_STACK_DIR.mkdir(mode=0o700, parents=True)
    started = time.monotonic()
    stack = start_stack(CLI_STACK_DIR, timeout_s=timeout_s, stop_at_exit=False, security=security)
    CLI_STACK_FILE.write_text(json.dumps(stack.as_json(), indent=2) + "\n")
    print(f"kafka  {stack.kafka_bootstrap}  (pid {stack.kafka_pid})")
    print(f"redis  {stack.redis_url}  (pid {stack.redis_pid})")
    print(f"security: {stack.security_mode}")
    if stack.security.enabled:
        sec = stack.security
        print(f"admin login (ksb acl apply, ksb principal add): {sec.store.path('admin')}")
        print(
            f"  export KSB_KAFKA_BOOTSTRAP={stack.kafka_bootstrap} KSB_REDIS_URL={stack.redis_url}"
        )
        print(f"  export KSB_KAFKA_SECURITY_PROTOCOL={sec.protocol}")
        print(
            f"  export KSB_KAFKA_USERNAME=admin KSB_KAFKA_PASSWORD_FILE={sec.store.path('admin')}"
        )
        print(
            "  export KSB_REDIS_USERNAME=admin "
            f"KSB_REDIS_PASSWORD_FILE={sec.store.redis_path('admin')}"
        )
        if sec.ca is not None:
            print(f"  export KSB_KAFKA_SSL_CA={sec.ca}")
    print(f"up in {time.monotonic() - started:.1f}s; state in {CLI_STACK_FILE}")
    return 0


def _cli_status() -> int:
    stack = _load_cli_stack()
    if stack is None:
        print("no stack recorded")
        return 1
    alive = _cli_alive(stack)
    print(json.dumps({**stack.as_json(), "alive": alive}, indent=2))
    return 0 if all(alive.values()) else 1


def main(argv: list[str] | None = None) -> int:
    """`up` / `down` / `status` for a long-lived stack under var/stack (demo, manual poking)."""
    parser = argparse.ArgumentParser(prog="python -m devtools.localstack", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a fresh stack under var/stack and detach")
    up.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for readiness")
    up.add_argument(
        "--security",
        choices=MODES,
        default=None,
        help="sasl (default; or KSB_STACK_SECURITY), tls, or plaintext (development only)",
    )
    sub.add_parser("down", help="stop the stack recorded in var/stack/stack.json")
    sub.add_parser("status", help="print var/stack/stack.json and whether the pids live")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            return _cli_up(args.timeout, security_mode(args.security))
        if args.command == "down":
            return _cli_down()
        return _cli_status()
    except LocalStackError as exc:
        print(exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
