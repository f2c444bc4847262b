"""The benchmark's load through a running instance with one fault injected part way, and the
invariants it must keep: what the scale-out tests (a dispatcher killed, paused or added) and the
Kafka-cluster test (a broker killed) share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.e2e import KsbResult, Tally, fault_at, run_ksb
from devtools.deployment import Deployment

__all__ = ["Load", "assert_exactly_once_in_order", "run_with_fault"]


@dataclass(frozen=True)
class Load:
    """The benchmark's load shape (`bench.e2e.run_ksb`): `messages` over `dialogs`, received by
    `receivers` threads with `window` commits in flight each, small bodies."""

    messages: int
    dialogs: int
    receivers: int = 4
    window: int = 16
    timeout_s: float = 200


def run_with_fault(
    settings: Deployment, load: Load, fault: Callable[[Tally], None], at: float
) -> tuple[KsbResult, list[BaseException]]:
    """The load, with `fault` run once the share `at` of its messages has been delivered
    (`bench.e2e.fault_at`); what the fault raised is returned beside the result."""
    tally = Tally(expected=load.messages)
    with fault_at(tally, at, fault) as failures:
        result = run_ksb(
            settings,
            dialogs=load.dialogs,
            messages=load.messages,
            body_bytes=64,
            receivers=load.receivers,
            window=load.window,
            top=None,
            probes=0,
            timeout_s=load.timeout_s,
            tally=tally,
        )
    return result, failures


def assert_exactly_once_in_order(
    result: KsbResult, failures: list[BaseException], load: Load
) -> None:
    """Every message delivered once, in its dialog's order, and no commit refused."""
    assert not failures, failures
    assert result.problems == ()
    assert result.verified and result.rate.messages == load.messages
    assert result.refused == 0 and result.lock_lost == 0
