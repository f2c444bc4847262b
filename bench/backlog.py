"""Backlog: N x 1 KB messages queued through a dispatcher, held by the queue service, then the
queue drained; what each process holds per waiting message.

`python -m bench.backlog [--messages 1000000]` starts its own stack; `run_backlog` runs the same
on a stack that is already up (bench/suite.py, `make bench`). A pool of dispatcher processes shares
the instance's shards, and the instance's queue service replicas (bench/queues.py) follow its
queues as they fill. The sender BEGINs ``dialogs`` dialogs and SENDs to them in turn, ``burst``
messages to each (0: all of a dialog's messages before the next, dialog by dialog; 1: one at a time
in turn, every conversation spread over its whole partition, the hard case for a store that reads
bodies back in the order they were written) through the SDK, back-pressure on, and waits until the
dispatchers have applied every request. Then a reader in a process of its own
(bench/backlog_reader.py) waits until the queue service says every message is ready, and drains it
with RECEIVE + commit, checking exactly-once and per-dialog order.

Memory per queued message: a dispatcher's is its peak RSS's (VmHWM) growth over its resident size
before the backlog, over the messages of its shards' dialogs. A queue service replica's is its
anonymous resident memory's (``RssAnon``: what the process itself holds, the index) growth over
the same, over all N; the store's pages are the kernel's page cache (file-backed, ``RssFile``) and
its file's allocated bytes, reported apart (bench/queues.py). With `BacklogOptions.compare_interleaved`
the section also drains a backlog of that size sent one at a time in turn and the same sent dialog
by dialog, each on an instance of its own, and sets the two drains' rates side by side.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

from confluent_kafka import TopicPartition

from bench.e2e import CONTRACT, INITIATOR, MESSAGE_TYPE, TARGET, bench_catalog
from bench.queues import DEFAULT_REPLICAS, ReplicaMemory, replica_memory, running_queues
from bench.scaling import sharded_instance
from bench.stats import fmt_x, make_body, now_ns, peak_rss_kb, ratio, rss_kb
from devtools.deployment import Deployment, stack_fields
from devtools.dispatchers import DispatcherPool
from devtools.localstack import start_stack
from devtools.runner import REPO_ROOT
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.catalog_store import apply_catalog
from ksb.sdk.backpressure import CommittedOffsets
from ksb.sdk.client import KsbClient
from ksb.settings import ClientSettings, settings_env
from ksb.wire.partitioning import shard_of

__all__ = [
    "BacklogOptions",
    "backlog_run",
    "compare_interleaved",
    "format_lines",
    "main",
    "replica_figures",
    "run_backlog",
]

log = logging.getLogger("bench.backlog")


@dataclass(frozen=True)
class BacklogOptions:
    messages: int = 1_000_000
    dialogs: int = 1_000
    body_bytes: int = 1024
    burst: int = 0
    """Messages SENT to one dialog before the next; 0: all of them (dialog by dialog). RECEIVE
    drains the group that became ready first until it is empty, so dialog by dialog a RECEIVE's
    messages lie side by side in the topic; with smaller bursts each conversation is spread over
    its whole partition (1 is the hard case: when the client read bodies back from Kafka, a seek
    per message, 0.013x the dialog-by-dialog drain; the queue service reads them by key from its
    store)."""
    dispatchers: int = 2
    """Dispatcher processes sharing the backlog (each holds its shards' share)."""
    shards: int = 4
    partitions: int = 4
    """Target queue partitions (a multiple of the shards)."""
    top: int = 0
    """RECEIVE TOP (n) while draining; 0: whole groups (a RECEIVE then reads one conversation's
    messages, side by side when sent dialog by dialog, in one pass)."""
    window: int = 16
    """Commits in flight per draining thread."""
    receivers: int = 1
    timeout_s: float = 3600.0
    """How long the dispatchers may take to apply the backlog, and the reader to index it."""
    drain_timeout_s: float = 3600.0
    """How long the drain may take before it stops and reports how far it got."""
    queue_replicas: int = DEFAULT_REPLICAS
    """Queue service replicas; each holds the whole backlog (its index and its store)."""
    compare_interleaved: int = 0
    """Beside the backlog, drain this many messages sent one at a time in turn over the dialogs
    and as many sent dialog by dialog, and compare the two rates (0: not)."""


def run_backlog(base: Deployment, opts: BacklogOptions, workdir: Path) -> dict[str, Any]:
    """The backlog on a running stack (`backlog_run`), then, with `opts.compare_interleaved`,
    the interleaved drain beside the dialog-by-dialog drain of that size (``interleaved``)."""
    result = backlog_run(base, opts, workdir, "bl")
    if opts.compare_interleaved:
        result["interleaved"] = compare_interleaved(base, opts, workdir)
    return result


def compare_interleaved(base: Deployment, opts: BacklogOptions, workdir: Path) -> dict[str, Any]:
    """`opts.compare_interleaved` messages sent one at a time in turn over the dialogs, drained;
    then as many sent dialog by dialog, drained: each on an instance of its own, one after the
    other on the same stack. The ratio is the interleaved drain's rate over the other's."""
    n = opts.compare_interleaved
    one = replace(opts, messages=n, burst=1, compare_interleaved=0)
    whole = replace(opts, messages=n, burst=0, compare_interleaved=0)
    interleaved = backlog_run(base, one, workdir, "bli")
    dialog_by_dialog = backlog_run(base, whole, workdir, "blw")
    rate_i = interleaved["drain"]["per_s"]
    rate_w = dialog_by_dialog["drain"]["per_s"]
    return {
        "messages": interleaved["config"]["messages"],
        "interleaved": interleaved,
        "dialog_by_dialog": dialog_by_dialog,
        "ratio_interleaved_over_dialog_by_dialog": ratio(rate_i, rate_w),
        "verified_exactly_once_in_order": interleaved["verified_exactly_once_in_order"]
        and dialog_by_dialog["verified_exactly_once_in_order"],
    }


def backlog_run(
    base: Deployment, opts: BacklogOptions, workdir: Path, suffix: str
) -> dict[str, Any]:
    """One backlog on a running stack: an instance of its own (``suffix`` after the base's name)
    with ``opts.shards`` shards, a pool of ``opts.dispatchers`` dispatcher processes, the queue
    service's replicas and one reader process."""
    load_at_start = round(os.getloadavg()[0], 2)
    settings = sharded_instance(base, suffix, opts.shards)
    apply_catalog(settings, bench_catalog(opts.partitions))
    per_dialog = max(1, opts.messages // opts.dialogs)
    n = per_dialog * opts.dialogs
    logs = workdir / f"backlog-{suffix}"
    memory: dict[str, dict[str, ReplicaMemory]] = {}

    def look(phase: str) -> None:
        for name in queues.members:
            memory.setdefault(name, {})[phase] = replica_memory(queues, name)

    with (
        running_queues(settings, logs, opts.queue_replicas) as (settings, queues),
        DispatcherPool(settings, logs) as pool,
    ):
        pool.start(opts.dispatchers)
        owned = pool.owned()
        pids = {name: p.proc.pid for name, p in pool.members.items() if p.proc is not None}
        base_kb = {name: rss_kb(pid) or 0 for name, pid in pids.items()}
        look("base")
        started = time.monotonic()
        handles = _push(settings, opts.dialogs, per_dialog, opts.body_bytes, opts.burst)
        sent_s = time.monotonic() - started
        _wait_applied(settings, opts.timeout_s)
        applied_s = time.monotonic() - started
        queued_kb = {name: peak_rss_kb(pid) or 0 for name, pid in pids.items()}
        reader = _read_and_drain(
            settings, opts, n, on_phase=lambda p: look(p) if p in ("indexed", "drained") else None
        )
        peak_kb = {name: peak_rss_kb(pid) or 0 for name, pid in pids.items()}
    shard = [shard_of(h, opts.shards) for h in handles]
    dispatchers = {}
    for name, shards in sorted(owned.items()):
        held = per_dialog * sum(1 for s in shard if s in shards)
        dispatchers[name] = {
            "shards": sorted(shards),
            "queued_messages": held,
            "base_rss_kb": base_kb[name],
            "peak_rss_kb_queued": queued_kb[name],
            "peak_rss_kb": peak_kb[name],
            "bytes_per_queued_message": (queued_kb[name] - base_kb[name]) * 1024 / held
            if held
            else None,
        }
    indexed = reader.get("indexed", {})
    # A reader that died while draining leaves its last progress report: how far it got.
    drained = reader.get("drained") or reader.get("draining", {})
    return {
        "config": {**asdict(opts), "messages": n, "cpus": len(os.sched_getaffinity(0))},
        "load_average_1m": {"start": load_at_start, "end": round(os.getloadavg()[0], 2)},
        "push": {
            "sent_seconds": sent_s,
            "applied_seconds": applied_s,
            "applied_per_s": n / applied_s if applied_s else None,
        },
        "dispatchers": dispatchers,
        "queue_service": {name: replica_figures(m, n) for name, m in sorted(memory.items())},
        "reader": {
            "ready_seconds": indexed.get("seconds"),
            "base_rss_kb": indexed.get("base_rss_kb"),
            "peak_rss_kb": drained.get("peak_rss_kb"),
        },
        "drain": {
            "seconds": drained.get("seconds"),
            "delivered": drained.get("delivered"),
            "per_s": drained["delivered"] / drained["seconds"] if drained.get("seconds") else None,
            "commits": drained.get("commits"),
            "refused": drained.get("refused"),
            "receive_errors": drained.get("receive_errors"),
            "last_receive_error": drained.get("last_receive_error"),
            "problems": drained.get(
                "problems", reader.get("failed", ["the reader ended before its drain did"])
            ),
        },
        "verified_exactly_once_in_order": "drained" in reader and not drained.get("problems"),
    }


def replica_figures(m: dict[str, ReplicaMemory], n: int) -> dict[str, Any]:
    """A replica's memory before the backlog, with it all ready and after the drain, and what
    the backlog added per queued message: anonymous memory (the process's own), file-backed
    pages (the store's, in the page cache) and the store's disk bytes, each apart."""
    base, full = m.get("base"), m.get("indexed")

    def per_message(field: str, scale: int) -> float | None:
        if base is None or full is None or not n:
            return None
        now, before = getattr(full, field), getattr(base, field)
        return None if now is None or before is None else (now - before) * scale / n

    return {
        **{phase: look.as_json() for phase, look in m.items()},
        "bytes_per_queued_message": per_message("rss_anon_kb", 1024),
        "file_bytes_per_queued_message": per_message("rss_file_kb", 1024),
        "store_bytes_per_queued_message": per_message("store_disk_bytes", 1),
    }


def _push(
    settings: Deployment, dialogs: int, per_dialog: int, body_bytes: int, burst: int
) -> list[str]:
    """SEND round-robin over the dialogs, ``burst`` messages to each in turn, through the SDK
    (back-pressure holds it to the pace the dispatchers apply), then wait until Kafka has stored
    every request; the dialogs' handles."""
    burst = burst or per_dialog
    with KsbClient(settings) as client:
        handles = [client.begin_dialog(INITIATOR, TARGET, CONTRACT) for _ in range(dialogs)]
        for first in range(0, per_dialog, burst):
            seqs = range(first, min(per_dialog, first + burst))
            for d, h in enumerate(handles):
                for seq in seqs:
                    client.send(h, MESSAGE_TYPE, make_body(body_bytes, now_ns(), f"{d}:{seq}"))
                if burst == per_dialog and d % max(1, dialogs // 10) == 0:
                    log.info("backlog: sent %d of %d", (d + 1) * per_dialog, per_dialog * dialogs)
            if burst < per_dialog:
                log.info("backlog: sent %d of %d", seqs.stop * dialogs, per_dialog * dialogs)
        client.flush(120)
    return handles


def _wait_applied(settings: Deployment, timeout_s: float) -> None:
    """Until the dispatchers' committed offsets reach the end of every partition of the requests
    topic the sender wrote."""
    names = Names(settings.instance)
    offsets = CommittedOffsets(settings.narrow(ClientSettings))
    probe = kafka.consumer(settings)
    try:
        topic = names.requests_for(settings.sender)
        parts = sorted(probe.list_topics(topic, timeout=30).topics[topic].partitions)
        tps = [(topic, p) for p in parts]
        ends = {tp: kafka.watermarks(probe, TopicPartition(*tp), 30)[1] for tp in tps}
        deadline = time.monotonic() + timeout_s
        while True:
            got = offsets(tps, 5.0)
            if all(got.get(tp, 0) >= end for tp, end in ends.items()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"dispatchers did not apply every request in time: {got}")
            time.sleep(0.2)
    finally:
        probe.close()
        offsets.close()


def _read_and_drain(
    settings: Deployment,
    opts: BacklogOptions,
    expected: int,
    on_phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run bench/backlog_reader.py; its JSON lines by phase (`on_phase` is called with each
    phase's name as its line arrives)."""
    argv = [
        sys.executable,
        "-m",
        "bench.backlog_reader",
        f"--messages={expected}",
        f"--dialogs={opts.dialogs}",
        f"--top={opts.top}",
        f"--window={opts.window}",
        f"--receivers={opts.receivers}",
        f"--timeout={opts.timeout_s}",
        f"--drain-timeout={opts.drain_timeout_s}",
    ]
    env = settings_env(settings.narrow(ClientSettings))
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
    phases: dict[str, Any] = {}
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            record = json.loads(line)
            phase = record.pop("phase")
            phases[phase] = record
            log.info("backlog reader: %s", line.strip())
            if on_phase is not None:
                on_phase(phase)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return phases


def _mb(kb: float | None) -> str:
    return "n/a" if kb is None else f"{kb / 1024:,.0f} MB"


def _pattern(burst: int) -> str:
    return "dialog by dialog" if not burst else f"{burst:,} to a dialog in turn"


def _kb_per(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f}"


def _head(r: dict[str, Any]) -> str:
    cfg = r["config"]
    return (
        f"{cfg['messages']:,} x {cfg['body_bytes']} B over {cfg['dialogs']:,} dialogs "
        f"({_pattern(cfg['burst'])}), {cfg['dispatchers']} dispatchers over {cfg['shards']} "
        f"shards, {cfg['partitions']} queue partitions, "
        f"{cfg.get('queue_replicas', 0)} queue service replicas"
    )


def _drained(r: dict[str, Any]) -> str:
    cfg, dr = r["config"], r["drain"]
    return (
        f"drained {dr.get('delivered') or 0:,} in {dr['seconds'] or 0:,.1f} s "
        f"({dr['per_s'] or 0:,.0f} msg/s, TOP {cfg['top'] or 'all'}, "
        f"{dr.get('receive_errors') or 0} RECEIVEs failed and retried); exactly once in order: "
        + ("yes" if r["verified_exactly_once_in_order"] else f"NO {dr['problems']}")
    )


def format_lines(r: dict[str, Any]) -> list[str]:
    cfg, rd, push = r["config"], r["reader"], r["push"]
    lines = [
        f"backlog: {_head(r)}, {cfg['cpus']} CPUs, load average "
        f"{r['load_average_1m']['start']} at start, {r['load_average_1m']['end']} at end",
        f"  {'':16}{'queued':>10}{'base RSS':>10}{'peak RSS':>10}{'bytes/queued msg':>18}"
        f"{'peak draining':>15}",
    ]
    for name, d in r["dispatchers"].items():
        per = d["bytes_per_queued_message"]
        lines.append(
            f"  {'dispatcher ' + name:16}{d['queued_messages']:>10,}{_mb(d['base_rss_kb']):>10}"
            f"{_mb(d['peak_rss_kb_queued']):>10}{_kb_per(per):>18}{_mb(d['peak_rss_kb']):>15}"
        )
    replicas = r.get("queue_service", {})
    if replicas:
        lines.append(
            f"  {'':16}{'queued':>10}{'RssAnon':>10}{'queued':>10}{'bytes/queued msg':>18}"
            f"{'drained':>10}{'RssFile':>10}{'store':>10}{'store B/msg':>12}"
        )
    for name, q in replicas.items():
        b, full, after = q.get("base", {}), q.get("indexed", {}), q.get("drained", {})
        store = full.get("store_disk_bytes")
        lines.append(
            f"  {'queue ' + name:16}{cfg['messages']:>10,}{_mb(b.get('rss_anon_kb')):>10}"
            f"{_mb(full.get('rss_anon_kb')):>10}{_kb_per(q['bytes_per_queued_message']):>18}"
            f"{_mb(after.get('rss_anon_kb')):>10}{_mb(full.get('rss_file_kb')):>10}"
            f"{_mb(None if store is None else store / 1024):>10}"
            f"{_kb_per(q['store_bytes_per_queued_message']):>12}"
        )
    if replicas:
        lines.append(
            "  (a replica's RssAnon is the memory it holds itself; RssFile and the store are the "
            "store's pages, file-backed page cache and disk, counted apart)"
        )
    lines.append(
        f"  queued in {push['applied_seconds']:,.0f} s ({push['applied_per_s'] or 0:,.0f} msg/s); "
        f"all ready to the reader {rd.get('ready_seconds') or 0:,.1f} s later; {_drained(r)}"
    )
    cmp = r.get("interleaved")
    if cmp is not None:
        one, whole = cmp["interleaved"], cmp["dialog_by_dialog"]
        lines += [
            f"interleaved backlog: {_head(one)}, against the same sent dialog by dialog "
            "(each on an instance of its own): drain "
            f"{fmt_x(cmp['ratio_interleaved_over_dialog_by_dialog'])} of dialog by dialog",
            f"  interleaved: queued in {one['push']['applied_seconds']:,.0f} s; {_drained(one)}",
            f"  dialog by dialog: queued in {whole['push']['applied_seconds']:,.0f} s; "
            f"{_drained(whole)}",
        ]
    return lines


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `finally` blocks that stop processes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.backlog", description=__doc__)
    d = BacklogOptions()
    parser.add_argument("--messages", type=int, default=d.messages)
    parser.add_argument("--dialogs", type=int, default=d.dialogs)
    parser.add_argument("--body-bytes", type=int, default=d.body_bytes)
    parser.add_argument(
        "--burst", type=int, default=d.burst, help="messages per dialog in a row; 0: all of them"
    )
    parser.add_argument("--dispatchers", type=int, default=d.dispatchers)
    parser.add_argument("--shards", type=int, default=d.shards)
    parser.add_argument("--partitions", type=int, default=d.partitions)
    parser.add_argument("--top", type=int, default=d.top, help="RECEIVE TOP while draining; 0: all")
    parser.add_argument("--window", type=int, default=d.window)
    parser.add_argument("--receivers", type=int, default=d.receivers)
    parser.add_argument("--timeout", type=float, default=d.timeout_s)
    parser.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s)
    parser.add_argument("--queue-replicas", type=int, default=d.queue_replicas)
    parser.add_argument(
        "--compare-interleaved",
        type=int,
        default=d.compare_interleaved,
        help="also drain this many sent one at a time in turn and as many dialog by dialog",
    )
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    a = parser.parse_args(argv)
    opts = BacklogOptions(
        messages=a.messages,
        dialogs=a.dialogs,
        body_bytes=a.body_bytes,
        burst=a.burst,
        dispatchers=a.dispatchers,
        shards=a.shards,
        partitions=a.partitions,
        top=a.top,
        window=a.window,
        receivers=a.receivers,
        timeout_s=a.timeout,
        drain_timeout_s=a.drain_timeout,
        queue_replicas=a.queue_replicas,
        compare_interleaved=a.compare_interleaved,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    signal.signal(signal.SIGTERM, _terminate)
    with tempfile.TemporaryDirectory(prefix="ksb-backlog-") as tmp:
        stack = start_stack(Path(tmp) / "stack")
        try:
            settings = Deployment.model_validate(
                {
                    "instance": f"backlog{uuid.uuid4().hex[:8]}",
                    "kafka_bootstrap": stack.kafka_bootstrap,
                    "redis_url": stack.redis_url,
                    **stack_fields(stack.security),
                }
            )
            result = run_backlog(settings, opts, Path(tmp))
        finally:
            stack.stop()
    print("\n".join(format_lines(result)))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["verified_exactly_once_in_order"] else 1


if __name__ == "__main__":
    sys.exit(main())
