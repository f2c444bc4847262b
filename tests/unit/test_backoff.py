"""The doubling curve after failures, and its checks."""

from __future__ import annotations

import pytest

from ksb.backoff import Backoff


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"initial_ms": 0}, "initial_ms"), ({"factor": 0.5}, "factor"), ({"max_ms": 10}, "max_ms")],
)
def test_backoff_settings_are_checked(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Backoff(**{"initial_ms": 1_000, "max_ms": 60_000, **kwargs})  # type: ignore[arg-type]


def test_backoff_never_overflows_for_a_peer_down_for_days() -> None:
    assert Backoff(initial_ms=1_000, max_ms=60_000).delay_ms(100_000) == 60_000
