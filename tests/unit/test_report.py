"""`make report`: the page is built from the job's Parquet files, newest batch winning per window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

from ksb.spark.ordering import ROW_COLUMNS  # noqa: E402
from ksb.spark.report import load_outputs, main, render  # noqa: E402


def _sla(batch: int, start: int, priority: int, received: int, p95: float) -> dict[str, Any]:
    return {
        "window_start_ms": start, "window_end_ms": start + 10_000, "queue": "Q", "service": "//s",
        "priority": priority, "enqueued": received, "received": received, "receives": received,
        "rollbacks": 0, "refused": 0, "purged": 0, "dead_lettered": 0, "errors": 0, "breaches": 1,
        "tiq_p50_ms": p95 / 2, "tiq_p95_ms": p95, "tiq_p99_ms": p95, "tiq_max_ms": p95,
        "e2e_p50_ms": None, "e2e_p95_ms": None, "e2e_p99_ms": None, "readers": 2,
        "target_ms": 50, "batch_id": batch,
    }  # fmt: skip


def _ordering(batch: int, **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_COLUMNS)
    row.update(values, batch_id=batch)
    return row


def _write(folder: Path, name: str, batch: int, rows: list[dict[str, Any]]) -> None:
    (folder / name).mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), folder / name / f"batch-{batch:010d}.parquet")


def test_report_renders_charts_from_the_newest_rows(tmp_path: Path) -> None:
    out = tmp_path / "spark" / "inst1"
    _write(out, "sla", 0, [_sla(0, 0, 5, 3, 40.0), _sla(0, 0, 9, 1, 5.0)])
    _write(out, "sla", 1, [_sla(1, 0, 5, 7, 80.0), _sla(1, 10_000, 5, 2, 20.0)])
    inv = dict(row="inversions", queue="Q", kind="receive", high=9, low=5, window_start_ms=0)
    _write(out, "ordering", 0, [
        _ordering(0, **inv, inversions=1, starvation_exceptions=0),
        _ordering(0, row="backlog", queue="Q", event_ms=5_000, ready_messages=12, ready_groups=3,
                  locked_groups=1),
    ])  # fmt: skip
    _write(out, "ordering", 1, [
        _ordering(1, **inv, inversions=2, starvation_exceptions=1),
        _ordering(1, row="totals", queue="Q", kind="receive", high=9, low=5, inversions=2,
                  starvation_exceptions=1),
        _ordering(1, row="reaction", queue="Q", event_ms=6_000, reaction_ms=250),
    ])  # fmt: skip

    outputs = load_outputs(tmp_path / "spark")
    assert {r["instance"] for r in outputs["sla"]} == {"inst1"}
    page = render(outputs)
    assert page.count("<svg") == 4  # p95, p50, inversions, readers against backlog
    assert "priority 9" in page and "receive 9&gt;5" in page
    # Newest batch per window: 7 + 2 + 1 received, not 3 + 7 + 2 + 1.
    assert "<td>inst1</td><td>Q</td><td>10</td>" in page
    assert "<td>250</td>" in page

    target = tmp_path / "report" / "index.html"
    assert main(["--input", str(tmp_path / "spark"), "--output", str(target)]) == 0
    assert target.read_text().startswith("<!doctype html>")


def test_report_without_outputs_says_so(tmp_path: Path) -> None:
    target = tmp_path / "index.html"
    assert main(["--input", str(tmp_path / "none"), "--output", str(target)]) == 0
    assert "No outputs yet" in target.read_text()
