"""Which of the stack's files a process the tools start may read: those its own settings name.

Every process of the local stack runs as the same Unix user, so the stack's directory being
private (0700) keeps other users out, not one process from another's password. The runner
(`devtools.runner`) therefore starts each service confined (`ksb.runtime.confinement`): it reads
nothing beneath the stack's private directories (``Deployment.private_dirs``: its secrets, the
Kafka and Redis data) but the files its own settings name, which are its own password files,
the CA it trusts, its lease key or certificate, and for a host of tasks the logins it holds for
them (its tasks inherit the confinement, then narrow it to their own). So a process can read
its own secrets and no other's, as each container of a compose deployment can.

The Spark job is not confined: its JVM keeps temporary files in ``/tmp`` that it reads back,
and a confined process cannot read what is created, after it started, directly in a directory
on the way to a private one (the test stack lives under ``/tmp``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from ksb.runtime import confinement
from ksb.settings import KsbSettings

__all__ = ["UNCONFINED", "confined", "own_files", "scratch_dirs"]

UNCONFINED = frozenset({"ksb.spark"})
"""Modules the runner does not confine (see the module's docstring)."""

_HOST_FILES = ("activation_config", "external_activator_config")
"""Settings naming a host's configuration, whose logins' files the host holds for its tasks."""
_SCRATCH = ("queue_store_dir", "spark_checkpoint_dir", "spark_output_dir")
"""Settings naming directories a process writes and reads back: made before it is confined."""


def own_files(settings: KsbSettings) -> list[str]:
    """Every existing file `settings` name, and those the files they name name in turn (a remote
    credentials file's password files, a host configuration's logins)."""
    values = [v for v in settings.model_dump().values() if isinstance(v, str) and v]
    files = [v for v in values if os.path.isfile(v)]
    named: list[str] = []
    remote = getattr(settings, "kafka_remote_credentials", "")
    if remote and os.path.isfile(remote):
        for entry in json.loads(Path(remote).read_text()).values():
            named += [entry.get("password_file", ""), entry.get("ssl_ca", "")]
    for field in _HOST_FILES:
        path = getattr(settings, field, "")
        if path and os.path.isfile(path):
            named += _login_files(yaml.safe_load(Path(path).read_text()) or {})
    return sorted({*files, *(f for f in named if f and os.path.isfile(f))})


def _login_files(config: dict[str, Any]) -> Iterable[str]:
    for login in (config.get("logins") or {}).values():
        yield from (login.get("kafka_password_file", ""), login.get("redis_password_file", ""))


def scratch_dirs(settings: KsbSettings) -> list[Path]:
    """The directories `settings` name that the process fills and reads back."""
    return [Path(v) for f in _SCRATCH if (v := getattr(settings, f, ""))]


def confined(
    argv: list[str], module: str, settings: KsbSettings, private_dirs: Iterable[str]
) -> list[str]:
    """`argv` (``python -m module``) confined to the files its `settings` name beneath
    `private_dirs`; unchanged where there is nothing private, for an unconfined module, or on a
    kernel without Landlock."""
    private = [d for d in private_dirs if d]
    if not private or module in UNCONFINED or not confinement.available():
        return argv
    for d in scratch_dirs(settings):
        d.mkdir(parents=True, exist_ok=True)
    return confinement.wrap(argv, denied=private, allowed=own_files(settings))
