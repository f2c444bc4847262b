"""The contract every decoder of outside bytes keeps, checked one input at a time.

A record, a catalog file, a DDL script or an environment comes from outside the process, so a
decoder must either return a value or raise the project's own error (a `ksb.errors.KsbError`) with
a reason a person can act on. Any other exception would crash the service reading it (the
dispatcher's loop, a catalog watcher, the CLI), and an input that takes seconds of CPU is a way to
stall it. Both fuzzers (hypothesis and atheris) call `check` so they judge by one rule.

The time bound is CPU time, measured with ``ITIMER_PROF``: it is what a runaway decoder burns,
it does not drift with the load other processes put on a shared machine, and its signal
(SIGPROF) does not collide with pytest-timeout's or libFuzzer's SIGALRM.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import TypeVar

from ksb.errors import KsbError

__all__ = [
    "CPU_LIMIT_S",
    "ContractViolation",
    "InputTimeout",
    "Outcome",
    "check",
    "cpu_limit",
]

CPU_LIMIT_S = 2.0
"""CPU seconds one decoder call may take; every real record decodes in well under 10 ms."""

T = TypeVar("T")


class InputTimeout(BaseException):
    """Raised inside a decoder that ran out of CPU time (a BaseException, so no ``except
    Exception`` in the code under test can swallow it)."""


class ContractViolation(AssertionError):
    """A decoder broke the contract: a foreign exception, an empty reason, or too much CPU."""


@dataclass(frozen=True)
class Outcome:
    """What one input did: decoded to `value`, or was refused with `error`."""

    value: object
    error: KsbError | None
    cpu_s: float


def _expired(_signum: int, _frame: FrameType | None) -> None:
    raise InputTimeout


@contextmanager
def cpu_limit(seconds: float) -> Iterator[None]:
    """Raise `InputTimeout` in the block once it has used `seconds` of process CPU time."""
    previous = signal.signal(signal.SIGPROF, _expired)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def check(decode: Callable[[], T], *, what: str, limit_s: float = CPU_LIMIT_S) -> Outcome:
    """Run one decoder call and hold it to the contract; raise `ContractViolation` if it breaks it."""
    started = time.process_time()
    try:
        with cpu_limit(limit_s):
            value: object = decode()
    except InputTimeout:
        raise ContractViolation(f"{what}: used more than {limit_s} s of CPU on one input") from None
    except KsbError as exc:
        if not isinstance(exc.reason, str) or not exc.reason.strip():
            raise ContractViolation(f"{what}: {type(exc).__name__} with an empty reason") from exc
        return Outcome(None, exc, time.process_time() - started)
    except Exception as exc:
        raise ContractViolation(
            f"{what}: raised {type(exc).__module__}.{type(exc).__name__} "
            f"instead of a KsbError: {str(exc)[:300]}"
        ) from exc
    return Outcome(value, None, time.process_time() - started)
