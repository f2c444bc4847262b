"""Podman as the container tools call it: with the project's containers.conf, every call bounded.

`CONTAINERS_CONF` points podman at infra/images/containers.conf (runc, cgroupfs, no ulimits: what
this machine needs), leaving /etc alone. Every call has a timeout, so a hung podman fails the run
with the command named instead of hanging CI.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devtools.processes import REPO_ROOT

__all__ = [
    "CONTAINERS_CONF",
    "PodmanError",
    "image_exists",
    "inspect",
    "podman",
    "podman_env",
]

CONTAINERS_CONF = REPO_ROOT / "infra" / "images" / "containers.conf"
DEFAULT_TIMEOUT_S = 120.0


class PodmanError(RuntimeError):
    """A podman (or podman-compose) command failed or timed out; the message names it."""


def podman_env() -> dict[str, str]:
    """This process's environment with podman pointed at the project's containers.conf."""
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def podman(
    *args: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    check: bool = True,
    cwd: Path = REPO_ROOT,
    stdin: bytes | None = None,
    program: Sequence[str] = ("podman",),
) -> subprocess.CompletedProcess[str]:
    """Run `podman <args>` (or `program <args>`), its output captured; raises PodmanError when it
    fails (with `check`) or outlives `timeout_s`."""
    cmd = [*program, *args]
    try:
        done = subprocess.run(
            cmd,
            cwd=cwd,
            env=podman_env(),
            input=stdin.decode() if stdin is not None else None,
            stdin=None if stdin is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        raise PodmanError(f"{' '.join(cmd)}: no answer in {timeout_s:.0f} s") from exc
    if check and done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()[-2000:]
        raise PodmanError(f"{' '.join(cmd)} exited {done.returncode}: {detail}")
    return done


def image_exists(name: str) -> bool:
    return podman("image", "exists", name, check=False).returncode == 0


def inspect(*names: str, kind: str = "container") -> list[dict[str, Any]]:
    """`podman <kind> inspect` of `names` (those that exist)."""
    if not names:
        return []
    done = podman(kind, "inspect", *names, check=False)
    if not done.stdout.strip():
        return []
    found: list[dict[str, Any]] = json.loads(done.stdout)
    return found
