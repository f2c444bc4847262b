"""Priorities benchmark: what broker priorities buy a level-10 message on a saturated queue.

One target queue, three initiator services; the catalog's broker priorities give the target
endpoints of ``//bench/prio/High`` level 10 and those of ``//bench/prio/Low`` level 1, and
``//bench/prio/Flat`` matches no rule (level 5). The section runs its own dispatcher (own instance)
on the suite's stack, and one reader (`_Receiver`: RECEIVE without WHERE, commits in flight up to a
window) that records every message's **time in queue** at the moment RECEIVE returned it: the
reader's wall clock minus the message's ``enqueued_ms``. ``enqueued_ms`` is the dispatcher's clock
when it began the transaction that wrote the message (whole ms, so figures carry up to 1 ms of
rounding), so time in queue includes that transaction's commit and the reader index's fetch.

* **idle**: level-10 messages one at a time to an empty queue;
* **saturated**: a backlog of level-1 messages in many groups, topped up by a feeder as the reader
  drains it, then level-10 messages at a steady pace; their time in queue as a ratio to idle, and
  the level-1 waits. RECEIVE is strict priority by design (priorities always apply to RECEIVE):
  it has no starvation bound, so the level-1 maximum wait is reported as measured;
* **throughput**: the same backlog drained by the same reader, once with every level at 5 (Flat)
  and once with levels 1 and 10 (Low and High), interleaved; messages/s of each and the ratio.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.queues import DEFAULT_REPLICAS, running_queues
from bench.stats import Phases, fmt_ms, fmt_x, make_body, now_ns, parse_body
from devtools.deployment import Deployment, secure_instance
from devtools.runner import ServiceProcess
from ksb.catalog.model import Catalog, parse_catalog
from ksb.errors import KsbError
from ksb.runtime.catalog_store import apply_catalog
from ksb.sdk.client import KsbClient

__all__ = [
    "PriorityOptions",
    "format_lines",
    "priority_catalog",
    "run_priorities",
]

LOW, HIGH, FLAT = "//bench/prio/Low", "//bench/prio/High", "//bench/prio/Flat"
TARGET, CONTRACT, MESSAGE_TYPE = "//bench/prio/Target", "//bench/prio/Contract", "//bench/prio/Job"
INITIATOR_QUEUE, TARGET_QUEUE = "PrioInitiatorQueue", "PrioTargetQueue"
_BODY_BYTES = 64
_HIGH_DIALOGS = 20
_WARMUP = 5


@dataclass(frozen=True)
class PriorityOptions:
    idle_probes: int = 100
    """Level-10 messages sent one at a time to the empty queue."""
    backlog: int = 5_000
    """Level-1 messages kept waiting (sent and not yet received) during the saturated phase."""
    backlog_groups: int = 500
    saturated_probes: int = 150
    probe_gap_ms: int = 25
    throughput_messages: int = 4_000
    """Messages per throughput run (each run: the backlog is sent first, then drained)."""
    throughput_groups: int = 400
    throughput_rounds: int = 2
    """Pairs of runs, interleaved flat, prio, prio, flat, ... so drift hits both alike."""
    window: int = 16
    """Commits in flight for the one reader."""
    partitions: int = 4
    timeout_s: float = 120.0
    queue_replicas: int = DEFAULT_REPLICAS
    """How long one phase may take (fill, probes, drain)."""


def priority_catalog(partitions: int) -> Catalog:
    return parse_catalog(
        {
            "message_types": [{"name": MESSAGE_TYPE, "validation": "NONE"}],
            "contracts": [
                {"name": CONTRACT, "messages": [{"type": MESSAGE_TYPE, "sent_by": "INITIATOR"}]}
            ],
            "queues": [
                {"name": INITIATOR_QUEUE, "partitions": 1},
                {"name": TARGET_QUEUE, "partitions": partitions},
            ],
            "services": [
                {"name": LOW, "queue": INITIATOR_QUEUE},
                {"name": HIGH, "queue": INITIATOR_QUEUE},
                {"name": FLAT, "queue": INITIATOR_QUEUE},
                {"name": TARGET, "queue": TARGET_QUEUE, "contracts": [CONTRACT]},
            ],
            # The target endpoint matches with itself as local and its initiator as remote.
            "priorities": [
                {"name": "bench-low", "local_service": TARGET, "remote_service": LOW, "level": 1},
                {
                    "name": "bench-high",
                    "local_service": TARGET,
                    "remote_service": HIGH,
                    "level": 10,
                },
            ],
        }
    )


# --------------------------------------------------------------------------- the reader
@dataclass(frozen=True)
class _Seen:
    level: int
    enqueued_ms: int
    received_ms: float
    sent_ns: int

    @property
    def wait_ms(self) -> float:
        return self.received_ms - self.enqueued_ms


@dataclass
class _Receiver:
    """One reader: RECEIVE (whole group) -> commit_async, up to ``window`` commits in flight."""

    client: KsbClient
    window: int
    seen: dict[str, _Seen] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    """Messages returned by RECEIVE, per level."""
    applied: int = 0
    refused: int = 0
    lock_lost: int = 0
    redelivered: int = 0
    first_ns: int = 0
    last_applied_ns: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition)
    stop: threading.Event = field(default_factory=threading.Event)
    failure: BaseException | None = None
    _thread: threading.Thread | None = None

    def start(self) -> _Receiver:
        self._thread = threading.Thread(target=self._run, name="bench-prio-reader", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(40)
        if self.failure is not None:
            raise RuntimeError("the priorities reader failed") from self.failure

    def count(self, level: int) -> int:
        with self.cond:
            return self.received.get(level, 0)

    def wait_until(self, done: Any, timeout_s: float, what: str) -> None:
        """Block until ``done()`` (evaluated under the lock) is true."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not done():
                if self.failure is not None:
                    raise RuntimeError("the priorities reader failed") from self.failure
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{what} not done in {timeout_s:.0f}s")
                self.cond.wait(min(remaining, 0.5))

    def _run(self) -> None:
        outstanding: deque[Future[Any]] = deque()
        try:
            while not self.stop.is_set():
                while outstanding and outstanding[0].done():
                    outstanding.popleft()
                if len(outstanding) >= self.window:
                    _settle(self.client, outstanding.popleft())
                    continue
                tx = self.client.transaction()
                msgs = tx.receive(TARGET_QUEUE, waitfor_ms=100)
                at_ms = time.time() * 1000
                if not msgs:
                    tx.rollback()
                    continue
                with self.cond:
                    if not self.first_ns:
                        self.first_ns = now_ns()
                    for m in msgs:
                        sent, _tag = parse_body(m.message_body)
                        if m.message_id in self.seen:
                            self.redelivered += 1
                        self.seen[m.message_id] = _Seen(m.priority, m.enqueued_ms, at_ms, sent)
                        self.received[m.priority] = self.received.get(m.priority, 0) + 1
                    self.cond.notify_all()
                try:
                    fut = tx.commit_async()
                except KsbError:
                    with self.cond:
                        self.lock_lost += 1
                    continue
                fut.add_done_callback(functools.partial(_on_outcome, self, len(msgs)))
                outstanding.append(fut)
            for fut in outstanding:
                _settle(self.client, fut)
        except BaseException as exc:
            self.failure = exc
            with self.cond:
                self.cond.notify_all()

    def outcome(self, n: int, fut: Future[Any]) -> None:
        with self.cond:
            if fut.exception() is not None:
                self.refused += 1
            else:
                self.applied += n
                self.last_applied_ns = now_ns()
            self.cond.notify_all()


def _on_outcome(receiver: _Receiver, n: int, fut: Future[Any]) -> None:
    receiver.outcome(n, fut)


def _settle(client: KsbClient, fut: Future[Any]) -> None:
    with contextlib.suppress(KsbError):  # refused / lock lost: counted by the done-callback
        client.wait(fut, 30)


def _send(client: KsbClient, handle: str, tag: str) -> None:
    while True:
        try:
            client.send(handle, MESSAGE_TYPE, make_body(_BODY_BYTES, now_ns(), tag))
            return
        except BufferError:  # the producer's local queue is full: let it drain
            with contextlib.suppress(KsbError):
                client.flush(0.05)


def _pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "count": len(values),
        "p50_ms": _pct(values, 50),
        "p99_ms": _pct(values, 99),
        "max_ms": max(values) if values else None,
        "mean_ms": statistics.fmean(values) if values else None,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


# --------------------------------------------------------------------------- the phases
def _idle(sender: KsbClient, receiver: KsbClient, highs: list[str], opts: PriorityOptions) -> Any:
    """Level-10 messages one at a time to an empty queue: the reader is waiting in RECEIVE."""
    r = _Receiver(receiver, opts.window).start()
    try:
        for i in range(_WARMUP + opts.idle_probes):
            _send(sender, highs[i % len(highs)], f"idle:{i}")
            sender.flush(10)
            r.wait_until(lambda n=i + 1: r.received.get(10, 0) >= n, 30, f"idle probe {i}")
    finally:
        r.close()
    probes = [s for s in r.seen.values() if s.level == 10]
    probes.sort(key=lambda s: s.enqueued_ms)
    kept = probes[_WARMUP:]
    return {
        "time_in_queue": _summary([s.wait_ms for s in kept]),
        "send_to_receive": _summary([s.received_ms - _wall_ms(s.sent_ns) for s in kept]),
    }


def _wall_ms(mono_ns: int) -> float:
    """A `now_ns` (monotonic) reading as wall-clock ms, using the current offset between them."""
    return mono_ns / 1e6 + (time.time() * 1000 - time.monotonic_ns() / 1e6)


def _fill(sender: KsbClient, handles: list[str], n: int, tag: str) -> None:
    for i in range(n):
        _send(sender, handles[i % len(handles)], f"{tag}:{i}")
    sender.flush(60)


def _wait_ready(receiver: KsbClient, n: int, timeout_s: float) -> None:
    """Until the reader's index holds at least ``n`` ready messages (the dispatcher wrote them)."""
    deadline = time.monotonic() + timeout_s
    while (ready := receiver.queue_state(TARGET_QUEUE).ready_messages) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {ready} of {n} messages ready in time")
        time.sleep(0.02)


def _saturated(
    sender: KsbClient, receiver: KsbClient, highs: list[str], opts: PriorityOptions
) -> dict[str, Any]:
    lows = [sender.begin_dialog(LOW, TARGET, CONTRACT) for _ in range(opts.backlog_groups)]
    sender.flush(30)
    fill_started = time.monotonic()
    _fill(sender, lows, opts.backlog, "low")
    _wait_ready(receiver, opts.backlog, opts.timeout_s)
    fill_s = time.monotonic() - fill_started
    sent_low = opts.backlog
    stop_feeding = threading.Event()
    feeder_error: list[BaseException] = []
    r = _Receiver(receiver, opts.window)
    reader_start_ms = time.time() * 1000
    r.start()

    def feed() -> None:
        """Top the level-1 backlog (sent, not yet received) back up as the reader drains it."""
        nonlocal sent_low
        try:
            while not stop_feeding.is_set():
                deficit = opts.backlog - (sent_low - r.count(1))
                if deficit <= 0:
                    time.sleep(0.005)
                    continue
                for _ in range(min(deficit, 200)):
                    _send(sender, lows[sent_low % len(lows)], f"low:{sent_low}")
                    sent_low += 1
        except BaseException as exc:
            feeder_error.append(exc)

    feeder = threading.Thread(target=feed, name="bench-prio-feeder", daemon=True)
    feeder.start()
    ready_samples: list[int] = []
    try:
        time.sleep(1.0)  # let the drain and the top-ups settle before measuring
        probes_start_ms = time.time() * 1000
        for i in range(opts.saturated_probes):
            _send(sender, highs[i % len(highs)], f"sat:{i}")
            ready_samples.append(receiver.queue_state(TARGET_QUEUE).ready_messages)
            time.sleep(opts.probe_gap_ms / 1000)
        r.wait_until(
            lambda: r.received.get(10, 0) >= opts.saturated_probes,
            opts.timeout_s,
            "level-10 probes under saturation",
        )
        probes_end_ms = time.time() * 1000
        stop_feeding.set()
        feeder.join(30)
        if feeder_error:
            raise RuntimeError("the level-1 feeder failed") from feeder_error[0]
        sender.flush(60)
        drained = True
        try:
            r.wait_until(lambda: r.received.get(1, 0) >= sent_low, opts.timeout_s, "level-1 drain")
        except TimeoutError:
            drained = False
        drain_end_ms = time.time() * 1000
    finally:
        stop_feeding.set()
        r.close()
    high = [s for s in r.seen.values() if s.level == 10]
    low = [s for s in r.seen.values() if s.level == 1]
    steady = [s for s in low if s.enqueued_ms >= reader_start_ms]
    low_during = [s for s in low if probes_start_ms <= s.received_ms <= probes_end_ms]
    left = sent_low - len(low)
    return {
        "backlog_target": opts.backlog,
        "backlog_groups": opts.backlog_groups,
        "backlog_fill_seconds": round(fill_s, 2),
        "ready_in_queue_during_probes": {
            "min": min(ready_samples) if ready_samples else None,
            "median": _pct([float(x) for x in ready_samples], 50),
            "max": max(ready_samples) if ready_samples else None,
        },
        "level10_time_in_queue": _summary([s.wait_ms for s in high]),
        "level10_send_to_receive": _summary([s.received_ms - _wall_ms(s.sent_ns) for s in high]),
        "level1_time_in_queue_steady": _summary([s.wait_ms for s in steady]),
        "level1_max_wait_ms_including_initial_backlog": max((s.wait_ms for s in low), default=None),
        "level1_sent": sent_low,
        "level1_received": len(low),
        "level1_drained": drained and left <= 0,
        "level1_received_per_s_during_probes": len(low_during)
        / max(1e-9, (probes_end_ms - probes_start_ms) / 1000),
        "probes_seconds": round((probes_end_ms - probes_start_ms) / 1000, 2),
        "drain_seconds": round((drain_end_ms - probes_end_ms) / 1000, 2),
        "redelivered": r.redelivered,
        "refused_commits": r.refused,
        "lock_lost": r.lock_lost,
    }


def _throughput_run(
    sender: KsbClient, receiver: KsbClient, mode: str, opts: PriorityOptions
) -> dict[str, Any]:
    """Send the whole backlog, wait until it is ready, then time one reader draining it."""
    services = [FLAT] if mode == "flat" else [LOW, HIGH]
    handles = [
        sender.begin_dialog(services[g % len(services)], TARGET, CONTRACT)
        for g in range(opts.throughput_groups)
    ]
    sender.flush(30)
    _fill(sender, handles, opts.throughput_messages, mode)
    _wait_ready(receiver, opts.throughput_messages, opts.timeout_s)
    r = _Receiver(receiver, opts.window)
    started = now_ns()
    r.start()
    try:
        r.wait_until(lambda: r.applied >= opts.throughput_messages, opts.timeout_s, f"{mode} drain")
    finally:
        r.close()
    seconds = (r.last_applied_ns - started) / 1e9
    levels = sorted(r.received)
    return {
        "mode": mode,
        "levels": levels,
        "messages": r.applied,
        "seconds": seconds,
        "per_s": r.applied / seconds if seconds > 0 else None,
        "refused_commits": r.refused,
        "redelivered": r.redelivered,
    }


def _throughput(sender: KsbClient, receiver: KsbClient, opts: PriorityOptions) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    order = []
    for i in range(opts.throughput_rounds):
        order.extend(["flat", "prio"] if i % 2 == 0 else ["prio", "flat"])
    for mode in order:
        runs.append(_throughput_run(sender, receiver, mode, opts))

    def rate(mode: str) -> float | None:
        picked = [r for r in runs if r["mode"] == mode]
        n = sum(r["messages"] for r in picked)
        s = sum(r["seconds"] for r in picked)
        return n / s if s > 0 else None

    flat, prio = rate("flat"), rate("prio")
    return {
        "messages_per_run": opts.throughput_messages,
        "groups": opts.throughput_groups,
        "runs": runs,
        "flat_level5_per_s": flat,
        "prio_levels_1_10_per_s": prio,
        "ratio_prio_over_flat": _ratio(prio, flat),
    }


def run_priorities(base: Deployment, opts: PriorityOptions, log_dir: Path) -> dict[str, Any]:
    """The RECEIVE part of the section on the running stack: its own instance and dispatcher."""
    settings = secure_instance(base.model_copy(update={"instance": f"{base.instance}prio"}))
    apply_catalog(settings, priority_catalog(opts.partitions))
    queues = running_queues(settings, log_dir / "prio-queue", opts.queue_replicas)
    dispatcher = ServiceProcess("dispatcher", settings, log_dir / "prio-dispatcher.log")
    phase = Phases()

    with queues as (settings, _replicas), contextlib.ExitStack() as stop:
        stop.callback(dispatcher.stop)
        dispatcher.start().wait_ready("dispatcher ready")
        phase("dispatcher_start")
        with KsbClient(settings) as sender, KsbClient(settings) as receiver:
            highs = [sender.begin_dialog(HIGH, TARGET, CONTRACT) for _ in range(_HIGH_DIALOGS)]
            sender.flush(30)
            idle = _idle(sender, receiver, highs, opts)
            phase("idle")
            throughput = _throughput(sender, receiver, opts)
            phase("throughput")
            saturated = _saturated(sender, receiver, highs, opts)
            phase("saturated")
    idle_tiq, sat_tiq = idle["time_in_queue"], saturated["level10_time_in_queue"]
    problems = []
    if saturated["redelivered"]:
        problems.append(f"{saturated['redelivered']} messages returned by RECEIVE twice")
    if not saturated["level1_drained"]:
        problems.append(
            f"level-1 backlog not drained in time: {saturated['level1_received']} of "
            f"{saturated['level1_sent']} received (the level-1 maximum wait is a lower bound)"
        )
    return {
        "config": {
            "instance": settings.instance,
            "partitions": opts.partitions,
            "window": opts.window,
            "idle_probes": opts.idle_probes,
            "saturated_probes": opts.saturated_probes,
            "probe_gap_ms": opts.probe_gap_ms,
            "body_bytes": _BODY_BYTES,
        },
        "idle": idle,
        "saturated": saturated,
        "level10_ratio_saturated_over_idle": {
            "p50": _ratio(sat_tiq["p50_ms"], idle_tiq["p50_ms"]),
            "p99": _ratio(sat_tiq["p99_ms"], idle_tiq["p99_ms"]),
        },
        "throughput": throughput,
        "problems": problems,
        "phase_seconds": phase.seconds,
    }


def format_lines(j: dict[str, Any]) -> list[str]:
    """The RECEIVE part's lines for the bench table."""

    def ms(v: float | None) -> str:
        return fmt_ms(v, 1)

    x = fmt_x
    cfg, idle, sat = j["config"], j["idle"]["time_in_queue"], j["saturated"]
    high, ratio, tp = (
        sat["level10_time_in_queue"],
        j["level10_ratio_saturated_over_idle"],
        j["throughput"],
    )
    steady, ready = sat["level1_time_in_queue_steady"], sat["ready_in_queue_during_probes"]
    lines = [
        f"priorities (RECEIVE, one reader, window {cfg['window']}, {cfg['partitions']} "
        f"partitions; time in queue = enqueued_ms -> RECEIVE returned it):",
        f"  level 10 idle ({idle['count']} one at a time): p50 {ms(idle['p50_ms'])}, "
        f"p99 {ms(idle['p99_ms'])}",
        f"  level 10 under level-1 saturation ({high['count']} every {cfg['probe_gap_ms']} ms; "
        f"backlog {sat['backlog_target']:,} over {sat['backlog_groups']:,} groups, "
        f"{ready['min']:,}-{ready['max']:,} ready in the queue): p50 {ms(high['p50_ms'])} "
        f"({x(ratio['p50'])} idle), p99 {ms(high['p99_ms'])} ({x(ratio['p99'])} idle)",
        f"  level-1 wait (RECEIVE is strict priority: no starvation bound; measured): max "
        f"{ms(steady['max_ms'])}, p50 {ms(steady['p50_ms'])}, p99 {ms(steady['p99_ms'])} over "
        f"{steady['count']:,} sent while draining (max incl. the initial backlog "
        f"{ms(sat['level1_max_wait_ms_including_initial_backlog'])}); drained at "
        f"{sat['level1_received_per_s_during_probes']:,.0f} msg/s",
        f"  throughput draining {tp['messages_per_run']:,} messages over {tp['groups']} groups: "
        f"all at level 5 {_rate(tp['flat_level5_per_s'])}, levels 1/10 "
        f"{_rate(tp['prio_levels_1_10_per_s'])} ({x(tp['ratio_prio_over_flat'])})",
    ]
    lines.extend(f"  problem: {p}" for p in j["problems"])
    return lines


def _rate(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f} msg/s"
