"""``make report``: the Spark job's Parquet outputs as one self-contained HTML page.

For people without Grafana: time in queue per priority over time, priority inversions, and readers
against backlog, per queue, drawn as inline SVG (no plotting library, no network, one file to mail).
The Parquet files hold update-mode rows (absolute figures per window, rewritten as a window fills),
so for every window and series the row of the newest micro-batch is the one shown.

    python -m ksb.spark.report [--input var/spark] [--output var/report/index.html]
"""

from __future__ import annotations

import argparse
import datetime as dt
import html
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["load_outputs", "main", "render"]

Row = dict[str, Any]
_PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


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


# --------------------------------------------------------------------------- SVG charts
def _fmt_time(ms: float) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%H:%M:%S")


def line_chart(
    title: str,
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    y_label: str,
    right: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    right_label: str = "",
    width: int = 760,
    height: int = 260,
) -> str:
    """Lines over time (x: Unix ms); an optional second set of series on a right-hand axis."""
    right = right or {}
    points = [p for s in (*series.values(), *right.values()) for p in s]
    if not points:
        return f"<h3>{html.escape(title)}</h3><p class='empty'>no data</p>"
    left_pad, right_pad, top, bottom = 60, 60 if right else 20, 20, 40
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    x1 = x1 if x1 > x0 else x0 + 1

    def y_max(ss: Mapping[str, Sequence[tuple[float, float]]]) -> float:
        ys = [p[1] for s in ss.values() for p in s]
        return (max(ys) or 1.0) * 1.1 if ys else 1.0

    ly, ry = y_max(series), y_max(right)
    pw, ph = width - left_pad - right_pad, height - top - bottom

    def sx(x: float) -> float:
        return left_pad + (x - x0) / (x1 - x0) * pw

    def sy(y: float, top_y: float) -> float:
        return top + ph - y / top_y * ph

    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height + 20}' "
        f"role='img' aria-label='{html.escape(title)}'>",
        f"<rect x='{left_pad}' y='{top}' width='{pw}' height='{ph}' fill='#fafafa' stroke='#ccc'/>",
    ]
    for i in range(5):
        frac = i / 4
        yv = top + ph - frac * ph
        parts.append(
            f"<line x1='{left_pad}' x2='{left_pad + pw}' y1='{yv:.1f}' y2='{yv:.1f}' "
            "stroke='#eee'/>"
        )
        parts.append(
            f"<text x='{left_pad - 4}' y='{yv + 4:.1f}' text-anchor='end' "
            f"font-size='10'>{frac * ly:.0f}</text>"
        )
        if right:
            parts.append(
                f"<text x='{left_pad + pw + 4}' y='{yv + 4:.1f}' font-size='10'>"
                f"{frac * ry:.0f}</text>"
            )
        xv = x0 + frac * (x1 - x0)
        parts.append(
            f"<text x='{sx(xv):.1f}' y='{top + ph + 14}' text-anchor='middle' "
            f"font-size='10'>{_fmt_time(xv)}</text>"
        )
    parts.append(
        f"<text x='12' y='{top + ph / 2:.0f}' font-size='11' "
        f"transform='rotate(-90 12 {top + ph / 2:.0f})' text-anchor='middle'>"
        f"{html.escape(y_label)}</text>"
    )
    if right:
        rx = width - 8
        parts.append(
            f"<text x='{rx}' y='{top + ph / 2:.0f}' font-size='11' "
            f"transform='rotate(90 {rx} {top + ph / 2:.0f})' text-anchor='middle'>"
            f"{html.escape(right_label)}</text>"
        )
    legend_x = left_pad
    for i, (name, pts, top_y, dash) in enumerate(
        [(n, p, ly, "") for n, p in series.items()] + [(n, p, ry, "5,3") for n, p in right.items()]
    ):
        color = _PALETTE[i % len(_PALETTE)]
        ordered = sorted(pts)
        path = " ".join(f"{sx(x):.1f},{sy(y, top_y):.1f}" for x, y in ordered)
        parts.append(
            f"<polyline fill='none' stroke='{color}' stroke-width='2' "
            f"stroke-dasharray='{dash}' points='{path}'/>"
        )
        if len(ordered) == 1:
            x, y = ordered[0]
            parts.append(f"<circle cx='{sx(x):.1f}' cy='{sy(y, top_y):.1f}' r='3' fill='{color}'/>")
        parts.append(
            f"<text x='{legend_x}' y='{height + 14}' font-size='11' fill='{color}'>"
            f"■ {html.escape(name)}</text>"
        )
        legend_x += 12 + 7 * len(name) + 12
    parts.append("</svg>")
    return f"<h3>{html.escape(title)}</h3>" + "".join(parts)


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
        return f"{value:.0f}"
    return str(value)


# --------------------------------------------------------------------------- the page
def render(outputs: Mapping[str, list[Row]]) -> str:
    sla = _latest(outputs["sla"], ("instance", "queue", "service", "priority", "window_start_ms"))
    ordering = outputs["ordering"]
    windows = _latest(
        (r for r in ordering if r["row"] == "inversions"),
        ("instance", "queue", "kind", "high", "low", "window_start_ms"),
    )
    totals = _latest(
        (r for r in ordering if r["row"] == "totals"), ("instance", "queue", "kind", "high", "low")
    )
    backlog = [r for r in ordering if r["row"] == "backlog"]
    reactions = [r for r in ordering if r["row"] == "reaction"]
    queues = sorted({(r["instance"], r["queue"]) for r in [*sla, *backlog] if r["queue"]})

    sections: list[str] = []
    summary = []
    for inst, queue in queues:
        mine = [r for r in sla if (r["instance"], r["queue"]) == (inst, queue)]
        received = sum(r["received"] or 0 for r in mine)
        breaches = sum(r["breaches"] or 0 for r in mine)
        inv = sum(r["inversions"] for r in totals if (r["instance"], r["queue"]) == (inst, queue))
        starv = sum(
            r["starvation_exceptions"]
            for r in totals
            if (r["instance"], r["queue"]) == (inst, queue)
        )
        react = [
            r["reaction_ms"] for r in reactions if (r["instance"], r["queue"]) == (inst, queue)
        ]
        summary.append((inst, queue, received, breaches, inv, starv, max(react) if react else None))
        sections.append(_queue_section(inst, queue, mine, windows, backlog))
    page = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<title>KSB SLA and priority audit</title><style>",
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:820px;color:#222}",
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
        "text-align:right}th{background:#f0f0f0}td:first-child,td:nth-child(2){text-align:left}",
        ".empty{color:#888}h2{border-top:2px solid #ddd;padding-top:1em}",
        "</style></head><body>",
        "<h1>KSB SLA and priority-ordering audit</h1>",
        f"<p>From the Spark audit job's Parquet outputs; generated "
        f"{dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M:%S')} UTC.</p>",
    ]
    if not queues:
        page.append("<p class='empty'>No outputs yet: run the audit job (python -m ksb.spark).</p>")
    else:
        page.append(
            _table(
                [
                    "instance",
                    "queue",
                    "received",
                    "SLA breaches",
                    "inversions",
                    "starvation exceptions",
                    "max activation reaction ms",
                ],
                summary,
            )
        )
        page.append("<h2>Priority inversions (all queues)</h2>")
        page.append(
            _table(
                ["instance", "queue", "kind", "high", "low", "inversions", "starvation exceptions"],
                sorted(
                    (
                        r["instance"],
                        r["queue"],
                        r["kind"],
                        r["high"],
                        r["low"],
                        r["inversions"],
                        r["starvation_exceptions"],
                    )
                    for r in totals
                ),
            )
            if totals
            else "<p class='empty'>No inversions.</p>"
        )
        page.extend(sections)
    page.append("</body></html>")
    return "\n".join(page)


def _queue_section(
    inst: str, queue: str, sla: list[Row], windows: list[Row], backlog: list[Row]
) -> str:
    parts = [f"<h2>{html.escape(queue)} <small>({html.escape(inst)})</small></h2>"]
    p95: dict[str, list[tuple[float, float]]] = defaultdict(list)
    p50: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in sla:
        if r["received"] and r["tiq_p95_ms"] is not None:
            label = f"priority {r['priority']}"
            p95[label].append((r["window_start_ms"], float(r["tiq_p95_ms"])))
            p50[label].append((r["window_start_ms"], float(r["tiq_p50_ms"])))
    parts.append(line_chart("Time in queue p95 per priority (ms)", p95, y_label="ms"))
    parts.append(line_chart("Time in queue p50 per priority (ms)", p50, y_label="ms"))
    inv: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in windows:
        if (r["instance"], r["queue"]) == (inst, queue) and r["inversions"]:
            inv[f"{r['kind']} {r['high']}>{r['low']}"].append(
                (r["window_start_ms"], float(r["inversions"]))
            )
    parts.append(line_chart("Inversions per window, by (high > low) pair", inv, y_label="count"))
    readers: dict[float, float] = defaultdict(float)
    for r in sla:
        readers[r["window_start_ms"]] = max(readers[r["window_start_ms"]], float(r["readers"] or 0))
    ready = sorted(
        (float(r["event_ms"]), float(r["ready_messages"]))
        for r in backlog
        if (r["instance"], r["queue"]) == (inst, queue) and r["event_ms"]
    )
    parts.append(
        line_chart(
            "Readers against backlog",
            {"backlog (ready messages)": ready},
            y_label="messages",
            right={"distinct readers per window": sorted(readers.items())},
            right_label="readers",
        )
    )
    return "".join(parts)


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
