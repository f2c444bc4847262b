"""`ksb.runtime.service.run_main` bounds the interpreter's exit after the service has closed: a
process whose exit hangs (here on a thread that never ends) ends itself with every thread's stack
in its log, instead of outliving its supervisor's grace."""

from __future__ import annotations

import subprocess
import sys

from devtools.runner import REPO_ROOT

_SERVICE = """
import threading
from ksb.runtime.service import run_main
from ksb.settings import ServiceSettings

class {name}:
    settings = ServiceSettings()

    def log_fields(self) -> dict[str, str]:
        return {{}}

    def run(self, stop: threading.Event) -> None:
        {body}

run_main({name}, "exit-test", exit_grace_s={grace_s})
"""


def _run(name: str, body: str, grace_s: float) -> subprocess.CompletedProcess[str]:
    code = _SERVICE.format(name=name, body=body, grace_s=grace_s)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_exit_held_up_by_a_thread_ends_with_status_1_and_the_stacks_logged() -> None:
    done = _run("Lingering", "threading.Thread(target=threading.Event().wait).start()", 0.3)

    assert done.returncode == 1, done.stderr
    assert "Timeout (0:00:00.3" in done.stderr, done.stderr
    assert "in wait" in done.stderr, done.stderr  # the stack of the thread that held the exit


def test_a_clean_exit_is_not_cut_short() -> None:
    done = _run("Prompt", "print('served', flush=True)", 10.0)

    assert done.returncode == 0, done.stderr
    assert done.stdout == "served\n"
    assert "Timeout" not in done.stderr
