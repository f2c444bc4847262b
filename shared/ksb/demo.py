"""`python -m ksb.demo` (`make run`): the whole system on this machine, end to end.

Starts a fresh local stack under ``var/demo/``, every service that exists under ``services/`` as a
child process, applies ``infra/demo/catalog.yaml`` and runs an order-processing request/reply: an
order client opens dialogs and SENDs order lines; the order service RECEIVEs them and replies in the
same transaction, ending each dialog after its last line; the client receives the replies and ends
its side. The summary checks that every endpoint is CLOSED and that the error topic is empty, and
the exit code says whether it all worked.

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

from confluent_kafka import Message
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ksb import kafka
from ksb.catalog import END_DIALOG, ERROR, Catalog, load_catalog_file
from ksb.catalog_store import apply_catalog
from ksb.client import KsbClient, Transaction
from ksb.endpoint import decode_endpoint
from ksb.errors import KsbError
from ksb.localstack import LocalStack, LocalStackError, start_stack
from ksb.names import Names
from ksb.protocol import QueueMessage
from ksb.runner import ServiceProcess
from ksb.settings import Settings, load_settings

__all__ = ["main"]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WORKDIR = REPO_ROOT / "var" / "demo"
DEFAULT_CATALOG = REPO_ROOT / "infra" / "demo" / "catalog.yaml"
# Services in start order; a name counts only once `services/<name>/__main__.py` exists.
SERVICE_NAMES = ("dispatcher", "transmitter", "transport", "forwarder", "activation")
INSTANCE = "demo"

# Names from infra/demo/catalog.yaml; checked against the loaded catalog before anything runs.
CLIENT_SERVICE = "//demo/orders/OrderClient"
ORDER_SERVICE = "//demo/orders/OrderService"
CONTRACT = "//demo/orders/OrderContract"
ORDER_LINE = "//demo/orders/OrderLine"
LINE_ACCEPTED = "//demo/orders/LineAccepted"

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


def parse_args(argv: list[str] | None) -> DemoOptions:
    parser = argparse.ArgumentParser(
        prog="python -m ksb.demo", description="Run KSB end to end on a fresh local stack."
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
        "--timeout", type=float, default=180.0, help="seconds the dialogs may take (default 180)"
    )
    parser.add_argument(
        "--no-spark",
        dest="spark",
        action="store_false",
        help="do not run the Spark audit/SLA job (local mode) beside the services",
    )
    a = parser.parse_args(argv)
    for name in ("dialogs", "messages_per_dialog", "window"):
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


def endpoint_states(settings: Settings) -> Counter[str]:
    """Endpoints by state, from the latest record of each in the compacted endpoints topic."""
    latest: dict[str, str] = {}

    def fold(m: Message) -> None:
        key, value = m.key(), m.value()
        if key is not None and value is not None:
            latest[key.decode()] = decode_endpoint(value).state.name

    _read(settings, Names(settings.instance).endpoints, fold)
    return Counter(latest.values())


def error_records(settings: Settings) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def fold(m: Message) -> None:
        value = m.value()
        if value is not None:
            out.append(json.loads(value))

    _read(settings, Names(settings.instance).errors, fold)
    return out


def _read(settings: Settings, topic: str, fold: Callable[[Message], None]) -> None:
    c = kafka.consumer(settings)
    try:
        kafka.read_to_end(c, topic, fold, timeout_s=30)
    finally:
        c.close()


# --------------------------------------------------------------------------- processes


SPARK_JOB = "spark-audit"
SPARK_MODULE = "ksb.spark"


def available_services() -> list[str]:
    return [n for n in SERVICE_NAMES if (REPO_ROOT / "services" / n / "__main__.py").is_file()]


@contextlib.contextmanager
def running_services(
    settings: Settings, names: list[str], logs: Path
) -> Iterator[list[ServiceProcess]]:
    """Start the services, wait for each to log "ready", and stop them all on the way out."""
    procs: list[ServiceProcess] = []
    try:
        for name in names:
            module = SPARK_MODULE if name == SPARK_JOB else None
            proc = ServiceProcess(name, settings, logs / f"{name}.log", module=module)
            procs.append(proc)
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
        if pid != os.getpid() and b"ksb.demo" in cmdline:
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
    services = {s.name for s in catalog.services}
    types = {m.name for m in catalog.message_types}
    missing = [n for n in (CLIENT_SERVICE, ORDER_SERVICE) if n not in services]
    missing += [n for n in (ORDER_LINE, LINE_ACCEPTED) if n not in types]
    missing += [CONTRACT] if CONTRACT not in {c.name for c in catalog.contracts} else []
    if missing:
        raise KsbError(f"the demo catalog lacks {', '.join(missing)}")


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
    opts: DemoOptions, settings: Settings, catalog: Catalog, services: list[ServiceProcess]
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


def _guarded(stats: Stats, who: str, fn: Callable[..., None], *args: Any) -> None:
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
            if stats.failures and any("crashed" in f for f in stats.failures):
                break
            dead = [s.name for s in services if not s.alive()]
            if dead:
                stats.fail(f"service(s) exited during the demo: {', '.join(dead)}")
                break
            if time.monotonic() > deadline:
                stats.fail(f"timed out after {opts.timeout_s:.0f}s")
                break
            time.sleep(0.05)
    elapsed = time.perf_counter() - started
    initiator.flush()
    return elapsed


def _settled_states(settings: Settings, expected: int) -> Counter[str]:
    """Endpoint states once all 2N endpoints are CLOSED, or whatever they are after the wait."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        states = endpoint_states(settings)
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


def _report_sla(out_dir: Path, wait_s: float = 40.0) -> None:
    """The Spark job closes an SLA window once the watermark passes it: wait a little for the
    first Parquet files, then say where `make report` will find them."""
    deadline = time.monotonic() + wait_s
    files: list[Path] = []
    while time.monotonic() < deadline and not files:
        files = list(out_dir.rglob("*.parquet")) if out_dir.exists() else []
        time.sleep(1.0)
    say(f"spark audit job: {len(files)} Parquet file(s) of SLA/audit output under {out_dir}")


def _print_env(stack: LocalStack, settings: Settings) -> None:
    say("")
    say("The stack and services keep running; press Ctrl-C to stop them all.")
    say("To use the ksb CLI against this instance, export:")
    say(f"  export KSB_INSTANCE={settings.instance}")
    say(f"  export KSB_KAFKA_BOOTSTRAP={stack.kafka_bootstrap}")
    say(f"  export KSB_REDIS_URL={stack.redis_url}")
    say("then e.g. `ksb endpoints --leaked` or `ksb errors`.")
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
    catalog = load_catalog_file(opts.catalog)
    _check_catalog(catalog)
    _guard_workdir(opts.workdir)
    say(f"starting the local stack (Kafka + Redis) under {opts.workdir}")
    t0 = time.perf_counter()
    stack = start_stack(opts.workdir / "stack", timeout_s=120, stop_at_exit=True)
    try:
        say(
            f"  kafka {stack.kafka_bootstrap} (pid {stack.kafka_pid}), redis {stack.redis_url} "
            f"(pid {stack.redis_pid}), up in {time.perf_counter() - t0:.1f}s"
        )
        settings = load_settings(
            instance=INSTANCE,
            kafka_bootstrap=stack.kafka_bootstrap,
            redis_url=stack.redis_url,
            spark_checkpoint_dir=str(opts.workdir / "spark" / "checkpoints"),
            spark_output_dir=str(opts.workdir / "spark"),
        )
        names = available_services() + ([SPARK_JOB] if opts.spark else [])
        say(f"starting services: {', '.join(names)}")
        with running_services(settings, names, opts.workdir / "logs") as services:
            pids = [f"kafka={stack.kafka_pid}", f"redis={stack.redis_pid}"]
            pids += [f"{s.name}={s.proc.pid}" for s in services if s.proc is not None]
            say("pids: " + " ".join(pids))
            applied = apply_catalog(settings, catalog)
            _wait_for_catalog(
                next((s for s in services if s.name == "dispatcher"), None), applied.version
            )
            say(
                f"catalog v{applied.version} applied from {opts.catalog.name}: "
                f"{len(catalog.message_types)} message types, "
                f"{len(catalog.contracts)} contract(s), "
                f"{len(catalog.queues)} queues, {len(catalog.services)} services, "
                f"{len(catalog.priorities)} priorities"
            )
            outcome = run_dialogs(opts, settings, catalog, services)
            print(outcome.summary, flush=True)
            if opts.spark:
                _report_sla(opts.workdir / "spark" / INSTANCE)
            say("demo OK" if outcome.ok else "demo FAILED")
            if opts.keep_running:
                _print_env(stack, settings)
                if not _wait_until_interrupted(services):
                    return EXIT_FAILED
            return EXIT_OK if outcome.ok else EXIT_FAILED
    finally:
        _defer_interrupts()
        say("stopping the stack")
        stack.stop()
        (opts.workdir / "demo.pid").unlink(missing_ok=True)


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
