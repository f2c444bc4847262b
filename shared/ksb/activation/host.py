"""The activation host's own configuration: the commands it may run and the logins tasks run as.

The catalog says *which* program a queue's readers are and *whom* they run as; the host says
*what* that program is and holds that principal's login. It is SQL Server External Activator's
split: its configuration file (``EAService.config``) lists each application's image path and
command line, and the database only raises the event. So the catalog names a command
(``COMMAND = 'order-reader'``) and a principal (``EXECUTE AS 'orders-app'``), and this file,
written by whoever runs the host (``KSB_ACTIVATION_CONFIG``), defines them::

    commands:                 # COMMAND = 'name' -> the program, as an argument vector (no shell)
      order-reader:
        argv: [python, -m, apps.orders_reader]
    logins:                   # EXECUTE AS 'principal' -> that principal's own secrets
      orders-app:
        kafka_password_file: /run/secrets/orders-app
        redis_password_file: /run/secrets/orders-app.redis   # optional: its task heartbeats

A catalog writer can thus choose among the programs and principals the host offers and no
other: shell text in ``COMMAND`` names no command, and a principal the host holds no login for
runs nothing. A task gets its principal's login and never the host's own (`task_launch`). Pure:
the activation service reads the file once, at start, and applies these rules to each start.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ksb.catalog.model import Activation
from ksb.errors import CatalogError
from ksb.runtime import confinement
from ksb.security.governance import COMMAND_NAME, PROCEDURE_PATH, task_principal
from ksb.settings import KsbSettings, QueueClientSettings

__all__ = [
    "ActivationHostConfig",
    "NamedCommand",
    "TaskLaunch",
    "TaskLogin",
    "confined_argv",
    "load_host_config",
    "task_launch",
    "task_settings",
]

S = TypeVar("S", bound=QueueClientSettings)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NamedCommand(_Model):
    """A program the catalog may name: its argument vector, run without a shell. The task
    finds its queue and id in ``ACTIVATED_QUEUE`` and ``ACTIVATED_TASK_ID``."""

    argv: tuple[str, ...] = Field(min_length=1)


class TaskLogin(_Model):
    """A principal's own secrets, which tasks running as it get (and nothing else)."""

    kafka_password_file: str = Field(min_length=1)
    redis_password_file: str = ""
    """Its Redis password (a task heartbeats into its queue's task set); empty: no Redis login,
    the activation service keeps the heartbeat of the tasks it started."""


class ActivationHostConfig(_Model):
    """``KSB_ACTIVATION_CONFIG``: the host's commands and the logins tasks may run as."""

    commands: dict[str, NamedCommand] = Field(default_factory=dict)
    logins: dict[str, TaskLogin] = Field(default_factory=dict)

    def secret_files(self) -> list[str]:
        """Every secret file the host holds for its tasks (none of which a task may read but
        its own)."""
        return [
            f
            for login in self.logins.values()
            for f in (login.kafka_password_file, login.redis_password_file)
            if f
        ]


def load_host_config(path: str) -> ActivationHostConfig:
    """The file at `path` (empty: a host that runs nothing), refused with the field named."""
    if not path:
        return ActivationHostConfig()
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise CatalogError(f"activation host config {p}: {exc}") from exc
    try:
        config = ActivationHostConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
        )
        raise CatalogError(f"activation host config {p}: {problems}") from exc
    bad = sorted(n for n in config.commands if not COMMAND_NAME.match(n))
    if bad:
        raise CatalogError(f"activation host config {p}: commands: not command names: {bad}")
    return config


@dataclass(frozen=True)
class TaskLaunch:
    """How to start one task: its argument vector, and whom it logs in as, with what."""

    argv: list[str]
    principal: str
    login: TaskLogin | None
    """None on a stack without security, where nobody logs in."""


def task_launch(
    host: ActivationHostConfig,
    activation: Activation,
    *,
    instance: str,
    queue: str,
    task_id: str,
    secured: bool = True,
) -> TaskLaunch:
    """The start of a task of `activation` on this host, or `CatalogError` saying why the host
    refuses it (``EXECUTE AS`` unmapped or a principal it holds no login for, a command it
    does not define, shell text where a name belongs). On a stack without security
    (`secured` False) nobody logs in, and a principal needs no login here."""
    principal = task_principal(activation, instance)
    login = host.logins.get(principal)
    if login is None and secured:
        raise CatalogError(
            f"EXECUTE AS {principal!r}: this activation host holds no login for {principal} "
            "(KSB_ACTIVATION_CONFIG, logins)",
            code="execute_as_unknown",
        )
    if activation.procedure is not None:
        if not PROCEDURE_PATH.match(activation.procedure):
            raise CatalogError(
                f"PROCEDURE_NAME {activation.procedure!r} is not a Python callable "
                "'module:function'",
                code="procedure_not_named",
            )
        argv = [sys.executable, "-m", "ksb.activation.activated", queue, activation.procedure]
        return TaskLaunch([*argv, task_id], principal, login)
    name = activation.command or ""
    command = host.commands.get(name) if COMMAND_NAME.match(name) else None
    if command is None:
        raise CatalogError(
            f"COMMAND {name!r} is not a command of this activation host "
            "(KSB_ACTIVATION_CONFIG, commands): the catalog names commands, it holds none",
            code="command_not_named",
        )
    return TaskLaunch(list(command.argv), principal, login)


def task_settings(
    host_settings: KsbSettings, model: type[S], principal: str, login: TaskLogin | None
) -> S:
    """The host's settings as a task of kind `model` reads them, logged in as `principal` with
    `login` and holding none of the host's own secrets (no password, no password file, no
    remote credentials): what a child of the host is started with."""
    own: dict[str, str] = {
        "kafka_password": "",
        "redis_password": "",
        "kafka_remote_credentials": "",
        "kafka_password_file": "",
        "redis_password_file": "",
        "redis_username": "",
        "kafka_username": "",
        "principal": "",
    }
    if login is not None:
        own.update(
            kafka_username=principal,
            kafka_password_file=login.kafka_password_file,
            principal=principal,
        )
        if login.redis_password_file:
            own.update(redis_username=principal, redis_password_file=login.redis_password_file)
    return host_settings.narrow(model, **own)


def confined_argv(
    argv: Sequence[str],
    host_settings: KsbSettings,
    held: Sequence[str],
    task: KsbSettings,
) -> list[str]:
    """`argv` confined (`ksb.runtime.confinement`) so that it reads, of the secrets the host
    has (its own password files and remote credentials, and the logins it `held` for tasks),
    only those its own `task` settings name; the CA files it trusts stay readable."""
    s = host_settings
    secrets = [s.kafka_password_file, s.redis_password_file, s.kafka_remote_credentials, *held]
    denied = sorted({os.path.dirname(os.path.abspath(f)) for f in secrets if f})
    own = [task.kafka_password_file, task.redis_password_file, task.kafka_ssl_ca, task.redis_ssl_ca]
    if isinstance(task, QueueClientSettings):
        own.append(task.queue_ssl_ca)
    return confinement.wrap(argv, denied=denied, allowed=sorted({f for f in own if f}))
