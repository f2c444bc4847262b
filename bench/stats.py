"""Measurement helpers: payloads carrying their send time, latency percentiles, peak RSS."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CpuMeter",
    "LatencySummary",
    "Phases",
    "Rate",
    "cpu_seconds",
    "fmt_ms",
    "fmt_x",
    "make_body",
    "now_ns",
    "parse_body",
    "peak_rss_kb",
    "ratio",
    "rss_kb",
    "run_ratios",
    "summarize",
]

_TS_DIGITS = 20


class Phases:
    """How long each part of a run took, in the order they ended: the ``phase_seconds`` every
    section reports, so a slow run shows which part was slow."""

    def __init__(
        self, log: logging.Logger | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.seconds: dict[str, float] = {}
        self._log = log
        self._clock = clock
        self._mark = clock()

    def __call__(self, name: str) -> None:
        """The part called `name` has ended (it began when the previous one ended)."""
        now = self._clock()
        self.seconds[name] = round(now - self._mark, 2)
        self._mark = now
        if self._log is not None:
            self._log.info("bench: %s done in %.1f s", name, self.seconds[name])


def fmt_ms(v: float | None, digits: int = 2) -> str:
    """A millisecond figure for the printed tables ("n/a" when it was not measured)."""
    return "n/a" if v is None else f"{v:,.{digits}f} ms"


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either was not measured (or b is no figure to divide by)."""
    return None if a is None or b is None or b <= 0 else a / b


def run_ratios(top: dict[str, Any], bottom: dict[str, Any]) -> dict[str, float | None]:
    """One run's throughput and latencies over another's (a run's `as_json` shape: throughput
    up is good, the rest down). A KSB run's one-at-a-time latency to RECEIVE
    (``latency_delivered``) is set against the other's to RECEIVE, or against its one at a time
    where it has none: raw Kafka's, produce -> consume."""
    out: dict[str, float | None] = {
        "throughput": ratio(top["throughput"]["per_s"], bottom["throughput"]["per_s"]),
        **{
            f"latency_{load}_{p}": ratio(
                top[f"latency_{load}"][f"{p}_ms"], bottom[f"latency_{load}"][f"{p}_ms"]
            )
            for load in ("loaded", "unloaded")
            for p in ("p50", "p99")
        },
    }
    if "latency_delivered" in top:
        under = bottom.get("latency_delivered", bottom["latency_unloaded"])
        for p in ("p50", "p99"):
            out[f"latency_delivered_{p}"] = ratio(
                top["latency_delivered"][f"{p}_ms"], under[f"{p}_ms"]
            )
    return out


def fmt_x(v: float | None) -> str:
    """A ratio for the printed tables ("n/a" when either side was not measured)."""
    return "n/a" if v is None else f"{v:.2f}x"


def now_ns() -> int:
    """The clock every timestamp in a payload uses: monotonic, so senders and receivers in this
    process agree and a wall-clock step cannot produce a negative latency."""
    return time.monotonic_ns()


def make_body(size_bytes: int, sent_ns: int, tag: str) -> str:
    """A text body of exactly ``size_bytes``: send time, a tag, then random hex.

    Random padding keeps compression, where a deployment turns it on (`KSB_KAFKA_COMPRESSION`),
    from shrinking a 1 KB message to a few bytes, which would flatter both sides of the
    comparison.
    """
    head = f"{sent_ns:0{_TS_DIGITS}d} {tag} "
    pad = max(0, size_bytes - len(head))
    return head + os.urandom((pad + 1) // 2).hex()[:pad]


def parse_body(body: bytes | str) -> tuple[int, str]:
    """(send time in ns, tag) of a body made by `make_body`."""
    text = body.decode() if isinstance(body, bytes) else body
    ts, tag, _pad = text.split(" ", 2)
    return int(ts), tag


@dataclass(frozen=True)
class LatencySummary:
    count: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _percentile(ordered: Sequence[int], q: float) -> int:
    """Nearest-rank percentile of an ascending sequence."""
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least 1
    return ordered[int(rank) - 1]


def summarize(latencies_ns: Sequence[int]) -> LatencySummary:
    if not latencies_ns:
        return LatencySummary(0, float("nan"), float("nan"), float("nan"), float("nan"))
    ordered = sorted(latencies_ns)
    ms = 1e-6
    return LatencySummary(
        count=len(ordered),
        p50_ms=_percentile(ordered, 50) * ms,
        p99_ms=_percentile(ordered, 99) * ms,
        max_ms=ordered[-1] * ms,
        mean_ms=sum(ordered) / len(ordered) * ms,
    )


@dataclass(frozen=True)
class Rate:
    messages: int
    seconds: float

    @property
    def per_s(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else float("nan")

    def as_json(self) -> dict[str, Any]:
        return {"messages": self.messages, "seconds": self.seconds, "per_s": self.per_s}


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None = None) -> float | None:
    """User + system CPU time of ``pid`` (this process by default) so far, every thread counted
    (utime + stime of /proc/<pid>/stat), or None once it is gone."""
    try:
        stat = Path(f"/proc/{'self' if pid is None else pid}/stat").read_text()
    except OSError:
        return None
    return _cpu_ticks(stat) / _CLOCK_TICKS


def _cpu_ticks(stat: str) -> int:
    """utime + stime of one /proc/<pid>[/task/<tid>]/stat line, in clock ticks."""
    fields = stat[stat.rindex(")") + 2 :].split()  # after "(comm)", which may hold spaces
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5)


_JIT_THREADS = ("C1 CompilerThre", "C2 CompilerThre")
"""HotSpot's JIT compiler threads, as /proc names them (comm is cut at 15 characters)."""


_LIBRDKAFKA_THREADS = ("rdk:",)
"""librdkafka's own threads (``rdk:main``, ``rdk:broker…``, ``rdk:bg``), as /proc names them."""


def thread_seconds(pid: int, prefixes: tuple[str, ...]) -> float | None:
    """User + system CPU time so far of the threads of ``pid`` whose names start with one of
    ``prefixes``; None once the process is gone."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        if stat[stat.index("(") + 1 : stat.rindex(")")].startswith(prefixes):
            total += _cpu_ticks(stat)
    return total / _CLOCK_TICKS


def jit_seconds(pid: int) -> float | None:
    """User + system CPU time so far of the JVM ``pid``'s JIT compiler threads: a broker that
    has run for a minute still compiles the code KSB's requests take, work a long-running
    broker did long ago. None once it is gone."""
    return thread_seconds(pid, _JIT_THREADS)


def librdkafka_seconds(pid: int) -> float | None:
    """User + system CPU time so far of the librdkafka threads of the process ``pid`` (its
    Kafka clients' network, fetch, batching and compression work, beside its Python)."""
    return thread_seconds(pid, _LIBRDKAFKA_THREADS)


def jit_settle(pid: int, *, quiet_s: float = 1.0, timeout_s: float = 30.0) -> float:
    """Wait until the JVM ``pid``'s JIT compilers have been idle (under 2 % of a CPU) for
    ``quiet_s``, at most ``timeout_s``; returns the seconds waited. On two CPUs a broker's
    compile queue drains slowly while load runs beside it: without a pause after the warm-up,
    its compilers took a sixth of the CPU a measured KSB run had (0.10-0.17 ms per message), work
    a long-running broker finished long ago."""
    started = last_t = time.monotonic()
    last = jit_seconds(pid)
    quiet_since = started
    while last is not None and time.monotonic() - started < timeout_s:
        time.sleep(0.25)
        now, spent = time.monotonic(), jit_seconds(pid)
        if spent is None:
            break
        if spent - last > 0.02 * (now - last_t):
            quiet_since = now
        elif now - quiet_since >= quiet_s:
            break
        last, last_t = spent, now
    return time.monotonic() - started


def peak_rss_kb(pid: int | None = None) -> int | None:
    """VmHWM (peak resident set) of ``pid`` (this process by default), or None if unreadable."""
    return _status_kb(pid, "VmHWM:")


def rss_kb(pid: int | None = None) -> int | None:
    """VmRSS (resident set now) of ``pid`` (this process by default), or None if unreadable."""
    return _status_kb(pid, "VmRSS:")


def _status_kb(pid: int | None, field: str) -> int | None:
    status = Path(f"/proc/{'self' if pid is None else pid}/status")
    try:
        for line in status.read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class CpuMeter:
    """CPU seconds each named process spends over one phase: `mark` is the ``on_load`` hook of
    `bench.raw_kafka.run_raw` and `bench.e2e.run_ksb` (True at the start, False at the end).
    A pid of None is this process (the benchmark's own clients)."""

    pids: dict[str, int | None]
    jvm: str | None = None
    """The name of a JVM among `pids` whose JIT compiler threads are measured too (`jit_s`)."""
    spent_s: dict[str, float] = field(default_factory=dict)
    """Per name, once the phase has ended (a process that died meanwhile is left out)."""
    jit_s: float | None = None
    """Of `jvm`'s share, its JIT compiler threads' (already counted in `spent_s`)."""
    librdkafka: tuple[str, ...] = ()
    """Names among `pids` whose librdkafka threads are measured too (`librdkafka_s`)."""
    librdkafka_s: float | None = None
    """Of the share of the `librdkafka` processes, their librdkafka threads' (all processes)."""
    _start: dict[str, float | None] = field(default_factory=dict)
    _jit_start: float | None = None
    _rdk_start: float | None = None

    def mark(self, starting: bool) -> None:
        now = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        jvm_pid = self.pids.get(self.jvm) if self.jvm is not None else None
        jit = None if jvm_pid is None else jit_seconds(jvm_pid)
        rdk = self._librdkafka_now()
        if starting:
            self._start, self._jit_start, self._rdk_start = now, jit, rdk
            return
        self.spent_s = {
            name: end - begin
            for name, end in now.items()
            if end is not None and (begin := self._start.get(name)) is not None
        }
        if jit is not None and self._jit_start is not None:
            self.jit_s = jit - self._jit_start
        if rdk is not None and self._rdk_start is not None:
            self.librdkafka_s = rdk - self._rdk_start

    def _librdkafka_now(self) -> float | None:
        """The `librdkafka` processes' librdkafka threads' CPU so far; None if one is gone."""
        total = 0.0
        for name in self.librdkafka:
            pid = self.pids.get(name)
            spent = None if pid is None else librdkafka_seconds(pid)
            if spent is None:
                return None
            total += spent
        return total if self.librdkafka else None

    def librdkafka_ms_per_message(self, messages: int) -> float | None:
        """The `librdkafka` processes' librdkafka threads' CPU per message, when measured."""
        if self.librdkafka_s is None or not messages:
            return None
        return self.librdkafka_s * 1000 / messages

    def jit_ms_per_message(self, messages: int) -> dict[str, float]:
        """``{"<jvm>_jit": ms}``, the JIT compiler's share per message, when it was measured."""
        if self.jit_s is None or not messages:
            return {}
        return {f"{self.jvm}_jit": self.jit_s * 1000 / messages}
