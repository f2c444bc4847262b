"""Reader processes: the e2e load (bench/e2e.py) RECEIVEd by several processes on one queue.

Before the queue service each reader process indexed the whole queue topic itself: every process
more read every queue record once more, and paid for it in CPU. Now the readers are clients of
the queue service, which reads each queue once per replica whatever the number of readers. This
section measures what ``processes`` reader processes (each one `KsbClient`, one RECEIVE loop
with ``window`` commits in flight) cost on one queue: throughput, loaded latency (SEND -> commit
outcome) and the CPU per message of every process involved (dispatchers, queue service replicas,
readers, broker, Redis, and this process, the sender), over the loaded phase.

Each reader (``python -m bench.readers reader OUT WINDOW``) appends ``dialog seq sent_ns
received_ns outcome_ns`` for every message whose commit was applied to a file of its own; the
bench counts those lines until every message is in, then stops the readers and checks the whole:
each message once, and per dialog in the order its RECEIVEs returned (one monotonic clock on one
host). Not in the order of the outcomes: a group's next holder may RECEIVE as soon as the queue
service has read the previous holder's outcome, and its own outcome can reach its process before
the previous holder's reaches a process that the two CPUs left waiting (seen in `make bench`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from bench.e2e import (
    CONTRACT,
    INITIATOR,
    MESSAGE_TYPE,
    TARGET,
    _send_all,
    bench_catalog,
    receive_batch,
)
from bench.queues import DEFAULT_REPLICAS, replica_pids, running_queues
from bench.raw_kafka import median_run
from bench.scaling import sharded_instance
from bench.stats import (
    CpuMeter,
    Rate,
    fmt_ms,
    jit_settle,
    make_body,
    now_ns,
    parse_body,
    summarize,
)
from devtools.deployment import Deployment
from devtools.dispatchers import DispatcherPool
from devtools.runner import REPO_ROOT, ServiceProcess
from ksb.errors import KsbError
from ksb.runtime.catalog_store import apply_catalog
from ksb.sdk.client import KsbClient
from ksb.settings import ClientSettings, settings_env

__all__ = [
    "ReaderOptions",
    "Row",
    "check_deliveries",
    "format_lines",
    "reader_main",
    "run_readers",
]

log = logging.getLogger("bench.readers")

READY = "bench reader ready"
WARM = 1_000_000
"""Dialog numbers from here on are the warm-up's, left out of every figure."""
_WARMUP = 20
_FLUSH_S = 0.1


@dataclass(frozen=True)
class ReaderOptions:
    processes: int = 4
    messages: int = 20_000
    dialogs: int = 1_000
    body_bytes: int = 1024
    window: int = 32
    """Commits in flight per reader process (4 x 32: as many as the scaling runs' 2 x 64)."""
    dispatchers: int = 2
    shards: int = 8
    partitions: int = 8
    queue_replicas: int = DEFAULT_REPLICAS
    runs: int = 3
    """Loaded runs, each on an instance of its own; the median by throughput is shown."""
    timeout_s: float = 180.0
    settle_jit: bool = True


# ----------------------------------------------------------------------------- a reader
def reader_main(argv: list[str]) -> int:
    """`python -m bench.readers reader OUT WINDOW`: RECEIVE + commit on the target queue until
    SIGTERM, each applied message a line of OUT (settings from ``KSB_*``)."""
    out_path, window = Path(argv[0]), int(argv[1])
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    lines: list[str] = []
    counts = {"refused": 0, "receive_errors": 0, "lock_lost": 0}
    lock = threading.Lock()

    def applied(batch: list[tuple[int, int, int]], received: int, fut: Future[Any]) -> None:
        now = now_ns()
        with lock:
            if fut.exception() is not None:
                counts["refused"] += 1
                return
            lines.extend(f"{d} {s} {sent} {received} {now}\n" for d, s, sent in batch)

    with KsbClient(ClientSettings.from_env()) as client, out_path.open("w") as out:
        flusher = threading.Thread(target=_flush_every, args=(out, lines, lock, stop), daemon=True)
        flusher.start()
        outstanding: set[Future[Any]] = set()
        ready = False
        while not stop.is_set():
            outstanding = {f for f in outstanding if not f.done()}
            if len(outstanding) >= window:
                wait(outstanding, timeout=30, return_when=FIRST_COMPLETED)
                continue
            tx = client.transaction()
            msgs, failed = receive_batch(tx, top=None, waitfor_ms=100)
            received = now_ns()
            if not ready:
                ready = True
                print(READY, flush=True)
            if failed is not None:
                counts["receive_errors"] += 1
                stop.wait(0.05)
                continue
            if not msgs:
                continue
            batch = [_decode(m.message_body) for m in msgs]
            try:
                fut = tx.commit_async()
            except KsbError:
                counts["lock_lost"] += 1
                continue
            fut.add_done_callback(functools.partial(applied, batch, received))
            outstanding.add(fut)
        for fut in outstanding:
            with contextlib.suppress(Exception):
                fut.result(30)
        flusher.join(5)
        _write(out, lines, lock)
    print(json.dumps(counts), flush=True)
    return 0


def _decode(body: bytes) -> tuple[int, int, int]:
    sent, tag = parse_body(body)
    dialog, _, seq = tag.partition(":")
    return int(dialog), int(seq), sent


def _write(out: TextIO, lines: list[str], lock: threading.Lock) -> None:
    with lock:
        taken = lines[:]
        lines.clear()
    out.writelines(taken)
    out.flush()


def _flush_every(
    out: TextIO, lines: list[str], lock: threading.Lock, stop: threading.Event
) -> None:
    while not stop.wait(_FLUSH_S):
        _write(out, lines, lock)


# ----------------------------------------------------------------------------- the checks
Row = tuple[int, int, int, int, int]
"""One applied message: dialog, seq, sent, RECEIVE returned, outcome (monotonic ns)."""


def _read(path: Path) -> list[Row]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 5:  # a line cut by a reader still writing is read next time
            d, s, sent, received, at = (int(p) for p in parts)
            rows.append((d, s, sent, received, at))
    return rows


def check_deliveries(rows: list[Row], dialogs: int, per_dialog: int) -> list[str]:
    """What is wrong with the deliveries of a run (`rows`, as `Row`): a message twice, one
    missing, or a dialog's messages RECEIVEd out of order (a RECEIVE returns a group's messages
    in order, and the group's next holder's RECEIVE returns after it)."""
    problems: list[str] = []
    by_dialog: dict[int, list[tuple[int, int]]] = {}
    for d, s, _sent, received, _at in rows:
        if d < WARM:
            by_dialog.setdefault(d, []).append((received, s))
    for d in range(dialogs):
        got = sorted(by_dialog.get(d, []))
        seqs = [s for _at, s in got]
        if sorted(seqs) != list(range(per_dialog)):
            extra = len(seqs) - len(set(seqs))
            what = f"{extra} twice" if extra else f"{per_dialog - len(set(seqs))} missing"
            problems.append(f"dialog {d}: {len(seqs)} messages of {per_dialog} ({what})")
        elif seqs != list(range(per_dialog)):
            problems.append(f"dialog {d}: received out of order")
        if len(problems) >= 20:
            break
    return problems


# ----------------------------------------------------------------------------- a run
def _start_reader(settings: Deployment, out: Path, log_path: Path, window: int) -> ServiceProcess:
    reader = ServiceProcess(f"reader {log_path.stem}", settings, log_path)
    with log_path.open("ab") as stdout:
        reader.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.readers", "reader", str(out), str(window)],
            cwd=REPO_ROOT,
            env=settings_env(settings.narrow(ClientSettings)),
            stdout=stdout,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return reader


def _wait_rows(outs: list[Path], count: int, timeout_s: float, what: str) -> list[Row]:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = [r for path in outs for r in _read(path)]
        if len(rows) >= count:
            return rows
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"readers: {len(rows)} of {count} {what} applied in {timeout_s:.0f} s"
            )
        time.sleep(0.05)


def _warm_up(sender: KsbClient, body_bytes: int) -> None:
    """`_WARMUP` messages on dialogs of their own (numbered from `WARM`), one each."""
    for i in range(_WARMUP):
        handle = sender.begin_dialog(INITIATOR, TARGET, CONTRACT)
        sender.send(handle, MESSAGE_TYPE, make_body(body_bytes, now_ns(), f"{WARM + i}:0"))
    sender.flush(30)


def _one_run(
    base: Deployment, o: ReaderOptions, workdir: Path, stack_pids: dict[str, int], attempt: int
) -> dict[str, Any]:
    settings = sharded_instance(base, f"rp{attempt}", o.shards)
    apply_catalog(settings, bench_catalog(o.partitions))
    logs = workdir / f"readers-r{attempt}"
    logs.mkdir(parents=True, exist_ok=True)
    per_dialog = max(1, o.messages // o.dialogs)
    expected = per_dialog * o.dialogs
    outs = [logs / f"r{i + 1}.deliveries" for i in range(o.processes)]
    readers: list[ServiceProcess] = []
    marks: list[int] = []
    with (
        running_queues(settings, logs, o.queue_replicas) as (settings, queues),
        DispatcherPool(settings, logs) as pool,
    ):
        pool.start(o.dispatchers)
        try:
            readers = [
                _start_reader(settings, out, logs / f"r{i + 1}.log", o.window)
                for i, out in enumerate(outs)
            ]
            for r in readers:
                r.wait_ready(READY, o.timeout_s)
            groups = {
                "dispatchers": {f"d {n}": _pid(p) for n, p in pool.members.items()},
                "queue_service": replica_pids(queues),
                "readers": {f"reader r{i + 1}": _pid(r) for i, r in enumerate(readers)},
            }
            pids = {name: pid for g in groups.values() for name, pid in g.items()}
            meter = CpuMeter({**pids, **stack_pids, "client": None}, jvm="kafka")
            with KsbClient(settings) as sender:
                _warm_up(sender, o.body_bytes)
                _wait_rows(outs, _WARMUP, o.timeout_s, "warm-up messages")
                if o.settle_jit and "kafka" in stack_pids:
                    jit_settle(stack_pids["kafka"])
                meter.mark(True)
                _send_all(sender, o.dialogs, per_dialog, o.body_bytes, marks, [])
                _wait_rows(outs, _WARMUP + expected, o.timeout_s, "messages")
                meter.mark(False)
        finally:
            for r in readers:
                r.stop()
    rows = [r for path in outs for r in _read(path)]
    measured = [r for r in rows if r[0] < WARM]
    last = max((r[4] for r in measured), default=marks[0] if marks else 0)
    seconds = (last - marks[0]) / 1e9 if marks else float("nan")
    spent = meter.spent_s
    per_msg = {
        **{
            g: sum(spent.get(n, 0.0) for n in members) * 1000 / expected
            for g, members in groups.items()
        },
        **{n: spent[n] * 1000 / expected for n in (*stack_pids, "client") if n in spent},
        **meter.jit_ms_per_message(expected),
        "all": sum(spent.values()) * 1000 / expected,
    }
    problems = check_deliveries(measured, o.dialogs, per_dialog)
    counts = [_last_json(r) for r in readers]
    return {
        "processes": o.processes,
        "throughput": Rate(expected, seconds).as_json(),
        "latency_loaded": summarize([r[4] - r[2] for r in measured]).as_json(),
        "cpu_s": spent,
        "cpu_ms_per_message": per_msg,
        "messages_per_reader": [sum(1 for r in _read(path) if r[0] < WARM) for path in outs],
        "refused_commits": sum(c.get("refused", 0) for c in counts),
        "receive_errors": sum(c.get("receive_errors", 0) for c in counts),
        "verified_exactly_once_in_order": not problems,
        "problems": problems,
    }


def _pid(p: ServiceProcess) -> int:
    assert p.proc is not None
    return p.proc.pid


def _last_json(p: ServiceProcess) -> dict[str, int]:
    """The counts a reader printed as it stopped (none if it did not)."""
    for line in reversed(p.log_text().splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                loaded: dict[str, int] = json.loads(line)
                return loaded
    return {}


def run_readers(
    base: Deployment, o: ReaderOptions, workdir: Path, stack_pids: dict[str, int]
) -> dict[str, Any]:
    """`o.runs` runs of the load RECEIVEd by `o.processes` reader processes; the median run by
    throughput, with every run's throughput and CPU per message of all processes."""
    tries = [_one_run(base, o, workdir, stack_pids, i) for i in range(o.runs)]
    rates = [t["throughput"]["per_s"] for t in tries]
    shown = dict(tries[median_run(rates, faster=False)])
    shown["throughput_runs"] = rates
    shown["cpu_all_runs"] = [t["cpu_ms_per_message"]["all"] for t in tries]
    shown["verified_exactly_once_in_order"] = all(
        t["verified_exactly_once_in_order"] for t in tries
    )
    shown["problems"] = [f"run {i + 1}: {p}" for i, t in enumerate(tries) for p in t["problems"]]
    shown["config"] = asdict(o)
    return shown


def format_lines(r: dict[str, Any]) -> list[str]:
    cfg, cpu = r["config"], r["cpu_ms_per_message"]
    rates = " / ".join(f"{t:,.0f}" for t in r["throughput_runs"])
    cpus = " / ".join(f"{c:.3f}" for c in r["cpu_all_runs"])
    lat = r["latency_loaded"]
    parts = ", ".join(
        f"{label} {fmt_ms(cpu.get(key), 3)}"
        for key, label in (
            ("dispatchers", "dispatchers"),
            ("queue_service", "queue service"),
            ("readers", "readers"),
            ("kafka", "broker"),
            ("redis", "Redis"),
            ("client", "sender"),
        )
        if key in cpu
    )
    return [
        f"reader processes: {cfg['processes']} reader processes on one queue (one RECEIVE loop "
        f"each, {cfg['window']} commits in flight), {cfg['messages']:,} x {cfg['body_bytes']} B "
        f"over {cfg['dialogs']:,} dialogs, {cfg['dispatchers']} dispatchers, "
        f"{cfg['queue_replicas']} queue service replicas; median of {len(r['throughput_runs'])} "
        f"runs ({rates} msg/s; CPU all processes {cpus} ms a message)",
        f"  {r['throughput']['per_s']:,.0f} msg/s, loaded p50 {fmt_ms(lat['p50_ms'])} p99 "
        f"{fmt_ms(lat['p99_ms'])}; CPU per message, all processes {fmt_ms(cpu['all'], 3)}: "
        f"{parts}; messages per reader {r['messages_per_reader']}; exactly once, in order: "
        + ("yes" if r["verified_exactly_once_in_order"] else f"NO {r['problems'][:3]}"),
    ]


if __name__ == "__main__":
    if sys.argv[1:2] != ["reader"]:
        print("usage: python -m bench.readers reader OUT WINDOW", file=sys.stderr)
        sys.exit(2)
    sys.exit(reader_main(sys.argv[2:]))
