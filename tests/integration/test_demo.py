"""`python -m devtools.demo` end to end: its own stack, every service, a clean result and a clean stop.

The demo starts its own stack on free ports (not the session's), so these tests only need to be
marked `integration` to run with the others; they drive it as a user would, through a subprocess.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
SUMMARY = re.compile(
    r"^summary: 20 dialogs, 120 messages in [0-9.]+s \([0-9]+ msg/s\), "
    r"latency p50 [0-9.]+ ms p99 [0-9.]+ ms, endpoints 40/40 CLOSED, 0 errors$"
)
# The dialogs from instance demo to instance demo-b: 10 by default, 3 reservations each.
CROSS_INSTANCE = re.compile(
    r"^cross-instance: 10 dialogs demo -> demo-b, 30 messages and 10 replies in [0-9.]+s, "
    r"exactly once and in order, endpoints 20/20 CLOSED, transmission queues drained, "
    r"connection demo -> demo-b CONNECTED, 0 errors$"
)
# The first instance's two dispatchers (one per shard), each shard owned by one of them.
DISPATCHERS = re.compile(
    r"^dispatchers: demo's 2 shards, "
    r"(d1 owns shard 0, d2 owns shard 1|d1 owns shard 1, d2 owns shard 0)$"
)
# What each recorded pid must still be running if it were leaked (guards against pid reuse).
PID_COMMANDS = {"kafka": b"kafka.Kafka", "redis": b"redis-server"}
# The second instance's processes run the same service modules under names ending in this; a
# dispatcher of the first is named after its member (``dispatcher/d1``).
SUFFIX_B = "-b"


def _demo_cmd(workdir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "devtools.demo",
        "--dialogs",
        "20",
        "--messages-per-dialog",
        "3",
        "--workdir",
        str(workdir),
        *extra,
    ]


def _env() -> dict[str, str]:
    """The caller's environment without KSB_ settings, which could point the demo elsewhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KSB_") or k == "KSB_KAFKA_LIBS"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _parse_pids(lines: list[str]) -> dict[str, int]:
    [line] = [ln for ln in lines if ln.startswith("pids: ")]
    pids = dict(item.split("=") for item in line.removeprefix("pids: ").split())
    return {name: int(pid) for name, pid in pids.items()}


def _running(name: str, pid: int) -> bool:
    """True if `pid` is still the process the demo started (alive, not a zombie, same command)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[0] == "Z":
        return False
    module = f"services.{name.split('/')[0].removesuffix(SUFFIX_B)}".encode()
    return PID_COMMANDS.get(name, module) in cmdline


class _Lines:
    """A child's stdout, line by line, read on a thread so waiting for a line can time out."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self._stdout = proc.stdout
        self._queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for line in self._stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"no line starting {prefix!r}; output:\n" + "\n".join(self.seen)
                )
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"output ended before {prefix!r}:\n" + "\n".join(self.seen))
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def join(self) -> None:
        self._thread.join(10)
        while not self._queue.empty():
            line = self._queue.get()
            if line is not None:
                self.seen.append(line)


@pytest.fixture
def demo_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "demo"


def test_demo_runs_clean_and_reports(demo_dir: Path) -> None:
    result = subprocess.run(
        _demo_cmd(demo_dir),
        cwd=REPO_ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    lines = result.stdout.splitlines()
    assert any(SUMMARY.match(line) for line in lines), out
    assert any(CROSS_INSTANCE.match(line) for line in lines), out
    assert any(DISPATCHERS.match(line) for line in lines), out
    assert "demo OK" in lines, out
    # A quiet console: the processes log to their files; librdkafka writes nothing raw.
    assert result.stderr == "", out
    pids = _parse_pids(lines)
    assert {"kafka", "redis", "dispatcher/d1", "dispatcher/d2"} <= set(pids), out
    assert {"dispatcher-b", "transmitter-b", "transport-b"} <= set(pids), out
    assert [name for name, pid in pids.items() if _running(name, pid)] == [], out


def test_keep_running_stops_everything_on_sigint(demo_dir: Path) -> None:
    proc = subprocess.Popen(
        _demo_cmd(demo_dir, "--keep-running", "--no-spark"),
        cwd=REPO_ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = _Lines(proc)
    try:
        lines.wait_for("pids: ", 200)
        pids = _parse_pids(lines.seen)
        summary = lines.wait_for("summary: ", 200)
        assert SUMMARY.match(summary), "\n".join(lines.seen)
        cross = lines.wait_for("cross-instance: ", 120)
        assert CROSS_INSTANCE.match(cross), "\n".join(lines.seen)
        bootstrap = lines.wait_for("  export KSB_KAFKA_BOOTSTRAP=", 30)
        lines.wait_for("  export KSB_REDIS_URL=redis://127.0.0.1:", 30)
        # Still serving while it waits for Ctrl-C.
        time.sleep(1.0)
        assert proc.poll() is None, "\n".join(lines.seen)
        assert all(_running(name, pid) for name, pid in pids.items()), pids
        assert bootstrap.startswith("  export KSB_KAFKA_BOOTSTRAP=127.0.0.1:")

        proc.send_signal(signal.SIGINT)
        returncode = proc.wait(30)
        lines.join()
        assert returncode == 0, "\n".join(lines.seen)
        left = {name: pid for name, pid in pids.items() if _running(name, pid)}
        assert left == {}, "\n".join(lines.seen)
        assert not (demo_dir / "demo.pid").exists()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
