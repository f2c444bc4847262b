"""docker-compose.yml on this machine: podman-compose, with what podman 4.3 without systemd lacks.

`make compose-test` runs the project's own compose file, plus infra/compose/test-override.yml
for what cannot exist here (Grafana; the network), on podman through podman-compose. Two things
compose does that this podman cannot, the run does itself, generically from the merged config:

* Health checks: podman schedules them with systemd timers, and there is no systemd here, so
  nothing runs them. `ComposeRun.healthy` runs a container's check (``podman healthcheck
  run``) whenever a wait needs its answer.
* ``depends_on`` conditions: podman-compose ignores ``service_healthy`` on podman before 4.6.
  `ComposeRun.up` starts services one at a time in dependency order (`start_order`), each once
  its dependencies meet their conditions (healthy, completed successfully, or started).

Every wait is bounded; `ComposeRun.down` removes containers, volumes and the network even after a
failure, and says what it could not remove. The network is made by the run itself, internal.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from devtools.compose_env import main as compose_env_main
from devtools.containers.podman import PodmanError, podman
from devtools.processes import REPO_ROOT

__all__ = [
    "COMPOSE_FILE",
    "OVERRIDE_FILE",
    "ComposeRun",
    "Container",
    "duration_s",
    "start_order",
]

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
OVERRIDE_FILE = REPO_ROOT / "infra" / "compose" / "test-override.yml"
PROJECT = "ksbtest"
HEALTH_POLL_S = 3.0
HEALTH_WAIT_CAP_S = 300.0
ONE_SHOT_TIMEOUT_S = 180.0
COMPOSE_TIMEOUT_S = 180.0
AARDVARK_DIR = Path("/run/containers/networks/aardvark-dns")
"""Where netavark keeps aardvark-dns's names, one file per network (podman as root)."""


def duration_s(text: str | int | float | None, default: float) -> float:
    """A compose duration (``10s``, ``1m30s``, ``500ms``) in seconds."""
    if text is None:
        return default
    if isinstance(text, int | float):
        return float(text)
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)", text):
        total += (
            float(number) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[unit]
        )
    return total


def _depends(svc: Mapping[str, Any]) -> dict[str, str]:
    """Dependency -> condition (the short list form means ``service_started``)."""
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {d: str((spec or {}).get("condition", "service_started")) for d, spec in deps.items()}


def start_order(services: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The services in an order that starts each after its dependencies (names sorted within a
    rank, so the order is the same every run); ValueError on an unknown dependency or a cycle."""
    for name, svc in services.items():
        unknown = set(_depends(svc)) - set(services)
        if unknown:
            raise ValueError(f"{name} depends on {sorted(unknown)}, which the config lacks")
    done: list[str] = []
    left = dict(services)
    while left:
        ready = sorted(n for n, svc in left.items() if set(_depends(svc)) <= set(done))
        if not ready:
            raise ValueError(f"depends_on has a cycle among {sorted(left)}")
        done += ready
        for n in ready:
            del left[n]
    return done


@dataclass(frozen=True)
class Container:
    """One container of the project, as `podman ps` shows it."""

    name: str
    service: str
    state: str
    exit_code: int

    @property
    def running(self) -> bool:
        return self.state == "running"


class ComposeRun:
    """One project of the compose file on podman: made, brought up, checked and removed."""

    def __init__(self, workdir: Path, *, network: str, say: Callable[[str], None] = print) -> None:
        self.workdir, self.network, self.say = workdir, network, say
        self.env_file = workdir / ".env"
        self.secrets_dir = workdir / "secrets"
        self._config: dict[str, Any] | None = None
        self.timings: dict[str, float] = {}

    # ----------------------------------------------------------------- commands
    def compose(self, *args: str, timeout_s: float = COMPOSE_TIMEOUT_S) -> str:
        """`podman-compose <args>` on this project; its output."""
        # The venv's podman-compose (pyproject pins it), else one on PATH.
        program = shutil.which("podman-compose", path=str(Path(sys.executable).parent))
        program = program or "podman-compose"
        done = podman(
            "--in-pod=false", "-p", PROJECT, "--env-file", str(self.env_file),
            "-f", str(COMPOSE_FILE), "-f", str(OVERRIDE_FILE), *args,
            timeout_s=timeout_s, program=(program,),
        )  # fmt: skip
        return done.stdout

    def config(self) -> dict[str, Any]:
        """The merged, interpolated config (services of profiles nobody asked for left out)."""
        if self._config is None:
            self._config = yaml.safe_load(self.compose("config"))
        return self._config

    def services(self) -> dict[str, dict[str, Any]]:
        return dict(self.config()["services"])

    def one_shot(self, service: str) -> bool:
        return str(self.services()[service].get("restart", "no")) == "no"

    def replicas(self, service: str) -> int:
        deploy = self.services()[service].get("deploy") or {}
        return int(deploy.get("replicas", 1))

    def containers(self, service: str | None = None) -> list[Container]:
        done = podman(
            "ps", "-a", "--filter", f"label=io.podman.compose.project={PROJECT}",
            "--format", "json",
        )  # fmt: skip
        found = []
        for c in json.loads(done.stdout or "[]"):
            svc = (c.get("Labels") or {}).get("com.docker.compose.service", "")
            if service is None or svc == service:
                found.append(Container(c["Names"][0], svc, c["State"], int(c.get("ExitCode", 0))))
        return sorted(found, key=lambda c: c.name)

    def exec(self, container: str, *cmd: str, timeout_s: float = 60) -> str:
        return podman("exec", container, *cmd, timeout_s=timeout_s).stdout

    def logs(self, container: str, lines: int = 40) -> str:
        done = podman("logs", "--tail", str(lines), container, check=False, timeout_s=30)
        return (done.stdout + done.stderr).strip()

    # ----------------------------------------------------------------- health
    def healthy(self, container: str) -> bool:
        """The container's compose health check, run now (nothing else runs it here)."""
        done = podman("healthcheck", "run", container, check=False, timeout_s=60)
        return done.returncode == 0

    def health_budget_s(self, service: str) -> float:
        """How long compose would wait for `service` to turn healthy: its start period plus its
        retries at its interval (capped)."""
        check = self.services()[service].get("healthcheck") or {}
        interval = duration_s(check.get("interval"), 30)
        budget = duration_s(check.get("start_period"), 0) + interval * int(check.get("retries", 3))
        return min(budget + 30, HEALTH_WAIT_CAP_S)

    def wait_healthy(self, service: str, timeout_s: float | None = None) -> None:
        """Every container of `service` running and passing its health check."""
        deadline = time.monotonic() + (timeout_s or self.health_budget_s(service))
        while True:
            containers = self.containers(service)
            sick = [c.name for c in containers if not (c.running and self.healthy(c.name))]
            if containers and not sick:
                return
            if time.monotonic() > deadline:
                detail = "\n".join(f"--- {n}:\n{self.logs(n)}" for n in sick or [service])
                raise PodmanError(
                    f"{service} not healthy in time: {sick or 'no container'}\n{detail}"
                )
            time.sleep(HEALTH_POLL_S)

    def wait_completed(self, service: str, timeout_s: float = ONE_SHOT_TIMEOUT_S) -> None:
        """Every container of one-shot `service` exited 0."""
        for c in self.containers(service):
            done = podman("wait", c.name, timeout_s=timeout_s, check=False)
            code = done.stdout.strip()
            if done.returncode != 0 or code != "0":
                raise PodmanError(f"{c.name} exited {code or '?'}:\n{self.logs(c.name)}")

    def wait_running(self, service: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(c.running for c in self.containers(service)):
            if time.monotonic() > deadline:
                raise PodmanError(f"{service} is not running")
            time.sleep(1)

    def _meet(self, service: str, condition: str) -> None:
        if condition == "service_healthy":
            self.wait_healthy(service)
        elif condition == "service_completed_successfully":
            self.wait_completed(service)
        elif condition == "service_started":
            self.wait_running(service)
        else:
            raise PodmanError(f"unknown depends_on condition {condition!r}")

    # ----------------------------------------------------------------- lifecycle
    def prepare(self) -> None:
        """The run's secrets (`devtools.compose_env`) and its internal network."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        compose_env_main(
            ["--out", str(self.env_file), "--secrets-dir", str(self.secrets_dir), "--force"]
        )
        podman("network", "rm", "-f", self.network, check=False)
        self._drop_stale_names()
        podman("network", "create", "--internal", self.network)

    def _drop_stale_names(self) -> None:
        """Remove aardvark-dns's file for the network when the network is gone. A run the machine
        restarted under never tore its network down, and netavark adds to the file it finds rather
        than writing a new one: its first line, the old gateway aardvark-dns listens on, and the
        old containers' names stayed, and no service could resolve another (seen here: Kafka
        could not resolve its own name, ``kafka``, and never became healthy)."""
        stale = AARDVARK_DIR / self.network
        if stale.exists():
            stale.unlink()
            self.say(f"removed {stale}, left by a run that was not torn down")

    def up(self) -> None:
        """Every service, in dependency order, each once its dependencies meet their conditions;
        then every service healthy (one-shots exited 0)."""
        services = self.services()
        order = start_order(services)
        met: set[tuple[str, str]] = set()
        for name in order:
            started = time.monotonic()
            for dep, condition in _depends(services[name]).items():
                if (dep, condition) not in met:
                    self._meet(dep, condition)
                    met.add((dep, condition))
            scale = [f"--scale={name}={self.replicas(name)}"] if self.replicas(name) > 1 else []
            self.compose("up", "-d", "--no-build", "--no-deps", *scale, name)
            self.timings[name] = time.monotonic() - started
            self.say(f"started {name} ({self.timings[name]:.0f} s waiting for its dependencies)")
        for name in order:
            self._meet(
                name, "service_completed_successfully" if self.one_shot(name) else "service_healthy"
            )

    def down(self) -> list[str]:
        """`down -v`, then remove whatever is left of the project (containers, volumes) and the
        network; returns what was still there after `down`, for the caller to report."""
        left: list[str] = []
        try:
            self.compose("down", "-v", "-t", "10", timeout_s=300)
        except PodmanError as exc:
            left.append(f"down failed: {exc}")
        label = f"label=io.podman.compose.project={PROJECT}"
        for kind, listing in (
            ("container", ["ps", "-a", "-q", "--filter", label]),
            ("volume", ["volume", "ls", "-q", "--filter", label]),
        ):
            ids = podman(*listing, check=False).stdout.split()
            if ids:
                left.append(f"{len(ids)} {kind}(s)")
                rm = ["rm", "-f", "-v"] if kind == "container" else ["volume", "rm", "-f"]
                podman(*rm, *ids, check=False, timeout_s=120)
        if podman("network", "exists", self.network, check=False).returncode == 0:
            podman("network", "rm", "-f", self.network, check=False)
        return left
