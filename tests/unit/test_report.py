"""`make report`: the page is built from the job's Parquet files, newest batch winning per window."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")
pytest.importorskip("plotly")

from ksb.spark.ordering import ROW_COLUMNS  # noqa: E402
from ksb.spark.report import CHARTS, charts, load_outputs, main, render, summary  # noqa: E402


def _sla(
    batch: int, start: int, priority: int, received: int, p95: float, dead: int = 0
) -> dict[str, Any]:
    return {
        "window_start_ms": start, "window_end_ms": start + 10_000, "queue": "Q", "service": "//s",
        "priority": priority, "enqueued": received, "received": received, "receives": received,
        "rollbacks": 0, "refused": 0, "purged": 0, "dead_lettered": dead, "errors": 0,
        "breaches": 1, "tiq_p50_ms": p95 / 2, "tiq_p95_ms": p95, "tiq_p99_ms": p95,
        "tiq_max_ms": p95, "e2e_p50_ms": None, "e2e_p95_ms": None, "e2e_p99_ms": None,
        "readers": 2, "target_ms": 50, "batch_id": batch,
    }  # fmt: skip


def _ordering(batch: int, **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_COLUMNS)
    row.update(values, batch_id=batch)
    return row


def _write(folder: Path, name: str, batch: int, rows: list[dict[str, Any]]) -> None:
    (folder / name).mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), folder / name / f"batch-{batch:010d}.parquet")


def write_outputs(spark_dir: Path) -> None:
    """Two batches of one instance's outputs, the second rewriting a window of the first."""
    out = spark_dir / "inst1"
    _write(out, "sla", 0, [_sla(0, 0, 5, 3, 40.0), _sla(0, 0, 9, 1, 5.0)])
    _write(out, "sla", 1, [_sla(1, 0, 5, 7, 80.0, dead=1), _sla(1, 10_000, 5, 2, 20.0, dead=3)])
    inv = dict(row="inversions", queue="Q", kind="receive", high=9, low=5, window_start_ms=0)
    _write(out, "ordering", 0, [
        _ordering(0, **inv, inversions=1, starvation_exceptions=0),
        _ordering(0, row="backlog", queue="Q", event_ms=5_000, ready_messages=12, ready_groups=3,
                  locked_groups=1, oldest_enqueued_ms=1_000, oldest_age_ms=4_000),
    ])  # fmt: skip
    _write(out, "ordering", 1, [
        _ordering(1, **inv, inversions=2, starvation_exceptions=1),
        _ordering(1, row="totals", queue="Q", kind="receive", high=9, low=5, inversions=2,
                  starvation_exceptions=1),
        _ordering(1, row="reaction", queue="Q", event_ms=6_000, reaction_ms=250),
        _ordering(1, row="backlog", queue="Q", event_ms=15_000, ready_messages=0, ready_groups=0,
                  locked_groups=0, oldest_enqueued_ms=None, oldest_age_ms=None),
    ])  # fmt: skip


def test_series_come_from_the_newest_rows(tmp_path: Path) -> None:
    write_outputs(tmp_path / "spark")
    outputs = load_outputs(tmp_path / "spark")
    assert {r["instance"] for r in outputs["sla"]} == {"inst1"}
    c = charts(outputs)
    assert tuple(c) == CHARTS
    q = "Q (inst1)"
    assert c["backlog"].series == {q: [(5_000, 12.0), (15_000, 0.0)]}
    assert c["oldest_age"].series == {q: [(5_000, 4.0), (15_000, 0.0)]}
    # Newest batch per window: window 0 received 7 (batch 1) + 1 (level 9, batch 0) in 10 s.
    assert c["throughput"].series[f"{q} received"] == [(0, pytest.approx(0.8)), (10_000, 0.2)]
    assert c["time_in_queue"].series == {
        f"{q} priority 5": [(0, 80.0), (10_000, 20.0)],
        f"{q} priority 9": [(0, 5.0)],
    }
    assert c["dead_letters"].series == {q: [(0, 1.0), (10_000, 3.0)]}
    assert c["inversions"].series == {f"{q} receive 9>5": [(0, 2.0)]}
    assert c["readers"].right == {f"{q} distinct readers": [(0, 2.0), (10_000, 2.0)]}
    # received, breaches, dead letters, inversions, starvation, backlog now, age now, reaction
    assert summary(outputs) == [("inst1", "Q", 10, 3, 4, 2, 1, 0, 0.0, 250)]


def test_the_page_is_one_offline_file_with_every_chart(tmp_path: Path) -> None:
    write_outputs(tmp_path / "spark")
    page = render(load_outputs(tmp_path / "spark"))
    for key in CHARTS:
        assert f'id="chart-{key}"' in page
    assert "Plotly.newPlot" in page
    # The library is inlined, and nothing is loaded from anywhere when the page is opened.
    assert len(page) > 1_000_000
    assert not re.search(r"<script[^>]+src=", page)
    assert "<td>inst1</td><td>Q</td><td>10</td>" in page

    target = tmp_path / "report" / "index.html"
    assert main(["--input", str(tmp_path / "spark"), "--output", str(target)]) == 0
    assert target.read_text().startswith("<!doctype html>")


def test_report_without_outputs_says_so(tmp_path: Path) -> None:
    target = tmp_path / "index.html"
    assert main(["--input", str(tmp_path / "none"), "--output", str(target)]) == 0
    page = target.read_text()
    assert "No outputs yet" in page
    assert all(charts({"sla": [], "ordering": []})[k].empty for k in CHARTS)
