"""What every demo scenario shares: the console, outcomes, waiting for endpoints to settle.

Endpoint states and error records are read with the CLI's readers (`ksb.cli.readers`), so the
demo checks exactly what `ksb endpoints` and `ksb errors` would show an operator.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rich.console import Console

from devtools.runner import ServiceProcess
from ksb.cli.readers import read_endpoints, read_errors
from ksb.settings import KsbSettings

__all__ = [
    "INSTANCE",
    "INSTANCE_B",
    "RECEIVE_WAIT_MS",
    "SETTLE_TIMEOUT_S",
    "Failures",
    "Outcome",
    "console",
    "endpoint_states",
    "error_records",
    "guarded",
    "percentile",
    "say",
    "settled_states",
    "should_stop",
]

INSTANCE = "demo"
INSTANCE_B = "demo-b"
"""The second instance runs only what carries dialogs across."""
RECEIVE_WAIT_MS = 200
SETTLE_TIMEOUT_S = 30.0  # how long endpoints may take to reach CLOSED after the last END

console = Console(highlight=False, soft_wrap=True)


def say(text: str) -> None:
    console.print(text, markup=False)


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile of an already sorted list (0 for an empty one)."""
    if not sorted_values:
        return 0.0
    rank = max(1, min(len(sorted_values), round(pct / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


@dataclass(frozen=True)
class Outcome:
    ok: bool
    summary: str


def endpoint_states(settings: KsbSettings, handles: set[str] | None = None) -> Counter[str]:
    """Endpoints by state, as `ksb endpoints --all` shows them (only those of `handles` if given:
    one instance can hold several scenarios' dialogs)."""
    eps = read_endpoints(settings)
    return Counter(e.state.name for h, e in eps.items() if handles is None or h in handles)


def error_records(settings: KsbSettings) -> list[dict[str, Any]]:
    """The error topic, as `ksb errors` shows it."""
    return read_errors(settings)


def settled_states(
    settings: KsbSettings,
    expected: int,
    handles: set[str] | None = None,
    timeout_s: float = SETTLE_TIMEOUT_S,
) -> Counter[str]:
    """Endpoint states once `expected` endpoints (of `handles`, if given) are CLOSED, or whatever
    they are after the wait."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = endpoint_states(settings, handles)
        if states.get("CLOSED", 0) >= expected or time.monotonic() > deadline:
            return states
        time.sleep(0.25)


class Failures(Protocol):
    """What a scenario's counters keep of what went wrong."""

    failures: list[str]

    def fail(self, what: str) -> None: ...


def guarded(stats: Failures, who: str, fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as exc:
        stats.fail(f"{who} crashed: {exc!r}")


def should_stop(
    stats: Failures, services: list[ServiceProcess], deadline: float, timed_out: str
) -> bool:
    """A reader crashed, a service died (recorded as a failure) or time is up (recorded too)."""
    if any("crashed" in f for f in stats.failures):
        return True
    dead = [s.name for s in services if not s.alive()]
    if dead:
        stats.fail(f"service(s) exited during the demo: {', '.join(dead)}")
        return True
    if time.monotonic() > deadline:
        stats.fail(timed_out)
        return True
    return False
