"""The benchmark's tally of deliveries: what it says of a run that stopped short."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from bench.e2e import Tally


def _applied() -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(None)
    return fut


def test_the_dialogs_short_of_their_messages_are_named_with_their_handles() -> None:
    tally = Tally(expected=6, handles=["h0", "h1", "h2"])
    tally.outcome(_applied(), [(0, 0, 0), (0, 1, 0), (1, 0, 0)])  # (dialog, seq, sent)
    assert tally.short_of(2) == {1: (1, "h1"), 2: (0, "h2")}
    # A message skipped is a gap in the problems; the dialog is short by its count, not here.
    tally.outcome(_applied(), [(2, 1, 0)])
    assert tally.short_of(2) == {1: (1, "h1")}
    assert tally.problems == ["dialog 2: got message 1, expected 0 (gap)"]
    assert tally.delivered == 4 and not tally.done.is_set()
