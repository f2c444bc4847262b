"""The cross-instance services start on their own, say they are ready and stop cleanly on SIGTERM.

`make run` and deployments start them as processes (`python -m services.<name>`), so one that
crashes at start-up or ignores SIGTERM would break every stack; their work is tested in
test_two_instances and test_two_clusters.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from devtools.deployment import Deployment
from devtools.runner import ServiceProcess

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", ["transmitter", "transport", "forwarder"])
def test_shell_starts_ticks_and_exits_zero_on_sigterm(
    name: str, settings: Deployment, tmp_path: Path
) -> None:
    # A short tick so the loop really runs ticks before the stop, not only the start-up path.
    fast = settings.model_copy(update={"tick_ms": 50})
    proc = ServiceProcess(name, fast, tmp_path / f"{name}.log").start()
    try:
        proc.wait_ready(f"{name} ready", timeout_s=30)
        time.sleep(0.3)
        assert proc.alive(), proc.tail()
        proc.stop(grace_s=10.0)  # past the grace it is SIGKILLed and the exit code is negative
        assert proc.proc is not None
        assert proc.proc.returncode == 0, proc.tail()
        assert f"{name} stopped after" in proc.tail()
    finally:
        proc.stop()
