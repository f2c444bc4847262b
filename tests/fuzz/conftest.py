"""The fuzz tests' budget: a few hundred inputs per decoder in `make test`, 10,000 with ``--long``.

Each test runs its property through `Budget.run`, which counts the inputs hypothesis actually fed
it; the counts are printed at the end of the session, so a long run reports what it covered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

__all__ = ["FAST_EXAMPLES", "LONG_EXAMPLES", "Budget"]

FAST_EXAMPLES = 150
LONG_EXAMPLES = 10_000

T = TypeVar("T")

_counts: dict[str, int] = {}


class Budget:
    """Runs a property over `examples` inputs of a strategy and records how many it ran."""

    def __init__(self, examples: int) -> None:
        self.examples = examples

    def run(self, name: str, strategy: st.SearchStrategy[T], prop: Callable[[T], None]) -> int:
        ran = 0

        @settings(
            max_examples=self.examples,
            deadline=None,  # the contract's own CPU bound judges time, load-independent
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.large_base_example,
            ],
        )
        @given(strategy)
        def each(value: T) -> None:
            nonlocal ran
            ran += 1
            prop(value)

        each()
        _counts[name] = _counts.get(name, 0) + ran
        return ran


@pytest.fixture
def budget(long_mode: bool) -> Budget:
    return Budget(LONG_EXAMPLES if long_mode else FAST_EXAMPLES)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _counts:
        terminalreporter.section("fuzz inputs (hypothesis)")
        for name, n in sorted(_counts.items()):
            terminalreporter.write_line(f"{name:<28} {n:>8} inputs")
