"""Suppression of destinations after a disconnect or a failed connection attempt, in milliseconds."""

from __future__ import annotations

from tests.unit.factories import suppression


def test_suppression_after_disconnect_lasts_15_seconds() -> None:
    s = suppression()
    s.on_disconnect("b", 1000)
    assert s.is_suppressed("b", 15_999)
    assert not s.is_suppressed("b", 16_000)


def test_suppression_restarts_after_each_failed_connect() -> None:
    s = suppression()
    s.on_failed_connect("b", 0)
    assert s.is_suppressed("b", 59_999)
    assert not s.is_suppressed("b", 60_000)
    s.on_failed_connect("b", 60_000)
    assert s.is_suppressed("b", 119_999)
    assert s.suppressed_until("b") == 120_000


def test_a_disconnect_does_not_shorten_a_failed_connect_back_off() -> None:
    s = suppression()
    s.on_failed_connect("b", 0)
    s.on_disconnect("b", 1000)
    assert s.is_suppressed("b", 59_999)


def test_a_connection_clears_suppression() -> None:
    s = suppression()
    s.on_failed_connect("b", 0)
    s.on_connected("b")
    assert not s.is_suppressed("b", 1)


def test_due_lists_pending_destinations_that_are_not_suppressed() -> None:
    s = suppression(after_disconnect_ms=1000)
    s.on_disconnect("down", 0)
    s.on_failed_connect("dead", 0)
    assert s.due(["up", "down", "dead"], 500) == ["up"]
    assert s.due(["up", "down", "dead"], 1000) == ["up", "down"]
