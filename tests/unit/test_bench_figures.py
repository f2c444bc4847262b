"""Raw Kafka's baseline in `make bench` is the median of several loaded runs: which run that is,
and how the table says so."""

from __future__ import annotations

import pytest

from bench.raw_kafka import median_run
from bench.scaling import raw_runs_note


def test_the_median_run_is_the_middle_rate_wherever_it_ran() -> None:
    assert median_run([45_000.0, 22_000.0, 36_000.0]) == 2
    assert median_run([22_000.0, 36_000.0, 45_000.0]) == 1
    assert median_run([30_000.0]) == 0


def test_of_an_even_count_the_faster_middle_run_is_taken() -> None:
    # The faster of the two: a slower baseline would raise KSB's throughput ratio.
    assert median_run([40_000.0, 10_000.0, 30_000.0, 20_000.0]) == 2


def test_no_runs_is_an_error() -> None:
    with pytest.raises(ValueError):
        median_run([])


def test_the_table_names_every_run_behind_the_median() -> None:
    note = raw_runs_note({"throughput_runs": [44_790.4, 22_385.0, 35_125.9]})
    assert note == "; raw Kafka's figures are its median run of 3 (44,790, 22,385, 35,126 msg/s)"


def test_one_run_needs_no_note() -> None:
    assert raw_runs_note({"throughput_runs": [35_000.0]}) == ""
    assert raw_runs_note({}) == ""
