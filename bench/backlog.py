"""Backlog: N x 1 KB messages queued through a dispatcher, one reader indexing them all, then the
queue drained; what each process holds per waiting message.

`python -m bench.backlog [--messages 1000000]` starts its own stack; `run_backlog` runs the same
on a stack that is already up (bench/suite.py, `make bench`). A pool of dispatcher processes shares
the instance's shards. The sender BEGINs ``dialogs`` dialogs and SENDs round-robin over them (every
conversation spread over its whole partition, the hard case for a reader that reads bodies back)
through the SDK, back-pressure on, and waits until the dispatchers have applied every request. Then a reader in a process of its own (bench/backlog_reader.py)
follows the queue until its index holds every message, and drains it with RECEIVE + commit,
checking exactly-once and per-dialog order. Peak RSS is VmHWM; bytes per queued message is the
peak's growth over the process's resident size before the backlog, divided by the messages it
holds (a dispatcher: those of its shards' dialogs; the reader: all N).
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
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from confluent_kafka import TopicPartition

from bench.e2e import CONTRACT, INITIATOR, MESSAGE_TYPE, TARGET, bench_catalog
from bench.scaling import sharded_instance
from bench.stats import make_body, now_ns, peak_rss_kb, rss_kb
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

__all__ = ["BacklogOptions", "format_lines", "main", "run_backlog"]

log = logging.getLogger("bench.backlog")


@dataclass(frozen=True)
class BacklogOptions:
    messages: int = 1_000_000
    dialogs: int = 1_000
    body_bytes: int = 1024
    burst: int = 0
    """Messages SENT to one dialog before the next; 0: all of them (dialog by dialog). RECEIVE
    drains the group that became ready first until it is empty, so dialog by dialog each RECEIVE
    reads on where the last one stopped; with smaller bursts each conversation is spread over its
    whole partition and every RECEIVE seeks to read its bodies back (far slower: 1 is the hard
    case)."""
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


def run_backlog(base: Deployment, opts: BacklogOptions, workdir: Path) -> dict[str, Any]:
    """The backlog on a running stack: an instance of its own with ``opts.shards`` shards, a pool
    of ``opts.dispatchers`` dispatcher processes and one reader process."""
    load_at_start = round(os.getloadavg()[0], 2)
    settings = sharded_instance(base, "bl", opts.shards)
    apply_catalog(settings, bench_catalog(opts.partitions))
    per_dialog = max(1, opts.messages // opts.dialogs)
    n = per_dialog * opts.dialogs
    with DispatcherPool(settings, workdir / "backlog") as pool:
        pool.start(opts.dispatchers)
        owned = pool.owned()
        pids = {name: p.proc.pid for name, p in pool.members.items() if p.proc is not None}
        base_kb = {name: rss_kb(pid) or 0 for name, pid in pids.items()}
        started = time.monotonic()
        handles = _push(settings, opts.dialogs, per_dialog, opts.body_bytes, opts.burst)
        sent_s = time.monotonic() - started
        _wait_applied(settings, opts.timeout_s)
        applied_s = time.monotonic() - started
        queued_kb = {name: peak_rss_kb(pid) or 0 for name, pid in pids.items()}
        reader = _read_and_drain(settings, opts, n)
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
    reader_peak = indexed.get("peak_rss_kb", 0)
    return {
        "config": {**asdict(opts), "messages": n, "cpus": len(os.sched_getaffinity(0))},
        "load_average_1m": {"start": load_at_start, "end": round(os.getloadavg()[0], 2)},
        "push": {
            "sent_seconds": sent_s,
            "applied_seconds": applied_s,
            "applied_per_s": n / applied_s if applied_s else None,
        },
        "dispatchers": dispatchers,
        "reader": {
            "base_rss_kb": indexed.get("base_rss_kb"),
            "peak_rss_kb_indexed": reader_peak,
            "peak_rss_kb": drained.get("peak_rss_kb"),
            "index_seconds": indexed.get("seconds"),
            "bytes_per_queued_message": (reader_peak - indexed.get("base_rss_kb", 0)) * 1024 / n
            if indexed
            else None,
            "cache_bytes": indexed.get("cache_bytes"),
            "bytes_per_queued_message_without_cache": (
                reader_peak - indexed.get("base_rss_kb", 0) - indexed.get("cache_bytes", 0) / 1024
            )
            * 1024
            / n
            if indexed
            else None,
        },
        "drain": {
            "seconds": drained.get("seconds"),
            "delivered": drained.get("delivered"),
            "per_s": drained["delivered"] / drained["seconds"] if drained.get("seconds") else None,
            "commits": drained.get("commits"),
            "refused": drained.get("refused"),
            "receive_errors": drained.get("receive_errors"),
            "last_receive_error": drained.get("last_receive_error"),
            "seeks": drained.get("seeks"),
            "records_read_back": drained.get("records_read_back"),
            "problems": drained.get(
                "problems", reader.get("failed", ["the reader ended before its drain did"])
            ),
        },
        "verified_exactly_once_in_order": "drained" in reader and not drained.get("problems"),
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


def _read_and_drain(settings: Deployment, opts: BacklogOptions, expected: int) -> dict[str, Any]:
    """Run bench/backlog_reader.py; its JSON lines by phase."""
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
            phases[record.pop("phase")] = record
            log.info("backlog reader: %s", line.strip())
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


def format_lines(r: dict[str, Any]) -> list[str]:
    cfg, rd, dr, push = r["config"], r["reader"], r["drain"], r["push"]
    bpm = rd["bytes_per_queued_message"]
    lines = [
        f"backlog: {cfg['messages']:,} x {cfg['body_bytes']} B over {cfg['dialogs']:,} dialogs "
        f"({_pattern(cfg['burst'])}), "
        f"{cfg['dispatchers']} dispatchers over {cfg['shards']} shards, {cfg['partitions']} queue "
        f"partitions, {cfg['cpus']} CPUs, load average {r['load_average_1m']['start']} at start, "
        f"{r['load_average_1m']['end']} at end",
        f"  {'':16}{'queued':>10}{'base RSS':>10}{'peak RSS':>10}{'bytes/queued msg':>18}"
        f"{'peak draining':>15}",
    ]
    for name, d in r["dispatchers"].items():
        per = d["bytes_per_queued_message"]
        lines.append(
            f"  {'dispatcher ' + name:16}{d['queued_messages']:>10,}{_mb(d['base_rss_kb']):>10}"
            f"{_mb(d['peak_rss_kb_queued']):>10}{'n/a' if per is None else f'{per:,.0f}':>18}"
            f"{_mb(d['peak_rss_kb']):>15}"
        )
    lines += [
        f"  {'reader':16}{cfg['messages']:>10,}{_mb(rd['base_rss_kb']):>10}"
        f"{_mb(rd['peak_rss_kb_indexed']):>10}{'n/a' if bpm is None else f'{bpm:,.0f}':>18}"
        f"{_mb(rd['peak_rss_kb']):>15}",
        f"  queued in {push['applied_seconds']:,.0f} s ({push['applied_per_s']:,.0f} msg/s); "
        f"reader indexed all in {rd['index_seconds'] or 0:,.1f} s; drained "
        f"{dr.get('delivered') or 0:,} in {dr['seconds'] or 0:,.0f} s ({dr['per_s'] or 0:,.0f} "
        f"msg/s, TOP {cfg['top'] or 'all'}, "
        f"{dr['seeks']} seeks, {dr['records_read_back']} records read back, "
        f"{dr.get('receive_errors') or 0} RECEIVEs failed and retried); exactly once in order: "
        + ("yes" if r["verified_exactly_once_in_order"] else f"NO {dr['problems']}"),
    ]
    if rd.get("cache_bytes") is not None and rd.get("bytes_per_queued_message_without_cache"):
        lines.append(
            f"  the reader's peak includes its body cache ({rd['cache_bytes'] / 2**20:,.0f} MB, "
            "bounded by KSB_READER_CACHE_BYTES): without it "
            f"{rd['bytes_per_queued_message_without_cache']:,.0f} bytes per queued message"
        )
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
