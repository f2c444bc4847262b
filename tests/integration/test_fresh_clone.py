"""The README's first command on a fresh clone: `make run` sets everything up and runs the demo.

A newcomer clones the repository and types `make run`. This test does the same: it clones the
committed HEAD of this checkout (uncommitted changes are not in it) into a temporary folder,
which has no `.venv/` and no `.cache/`, and runs `make run` there with no standard input and an
environment that points at nothing of this checkout (no ``KSB_*`` variable, no virtualenv on the
PATH, no outer make's flags). So the clone's own Makefile must create the virtualenv, install the
project, fetch the Kafka and Spark jars and the Debian packages, and the demo must reach its
summary and exit 0. Only the machine's package caches are shared (pip's under ``~/.cache/pip``,
Maven's ``~/.m2``, apt's), as on a developer's machine that has installed other projects.

It takes minutes (about 1 for the set-up, 1.5 for the demo on the project's 2-core machine), so
it is one test, and the clone (over 1 GB with its virtualenv) is removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
MAKE_RUN_TIMEOUT_S = 1200.0
"""Set-up from scratch and the demo at its default size: minutes, never twenty."""
SUMMARY = re.compile(
    r"^summary: 200 dialogs, 2000 messages in [0-9.]+s \([0-9]+ msg/s\), "
    r"latency p50 [0-9.]+ ms p99 [0-9.]+ ms, endpoints 400/400 CLOSED, 0 errors$"
)
CROSS_INSTANCE = re.compile(
    r"^cross-instance: 10 dialogs demo -> demo-b, .* exactly once and in order, "
    r"endpoints 20/20 CLOSED, transmission queues drained, .* 0 errors$"
)
DISPATCHERS = re.compile(
    r"^dispatchers: demo's 2 shards, "
    r"(d1 owns shard 0, d2 owns shard 1|d1 owns shard 1, d2 owns shard 0)$"
)
STAMPS = (".venv/.installed", ".cache/kafka/libs/.fetched", ".cache/spark/jars/.fetched")
"""What the clone's own `make` must have made: the project installed, the jars fetched."""
OUTER_MAKE = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")


def _git(*args: str, cwd: Path = REPO_ROOT) -> str:
    done = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=120
    )
    return done.stdout.strip()


def _newcomer_env() -> dict[str, str]:
    """This machine's environment as a newcomer's shell has it: nothing of this checkout's
    virtualenv or settings, the home directory (and so the package caches) kept."""
    venv_bins = {Path(sys.prefix) / "bin", REPO_ROOT / ".venv" / "bin"}
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KSB_")
        and k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", *OUTER_MAKE}
    }
    env["PATH"] = os.pathsep.join(
        d for d in env.get("PATH", "").split(os.pathsep) if d and Path(d) not in venv_bins
    )
    return env


@pytest.fixture
def clone(tmp_path: Path) -> Iterator[Path]:
    """HEAD of this checkout, cloned as `git clone` gives it; removed afterwards."""
    if shutil.which("git") is None or shutil.which("make") is None:
        pytest.skip("needs git and make")
    try:
        _git("rev-parse", "--verify", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"{REPO_ROOT} is not a git checkout with a commit: nothing to clone")
    target = tmp_path / "ksb"
    _git("clone", "--quiet", str(REPO_ROOT), str(target), cwd=tmp_path)
    try:
        yield target
    finally:
        shutil.rmtree(target, ignore_errors=True)


def _make_run(clone: Path, log: Path) -> tuple[int, float, float]:
    """`make run` in `clone`, its output in `log`: (exit code, seconds until the demo started,
    seconds in all).

    Its own process group, so a run that overstays is stopped as Ctrl-C would stop it (the demo
    stops its services and stack on SIGTERM), then killed."""
    started = time.monotonic()
    setup_s = 0.0
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["make", "run"],
            cwd=clone,
            env=_newcomer_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        while proc.poll() is None:
            elapsed = time.monotonic() - started
            if not setup_s and b"-m devtools.demo" in log.read_bytes():
                setup_s = elapsed
            if elapsed > MAKE_RUN_TIMEOUT_S:
                raise AssertionError(f"make run overstayed {elapsed:.0f}s:\n{_tail(log)}")
            time.sleep(0.5)
    except BaseException:  # overstayed, or the test itself was stopped
        _stop(proc)
        raise
    return proc.returncode, setup_s, time.monotonic() - started


def _tail(log: Path, lines: int = 80) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _left_running(clone: Path, redis_pid: int | None) -> list[str]:
    """Processes still running from the clone (its Python, its Kafka jars) and its Redis."""
    left = []
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            cmdline = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc_dir / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue
        if str(clone) in cmdline or (int(proc_dir.name) == redis_pid and "redis-server" in cmdline):
            left.append(f"{proc_dir.name}: {cmdline[:200]}")
    return left


@pytest.mark.timeout(MAKE_RUN_TIMEOUT_S + 300)
def test_make_run_works_on_a_fresh_clone(clone: Path, tmp_path: Path) -> None:
    assert not (clone / ".venv").exists() and not (clone / ".cache").exists()
    log = tmp_path / "make-run.log"
    code, setup_s, total_s = _make_run(clone, log)
    lines = log.read_text(errors="replace").splitlines()
    tail = _tail(log)
    assert code == 0, f"make run exited {code} after {total_s:.0f}s:\n{tail}"
    assert ".venv/bin/python -m devtools.demo" in lines, tail  # the clone's own virtualenv
    assert [s for s in STAMPS if not (clone / s).exists()] == [], tail
    assert any(SUMMARY.match(line) for line in lines), tail
    assert any(CROSS_INSTANCE.match(line) for line in lines), tail
    assert any(DISPATCHERS.match(line) for line in lines), tail
    assert "demo OK" in lines, tail
    pids = [line for line in lines if line.startswith("pids: ")]
    redis = re.search(r"\bredis=(\d+)", pids[0]) if pids else None
    assert _left_running(clone, int(redis.group(1)) if redis else None) == [], tail
    print(f"make run on a fresh clone: set-up {setup_s:.0f}s, all {total_s:.0f}s")
