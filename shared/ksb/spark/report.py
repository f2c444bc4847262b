"""``make report``: the Spark job's Parquet outputs as one self-contained HTML page.

For people without Grafana, the charts an operator asks for first, every queue on each: backlog
(ready messages) and the age of the oldest ready message, throughput (received and enqueued
messages per second, per window), time in queue per priority, dead letters per window, priority
inversions per window, and readers against backlog. Drawn with plotly (Plotly.js), whose library
is written once into the page itself, so the page is one file that works offline: nothing is
fetched when it is opened.

The Parquet files hold update-mode rows (absolute figures per window, rewritten as a window fills),
so for every window and series the row of the newest micro-batch is the one shown. Shaping the
rows into series (`charts`) is pure and tested apart from drawing them (`render`).

    python -m ksb.spark.report [--input var/spark] [--output var/report/index.html]
"""

from __future__ import annotations

import argparse
import datetime as dt
import html
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CHARTS", "Chart", "charts", "load_outputs", "main", "render"]

Row = dict[str, Any]
Point = tuple[float, float]


@dataclass(frozen=True)
class Chart:
    """One chart: named lines of (Unix ms, value) points, and an optional right-hand axis."""

    key: str
    title: str
    y_label: str
    series: Mapping[str, Sequence[Point]]
    right: Mapping[str, Sequence[Point]] = field(default_factory=dict)
    right_label: str = ""
    bar_ms: float | None = None
    """Draw the main series as bars this wide (a window), not lines."""

    @property
    def empty(self) -> bool:
        return not any(self.series.values()) and not any(self.right.values())


CHARTS = (
    "backlog",
    "oldest_age",
    "throughput",
    "time_in_queue",
    "dead_letters",
    "inversions",
    "readers",
)
"""Every chart the page draws, in page order (each has a ``chart-<key>`` element)."""


def load_outputs(folder: Path) -> dict[str, list[Row]]:
    """Every row the job wrote under ``folder`` (any depth: one sub-folder per instance)."""
    import pyarrow.parquet as pq

    out: dict[str, list[Row]] = {"sla": [], "ordering": []}
    for name, rows in out.items():
        for path in sorted(folder.rglob(f"{name}/*.parquet")):
            instance = path.parent.parent.name
            for r in pq.read_table(path).to_pylist():
                r.setdefault("instance", instance)
                rows.append(r)
    return out


def _latest(rows: Iterable[Row], key: Sequence[str]) -> list[Row]:
    best: dict[tuple[Any, ...], Row] = {}
    for r in sorted(rows, key=lambda r: r.get("batch_id", 0)):
        best[tuple(r.get(k) for k in key)] = r
    return list(best.values())


def _queue(r: Row) -> str:
    return f"{r['queue']} ({r['instance']})"


def _lines(points: Mapping[str, Mapping[float, float]]) -> dict[str, list[Point]]:
    return {name: sorted(p.items()) for name, p in sorted(points.items()) if p}


# --------------------------------------------------------------------------- rows -> series
def charts(outputs: Mapping[str, list[Row]]) -> dict[str, Chart]:
    """Every chart's series from the job's rows (newest batch per window and series)."""
    sla = _latest(outputs["sla"], ("instance", "queue", "service", "priority", "window_start_ms"))
    ordering = outputs["ordering"]
    windows = _latest(
        (r for r in ordering if r["row"] == "inversions"),
        ("instance", "queue", "kind", "high", "low", "window_start_ms"),
    )
    backlog = sorted(
        (r for r in ordering if r["row"] == "backlog" and r.get("event_ms")),
        key=lambda r: (r["event_ms"], r.get("batch_id", 0)),
    )
    ready: dict[str, dict[float, float]] = defaultdict(dict)
    age: dict[str, dict[float, float]] = defaultdict(dict)
    for r in backlog:
        ready[_queue(r)][r["event_ms"]] = float(r["ready_messages"] or 0)
        if r.get("oldest_age_ms") is not None:
            age[_queue(r)][r["event_ms"]] = r["oldest_age_ms"] / 1000
        elif "oldest_age_ms" in r:
            age[_queue(r)][r["event_ms"]] = 0.0  # nothing ready: nothing waits
    received: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    enqueued: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    dead: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    p95: dict[str, dict[float, float]] = defaultdict(dict)
    p50: dict[str, dict[float, float]] = defaultdict(dict)
    readers: dict[str, dict[float, float]] = defaultdict(dict)
    for r in sla:
        if not r["queue"]:
            continue  # errors not tied to a queue
        q, start = _queue(r), r["window_start_ms"]
        seconds = max(1.0, (r["window_end_ms"] - start) / 1000)
        received[q][start] += (r["received"] or 0) / seconds
        enqueued[q][start] += (r["enqueued"] or 0) / seconds
        dead[q][start] += float(r["dead_lettered"] or 0)
        readers[q][start] = max(readers[q].get(start, 0.0), float(r["readers"] or 0))
        if r["received"] and r["tiq_p95_ms"] is not None:
            label = f"{q} priority {r['priority']}"
            # One line per level: the worst service's figure in the window.
            p95[label][start] = max(p95[label].get(start, 0.0), float(r["tiq_p95_ms"]))
            p50[label][start] = max(p50[label].get(start, 0.0), float(r["tiq_p50_ms"]))
    window_ms = max((r["window_end_ms"] - r["window_start_ms"] for r in sla), default=10_000)
    inversions: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for r in windows:
        if r["inversions"]:
            label = f"{_queue(r)} {r['kind']} {r['high']}>{r['low']}"
            inversions[label][r["window_start_ms"]] += float(r["inversions"])
    flow = {f"{q} received": p for q, p in received.items()}
    flow.update({f"{q} enqueued": p for q, p in enqueued.items()})
    out = [
        Chart("backlog", "Backlog: ready messages per queue", "messages", _lines(ready)),
        Chart("oldest_age", "Age of the oldest ready message per queue", "seconds", _lines(age)),
        Chart("throughput", "Throughput per queue (per window)", "messages/s", _lines(flow)),
        Chart(
            "time_in_queue",
            "Time in queue per priority: p95 (solid) and p50 (dotted)",
            "ms",
            _lines(p95),
            right=_lines({f"{k} p50": v for k, v in p50.items()}),
        ),
        Chart(
            "dead_letters",
            "Dead letters per queue per window",
            "messages",
            _lines(dead),
            bar_ms=window_ms * 0.9,
        ),
        Chart(
            "inversions",
            "Priority inversions per window, by (high > low) pair",
            "count",
            _lines(inversions),
            bar_ms=window_ms * 0.9,
        ),
        Chart(
            "readers",
            "Readers against backlog",
            "ready messages",
            _lines({f"{q} backlog": p for q, p in ready.items()}),
            right=_lines({f"{q} distinct readers": p for q, p in readers.items()}),
            right_label="readers per window",
        ),
    ]
    assert tuple(c.key for c in out) == CHARTS
    return {c.key: c for c in out}


def summary(outputs: Mapping[str, list[Row]]) -> list[tuple[Any, ...]]:
    """Per queue: received, breaches, dead letters, inversions, starvation exceptions, the
    latest backlog and oldest age, and the slowest activation reaction."""
    sla = _latest(outputs["sla"], ("instance", "queue", "service", "priority", "window_start_ms"))
    ordering = outputs["ordering"]
    totals = _latest(
        (r for r in ordering if r["row"] == "totals"), ("instance", "queue", "kind", "high", "low")
    )
    backlog = _latest(
        sorted(
            (r for r in ordering if r["row"] == "backlog"),
            key=lambda r: (r.get("event_ms") or 0, r.get("batch_id", 0)),
        ),
        ("instance", "queue"),
    )
    reactions = [r for r in ordering if r["row"] == "reaction"]
    queues = sorted({(r["instance"], r["queue"]) for r in [*sla, *backlog] if r["queue"]})
    rows = []
    for inst, queue in queues:

        def mine(rs: Iterable[Row], inst: str = inst, queue: str = queue) -> list[Row]:
            return [r for r in rs if (r["instance"], r["queue"]) == (inst, queue)]

        last = mine(backlog)
        react = [r["reaction_ms"] for r in mine(reactions)]
        rows.append(
            (
                inst,
                queue,
                sum(r["received"] or 0 for r in mine(sla)),
                sum(r["breaches"] or 0 for r in mine(sla)),
                sum(r["dead_lettered"] or 0 for r in mine(sla)),
                sum(r["inversions"] for r in mine(totals)),
                sum(r["starvation_exceptions"] for r in mine(totals)),
                last[-1]["ready_messages"] if last else None,
                (last[-1].get("oldest_age_ms") or 0) / 1000 if last else None,
                max(react) if react else None,
            )
        )
    return rows


# --------------------------------------------------------------------------- drawing
def _figure(chart: Chart) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()

    def x(points: Sequence[Point]) -> list[dt.datetime]:
        return [dt.datetime.fromtimestamp(p[0] / 1000, dt.UTC) for p in points]

    for name, points in chart.series.items():
        y = [p[1] for p in points]
        if chart.bar_ms:
            # Bars start at their window's start and span it.
            fig.add_trace(go.Bar(x=x(points), y=y, name=name, width=chart.bar_ms, offset=0))
        else:
            fig.add_trace(go.Scatter(x=x(points), y=y, name=name, mode="lines+markers"))
    for name, points in chart.right.items():
        fig.add_trace(
            go.Scatter(
                x=x(points),
                y=[p[1] for p in points],
                name=name,
                mode="lines+markers",
                line={"dash": "dot"},
                yaxis="y2" if chart.right_label else "y",
            )
        )
    layout: dict[str, Any] = {
        "title": {"text": chart.title},
        "height": 340,
        "margin": {"l": 60, "r": 60, "t": 50, "b": 40},
        "yaxis": {"title": {"text": chart.y_label}, "rangemode": "tozero"},
        "xaxis": {"title": {"text": "time (UTC)"}},
        "legend": {"orientation": "h", "y": -0.25},
        "showlegend": True,  # even with one line: its name is the queue's
        "template": "plotly_white",
        "barmode": "group",
    }
    if chart.right_label:
        layout["yaxis2"] = {
            "title": {"text": chart.right_label},
            "overlaying": "y",
            "side": "right",
            "rangemode": "tozero",
        }
    if chart.empty:
        layout["annotations"] = [
            {"text": "no data", "showarrow": False, "font": {"size": 18, "color": "#888"}}
        ]
    fig.update_layout(**layout)
    return fig


def _chart_html(chart: Chart) -> str:
    import plotly.io as pio

    div: str = pio.to_html(
        _figure(chart),
        include_plotlyjs=False,  # the page carries the library once, in its head
        full_html=False,
        div_id=f"chart-{chart.key}",
        config={"displaylogo": False, "responsive": True},
    )
    return f"<section class='chart' data-chart='{chart.key}'>{div}</section>"


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(c))}</td>" for c in r) + "</tr>" for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if value < 100 else f"{value:.0f}"
    return str(value)


_SUMMARY_HEADERS = (
    "instance",
    "queue",
    "received",
    "SLA breaches",
    "dead letters",
    "inversions",
    "starvation exceptions",
    "backlog now",
    "oldest age now (s)",
    "max activation reaction ms",
)


def render(outputs: Mapping[str, list[Row]]) -> str:
    """The whole page, Plotly.js inlined: one offline file."""
    from plotly.offline import get_plotlyjs

    rows = summary(outputs)
    page = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<title>KSB SLA and priority audit</title><style>",
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}",
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
        "text-align:right}th{background:#f0f0f0}td:first-child,td:nth-child(2){text-align:left}",
        ".empty{color:#888}.chart{border-top:1px solid #ddd;margin-top:1em}",
        "</style>",
        f"<script type='text/javascript'>{get_plotlyjs()}</script>",
        "</head><body>",
        "<h1>KSB SLA and priority-ordering audit</h1>",
        f"<p>From the Spark audit job's Parquet outputs; generated "
        f"{dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M:%S')} UTC.</p>",
    ]
    if not rows:
        page.append("<p class='empty'>No outputs yet: run the audit job (python -m ksb.spark).</p>")
    else:
        page.append(_table(_SUMMARY_HEADERS, rows))
    page.extend(_chart_html(c) for c in charts(outputs).values())
    page.append("</body></html>")
    return "\n".join(page)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ksb.spark.report", description=__doc__)
    parser.add_argument("--input", type=Path, default=Path("var") / "spark")
    parser.add_argument("--output", type=Path, default=Path("var") / "report" / "index.html")
    args = parser.parse_args(argv)
    outputs = load_outputs(args.input) if args.input.is_dir() else {"sla": [], "ordering": []}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render(outputs))
    n = len(outputs["sla"]) + len(outputs["ordering"])
    print(f"report: {args.output} ({n} rows from {args.input})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
