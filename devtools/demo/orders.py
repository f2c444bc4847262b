"""The order-processing scenario of `make run`: request/reply dialogs on one instance.

An order client opens dialogs and SENDs order lines; the order service RECEIVEs them and replies
in the same transaction, ending each dialog after its last line; the client receives the replies
and ends its side. The summary checks that every endpoint is CLOSED and the error topic is empty.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from apps.orders import (
    CLIENT_SERVICE,
    CONTRACT,
    LINE_ACCEPTED,
    ORDER_LINE,
    ORDER_SERVICE,
    accept_order_lines,
)
from devtools.demo.common import (
    RECEIVE_WAIT_MS,
    Outcome,
    console,
    error_records,
    guarded,
    percentile,
    say,
    settled_states,
    should_stop,
)
from devtools.demo.options import DemoOptions
from devtools.deployment import Deployment
from devtools.runner import ServiceProcess
from ksb.catalog.model import END_DIALOG, ERROR, Catalog
from ksb.sdk.client import KsbClient
from ksb.wire.protocol import QueueMessage

__all__ = [
    "CLIENT_SERVICE",
    "CONTRACT",
    "LINE_ACCEPTED",
    "ORDER_LINE",
    "ORDER_SERVICE",
    "Stats",
    "accept_order_lines",
    "run_dialogs",
]

MAX_COMMITS_IN_FLIGHT = 64  # per reader: commits sent whose outcome has not come back yet


@dataclass
class Stats:
    """What both sides did, updated from their threads (and commit callbacks) under one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    requests_sent: int = 0
    requests_replied: int = 0
    replies_received: int = 0
    dialogs_opened: int = 0
    dialogs_ended: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    priorities: dict[str, Counter[int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    sent_at: dict[tuple[str, int], float] = field(default_factory=dict)

    def add(self, counter: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, counter, getattr(self, counter) + n)

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)

    def seen_priority(self, queue: str, level: int) -> None:
        with self.lock:
            self.priorities.setdefault(queue, Counter())[level] += 1

    def snapshot(self) -> tuple[int, int, int]:
        with self.lock:
            return self.requests_replied, self.replies_received, self.dialogs_ended


class CommitPipeline:
    """Commits sent with `commit_async`, so a reader does not wait a round trip per RECEIVE.

    Each commit holds its group lock until its outcome is back, so at most
    MAX_COMMITS_IN_FLIGHT groups are held at once; `on_applied` runs once the dispatcher applied it.
    """

    def __init__(self, client: KsbClient, stats: Stats, who: str) -> None:
        self._client, self._stats, self._who = client, stats, who
        self._inflight: list[Future[Any]] = []

    def add(self, fut: Future[Any], on_applied: Callable[[], None]) -> None:
        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                self._stats.fail(f"{self._who}: commit not applied: {exc}")
            else:
                on_applied()

        fut.add_done_callback(done)
        self._inflight.append(fut)
        self._inflight = [f for f in self._inflight if not f.done()]
        while len(self._inflight) >= MAX_COMMITS_IN_FLIGHT:
            with contextlib.suppress(Exception):  # failures are counted by the callback
                self._client.wait(self._inflight.pop(0))

    def drain(self, timeout_s: float = 30.0) -> None:
        for fut in self._inflight:
            with contextlib.suppress(Exception):
                self._client.wait(fut, timeout_s)
        self._inflight.clear()


def order_service(
    client: KsbClient, queue: str, lines: int, total: int, stats: Stats, stop: threading.Event
) -> None:
    """The target: RECEIVE order lines, reply in the same transaction, END after the last one."""
    pipeline = CommitPipeline(client, stats, "order service")
    while not stop.is_set() and stats.snapshot()[0] < total:
        tx = client.transaction()
        msgs = tx.receive(queue, waitfor_ms=RECEIVE_WAIT_MS)
        if not msgs:
            tx.rollback()
            continue
        replied = 0
        for m in msgs:
            stats.seen_priority(queue, m.priority)
            if m.message_type_name == ORDER_LINE:
                line = json.loads(m.message_body)
                reply = {"order_id": line["order_id"], "line": line["line"], "status": "accepted"}
                tx.send(m.conversation_handle, LINE_ACCEPTED, json.dumps(reply))
                replied += 1
                if line["line"] == lines - 1:
                    tx.end_conversation(m.conversation_handle)
            elif m.message_type_name == ERROR:
                stats.fail(f"order service got an Error: {m.message_body.decode(errors='replace')}")
                tx.end_conversation(m.conversation_handle)
            elif m.message_type_name == END_DIALOG:
                tx.end_conversation(m.conversation_handle)
        pipeline.add(tx.commit_async(), functools.partial(stats.add, "requests_replied", replied))
    pipeline.drain()


def order_client_replies(
    client: KsbClient, queue: str, dialogs: int, stats: Stats, stop: threading.Event
) -> None:
    """The initiator's reader: take the replies (latency), END its side when the EndDialog comes."""
    pipeline = CommitPipeline(client, stats, "order client")
    while not stop.is_set() and stats.snapshot()[2] < dialogs:
        tx = client.transaction()
        msgs = tx.receive(queue, waitfor_ms=RECEIVE_WAIT_MS)
        if not msgs:
            tx.rollback()
            continue
        ended = 0
        now = time.perf_counter()
        for m in msgs:
            stats.seen_priority(queue, m.priority)
            if m.message_type_name == LINE_ACCEPTED:
                _record_reply(stats, m, now)
            elif m.message_type_name in (END_DIALOG, ERROR):
                if m.message_type_name == ERROR:
                    body = m.message_body.decode(errors="replace")
                    stats.fail(f"order client got an Error: {body}")
                tx.end_conversation(m.conversation_handle)
                ended += 1
        pipeline.add(tx.commit_async(), functools.partial(stats.add, "dialogs_ended", ended))
    pipeline.drain()


def _record_reply(stats: Stats, m: QueueMessage, now: float) -> None:
    line = int(json.loads(m.message_body)["line"])
    with stats.lock:
        stats.replies_received += 1
        sent = stats.sent_at.pop((m.conversation_handle, line), None)
        if sent is not None:
            stats.latencies_ms.append((now - sent) * 1000)


def open_dialog(client: KsbClient, order_no: int, lines: int, stats: Stats) -> None:
    """BEGIN DIALOG and SEND every line of one order (outside a transaction, as an app would)."""
    handle = client.begin_dialog(CLIENT_SERVICE, ORDER_SERVICE, CONTRACT)
    order_id = f"order-{order_no:06d}"
    for line in range(lines):
        body = {
            "order_id": order_id,
            "line": line,
            "sku": f"SKU-{line % 10000:04d}",
            "qty": 1 + line,
        }
        with stats.lock:
            stats.sent_at[(handle, line)] = time.perf_counter()
        client.send(handle, ORDER_LINE, json.dumps(body))
    with stats.lock:
        stats.requests_sent += lines
        stats.dialogs_opened += 1


def run_dialogs(
    opts: DemoOptions, settings: Deployment, catalog: Catalog, services: list[ServiceProcess]
) -> Outcome:
    """Drive both applications, show progress, then check what Kafka says about the result."""
    queues = {s.name: s.queue for s in catalog.services}
    total = opts.dialogs * opts.messages_per_dialog
    stats = Stats()
    stop = threading.Event()
    initiator, target = KsbClient(settings), KsbClient(settings)
    threads: list[threading.Thread] = []
    interrupted = False
    elapsed = 0.0
    try:
        threads = [
            threading.Thread(
                target=guarded,
                args=(
                    stats,
                    "order service",
                    order_service,
                    target,
                    queues[ORDER_SERVICE],
                    opts.messages_per_dialog,
                    total,
                    stats,
                    stop,
                ),
                name="demo-order-service",
                daemon=True,
            ),
            threading.Thread(
                target=guarded,
                args=(
                    stats,
                    "order client",
                    order_client_replies,
                    initiator,
                    queues[CLIENT_SERVICE],
                    opts.dialogs,
                    stats,
                    stop,
                ),
                name="demo-order-client",
                daemon=True,
            ),
        ]
        for t in threads:
            t.start()
        say(
            f"running {opts.dialogs} dialogs x {opts.messages_per_dialog} requests "
            f"(at most {opts.window} open at once)"
        )
        started = time.perf_counter()
        elapsed = _drive(opts, initiator, stats, services, started)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        stop.set()
        for t in threads:
            t.join(15)
        initiator.close()
        target.close()
        # Drop the clients before the stack stops. A Ctrl-C is re-raised below, outside the frames
        # that hold them, so no traceback keeps a producer (and its reconnect attempts to the
        # stopped broker) alive until the process exits.
        del initiator, target
    if interrupted:
        raise KeyboardInterrupt

    states = settled_states(settings, 2 * opts.dialogs)
    errors = error_records(settings)
    return _summarise(opts, stats, elapsed, states, errors)


def _drive(
    opts: DemoOptions,
    initiator: KsbClient,
    stats: Stats,
    services: list[ServiceProcess],
    started: float,
) -> float:
    """Open dialogs within the window and show progress until every dialog has ended."""
    total = opts.dialogs * opts.messages_per_dialog
    deadline = time.monotonic() + opts.timeout_s
    progress = Progress(
        TextColumn("{task.description:<34}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    with progress:
        replied = progress.add_task("requests received + replied", total=total)
        received = progress.add_task("replies received by the client", total=total)
        ended = progress.add_task("dialogs ended", total=opts.dialogs)
        while True:
            n_replied, n_received, n_ended = stats.snapshot()
            opened = stats.dialogs_opened
            while opened < opts.dialogs and opened - n_ended < opts.window:
                open_dialog(initiator, opened, opts.messages_per_dialog, stats)
                opened += 1
            progress.update(replied, completed=n_replied)
            progress.update(received, completed=n_received)
            progress.update(ended, completed=n_ended)
            if n_ended >= opts.dialogs:
                break
            if should_stop(stats, services, deadline, f"timed out after {opts.timeout_s:.0f}s"):
                break
            time.sleep(0.05)
    elapsed = time.perf_counter() - started
    initiator.flush()
    return elapsed


def _summarise(
    opts: DemoOptions,
    stats: Stats,
    elapsed: float,
    states: Counter[str],
    errors: list[dict[str, Any]],
) -> Outcome:
    total = opts.dialogs * opts.messages_per_dialog
    lat = sorted(stats.latencies_ms)
    p50, p99 = percentile(lat, 50), percentile(lat, 99)
    messages = stats.requests_replied + stats.replies_received
    throughput = messages / elapsed if elapsed > 0 else 0.0

    table = Table(title="KSB demo", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("dialogs", f"{stats.dialogs_ended} of {opts.dialogs} ended by the client")
    table.add_row("requests", f"{stats.requests_sent} sent, {stats.requests_replied} replied")
    table.add_row("replies", f"{stats.replies_received} received of {total}")
    table.add_row("elapsed", f"{elapsed:.2f} s")
    table.add_row("throughput", f"{throughput:.0f} msg/s (requests + replies)")
    table.add_row("request→reply latency", f"p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    for queue, levels in sorted(stats.priorities.items()):
        seen = ", ".join(f"level {lvl}: {n}" for lvl, n in sorted(levels.items()))
        table.add_row(f"priorities in {queue}", seen)
    table.add_row("endpoints", ", ".join(f"{s} {n}" for s, n in sorted(states.items())) or "none")
    table.add_row("error topic", f"{len(errors)} record(s)")
    console.print(table)

    problems = list(stats.failures)
    if stats.replies_received < total:
        problems.append(f"{total - stats.replies_received} replies missing")
    if stats.dialogs_ended < opts.dialogs:
        problems.append(f"{opts.dialogs - stats.dialogs_ended} dialogs not ended")
    not_closed = sum(n for s, n in states.items() if s != "CLOSED")
    if states.get("CLOSED", 0) != 2 * opts.dialogs or not_closed:
        problems.append(
            f"endpoints not all CLOSED: {dict(states)} (expected CLOSED {2 * opts.dialogs})"
        )
    for rec in errors[:5]:
        problems.append(f"error record: {rec.get('code')}: {rec.get('reason')}")
    if len(errors) > 5:
        problems.append(f"... and {len(errors) - 5} more error records")

    summary = (
        f"summary: {opts.dialogs} dialogs, {messages} messages in {elapsed:.2f}s "
        f"({throughput:.0f} msg/s), latency p50 {p50:.1f} ms p99 {p99:.1f} ms, "
        f"endpoints {states.get('CLOSED', 0)}/{2 * opts.dialogs} CLOSED, {len(errors)} errors"
    )
    for p in problems:
        say(f"PROBLEM: {p}")
    return Outcome(ok=not problems, summary=summary)
