"""The embedded local stack: a one-node KRaft Kafka and a Redis, as plain local processes.

Tests, the demo and the benchmarks need a real broker (transactions, consumer groups,
read_committed) and a real Redis, but must not depend on Docker or on anything already
running on the machine. So each run gets its own processes on free 127.0.0.1 ports and its
own data directories, and nothing is shared between runs.

Processes start in their own session so that a Ctrl-C in the terminal does not kill them
half-way through a test's teardown; an atexit hook stops them instead, so a Python process
that exits (normally or by an uncaught exception) leaves nothing behind.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "LocalStack",
    "LocalStackError",
    "free_port",
    "kafka_libs_dir",
    "running_stack",
    "start_stack",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
LOG4J2_CONFIG = REPO_ROOT / "infra" / "local" / "log4j2.properties"
CLI_STACK_DIR = REPO_ROOT / "var" / "stack"
CLI_STACK_FILE = CLI_STACK_DIR / "stack.json"

# Fixed per-stack settings. Replication factors and ISR of 1 because there is one broker;
# small internal-topic partition counts because creating 50 partitions per internal topic
# is most of a cold broker's start-up time; no auto-creation so a typo in a topic name is
# an error instead of a silently created topic; a short abort-cleanup interval so tests of
# timed-out transactions do not wait a minute.
KAFKA_BROKER_SETTINGS: dict[str, str] = {
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "4",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "4",
    "min.insync.replicas": "1",
    "group.initial.rebalance.delay.ms": "0",
    "group.min.session.timeout.ms": "500",
    "auto.create.topics.enable": "false",
    "message.max.bytes": "8388608",
    "transaction.abort.timed.out.transaction.cleanup.interval.ms": "2000",
}
KAFKA_JVM_OPTS: tuple[str, ...] = ("-Xms256m", "-Xmx768m", "-Djava.awt.headless=true")
STOP_GRACE_S = 10.0
LOG_TAIL_LINES = 60


class LocalStackError(RuntimeError):
    """The local stack could not be set up; the message says what to look at."""


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

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop both processes: SIGTERM, then SIGKILL after `grace_s`.

        Safe to call more than once and on already-dead processes, because teardown paths
        (fixture finaliser, atexit, failed start) overlap. Both processes are signalled
        before waiting so their shutdowns overlap instead of adding up.
        """
        pids = [self.kafka_pid, self.redis_pid]
        for pid in pids:
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for pid in pids:
            if not _wait_gone(pid, deadline):
                _signal_group(pid, signal.SIGKILL)
                _wait_gone(pid, time.monotonic() + 5.0)
        _forget(self)

    def as_json(self) -> dict[str, Any]:
        """The stack.json shape, so other tools need no knowledge of this module."""
        return {
            "kafka_bootstrap": self.kafka_bootstrap,
            "redis_url": self.redis_url,
            "workdir": str(self.workdir),
            "kafka_pid": self.kafka_pid,
            "redis_pid": self.redis_pid,
        }


# --------------------------------------------------------------------------- processes


# Popen objects of the processes this Python process started, by pid. Reaping through
# Popen.poll() (not os.waitpid) keeps Popen's own bookkeeping right, so it does not warn
# "subprocess is still running" when garbage-collected (filterwarnings=error in pytest).
_children: dict[int, subprocess.Popen[bytes]] = {}


def _is_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie counts as gone (it has released its ports)."""
    if pid <= 1:
        return False
    child = _children.get(pid)
    if child is not None:
        if child.poll() is None:
            return True
        _children.pop(pid, None)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A non-child zombie waits for its own parent to reap it; it is already gone for us.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _wait_gone(pid: int, deadline: float) -> bool:
    while _is_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal the process group the process leads (start_new_session), then the process.

    The group catches helpers the JVM might fork; the direct kill covers a process that
    is no longer a group leader.
    """
    if pid <= 1:
        return  # never kill(-1) / kill(0): that would signal everything we may signal
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


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


# --------------------------------------------------------------------------- discovery


def kafka_libs_dir() -> Path:
    """Where the Kafka jars are: `KSB_KAFKA_LIBS` or the `make setup` cache.

    Raises rather than downloading: fetching jars is `make setup`'s job, and a test run
    should fail fast with the fix in the message.
    """
    env = os.environ.get("KSB_KAFKA_LIBS")
    libs = Path(env) if env else REPO_ROOT / ".cache" / "kafka" / "libs"
    if not libs.is_dir() or not any(libs.glob("kafka_2.13-*.jar")):
        raise LocalStackError(
            f"Kafka jars not found in {libs} (no kafka_2.13-*.jar). "
            "Run `make setup` (or set KSB_KAFKA_LIBS to a directory of Kafka 4.2 jars)."
        )
    return libs


def free_port() -> int:
    """A port that was free a moment ago; the OS picks it so parallel runs do not collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise LocalStackError("`java` not found on PATH (Java 17+ is needed for Kafka 4.2)")
    return found


def _redis_server() -> str:
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").is_file() else None
    )
    if found is None:
        raise LocalStackError("`redis-server` not found; run `make setup`")
    return found


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"({path} not readable)"
    return "\n".join(text.splitlines()[-lines:]) or f"({path} is empty)"


# --------------------------------------------------------------------------- kafka


@dataclass(frozen=True)
class _KafkaLayout:
    root: Path
    port: int
    controller_port: int

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def properties(self) -> Path:
        return self.root / "server.properties"

    @property
    def console(self) -> Path:
        return self.logs / "kafka.out"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tails(self) -> str:
        return (
            f"--- {self.console} ---\n{_tail(self.console)}\n"
            f"--- {self.logs / 'server.log'} ---\n{_tail(self.logs / 'server.log')}"
        )


def _write_kafka_properties(k: _KafkaLayout) -> None:
    """Static voters, not a dynamic quorum: one node never changes membership, and with
    static voters `StorageTool format` needs neither --standalone nor --initial-controllers.
    """
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{k.controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{k.port},CONTROLLER://127.0.0.1:{k.controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{k.port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(k.data),
        **KAFKA_BROKER_SETTINGS,
    }
    k.properties.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))


def _java_cmd(libs: Path, k: _KafkaLayout, main: str, *args: str) -> list[str]:
    return [
        _java(),
        *KAFKA_JVM_OPTS,
        f"-Dlog4j2.configurationFile={LOG4J2_CONFIG}",
        f"-Dkafka.logs.dir={k.logs}",
        "-cp",
        f"{libs}/*",
        main,
        *args,
    ]


def _format_kafka_storage(libs: Path, k: _KafkaLayout) -> None:
    cluster_id = _kafka_cluster_id()
    cmd = _java_cmd(
        # `--cluster-id=ID`, not `-t ID`: a random id starting with "-" (1 in 64) would be read as
        # an option and the format would fail.
        libs,
        k,
        "kafka.tools.StorageTool",
        "format",
        f"--cluster-id={cluster_id}",
        "-c",
        str(k.properties),
    )
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        raise LocalStackError(
            f"Kafka storage format failed (exit {result.returncode}):\n"
            f"{result.stdout}\n{result.stderr}"
        )


def _kafka_cluster_id() -> str:
    """What `StorageTool random-uuid` prints, without paying for a second JVM start."""
    import base64

    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def _start_kafka(libs: Path, k: _KafkaLayout) -> subprocess.Popen[bytes]:
    with k.console.open("ab") as out:
        proc = subprocess.Popen(
            _java_cmd(libs, k, "kafka.Kafka", str(k.properties)),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=k.root,
            start_new_session=True,
        )
    _children[proc.pid] = proc
    return proc


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _quiet_logger() -> Any:
    """librdkafka logs every refused connection; during start-up those are expected."""
    import logging

    logger = logging.getLogger("devtools.localstack.kafka-probe")
    logger.propagate = False
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    return logger


def _kafka_ready(bootstrap: str, deadline: float) -> None:
    """Wait for metadata AND a working transaction coordinator.

    A broker that answers metadata may still fail the first `init_transactions` while it
    creates __transaction_state; tests that start with a transaction would flake on that,
    so readiness includes one successful init_transactions.
    """
    from confluent_kafka import KafkaException, Producer
    from confluent_kafka.admin import AdminClient

    logger = _quiet_logger()
    admin = AdminClient({"bootstrap.servers": bootstrap, "logger": logger})
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"Kafka at {bootstrap} did not report a broker in time")
        try:
            if admin.list_topics(timeout=min(2.0, remaining)).brokers:
                break
        except KafkaException:
            pass
        time.sleep(0.1)

    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": f"ksb-localstack-probe-{uuid.uuid4().hex}",
            "logger": logger,
        }
    )
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"Kafka at {bootstrap} could not init a transaction in time")
        try:
            producer.init_transactions(min(10.0, remaining))
            break
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            retriable = getattr(err, "retriable", lambda: True)()
            if not retriable:
                raise LocalStackError(f"init_transactions failed: {exc}") from exc
            time.sleep(0.1)
    producer.flush(1.0)


# --------------------------------------------------------------------------- redis


def _start_redis(root: Path, port: int) -> subprocess.Popen[bytes]:
    """No persistence (--save '' / no AOF): the stack is throwaway and fsyncs cost latency."""
    root.mkdir(parents=True, exist_ok=True)
    cmd = [
        _redis_server(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(root),
        "--logfile", str(root / "redis.log"),
        "--daemonize", "no",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=root,
        start_new_session=True,
    )
    _children[proc.pid] = proc
    return proc


def _redis_ready(url: str, deadline: float) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1.0)
    try:
        while True:
            try:
                if client.ping():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"Redis at {url} did not answer PING in time")
            time.sleep(0.05)
    finally:
        client.close()


# --------------------------------------------------------------------------- public API


def start_stack(workdir: Path, *, timeout_s: float = 60.0, stop_at_exit: bool = True) -> LocalStack:
    """Start Kafka and Redis under `workdir` and return once both are usable.

    "Usable" means what the first test will do works: Kafka lists a broker and completes
    init_transactions, Redis answers PING. On any failure everything started here is
    stopped again and the error carries the tail of the Kafka log, because a bare timeout
    says nothing about why a JVM did not come up.

    `stop_at_exit=False` is for `python -m devtools.localstack up`, whose whole point is that
    the processes outlive it.
    """
    deadline = time.monotonic() + timeout_s
    workdir = workdir.resolve()
    libs = kafka_libs_dir()
    k = _KafkaLayout(root=workdir / "kafka", port=free_port(), controller_port=free_port())
    k.data.mkdir(parents=True, exist_ok=True)
    k.logs.mkdir(parents=True, exist_ok=True)
    redis_port = free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"

    # Redis first: it is up in milliseconds and runs while the storage-format JVM starts.
    redis_proc = _start_redis(workdir / "redis", redis_port)
    kafka_proc: subprocess.Popen[bytes] | None = None
    stack: LocalStack | None = None
    try:
        _write_kafka_properties(k)
        _format_kafka_storage(libs, k)
        kafka_proc = _start_kafka(libs, k)
        stack = LocalStack(
            kafka_bootstrap=k.bootstrap,
            redis_url=redis_url,
            workdir=workdir,
            kafka_pid=kafka_proc.pid,
            redis_pid=redis_proc.pid,
        )
        if stop_at_exit:
            _remember(stack)
        while not _port_open(k.port):
            if kafka_proc.poll() is not None:
                raise LocalStackError(f"Kafka exited with code {kafka_proc.returncode}")
            if redis_proc.poll() is not None:
                raise LocalStackError(f"redis-server exited with code {redis_proc.returncode}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"Kafka did not listen on {k.bootstrap} in {timeout_s}s")
            time.sleep(0.05)
        _kafka_ready(k.bootstrap, deadline)
        _redis_ready(redis_url, deadline)
    except BaseException as exc:
        if stack is not None:
            stack.stop(grace_s=2.0)
        else:
            _signal_group(redis_proc.pid, signal.SIGKILL)
            _wait_gone(redis_proc.pid, time.monotonic() + 5.0)
        if isinstance(exc, Exception):
            raise LocalStackError(
                f"local stack failed to start in {workdir}: {exc}\n{k.log_tails()}\n"
                f"--- redis ---\n{_tail(workdir / 'redis' / 'redis.log', 20)}"
            ) from exc
        raise
    return stack


@contextlib.contextmanager
def running_stack(workdir: Path) -> Iterator[LocalStack]:
    """A stack for the duration of a `with` block, stopped even if the block raises."""
    stack = start_stack(workdir)
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
    )


def _cli_alive(stack: LocalStack) -> dict[str, bool]:
    """Checks the command line too, so a recycled pid is never taken for our broker."""
    return {
        "kafka": _is_alive(stack.kafka_pid) and "kafka.Kafka" in _cmdline(stack.kafka_pid),
        "redis": _is_alive(stack.redis_pid) and "redis-server" in _cmdline(stack.redis_pid),
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
    ).stop()
    CLI_STACK_FILE.unlink(missing_ok=True)
    print("stack stopped")
    return 0


def _cli_up(timeout_s: float) -> int:
    existing = _load_cli_stack()
    if existing is not None and any(_cli_alive(existing).values()):
        print(f"a stack is already running (see {CLI_STACK_FILE}); run `down` first")
        return 1
    if CLI_STACK_DIR.exists():
        shutil.rmtree(CLI_STACK_DIR)
    CLI_STACK_DIR.mkdir(parents=True)
    started = time.monotonic()
    stack = start_stack(CLI_STACK_DIR, timeout_s=timeout_s, stop_at_exit=False)
    CLI_STACK_FILE.write_text(json.dumps(stack.as_json(), indent=2) + "\n")
    print(f"kafka  {stack.kafka_bootstrap}  (pid {stack.kafka_pid})")
    print(f"redis  {stack.redis_url}  (pid {stack.redis_pid})")
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
    sub.add_parser("down", help="stop the stack recorded in var/stack/stack.json")
    sub.add_parser("status", help="print var/stack/stack.json and whether the pids live")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            return _cli_up(args.timeout)
        if args.command == "down":
            return _cli_down()
        return _cli_status()
    except LocalStackError as exc:
        print(exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
