"""The external activator's decisions: how many reader commands to start for a queue, and when.

With external activation KSB does not run readers itself: the activation service publishes a
QUEUE_ACTIVATION event when a new reader would have useful work, and BROKER_QUEUE_DISABLED when
poison handling turns a queue off. The external activator (`services.external_activator`) reads
those events and runs a configured command per queue, between its own minimum and maximum.

Everything here is pure (no processes, no Kafka, no clock): the service counts its live commands
and feeds the counts in, so the rules below are unit-tested in milliseconds.

- A QUEUE_ACTIVATION event starts one more command, unless ``max`` already run. One, not "up to
  max": the activation service re-evaluates after the next RECEIVE and sends another event if
  work is still piling up, so readers grow with demand instead of all at once.
- ``min`` commands are kept running always: one that exits is restarted. A command that keeps
  failing (non-zero exit) is restarted with exponential back-off, so a broken command line does
  not become a fork loop.
- A command runs as the principal its queue's ``execute_as`` names, with the login the file
  holds for it (``logins``, as `ksb.activation.host`'s): never with the activator's own, which
  no reader inherits. The file is the host's, so its commands are the host's command lines.
- BROKER_QUEUE_DISABLED stops new starts for the queue (the running readers find RECEIVE refused
  and exit by themselves). The activation service sends no QUEUE_ACTIVATION for a disabled queue,
  and events of one queue share a key and so a partition; a QUEUE_ACTIVATION read after the
  disable therefore means the queue was enabled again, and starts are allowed again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ksb.activation.host import TaskLogin
from ksb.backoff import Backoff, FailureHold
from ksb.errors import CatalogError
from ksb.wire.activation import ActivationEvent, BrokerQueueDisabled

__all__ = [
    "ActivationPlanner",
    "ExternalActivatorConfig",
    "QueueReaders",
    "StartDecision",
    "load_config",
]


class QueueReaders(BaseModel):
    """What to run for one queue, and how many of it (``min``/``max`` in the YAML file)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    command: str = Field(min_length=1)
    min_readers: int = Field(0, ge=0, alias="min")
    max_readers: int = Field(1, ge=1, alias="max")
    execute_as: str = ""
    """The principal the command logs in as (its login in the file's ``logins``); empty: none,
    for a stack without security."""

    @model_validator(mode="after")
    def _min_within_max(self) -> QueueReaders:
        if self.min_readers > self.max_readers:
            raise ValueError(f"min ({self.min_readers}) exceeds max ({self.max_readers})")
        return self


class ExternalActivatorConfig(BaseModel):
    """The YAML file: ``queues: {QueueName: {command: ..., min: 0, max: 2, execute_as: p}}`` and
    ``logins: {p: {kafka_password_file: ..., redis_password_file: ...}}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    queues: dict[str, QueueReaders] = Field(min_length=1)
    logins: dict[str, TaskLogin] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _logins_known(self) -> ExternalActivatorConfig:
        for name, q in self.queues.items():
            if q.execute_as and q.execute_as not in self.logins:
                raise ValueError(f"queues.{name}.execute_as: no login for {q.execute_as!r}")
        return self

    def secret_files(self) -> list[str]:
        """Every secret file the activator holds for its readers."""
        return [
            f
            for login in self.logins.values()
            for f in (login.kafka_password_file, login.redis_password_file)
            if f
        ]


def load_config(path: str | Path) -> ExternalActivatorConfig:
    """Read and validate the file; a typo or a bad count fails at start-up with the field named."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CatalogError(f"external activator config {p}: {exc}") from exc
    try:
        return ExternalActivatorConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
        )
        raise CatalogError(f"external activator config {p}: {problems}") from exc


@dataclass(frozen=True)
class StartDecision:
    """How many commands to start now for ``queue`` (0 or more), and why, for the log."""

    queue: str
    start: int
    reason: str


@dataclass
class _QueueState:
    hold: FailureHold
    """Minimum restarts held back after failed commands."""
    disabled: bool = False


@dataclass
class ActivationPlanner:
    """Per-queue decisions for one instance's external activator.

    ``running`` arguments are the commands of that queue still alive, as the caller counts them
    (it started them, so it knows); the planner itself keeps only what events and exits tell it.
    """

    config: ExternalActivatorConfig
    instance: str
    backoff: Backoff
    _states: dict[str, _QueueState] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._states = {q: _QueueState(FailureHold(self.backoff)) for q in self.config.queues}

    @property
    def queues(self) -> list[str]:
        return list(self.config.queues)

    def readers(self, queue: str) -> QueueReaders:
        return self.config.queues[queue]

    def disabled(self, queue: str) -> bool:
        return self._states[queue].disabled

    def on_event(self, event: ActivationEvent, running: int) -> StartDecision:
        """Apply one event: maybe start one command (QUEUE_ACTIVATION), or stop starting (DISABLED)."""
        if event.instance != self.instance:
            return StartDecision(event.queue, 0, f"event of instance {event.instance!r}")
        state = self._states.get(event.queue)
        if state is None:
            return StartDecision(event.queue, 0, "queue not configured")
        if isinstance(event, BrokerQueueDisabled):
            state.disabled = True
            return StartDecision(event.queue, 0, "queue disabled")
        state.disabled = False
        limit = self.config.queues[event.queue].max_readers
        if running >= limit:
            return StartDecision(event.queue, 0, f"{running} running, at max {limit}")
        return StartDecision(event.queue, 1, f"starting one ({running} running, max {limit})")

    def keep_minimum(self, queue: str, running: int, now_ms: int) -> StartDecision:
        """Top the queue up to ``min`` commands, unless disabled or backing off after failures."""
        state = self._states[queue]
        missing = self.config.queues[queue].min_readers - running
        if missing <= 0:
            return StartDecision(queue, 0, "minimum running")
        if state.disabled:
            return StartDecision(queue, 0, "queue disabled")
        if state.hold.holds(now_ms):
            return StartDecision(queue, 0, f"backing off until {state.hold.until_ms}")
        return StartDecision(queue, missing, f"keeping min {missing + running}")

    def on_exit(self, queue: str, returncode: int, now_ms: int) -> None:
        """Record a command's exit: a failure delays the next minimum restart, exponentially."""
        hold = self._states[queue].hold
        if returncode == 0:
            hold.clear()
        else:
            hold.failed(now_ms)
