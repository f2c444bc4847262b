"""`devtools.runner.stop_all`: every process ends, one that ignores SIGTERM included, and none is
left running because another one was slow."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.runner import ServiceProcess, stop_all
from ksb.settings import KsbSettings

_POLITE = "import time\nwhile True: time.sleep(0.05)"
"""Ends on SIGTERM (Python's default action for it)."""

_STUBBORN = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ignoring', flush=True)\n"
    "while True: time.sleep(0.05)"
)
"""Ignores SIGTERM, as a service stuck in its shutdown does: only SIGKILL ends it."""


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[ServiceProcess]]:
    """The processes a test starts with `_running`; their pipes closed, and any left killed."""
    procs: list[ServiceProcess] = []
    yield procs
    for p in procs:
        p.kill()
        if p.proc is not None and p.proc.stdout is not None:
            p.proc.stdout.close()


def _running(started: list[ServiceProcess], name: str, code: str) -> ServiceProcess:
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    started.append(ServiceProcess(name, KsbSettings(), Path(f"{name}.log"), proc=proc))
    return started[-1]


def test_stop_all_ends_polite_and_stubborn_processes_and_reports_none_left(
    started: list[ServiceProcess],
) -> None:
    stubborn = [_running(started, f"stubborn-{i}", _STUBBORN) for i in range(2)]
    for p in stubborn:  # its handler is in place before it is signalled
        assert p.proc is not None and p.proc.stdout is not None
        assert p.proc.stdout.readline() == b"ignoring\n"
    polite = [_running(started, f"polite-{i}", _POLITE) for i in range(2)]
    procs = [stubborn[0], *polite, stubborn[1]]

    left = stop_all(procs, grace_s=0.5, kill_wait_s=10)

    assert left == []
    assert not any(p.alive() for p in procs)
    codes = {p.name: p.proc.returncode for p in procs if p.proc is not None}
    assert codes == {"stubborn-0": -9, "polite-0": -15, "polite-1": -15, "stubborn-1": -9}


def test_stop_all_skips_processes_that_already_ended(started: list[ServiceProcess]) -> None:
    done = _running(started, "done", "pass")
    assert done.proc is not None
    done.proc.wait(10)
    never_started = ServiceProcess("never", KsbSettings(), Path("never.log"))

    assert stop_all([done, never_started], grace_s=0.1, kill_wait_s=1) == []
    assert done.proc.returncode == 0
