"""The chaos harness's table: one row per round, faults of each kind, messages, each invariant."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from devtools.chaos.invariants import INVARIANTS
from devtools.chaos.round import RoundResult
from devtools.chaos.schedule import FaultKind

__all__ = ["as_json", "details", "table"]


def _row(r: RoundResult) -> list[str]:
    return [
        str(r.round_no),
        str(r.seed),
        *(str(r.injected[k]) for k in FaultKind),
        str(len(r.remedies)),
        str(r.workload.requests),
        str(r.received),
        *(str(r.verdict.counts[i]) for i in INVARIANTS),
        str(r.verdict.stale_refused),
        str(len(r.crashes)),
        f"{r.seconds:.0f}",
        "ok" if r.ok else "FAIL",
    ]


HEADER = [
    "round",
    "seed",
    *(k.value for k in FaultKind),
    "kfix",
    "sent",
    "recvd",
    *INVARIANTS,
    "fenced",
    "crash",
    "secs",
    "",
]


def table(results: Sequence[RoundResult]) -> str:
    """The rows, with a total line. ``sent``: requests; ``recvd``: messages received on both
    sides (requests, replies, EndDialog/Error/DialogTimer) and dead-lettered; ``fenced``:
    commits the dispatchers refused for a stale token; ``kfix``: broker restarts for Kafka's
    coordinator failing to load a partition (`devtools.chaos.remedy`); ``crash``: processes that
    exited on their own and were started again."""
    rows = [HEADER, *(_row(r) for r in results)]
    if len(results) > 1:
        total: Counter[FaultKind] = Counter()
        for r in results:
            total.update(r.injected)
        rows.append(
            [
                "all",
                "",
                *(str(total[k]) for k in FaultKind),
                str(sum(len(r.remedies) for r in results)),
                str(sum(r.workload.requests for r in results)),
                str(sum(r.received for r in results)),
                *(str(sum(r.verdict.counts[i] for r in results)) for i in INVARIANTS),
                str(sum(r.verdict.stale_refused for r in results)),
                str(sum(len(r.crashes) for r in results)),
                f"{sum(r.seconds for r in results):.0f}",
                "ok" if all(r.ok for r in results) else "FAIL",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    return "\n".join(
        "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def details(r: RoundResult) -> str:
    """What a round's problems were, its crashes and its skipped faults (empty when clean)."""
    lines: list[str] = []
    for p in r.verdict.problems:
        lines.append(f"  {p}")
    for e in r.errors:
        lines.append(f"  harness: {e}")
    for c in r.crashes:
        last = c.tail.strip().splitlines()[-3:]
        lines.append(f"  crash: {c.name} at {c.at_s:.0f}s: " + " | ".join(last))
    for s in r.skipped:
        lines.append(f"  skipped fault: {s}")
    for why in r.remedies:
        lines.append(f"  broker restarted: {why}")
    if r.zombies:
        lines.append(f"  zombie commits: {', '.join(r.zombies)}")
    if not lines:
        return ""
    return f"round {r.round_no} (seed {r.seed}):\n" + "\n".join(lines)


def as_json(r: RoundResult) -> dict[str, Any]:
    return {
        "round": r.round_no,
        "seed": r.seed,
        "dialogs": len(r.workload.dialogs),
        "requests": r.workload.requests,
        "received": r.received,
        "faults": {k.value: r.injected[k] for k in FaultKind},
        "invariants": dict(r.verdict.counts),
        "stale_refused": r.verdict.stale_refused,
        "problems": r.verdict.problems,
        "errors": r.errors,
        "crashes": [{"name": c.name, "at_s": round(c.at_s, 1), "tail": c.tail} for c in r.crashes],
        "events": r.events,
        "skipped": r.skipped,
        "zombies": r.zombies,
        "hostile": [
            {"class": h.name, "request_id": h.request_id, "got": h.got, "ok": h.ok}
            for h in r.refusals
        ],
        "remedies": r.remedies,
        "seconds": round(r.seconds, 1),
        "ok": r.ok,
    }
