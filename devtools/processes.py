"""The processes the development tools start: who is alive, how to stop them, free ports, logs.

Processes start in their own session so that a Ctrl-C in the terminal does not kill them half-way
through a test's teardown; the tools stop them explicitly instead.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "REPO_ROOT",
    "STACK_UMASK",
    "LocalStackError",
    "LogTail",
    "free_port",
    "is_alive",
    "port_open",
    "register_child",
    "signal_group",
    "stop_pids",
    "tail",
    "wait_gone",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
LOG_TAIL_LINES = 60
STACK_UMASK = 0o077
"""The local stack's processes (Kafka, its storage format, Redis) create files for their owner
alone: Kafka's segments hold the queues' messages and its metadata log the SCRAM records."""


class LocalStackError(RuntimeError):
    """The local stack could not be set up; the message says what to look at."""


# Popen objects of the processes this Python process started, by pid. Reaping through
# Popen.poll() (not os.waitpid) keeps Popen's own bookkeeping right, so it does not warn
# "subprocess is still running" when garbage-collected (filterwarnings=error in pytest).
_children: dict[int, subprocess.Popen[bytes]] = {}


def is_alive(pid: int) -> bool:
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


def wait_gone(pid: int, deadline: float) -> bool:
    while is_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def signal_group(pid: int, sig: signal.Signals) -> None:
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


def stop_pids(pids: Sequence[int], grace_s: float, kill_wait_s: float = 5.0) -> list[int]:
    """Stop processes at once: SIGTERM to all, SIGKILL to those still running after ``grace_s``;
    returns those still alive ``kill_wait_s`` after that.

    All are signalled before any is waited for, so their shutdowns overlap instead of adding up;
    and one that outlives even its SIGKILL is returned rather than raised, because an exception
    here would leave every process after it running (a demo once left a whole instance behind
    that way).
    """
    for pid in pids:
        signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    stuck = [pid for pid in pids if not wait_gone(pid, deadline)]
    for pid in stuck:
        signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + kill_wait_s
    return [pid for pid in stuck if not wait_gone(pid, deadline)]


def register_child(proc: subprocess.Popen[bytes]) -> None:
    """Remember a process this Python process started, so it is reaped through its Popen."""
    _children[proc.pid] = proc


_PORTS = random.Random()
"""free_port's own generator: the chaos harness seeds the shared one for its schedules."""


def _ephemeral_low() -> int:
    """Where the kernel's range for outgoing connections (and port-0 binds) starts."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _bind(port: int) -> int | None:
    """`port` if it can be bound now (0: the one the OS picks), else None."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return None
        return int(s.getsockname()[1])


def free_port() -> int:
    """A port that was free a moment ago, at random below the kernel's ephemeral range. A port
    the OS picks for a bind to port 0 comes from that range, which outgoing connections draw
    from too, so one could take it before the server bound it: a `make bench` broker failed to
    start so ("Address already in use") after the runs before it had made thousands of
    connections. At random, so parallel runs rarely pick alike; a taken port is skipped. Where
    the range leaves too little below it, the OS picks."""
    low = _ephemeral_low()
    tries = 200 if low > 11_000 else 0
    for port in (_PORTS.randrange(10_000, low) for _ in range(tries)):
        if _bind(port) is not None:
            return port
    picked = _bind(0)
    assert picked is not None  # port 0 always binds
    return picked


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"({path} not readable)"
    return "\n".join(text.splitlines()[-lines:]) or f"({path} is empty)"


class LogTail:
    """What a growing file gained since the last call, whole lines only (a line still being
    written waits for the next call). Starts at the file's current end, so what is there already
    is not read again, or with `from_start` at its beginning."""

    def __init__(self, path: Path, *, from_start: bool = False) -> None:
        self.path = path
        self._offset = 0 if from_start or not path.exists() else path.stat().st_size

    def new_text(self) -> str:
        if not self.path.exists():
            return ""
        if self.path.stat().st_size < self._offset:  # the file was rolled or started over
            self._offset = 0
        with self.path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self._offset += end
        return chunk[:end].decode(errors="replace")


# --------------------------------------------------------------------------- redis


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
