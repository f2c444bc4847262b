"""One queue monitor's state: what it has seen of its queue, and what it has started."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from typing import Any

from ksb.activation.events import Traces
from ksb.activation.monitor import ExternalNotifier, QueueMonitor
from ksb.catalog.model import Queue

__all__ = ["QueueWatch"]


@dataclass
class QueueWatch:
    """One queue monitor's state."""

    queue: Queue
    monitor: QueueMonitor
    notifier: ExternalNotifier | None
    tasks: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    traces: Traces = field(default_factory=Traces)
    """The queue and its readers as of the previous look (`ksb.activation.events`)."""
    last_activation_ms: int | None = None
    activations: int = 0
    notifications: int = 0
    view: dict[str, Any] = field(default_factory=dict)
    refused: str | None = None
    """Why the host refused the last start (`ksb.activation.host`), until one succeeds."""

    def running(self) -> int:
        """Tasks this service started that still run."""
        return sum(1 for p in self.tasks.values() if p.poll() is None)
