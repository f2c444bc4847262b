"""Issue 39's benchmark targets, and issue 38's security cost, each read from one run's figures:
met, missed, or not measured.

The issue moved RECEIVE into the queue service and set what the move must buy, on this machine,
ratios from one run. Each target here names the figure it reads and its goal; `make bench` prints
them after its sections and writes them in the JSON (``targets``), so a run says at once which it
met. The one target whose baseline no longer runs (readers in the client process, before the
queue service) is set against the figure measured with that code (`IN_PROCESS_READERS_CPU_MS`).
Issue 38 asked that security on cost KSB end to end at most a tenth of its throughput, measured in
the same run (bench/security_e2e.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from bench.peer import ratios_over_peer
from bench.scaling import run_label
from bench.security_e2e import SECURED, secured_ratio

__all__ = [
    "IN_PROCESS_READERS_CPU_MS",
    "THROUGHPUT_BEFORE",
    "Target",
    "all_targets",
    "format_lines",
    "issue39",
]

INTERLEAVED_RATIO = 0.5
"""The interleaved drain over the dialog-by-dialog drain of the same size, at least (0.013x
when the client read an interleaved backlog's bodies back from Kafka)."""
FIRST_RECEIVE_P50_MS = 300
"""The next reader's first RECEIVE after activation, p50, at most (881 ms before)."""
THROUGHPUT_BEFORE = 3_400
"""End-to-end msg/s with 2 receivers not below the week's runs before the queue service
(3.4-4.3k in `make bench`): the low end."""
IN_PROCESS_READERS_CPU_MS = 0.679
"""CPU per message of all processes with 4 reader processes on one queue before the queue
service, each indexing the queue in its own process: bench/readers.py's section (its median
of 3 runs: 0.690 / 0.679 / 0.547 ms) run with the code of commit c3a9d86 on a stack of its own,
warmed with 40,000 messages first (docs/benchmarks.md, 2026-11-28)."""
PEER_RATIO = 1.0
"""KSB's throughput over the exactly-once peer's (bench/peer.py), at least."""
SECURED_RATIO = 0.9
"""Issue 38: KSB's end-to-end throughput on a secured stack over a plaintext one in the same
run, at least (a throughput cost of at most 10 %)."""


@dataclass(frozen=True)
class Target:
    issue: int
    name: str
    goal: str
    figure: str
    met: bool | None
    """None: not measured in this run (its section skipped or failed)."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _get(r: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(r, dict) or key not in r:
            return None
        r = r[key]
    return r


def _interleaved(r: dict[str, Any]) -> Target:
    cmp = _get(r, "backlog", "interleaved")
    x = _get(cmp, "ratio_interleaved_over_dialog_by_dialog") if cmp else None
    n = _get(cmp, "messages") if cmp else None
    figure = "not measured" if x is None else f"{x:.2f}x over {n:,} messages"
    return Target(
        39,
        "interleaved backlog drain over dialog by dialog",
        f">= {INTERLEAVED_RATIO}x",
        figure,
        None if x is None else x >= INTERLEAVED_RATIO,
    )


def _first_receive(r: dict[str, Any]) -> Target:
    p50 = _get(r, "activation", "first_receive_after_activation", "p50_ms")
    count = _get(r, "activation", "first_receive_after_activation", "count")
    return Target(
        39,
        "next reader's first RECEIVE after activation, p50",
        f"<= {FIRST_RECEIVE_P50_MS} ms",
        "not measured" if p50 is None else f"{p50:,} ms over {count} readers",
        None if p50 is None else p50 <= FIRST_RECEIVE_P50_MS,
    )


def _throughput(r: dict[str, Any]) -> Target:
    runs = [x for x in _get(r, "scaling", "runs") or [] if not x.get("max_queue_depth")]
    rates = {run_label(x): x["throughput"]["per_s"] for x in runs}
    figure = ", ".join(f"{label} {v:,.0f}" for label, v in rates.items()) + " msg/s"
    return Target(
        39,
        "end-to-end throughput, 2 receivers, each dispatcher count",
        f">= {THROUGHPUT_BEFORE:,} msg/s",
        figure if rates else "not measured",
        min(rates.values()) >= THROUGHPUT_BEFORE if rates else None,
    )


def _readers(r: dict[str, Any]) -> Target:
    cpu = _get(r, "readers", "cpu_ms_per_message", "all")
    n = _get(r, "readers", "processes")
    return Target(
        39,
        f"CPU per message, all processes, {n or 4} reader processes",
        f"< {IN_PROCESS_READERS_CPU_MS:.3f} ms (4 in-process readers before the queue service)",
        "not measured" if cpu is None else f"{cpu:.3f} ms",
        None if cpu is None else cpu < IN_PROCESS_READERS_CPU_MS,
    )


def _peer(r: dict[str, Any]) -> Target:
    peer = r.get("peer")
    runs = _get(r, "scaling", "runs") or []
    if not peer or "error" in peer or not runs:
        return Target(
            39, "KSB throughput over the EOS peer", f">= {PEER_RATIO}x", "not measured", None
        )
    xs = {run_label(x): ratios_over_peer(x, peer)["throughput"] for x in runs}
    return Target(
        39,
        "KSB throughput over the EOS peer, each column",
        f">= {PEER_RATIO}x",
        ", ".join(f"{label} {v:.2f}x" for label, v in xs.items() if v is not None),
        all(v is not None and v >= PEER_RATIO for v in xs.values()),
    )


def _secured(r: dict[str, Any]) -> Target:
    section = r.get("security_e2e") or {}
    x = secured_ratio(section) if "error" not in section else None
    rates = {m: _get(section, "runs", m, "throughput", "per_s") for m in ("plaintext", SECURED)}
    figure = (
        "not measured"
        if x is None
        else f"{x:.2f}x ({rates[SECURED]:,.0f} against {rates['plaintext']:,.0f} msg/s)"
    )
    return Target(
        38,
        f"KSB end-to-end throughput, {SECURED} stack over plaintext, same run",
        f">= {SECURED_RATIO}x",
        figure,
        None if x is None else x >= SECURED_RATIO,
    )


_TARGETS: tuple[Callable[[dict[str, Any]], Target], ...] = (
    _interleaved,
    _first_receive,
    _throughput,
    _readers,
    _peer,
)


def issue39(results: dict[str, Any]) -> list[Target]:
    """Every issue 39 target, read from one run's results (the JSON `bench.suite.run` returns)."""
    return [target(results) for target in _TARGETS]


def all_targets(results: dict[str, Any]) -> list[Target]:
    """Issue 38's security cost, then issue 39's targets."""
    return [_secured(results), *issue39(results)]


def format_lines(targets: list[dict[str, Any]]) -> list[str]:
    """The targets blocks of the printed table (from the JSON's ``targets``), by issue."""
    lines: list[str] = []
    for issue in sorted({t.get("issue", 39) for t in targets}):
        of = [t for t in targets if t.get("issue", 39) == issue]
        lines.append(f"issue {issue} target{'s' if len(of) > 1 else ''} (this run):")
        for t in of:
            verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
            lines.append(f"  {t['name']}: {t['figure']} (goal {t['goal']}): {verdict}")
    return lines
