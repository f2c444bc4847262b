"""Run KSB services as child processes: used by `make run`, the tests and the benchmarks.

Each service gets its settings through ``KSB_*`` variables, exactly as in docker-compose (only the
variables its own settings model reads), so what the tests start is what a deployment runs. On
a secured stack each is confined to its own secrets (`devtools.confined`): it reads nothing of
the stack's private directories but the files its own settings name, as a container holds only
its own secret.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from devtools.confined import confined
from devtools.deployment import Deployment, process_settings
from devtools.processes import REPO_ROOT, register_child, signal_group, stop_pids
from ksb.settings import KsbSettings, settings_env

__all__ = ["REPO_ROOT", "ServiceProcess", "stop_all"]


@dataclass
class ServiceProcess:
    """One service (``python -m services.<name>``) as a supervised child process."""

    name: str
    settings: KsbSettings
    """The instance's settings; the process gets them narrowed to its module's own model and,
    from a `Deployment`, logged in as its own principal (`devtools.deployment.process_settings`)."""
    log_path: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    _log_start: int = 0
    module: str | None = None
    """Run this module instead of ``services.<name>`` (the Spark job is ``ksb.spark``)."""

    @property
    def main_module(self) -> str:
        return self.module or f"services.{self.name}"

    def start(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Readiness is looked for only in what this run writes, so a reused log cannot fool it.
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = self.log_path.open("ab")
        own = process_settings(self.settings, self.main_module)
        argv = [sys.executable, "-m", self.main_module]
        env = settings_env(own, **self.extra_env)
        if isinstance(self.settings, Deployment) and self.settings.secured:
            confined_argv = confined(argv, self.main_module, own, self.private_dirs)
            if confined_argv is not argv:
                # Python's temporary files where the process may read them back (a directory
                # made after the confinement, beside a private one, could not be read).
                scratch = self.log_path.with_name(f"{self.log_path.name}.tmp")
                scratch.mkdir(exist_ok=True)
                env.setdefault("TMPDIR", str(scratch))
                argv = confined_argv
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def private_dirs(self) -> list[str]:
        """The stack's private directories (`Deployment.private_dirs`)."""
        value = self.settings.private_dirs if isinstance(self.settings, Deployment) else ""
        return [d.strip() for d in value.split(",") if d.strip()]

    def wait_ready(self, marker: str = "ready", timeout_s: float = 60) -> None:
        """Wait for the service to log ``marker`` (each service logs it when it takes work)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}"
                )
            if marker in self.log_text():
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready in {timeout_s}s:\n{self.tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the crash the fault tests inject."""
        if self.send_signal(signal.SIGKILL):
            assert self.proc is not None
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: a process that stops answering without dying (a GC pause, a frozen VM)."""
        self.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        self.send_signal(signal.SIGCONT)

    def send_signal(self, sig: signal.Signals) -> bool:
        """Send ``sig`` to the process's whole group if it still runs; whether it did."""
        if not self.alive():
            return False
        assert self.proc is not None
        signal_group(self.proc.pid, sig)
        return True

    def log_text(self) -> str:
        """What this run of the process has logged (not an earlier run's lines in the same file)."""
        if not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as f:
            f.seek(self._log_start)
            return f.read().decode(errors="replace")

    def stop(self, grace_s: float = 10) -> None:
        """SIGTERM, then SIGKILL if it does not drain in time (`stop_all` of one)."""
        if stop_all([self], grace_s, kill_wait_s=10):
            raise TimeoutError(f"{self.name} still runs 10 s after its SIGKILL:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def stop_all(
    procs: Sequence[ServiceProcess], grace_s: float = 10, kill_wait_s: float = 30
) -> list[ServiceProcess]:
    """`devtools.processes.stop_pids` for service processes: all stopped at once; returns those
    still alive ``kill_wait_s`` after their SIGKILL."""
    running: dict[int, ServiceProcess] = {}
    for p in procs:
        if p.alive():
            assert p.proc is not None
            register_child(p.proc)  # reaped through its Popen, so its returncode is kept
            running[p.proc.pid] = p
    return [running[pid] for pid in stop_pids(list(running), grace_s, kill_wait_s)]
