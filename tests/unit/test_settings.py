"""Settings from the environment: typos refused by name, interval variables left to their reader."""

from __future__ import annotations

import pytest

from ksb.errors import CatalogError
from ksb.runtime.ticker import Intervals, IntervalsError
from ksb.settings import load_settings


def test_a_misspelt_setting_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KSB_INSTANSE", "x")
    with pytest.raises(CatalogError, match="KSB_INSTANSE"):
        load_settings()


def test_interval_variables_pass_settings_and_are_checked_by_intervals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A service reads both: `load_settings` must not refuse what `Intervals.from_env` owns."""
    monkeypatch.setenv("KSB_TICK_MS", "250")
    monkeypatch.setenv("KSB_INTERVAL_SUPPRESS_AFTER_DISCONNECT_MS", "1500")
    monkeypatch.setenv("KSB_TRANSMITTER_MEMORY_BYTES", "1048576")
    s = load_settings()
    assert s.tick_ms == 250 and s.transmitter_memory_bytes == 1_048_576
    assert Intervals.from_env().suppress_after_disconnect_ms == 1_500
    monkeypatch.setenv("KSB_INTERVAL_SUPRESS_MS", "1")
    load_settings()
    with pytest.raises(IntervalsError, match="KSB_INTERVAL_SUPRESS_MS"):
        Intervals.from_env()
