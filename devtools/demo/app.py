"""`python -m devtools.demo` (`make run`): the whole system on this machine, end to end.

Starts a fresh local stack under ``var/demo/``, every service that exists under ``services/`` as a
child process, applies ``infra/demo/catalog.yaml`` and runs an order-processing request/reply: an
order client opens dialogs and SENDs order lines; the order service RECEIVEs them and replies in the
same transaction, ending each dialog after its last line; the client receives the replies and ends
its side. The summary checks that every endpoint is CLOSED and that the error topic is empty.

A second broker instance, "demo-b" (``infra/demo/catalog-b.yaml``), runs its own dispatcher,
transmitter and transport on the same Kafka cluster and Redis. A stock client on "demo" then opens
dialogs to the warehouse on "demo-b" through a route: its messages cross from ``ksb.demo.*`` to
``ksb.demo-b.*`` and the replies come back. That part checks exactly-once and in-order delivery,
that both transmission queues drain and that the connection is up. The exit code says whether it
all worked.

Ctrl-C (or SIGTERM) at any moment stops the services, then the stack: nothing is left running.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import redis
from confluent_kafka import Message
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from devtools.deployment import Deployment
from devtools.localstack import LocalStack, LocalStackError, start_stack
from devtools.runner import ServiceProcess
from ksb.catalog.model import END_DIALOG, ERROR, Catalog, load_catalog_file
from ksb.dialog.endpoint import decode_endpoint
from ksb.errors import KsbError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.catalog_store import apply_catalog
from ksb.runtime.redis_view import read_transmission_view
from ksb.sdk.client import KsbClient, Transaction
from ksb.wire.protocol import QueueMessage

__all__ = ["main"]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WORKDIR = REPO_ROOT / "var" / "demo"
DEFAULT_CATALOG = REPO_ROOT / "infra" / "demo" / "catalog.yaml"
DEFAULT_CATALOG_B = REPO_ROOT / "infra" / "demo" / "catalog-b.yaml"
# Services in start order; a name counts only once `services/<name>/__main__.py` exists.
SERVICE_NAMES = ("dispatcher", "transmitter", "transport", "forwarder", "activation")
INSTANCE = "demo"
# The second instance runs only what carries dialogs across; its process names get this suffix.
INSTANCE_B = "demo-b"
SERVICE_NAMES_B = ("dispatcher", "transmitter", "transport")
SUFFIX_B = "-b"

# Names from infra/demo/catalog.yaml; checked against the loaded catalog before anything runs.
CLIENT_SERVICE = "//demo/orders/OrderClient"
ORDER_SERVICE = "//demo/orders/OrderService"
CONTRACT = "//demo/orders/OrderContract"
ORDER_LINE = "//demo/orders/OrderLine"
LINE_ACCEPTED = "//demo/orders/LineAccepted"
# The cross-instance part: the stock client is on INSTANCE, the warehouse on INSTANCE_B.
STOCK_CLIENT = "//demo/warehouse/StockClient"
WAREHOUSE = "//demo/warehouse/Warehouse"
STOCK_CONTRACT = "//demo/warehouse/StockContract"
RESERVE_STOCK = "//demo/warehouse/ReserveStock"
STOCK_RESERVED = "//demo/warehouse/StockReserved"
CROSS_LINES = 3  # ReserveStock messages per cross-instance dialog
CROSS_TIMEOUT_S = 60.0  # how long the cross-instance dialogs may take
DRAIN_TIMEOUT_S = 30.0  # how long the transmission queues may take to empty afterwards

RECEIVE_WAIT_MS = 200
MAX_COMMITS_IN_FLIGHT = 64  # per reader: commits sent whose outcome has not come back yet
SETTLE_TIMEOUT_S = 30.0  # how long endpoints may take to reach CLOSED after the last END

EXIT_OK, EXIT_FAILED, EXIT_START_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 130

console = Console(highlight=False, soft_wrap=True)


def say(text: str) -> None:
    console.print(text, markup=False)


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class DemoOptions:
    dialogs: int
    messages_per_dialog: int
    window: int
    keep_running: bool
    workdir: Path
    catalog: Path
    timeout_s: float
    spark: bool = True
    cross_dialogs: int = 10
    catalog_b: Path = DEFAULT_CATALOG_B


def parse_args(argv: list[str] | None) -> DemoOptions:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.demo", description="Run KSB end to end on a fresh local stack."
    )
    parser.add_argument("--dialogs", type=int, default=200, help="dialogs to open (default 200)")
    parser.add_argument(
        "--messages-per-dialog", type=int, default=5, help="requests per dialog (default 5)"
    )
    parser.add_argument(
        "--window", type=int, default=50, help="dialogs open at once at most (default 50)"
    )
    parser.add_argument(
        "--keep-running",
        action="store_true",
        help="keep the stack and services up after the demo, until Ctrl-C",
    )
    parser.add_argument(
        "--workdir", type=Path, default=DEFAULT_WORKDIR, help="state directory (wiped first)"
    )
    parser.add_argument("--catalog", type=Path, default=DEFAULT_CATALOG, help="catalog YAML")
    parser.add_argument(
        "--catalog-b",
        type=Path,
        default=DEFAULT_CATALOG_B,
        help=f"catalog YAML of the second instance, {INSTANCE_B}",
    )
    parser.add_argument(
        "--cross-dialogs",
        type=int,
        default=10,
        help=f"dialogs from {INSTANCE} to {INSTANCE_B} (default 10)",
    )
    parser.add_argument(
        "--timeout", type=float, default=180.0, help="seconds the dialogs may take (default 180)"
    )
    parser.add_argument(
        "--no-spark",
        dest="spark",
        action="store_false",
        help="do not run the Spark audit/SLA job (local mode) beside the services",
    )
    a = parser.parse_args(argv)
    for name in ("dialogs", "messages_per_dialog", "window", "cross_dialogs"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return DemoOptions(
        dialogs=a.dialogs,
        messages_per_dialog=a.messages_per_dialog,
        window=a.window,
        keep_running=a.keep_running,
        workdir=a.workdir.resolve(),
        spark=a.spark,
        catalog=a.catalog.resolve(),
        timeout_s=a.timeout,
        cross_dialogs=a.cross_dialogs,
        catalog_b=a.catalog_b.resolve(),
    )


# --------------------------------------------------------------------------- counters


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


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile of an already sorted list (0 for an empty one)."""
    if not sorted_values:
        return 0.0
    rank = max(1, min(len(sorted_values), round(pct / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


# --------------------------------------------------------------------------- the two applications


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


def accept_order_lines(tx: Transaction, messages: list[QueueMessage]) -> None:
    """The order service as an activation procedure (docker-compose's external activator runs it):
    accept each line in the same transaction and end conversations the client has ended."""
    for m in messages:
        if m.message_type_name == ORDER_LINE:
            line = json.loads(m.message_body)
            reply = {"order_id": line["order_id"], "line": line["line"], "status": "accepted"}
            tx.send(m.conversation_handle, LINE_ACCEPTED, json.dumps(reply))
        elif m.message_type_name in (END_DIALOG, ERROR):
            tx.end_conversation(m.conversation_handle)


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


# --------------------------------------------------------------------------- reading the topics


def endpoint_states(settings: Deployment, handles: set[str] | None = None) -> Counter[str]:
    """Endpoints by state, from the latest record of each in the compacted endpoints topic
    (only those of `handles` if given: one instance can hold several scenarios' dialogs)."""
    latest: dict[str, str] = {}

    def fold(m: Message) -> None:
        key, value = m.key(), m.value()
        if key is not None and value is not None and (handles is None or key.decode() in handles):
            latest[key.decode()] = decode_endpoint(value).state.name

    _read(settings, Names(settings.instance).endpoints, fold)
    return Counter(latest.values())


def error_records(settings: Deployment) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def fold(m: Message) -> None:
        value = m.value()
        if value is not None:
            out.append(json.loads(value))

    _read(settings, Names(settings.instance).errors, fold)
    return out


def _read(settings: Deployment, topic: str, fold: Callable[[Message], None]) -> None:
    c = kafka.consumer(settings)
    try:
        kafka.read_to_end(c, topic, fold, timeout_s=30)
    finally:
        c.close()


# --------------------------------------------------------------------------- processes


SPARK_JOB = "spark-audit"
SPARK_MODULE = "ksb.spark"


def available_services(names: tuple[str, ...] = SERVICE_NAMES) -> list[str]:
    return [n for n in names if (REPO_ROOT / "services" / n / "__main__.py").is_file()]


def service_processes(
    settings: Deployment, names: list[str], logs: Path, suffix: str = ""
) -> list[ServiceProcess]:
    """One (not yet started) process per name; `suffix` tells a second instance's apart in the
    process names and logs, while each still runs its own `services.<name>` module."""
    procs = []
    for name in names:
        module = SPARK_MODULE if name == SPARK_JOB else f"services.{name}"
        procs.append(
            ServiceProcess(f"{name}{suffix}", settings, logs / f"{name}{suffix}.log", module=module)
        )
    return procs


@contextlib.contextmanager
def running_services(procs: list[ServiceProcess]) -> Iterator[list[ServiceProcess]]:
    """Start the services, wait for each to log "ready", and stop them all on the way out."""
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            marker = "audit job running" if proc.module == SPARK_MODULE else "ready"
            proc.wait_ready(marker, timeout_s=180)
            assert proc.proc is not None
            say(f"  {proc.name} ready (pid {proc.proc.pid}, log {proc.log_path})")
        yield procs
    finally:
        _defer_interrupts()
        if procs:
            say("stopping services: " + ", ".join(p.name for p in procs))
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.stop(grace_s=10)


def _guard_workdir(workdir: Path) -> None:
    """Refuse to wipe the state of a demo that still runs (e.g. one left with --keep-running)."""
    pid_file = workdir / "demo.pid"
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        cmdline = b""
    else:
        if pid != os.getpid() and b"devtools.demo" in cmdline:
            raise LocalStackError(
                f"a demo (pid {pid}) is still running in {workdir}; stop it with Ctrl-C or "
                f"`kill -INT {pid}`, or pass another --workdir"
            )
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    pid_file.write_text(f"{os.getpid()}\n")


def _wait_for_catalog(dispatcher: ServiceProcess | None, version: int) -> None:
    """The dispatcher was running before the catalog existed: wait until it has hot-loaded it."""
    if dispatcher is None:
        return
    deadline = time.monotonic() + 30
    markers = (f"catalog v{version} applied", f"rebuilt: catalog v{version},")
    while time.monotonic() < deadline:
        text = dispatcher.log_path.read_text(errors="replace")
        if any(mark in text for mark in markers):
            return
        if not dispatcher.alive():
            raise KsbError(f"dispatcher exited:\n{dispatcher.tail()}")
        time.sleep(0.05)
    raise KsbError(f"dispatcher did not load catalog v{version} in 30s:\n{dispatcher.tail()}")


def _check_catalog(catalog: Catalog) -> None:
    _require(
        catalog,
        "the demo catalog",
        services=(CLIENT_SERVICE, ORDER_SERVICE, STOCK_CLIENT),
        routes=(WAREHOUSE,),
    )


def _check_catalog_b(catalog: Catalog) -> None:
    _require(catalog, f"the {INSTANCE_B} catalog", services=(WAREHOUSE,), routes=(STOCK_CLIENT,))


def _require(
    catalog: Catalog, what: str, services: tuple[str, ...], routes: tuple[str, ...]
) -> None:
    """Fail before anything starts if a catalog lacks a name the demo's applications use."""
    types = {m.name for m in catalog.message_types}
    contracts = {c.name for c in catalog.contracts}
    missing = [n for n in services if n not in {s.name for s in catalog.services}]
    missing += [
        f"a route for {n}" for n in routes if n not in {r.service_name for r in catalog.routes}
    ]
    missing += [n for n in (RESERVE_STOCK, STOCK_RESERVED) if n not in types]
    missing += [STOCK_CONTRACT] if STOCK_CONTRACT not in contracts else []
    if CLIENT_SERVICE in services:
        missing += [n for n in (ORDER_LINE, LINE_ACCEPTED) if n not in types]
        missing += [CONTRACT] if CONTRACT not in contracts else []
    if missing:
        raise KsbError(f"{what} lacks {', '.join(missing)}")


# --------------------------------------------------------------------------- signals


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _stopping(_signum: int, _frame: FrameType | None) -> None:
    say("still stopping; everything started will be stopped")


def _defer_interrupts() -> None:
    """Cleanup has begun: a second Ctrl-C must not cut it short and leave processes behind."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _stopping)
        signal.signal(signal.SIGTERM, _stopping)


# --------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class Outcome:
    ok: bool
    summary: str


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
        # Readers first, so they follow their queue topics before the first message arrives.
        initiator.reader(queues[CLIENT_SERVICE])
        target.reader(queues[ORDER_SERVICE])
        threads = [
            threading.Thread(
                target=_guarded,
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
                target=_guarded,
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

    states = _settled_states(settings, 2 * opts.dialogs)
    errors = error_records(settings)
    return _summarise(opts, stats, elapsed, states, errors)


def _guarded(stats: Stats | CrossStats, who: str, fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as exc:
        stats.fail(f"{who} crashed: {exc!r}")


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
            if _should_stop(stats, services, deadline, f"timed out after {opts.timeout_s:.0f}s"):
                break
            time.sleep(0.05)
    elapsed = time.perf_counter() - started
    initiator.flush()
    return elapsed


def _settled_states(
    settings: Deployment,
    expected: int,
    handles: set[str] | None = None,
    timeout_s: float = SETTLE_TIMEOUT_S,
) -> Counter[str]:
    """Endpoint states once `expected` endpoints (of `handles`, if given) are CLOSED, or whatever
    they are after the wait."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = endpoint_states(settings, handles)
        if states.get("CLOSED", 0) >= expected or time.monotonic() > deadline:
            return states
        time.sleep(0.25)


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


# --------------------------------------------------------------------------- across two instances


@dataclass
class CrossStats:
    """What crossed between the instances, from both sides' threads, under one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    lines_received: dict[str, list[int]] = field(default_factory=dict)
    """On B: each conversation's ReserveStock lines, in the order committed RECEIVEs took them."""
    message_ids: Counter[str] = field(default_factory=Counter)
    replies: Counter[str] = field(default_factory=Counter)
    """On A: StockReserved replies per conversation handle."""
    ended: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)

    def received(self, got: list[tuple[str, str, int]]) -> None:
        with self.lock:
            for conversation_id, message_id, line in got:
                self.lines_received.setdefault(conversation_id, []).append(line)
                self.message_ids[message_id] += 1

    def replied(self, handles: list[str], ended: list[str]) -> None:
        with self.lock:
            self.replies.update(handles)
            self.ended.update(ended)

    def n_ended(self) -> int:
        with self.lock:
            return len(self.ended)


def warehouse(client: KsbClient, queue: str, stats: CrossStats, stop: threading.Event) -> None:
    """The target on instance B: RECEIVE reservations; once a dialog's last line is in, reply
    StockReserved and END it in the same transaction. Counts only what a commit applied."""
    while not stop.is_set():
        tx = client.transaction()
        msgs = tx.receive(queue, waitfor_ms=RECEIVE_WAIT_MS)
        if not msgs:
            tx.rollback()
            continue
        got: list[tuple[str, str, int]] = []
        for m in msgs:
            if m.message_type_name == RESERVE_STOCK:
                line = json.loads(m.message_body)
                got.append((m.conversation_id, m.message_id, int(line["line"])))
                if line["line"] == CROSS_LINES - 1:
                    reply = {"order_id": line["order_id"], "lines": CROSS_LINES}
                    tx.send(m.conversation_handle, STOCK_RESERVED, json.dumps(reply))
                    tx.end_conversation(m.conversation_handle)
            elif m.message_type_name in (END_DIALOG, ERROR):
                if m.message_type_name == ERROR:
                    stats.fail(f"warehouse got an Error: {m.message_body.decode(errors='replace')}")
                tx.end_conversation(m.conversation_handle)
        try:
            tx.commit()
        except KsbError as exc:  # not applied: the messages are received again
            stats.fail(f"warehouse: commit not applied: {exc}")
            continue
        stats.received(got)


def stock_client(
    client: KsbClient, queue: str, dialogs: int, stats: CrossStats, stop: threading.Event
) -> None:
    """The initiator's reader on instance A: take the reply, END its side on the EndDialog."""
    while not stop.is_set() and stats.n_ended() < dialogs:
        tx = client.transaction()
        msgs = tx.receive(queue, waitfor_ms=RECEIVE_WAIT_MS)
        if not msgs:
            tx.rollback()
            continue
        replies: list[str] = []
        ended: list[str] = []
        for m in msgs:
            if m.message_type_name == STOCK_RESERVED:
                replies.append(m.conversation_handle)
            elif m.message_type_name in (END_DIALOG, ERROR):
                if m.message_type_name == ERROR:
                    body = m.message_body.decode(errors="replace")
                    stats.fail(f"stock client got an Error: {body}")
                tx.end_conversation(m.conversation_handle)
                ended.append(m.conversation_handle)
        try:
            tx.commit()
        except KsbError as exc:
            stats.fail(f"stock client: commit not applied: {exc}")
            continue
        stats.replied(replies, ended)


def open_stock_dialog(client: KsbClient, order_no: int) -> str:
    """BEGIN DIALOG to the warehouse on the other instance and SEND one line per message."""
    handle = client.begin_dialog(STOCK_CLIENT, WAREHOUSE, STOCK_CONTRACT)
    for line in range(CROSS_LINES):
        body = {"order_id": f"order-{order_no:06d}", "line": line, "sku": f"SKU-{line:04d}"}
        client.send(handle, RESERVE_STOCK, json.dumps(body))
    return handle


def delivery_problems(stats: CrossStats, handles: list[str]) -> list[str]:
    """Exactly once and in order: each dialog's lines arrived 0, 1, 2 ... once each, nothing
    else arrived, no message id twice, and each dialog got one reply and one end."""
    expected = list(range(CROSS_LINES))
    wrong = [h for h in handles if stats.lines_received.get(h) != expected]
    problems = [
        f"dialog {h}: warehouse received lines {stats.lines_received.get(h, [])}, "
        f"expected {expected}"
        for h in wrong[:5]
    ]
    strangers = set(stats.lines_received) - set(handles)
    if strangers:
        problems.append(f"warehouse received {len(strangers)} dialog(s) nobody opened")
    twice = [mid for mid, n in stats.message_ids.items() if n > 1]
    if twice:
        problems.append(f"{len(twice)} message id(s) received more than once")
    no_reply = [h for h in handles if stats.replies[h] != 1]
    if no_reply:
        problems.append(f"{len(no_reply)} dialog(s) without exactly one StockReserved reply")
    if len(stats.ended) < len(handles):
        problems.append(f"{len(handles) - len(stats.ended)} dialog(s) not ended by the client")
    return problems


def wait_transmission_drained(
    settings: Deployment, since_ms: int, timeout_s: float = DRAIN_TIMEOUT_S
) -> dict[str, Any]:
    """The instance's transmission queue view once it is empty in a snapshot taken after
    `since_ms` (an older one could predate the last sends), or the last view after the wait."""
    r = redis.Redis.from_url(settings.redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            view = read_transmission_view(r, Names(settings.instance))
            fresh = (view["updated_ms"] or 0) >= since_ms
            if (fresh and not view["messages"]) or time.monotonic() > deadline:
                return view
            time.sleep(0.1)
    finally:
        r.close()


def connection_state(view: dict[str, Any], destination: str) -> str:
    """The transport's connection row to `destination` (like sys.dm_broker_connections)."""
    rows = [c for c in view["connections"] if c.get("destination") == destination]
    return str(rows[0].get("state")) if rows else "no connection"


def run_cross_instance(
    opts: DemoOptions,
    sa: Deployment,
    sb: Deployment,
    queues: tuple[str, str],
    services: list[ServiceProcess],
) -> Outcome:
    """Dialogs from the stock client on A to the warehouse on B, then check what crossed.
    `queues` are the stock client's queue on A and the warehouse's on B."""
    stock_queue, warehouse_queue = queues
    errors_before = len(error_records(sa))
    stats = CrossStats()
    stop = threading.Event()
    client_a, client_b = KsbClient(sa), KsbClient(sb)
    threads: list[threading.Thread] = []
    handles: list[str] = []
    interrupted = False
    elapsed = 0.0
    try:
        client_a.reader(stock_queue)
        client_b.reader(warehouse_queue)
        threads = [
            threading.Thread(
                target=_guarded,
                args=(stats, "warehouse", warehouse, client_b, warehouse_queue, stats, stop),
                name="demo-warehouse",
                daemon=True,
            ),
            threading.Thread(
                target=_guarded,
                args=(
                    stats,
                    "stock client",
                    stock_client,
                    client_a,
                    stock_queue,
                    opts.cross_dialogs,
                    stats,
                    stop,
                ),
                name="demo-stock-client",
                daemon=True,
            ),
        ]
        for t in threads:
            t.start()
        say(
            f"running {opts.cross_dialogs} dialogs x {CROSS_LINES} reservations across instances, "
            f"{STOCK_CLIENT} on {INSTANCE} -> {WAREHOUSE} on {INSTANCE_B}"
        )
        started = time.perf_counter()
        handles = [open_stock_dialog(client_a, n) for n in range(opts.cross_dialogs)]
        client_a.flush()
        _await_cross(stats, opts.cross_dialogs, services)
        elapsed = time.perf_counter() - started
    except KeyboardInterrupt:
        interrupted = True
    finally:
        stop.set()
        for t in threads:
            t.join(15)
        client_a.close()
        client_b.close()
        del client_a, client_b  # as in run_dialogs: nothing may keep a producer alive past here
    if interrupted:
        raise KeyboardInterrupt
    return _check_cross(sa, sb, stats, handles, elapsed, errors_before)


def _await_cross(stats: CrossStats, dialogs: int, services: list[ServiceProcess]) -> None:
    """Until the client has ended every dialog, a reader crashed, a service died or time is up."""
    deadline = time.monotonic() + CROSS_TIMEOUT_S
    timed_out = f"cross-instance dialogs timed out after {CROSS_TIMEOUT_S:.0f}s"
    while stats.n_ended() < dialogs:
        if _should_stop(stats, services, deadline, timed_out):
            return
        time.sleep(0.02)


def _should_stop(
    stats: Stats | CrossStats, services: list[ServiceProcess], deadline: float, timed_out: str
) -> bool:
    """A reader crashed, a service died (recorded as a failure) or time is up (recorded too)."""
    if any("crashed" in f for f in stats.failures):
        return True
    dead = [s.name for s in services if not s.alive()]
    if dead:
        stats.fail(f"service(s) exited during the demo: {', '.join(dead)}")
        return True
    if time.monotonic() > deadline:
        stats.fail(timed_out)
        return True
    return False


@dataclass(frozen=True)
class CrossFacts:
    """What Kafka and Redis say about the cross-instance dialogs once they have settled."""

    states_a: Counter[str]
    states_b: Counter[str]
    waiting: dict[str, int]
    """Unacknowledged messages in each instance's transmission queue view."""
    links: dict[tuple[str, str], str]
    """Connection state by (from instance, to instance), from each transport's view."""
    errors: list[dict[str, Any]]

    @property
    def closed(self) -> int:
        return self.states_a.get("CLOSED", 0) + self.states_b.get("CLOSED", 0)

    @property
    def all_closed(self) -> bool:
        return self.closed == sum(self.states_a.values()) + sum(self.states_b.values())


def _observe_cross(
    sa: Deployment, sb: Deployment, handles: list[str], settled: bool, errors_before: int
) -> CrossFacts:
    """Endpoints CLOSED on both sides first, then both transmission queues in views taken after
    that: once both ends are CLOSED nothing is still on its way, so an empty view means drained.
    Dialogs that did not all end (`settled` False) will not settle: read once, do not wait."""
    settle_s, drain_s = (SETTLE_TIMEOUT_S, DRAIN_TIMEOUT_S) if settled else (0.0, 1.0)
    states_a = _settled_states(sa, len(handles), set(handles), settle_s)
    states_b = _settled_states(sb, len(handles), timeout_s=settle_s)
    settled_ms = int(time.time() * 1000)
    view_a = wait_transmission_drained(sa, settled_ms, drain_s)
    view_b = wait_transmission_drained(sb, settled_ms, drain_s)
    return CrossFacts(
        states_a=states_a,
        states_b=states_b,
        waiting={INSTANCE: len(view_a["messages"]), INSTANCE_B: len(view_b["messages"])},
        links={
            (INSTANCE, INSTANCE_B): connection_state(view_a, INSTANCE_B),
            (INSTANCE_B, INSTANCE): connection_state(view_b, INSTANCE),
        },
        errors=error_records(sa)[errors_before:] + error_records(sb),
    )


def _check_cross(
    sa: Deployment,
    sb: Deployment,
    stats: CrossStats,
    handles: list[str],
    elapsed: float,
    errors_before: int,
) -> Outcome:
    """Exactly once and in order, every endpoint CLOSED, both transmission queues drained, both
    connections up and no new error records; the summary line says which held."""
    n = len(handles)
    facts = _observe_cross(sa, sb, handles, stats.n_ended() >= n > 0, errors_before)
    delivery = delivery_problems(stats, handles)
    problems = list(stats.failures) + delivery
    if facts.closed != 2 * n or not facts.all_closed:
        problems.append(
            f"cross-instance endpoints not all CLOSED: {INSTANCE} {dict(facts.states_a)}, "
            f"{INSTANCE_B} {dict(facts.states_b)} (expected CLOSED {n} on each)"
        )
    drained = not any(facts.waiting.values())
    if not drained:
        problems.append(f"transmission queues not drained: {facts.waiting} unacknowledged")
    problems += [
        f"connection {src} -> {dst}: {state}"
        for (src, dst), state in facts.links.items()
        if state != "CONNECTED"
    ]
    problems += [f"error record: {r.get('code')}: {r.get('reason')}" for r in facts.errors[:5]]

    links = ", ".join(f"{src} -> {dst} {state}" for (src, dst), state in facts.links.items())
    say(
        f"  connections: {links}; `ksb transmission` shows them (KSB_INSTANCE={INSTANCE}|{INSTANCE_B})"
    )
    received = sum(len(lines) for lines in stats.lines_received.values())
    summary = (
        f"cross-instance: {n} dialogs {INSTANCE} -> {INSTANCE_B}, {received} messages and "
        f"{sum(stats.replies.values())} replies in {elapsed:.2f}s, "
        f"{'exactly once and in order' if not delivery else 'NOT exactly once and in order'}, "
        f"endpoints {facts.closed}/{2 * n} CLOSED, "
        f"transmission queues {'drained' if drained else 'NOT drained'}, "
        f"connection {INSTANCE} -> {INSTANCE_B} {facts.links[(INSTANCE, INSTANCE_B)]}, "
        f"{len(facts.errors)} errors"
    )
    for p in problems:
        say(f"PROBLEM: {p}")
    return Outcome(ok=not problems, summary=summary)


def _report_sla(out_dir: Path, wait_s: float = 40.0) -> None:
    """The Spark job closes an SLA window once the watermark passes it: wait a little for the
    first Parquet files, then say where `make report` will find them."""
    deadline = time.monotonic() + wait_s
    files: list[Path] = []
    while time.monotonic() < deadline and not files:
        files = list(out_dir.rglob("*.parquet")) if out_dir.exists() else []
        time.sleep(1.0)
    say(f"spark audit job: {len(files)} Parquet file(s) of SLA/audit output under {out_dir}")


def _print_env(stack: LocalStack, settings: Deployment) -> None:
    say("")
    say("The stack and services keep running; press Ctrl-C to stop them all.")
    say("To use the ksb CLI against this instance, export:")
    say(f"  export KSB_INSTANCE={settings.instance}")
    say(f"  export KSB_KAFKA_BOOTSTRAP={stack.kafka_bootstrap}")
    say(f"  export KSB_REDIS_URL={stack.redis_url}")
    say("then e.g. `ksb endpoints --leaked` or `ksb errors`;")
    say(f"KSB_INSTANCE={INSTANCE_B} for the second instance, e.g. `ksb transmission`.")
    sys.stdout.flush()


def _wait_until_interrupted(services: list[ServiceProcess]) -> bool:
    """Block until Ctrl-C / SIGTERM (True) or until a service dies (False)."""
    try:
        while True:
            time.sleep(0.5)
            dead = [s.name for s in services if not s.alive()]
            if dead:
                say(f"service(s) exited: {', '.join(dead)}; stopping")
                return False
    except KeyboardInterrupt:
        say("interrupted")
        return True


def demo(opts: DemoOptions) -> int:
    catalog, catalog_b = load_catalog_file(opts.catalog), load_catalog_file(opts.catalog_b)
    _check_catalog(catalog)
    _check_catalog_b(catalog_b)
    _guard_workdir(opts.workdir)
    say(f"starting the local stack (Kafka + Redis) under {opts.workdir}")
    t0 = time.perf_counter()
    stack = start_stack(opts.workdir / "stack", timeout_s=120, stop_at_exit=True)
    try:
        say(
            f"  kafka {stack.kafka_bootstrap} (pid {stack.kafka_pid}), redis {stack.redis_url} "
            f"(pid {stack.redis_pid}), up in {time.perf_counter() - t0:.1f}s"
        )
        settings = Deployment(
            instance=INSTANCE,
            kafka_bootstrap=stack.kafka_bootstrap,
            redis_url=stack.redis_url,
            spark_checkpoint_dir=str(opts.workdir / "spark" / "checkpoints"),
            spark_output_dir=str(opts.workdir / "spark"),
        )
        settings_b = Deployment(
            instance=INSTANCE_B, kafka_bootstrap=stack.kafka_bootstrap, redis_url=stack.redis_url
        )
        logs = opts.workdir / "logs"
        procs = service_processes(
            settings, available_services() + ([SPARK_JOB] if opts.spark else []), logs
        )
        procs += service_processes(settings_b, available_services(SERVICE_NAMES_B), logs, SUFFIX_B)
        say(f"starting services: {', '.join(p.name for p in procs)}")
        with running_services(procs) as services:
            pids = [f"kafka={stack.kafka_pid}", f"redis={stack.redis_pid}"]
            pids += [f"{s.name}={s.proc.pid}" for s in services if s.proc is not None]
            say("pids: " + " ".join(pids))
            _apply_catalogs(
                [
                    (settings, catalog, opts.catalog, "dispatcher"),
                    (settings_b, catalog_b, opts.catalog_b, f"dispatcher{SUFFIX_B}"),
                ],
                services,
            )
            outcome = run_dialogs(opts, settings, catalog, services)
            print(outcome.summary, flush=True)
            queues = (_queue_of(catalog, STOCK_CLIENT), _queue_of(catalog_b, WAREHOUSE))
            cross = run_cross_instance(opts, settings, settings_b, queues, services)
            print(cross.summary, flush=True)
            if opts.spark:
                _report_sla(opts.workdir / "spark" / INSTANCE)
            ok = outcome.ok and cross.ok
            say("demo OK" if ok else "demo FAILED")
            if opts.keep_running:
                _print_env(stack, settings)
                if not _wait_until_interrupted(services):
                    return EXIT_FAILED
            return EXIT_OK if ok else EXIT_FAILED
    finally:
        _defer_interrupts()
        say("stopping the stack")
        stack.stop()
        (opts.workdir / "demo.pid").unlink(missing_ok=True)


def _apply_catalogs(
    catalogs: list[tuple[Deployment, Catalog, Path, str]], services: list[ServiceProcess]
) -> None:
    """Apply each instance's catalog, then wait for its dispatcher (the name last in each tuple)
    to have loaded it: all are applied first, so the dispatchers load them in the same wait."""
    versions = [apply_catalog(settings, catalog).version for settings, catalog, _, _ in catalogs]
    for (settings, catalog, path, reader), version in zip(catalogs, versions, strict=True):
        _wait_for_catalog(next((s for s in services if s.name == reader), None), version)
        say(
            f"catalog v{version} applied to {settings.instance} from {path.name}: "
            f"{len(catalog.message_types)} message types, "
            f"{len(catalog.contracts)} contract(s), "
            f"{len(catalog.queues)} queues, {len(catalog.services)} services, "
            f"{len(catalog.priorities)} priorities, {len(catalog.routes)} route(s)"
        )


def _queue_of(catalog: Catalog, service: str) -> str:
    return next(s.queue for s in catalog.services if s.name == service)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        return demo(opts)
    except KeyboardInterrupt:
        say("interrupted; everything stopped")
        return EXIT_INTERRUPTED
    except (LocalStackError, KsbError, TimeoutError, RuntimeError) as exc:
        say(f"demo could not run: {exc}")
        return EXIT_START_FAILED


if __name__ == "__main__":
    raise SystemExit(main())
