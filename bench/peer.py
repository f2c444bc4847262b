"""The exactly-once peer: the pipeline a user would write on Kafka without KSB, with KSB's two
crossings, on the same broker with the same load, beside raw Kafka in `make bench`'s table.

KSB's round trip crosses the dispatchers twice: the SEND is applied in one transaction (the
message becomes visible to RECEIVE), and the reader's commit in another (its outcome is what the
reader waits for). Without KSB, the same guarantees take Kafka's consume -> transform -> produce
pattern twice, each under exactly-once:

* the client produces each message to a requests topic (the SDK's request producer's settings);
* worker 1, a consumer-group member, consumes it and re-produces it to a work topic in a
  transaction with its consumer offsets;
* worker 2 consumes the work topic read_committed and produces an acknowledgement in a
  transaction with its offsets (the application's processing and its commit);
* the client reads the acknowledgements read_committed: a message is done when its
  acknowledgement is read, as a KSB message is when its commit's outcome says applied.

Each worker is a process of its own, as each dispatcher is, and batches as the dispatcher does
(up to `DispatcherSettings.batch_max` records a transaction, taken as soon as any is there); all
its clients are KSB's (`ksb.runtime.kafka`: the dispatcher's transactional producer settings, a
KIP-848 group member, a read_committed reader), so the gap is what KSB adds beyond Kafka's
exactly-once, not a different tuning. Messages are keyed by dialog (``keys`` of them), so per key
the order is the partition's; every acknowledgement is checked: each message once, in order per
key. A worker's acknowledgement carries when worker 2 consumed the message, so the figure KSB
calls SEND -> RECEIVE is measured here too (one monotonic clock, one host).

CPU is measured as for KSB's runs (bench/scaling.py): utime + stime of the broker, both workers
and this process (the client) over the loaded phase, over the messages.
"""

from __future__ import annotations

import functools
import logging
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

import ksb.runtime.kafka as kafka
from bench.raw_kafka import median_run
from bench.stats import (
    CpuMeter,
    LatencySummary,
    Rate,
    fmt_ms,
    fmt_x,
    jit_settle,
    make_body,
    now_ns,
    parse_body,
    ratio,
    run_ratios,
    summarize,
)
from devtools.deployment import Deployment
from devtools.runner import REPO_ROOT, ServiceProcess
from ksb.settings import DispatcherSettings, KsbSettings, settings_env
from services.dispatcher.journal import TXN_PRODUCER

__all__ = [
    "COLUMN",
    "PeerOptions",
    "format_lines",
    "parse_ack",
    "ratios_over_peer",
    "run_peer",
    "table_column",
    "worker_main",
]

log = logging.getLogger("bench.peer")

READY = "peer worker ready"
_WARMUP = 5
"""One-at-a-time messages before each run (connections, metadata, the workers' first
transactions), as KSB's e2e run sends five probes first."""
_TXN_TIMEOUT_S = 30.0
_REBALANCE_TIMEOUT_MS = 30_000


@dataclass(frozen=True)
class PeerOptions:
    messages: int = 20_000
    keys: int = 1_000
    """Keys the messages go round-robin over (KSB's dialogs)."""
    body_bytes: int = 1024
    partitions: int = 8
    """Partitions of each of its three topics (KSB's shards and target queue partitions)."""
    batch_max: int = DispatcherSettings().batch_max
    """Records a worker's transaction takes at most (the dispatcher's)."""
    probes: int = 100
    runs: int = 3
    """Loaded runs, each with workers of its own; the median by throughput is shown."""
    timeout_s: float = 180.0
    settle_jit: bool = True


# ----------------------------------------------------------------------------- the workers
def parse_ack(value: bytes) -> tuple[int, str, int]:
    """(send time, tag, when worker 2 consumed it) of an acknowledgement."""
    sent, tag, consumed = value.decode().split(" ")
    return int(sent), tag, int(consumed)


def _ack(body: bytes, consumed_ns: int) -> bytes:
    sent, tag = parse_body(body)
    return f"{sent} {tag} {consumed_ns}".encode()


def worker_main(argv: list[str]) -> int:
    """`python -m bench.peer worker STAGE IN OUT GROUP TXN_ID BATCH_MAX`: one worker until SIGTERM
    (settings from ``KSB_*``). Stage 1 passes each record on; stage 2 acknowledges it."""
    stage, source, sink, group, txn_id, batch_max = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s peer %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    settings = KsbSettings.from_env()
    member = kafka.group_consumer(
        settings, group=group, rebalance_timeout_ms=_REBALANCE_TIMEOUT_MS, assignor="range"
    )
    member.subscribe([source])
    producer = kafka.producer(settings, transactional_id=txn_id, extra=TXN_PRODUCER)
    producer.init_transactions(_TXN_TIMEOUT_S)
    ready = False
    applied = transactions = 0
    try:
        while not stop.is_set():
            msgs = kafka.consume_batch(member, int(batch_max), 0.1)
            if not ready and member.assignment():
                ready = True
                log.info("%s (stage %s, %d partitions)", READY, stage, len(member.assignment()))
            records = [m for m in msgs if m.error() is None]
            for m in msgs:
                err = m.error()
                if err is not None and err.code() != KafkaError._PARTITION_EOF:
                    raise KafkaException(err)
            if not records:
                continue
            consumed = now_ns()
            producer.begin_transaction()
            for m in records:
                value = m.value() or b""
                out = value if stage == "1" else _ack(value, consumed)
                _produce(producer, sink, m.key(), out)
            producer.send_offsets_to_transaction(
                member.position(member.assignment()),
                member.consumer_group_metadata(),
                _TXN_TIMEOUT_S,
            )
            producer.commit_transaction(_TXN_TIMEOUT_S)
            applied += len(records)
            transactions += 1
    finally:
        member.close()
        log.info("peer worker %s: %d applied in %d transactions", stage, applied, transactions)
    return 0


def _produce(p: Producer, topic: str, key: bytes | None, value: bytes) -> None:
    while True:
        try:
            p.produce(topic, key=key, value=value)
            return
        except BufferError:  # local queue full: let librdkafka drain a little
            p.poll(0.01)


def _start_worker(
    settings: Deployment, args: list[str], log_path: Path, name: str
) -> ServiceProcess:
    """A worker as a child process, driven like any `ServiceProcess`."""
    worker = ServiceProcess(name, settings, log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        worker.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.peer", "worker", *args],
            cwd=REPO_ROOT,
            env=settings_env(settings.narrow(KsbSettings)),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return worker


# ----------------------------------------------------------------------------- the client
@dataclass
class _Acks:
    """The client's read_committed reader of the acknowledgements, checking each key's order."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    cond: threading.Condition = field(init=False)
    latencies_ns: list[int] = field(default_factory=list)
    delivered_ns: list[int] = field(default_factory=list)
    next_seq: dict[str, int] = field(default_factory=dict)
    seen: int = 0
    last_ns: int = 0
    tags: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    failure: BaseException | None = None

    def __post_init__(self) -> None:
        self.cond = threading.Condition(self.lock)

    def add(self, values: list[bytes], now: int) -> None:
        with self.cond:
            for value in values:
                sent, tag, consumed = parse_ack(value)
                self.latencies_ns.append(now - sent)
                self.delivered_ns.append(consumed - sent)
                key, _, seq = tag.partition(":")
                if key in ("probe", "warm"):
                    self.tags.add(tag)
                else:
                    want = self.next_seq.get(key, 0)
                    if int(seq) != want and len(self.problems) < 20:
                        kind = "duplicate" if int(seq) < want else "gap"
                        self.problems.append(f"key {key}: got {seq}, expected {want} ({kind})")
                    self.next_seq[key] = max(want, int(seq) + 1)
            self.seen += len(values)
            self.last_ns = now
            self.cond.notify_all()

    def reset(self) -> None:
        with self.cond:
            self.latencies_ns.clear()
            self.delivered_ns.clear()
            self.seen = 0

    def wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: done() or self.failure is not None, timeout_s):
                raise TimeoutError(f"peer: {what} not acknowledged in {timeout_s:.0f} s")
        if self.failure is not None:
            raise RuntimeError("the peer's acknowledgement reader failed") from self.failure


def _follow(
    settings: Deployment, topic: str, partitions: int, acks: _Acks, stop: threading.Event
) -> None:
    reader = kafka.consumer(settings, read_committed=True, group=f"{topic}.client")
    reader.assign([TopicPartition(topic, p, -2) for p in range(partitions)])
    try:
        while not stop.is_set():
            msgs = kafka.consume_batch(reader, 1000, 0.05)
            now = now_ns()
            values = []
            for m in msgs:
                err = m.error()
                if err is None:
                    values.append(m.value() or b"")
                elif err.code() != KafkaError._PARTITION_EOF:
                    raise KafkaException(err)
            if values:
                acks.add(values, now)
    except BaseException as exc:
        acks.failure = exc
        with acks.cond:
            acks.cond.notify_all()
    finally:
        reader.close()


@dataclass(frozen=True)
class _Topics:
    requests: str
    work: str
    acks: str


def _one_at_a_time(
    producer: Producer, topics: _Topics, acks: _Acks, count: int, tag: str, o: PeerOptions
) -> None:
    for i in range(count):
        name = f"{tag}:{i}"
        body = make_body(o.body_bytes, now_ns(), name).encode()
        _produce(producer, topics.requests, name.encode(), body)
        producer.poll(0)
        acks.wait(functools.partial(acks.tags.__contains__, name), o.timeout_s, name)


def _one_run(
    settings: Deployment,
    o: PeerOptions,
    workdir: Path,
    attempt: int,
    stack_pids: dict[str, int],
) -> dict[str, Any]:
    run = f"bench.peer.{uuid.uuid4().hex[:8]}"
    topics = _Topics(f"{run}.requests", f"{run}.work", f"{run}.acks")
    kafka.ensure_topics(
        kafka.admin(settings),
        [kafka.TopicSpec(t, o.partitions) for t in (topics.requests, topics.work, topics.acks)],
    )
    logs = workdir / f"peer-r{attempt}"
    workers = [
        _start_worker(
            settings,
            ["1", topics.requests, topics.work, f"{run}.w1", f"{run}.w1", str(o.batch_max)],
            logs / "worker-1.log",
            "peer-w1",
        ),
        _start_worker(
            settings,
            ["2", topics.work, topics.acks, f"{run}.w2", f"{run}.w2", str(o.batch_max)],
            logs / "worker-2.log",
            "peer-w2",
        ),
    ]
    acks = _Acks()
    stop = threading.Event()
    follower = threading.Thread(
        target=_follow, args=(settings, topics.acks, o.partitions, acks, stop), daemon=True
    )
    follower.start()
    producer = kafka.request_producer(settings)
    per_key = max(1, o.messages // o.keys)
    expected = per_key * o.keys
    try:
        for w in workers:
            w.wait_ready(READY, o.timeout_s)
        _one_at_a_time(producer, topics, acks, _WARMUP, "warm", o)
        pids = {"worker 1": _pid(workers[0]), "worker 2": _pid(workers[1])}
        meter = CpuMeter(
            {**pids, **stack_pids, "client": None}, jvm="kafka", librdkafka=tuple(pids)
        )
        if o.settle_jit and "kafka" in stack_pids:
            jit_settle(stack_pids["kafka"])
        acks.reset()
        meter.mark(True)
        started = now_ns()
        for seq in range(per_key):
            for k in range(o.keys):
                tag = f"{k}:{seq}"
                body = make_body(o.body_bytes, now_ns(), tag).encode()
                _produce(producer, topics.requests, str(k).encode(), body)
                producer.poll(0)
        producer.flush(o.timeout_s)
        sent_ns = now_ns()
        acks.wait(lambda: acks.seen >= expected, o.timeout_s, f"{expected} messages")
        meter.mark(False)
        loaded = summarize(acks.latencies_ns[:expected])
        delivered_loaded = summarize(acks.delivered_ns[:expected])
        rate = Rate(expected, (acks.last_ns - started) / 1e9)
        acks.reset()
        _one_at_a_time(producer, topics, acks, o.probes, "probe", o)
        probe, delivered = summarize(acks.latencies_ns), summarize(acks.delivered_ns)
    finally:
        stop.set()
        producer.flush(5)
        for w in workers:
            w.stop()
        follower.join(10)
    problems = list(acks.problems)
    short = [k for k in range(o.keys) if acks.next_seq.get(str(k), 0) != per_key]
    if short:
        problems.append(f"{len(short)} keys incomplete, e.g. key {short[0]}")
    return _as_json(
        rate, loaded, probe, delivered, delivered_loaded, meter, sent_ns - started, problems
    )


def _pid(p: ServiceProcess) -> int:
    assert p.proc is not None
    return p.proc.pid


def _as_json(
    rate: Rate,
    loaded: LatencySummary,
    probe: LatencySummary,
    delivered: LatencySummary,
    delivered_loaded: LatencySummary,
    meter: CpuMeter,
    send_ns: int,
    problems: list[str],
) -> dict[str, Any]:
    n = rate.messages
    spent = meter.spent_s
    workers = sum(s for name, s in spent.items() if name.startswith("worker"))
    return {
        "throughput": rate.as_json(),
        "send_seconds": send_ns / 1e9,
        "latency_loaded": loaded.as_json(),
        "latency_unloaded": probe.as_json(),
        "latency_delivered": delivered.as_json(),
        "latency_delivered_loaded": delivered_loaded.as_json(),
        "cpu_s": spent,
        "cpu_ms_per_message": {
            "workers": workers * 1000 / n,
            "workers_librdkafka": meter.librdkafka_ms_per_message(n),
            **{name: s * 1000 / n for name, s in spent.items()},
            **meter.jit_ms_per_message(n),
            "all": sum(spent.values()) * 1000 / n,
        },
        "verified_exactly_once_in_order": not problems,
        "problems": problems,
    }


def run_peer(
    settings: Deployment, o: PeerOptions, workdir: Path, stack_pids: dict[str, int]
) -> dict[str, Any]:
    """`o.runs` loaded runs of the peer on the running stack, as `settings`' principal (the
    admin: its topics are nobody's instance's); the median by throughput, with every run's
    throughput and whether any lost or repeated a message."""
    tries = [_one_run(settings, o, workdir, i, stack_pids) for i in range(o.runs)]
    rates = [t["throughput"]["per_s"] for t in tries]
    shown = dict(tries[median_run(rates)])
    shown["throughput_runs"] = rates
    shown["worker_cpu_runs"] = [t["cpu_ms_per_message"]["workers"] for t in tries]
    shown["verified_exactly_once_in_order"] = all(
        t["verified_exactly_once_in_order"] for t in tries
    )
    shown["problems"] = [f"run {i + 1}: {p}" for i, t in enumerate(tries) for p in t["problems"]]
    shown["config"] = asdict(o)
    return shown


# ----------------------------------------------------------------------------- the table
COLUMN = "EOS peer"
"""The peer's column in the scaling table (bench/scaling.py), beside raw Kafka's."""


def table_column(peer: dict[str, Any]) -> dict[str, str]:
    """The peer's cells of the scaling table, by row label (rows it has no figure for: none)."""
    cpu = peer["cpu_ms_per_message"]
    cells = {
        "throughput": f"{peer['throughput']['per_s']:,.0f} msg/s",
        "dispatcher CPU per message": f"workers {fmt_ms(cpu.get('workers'), 3)}",
        "  of which librdkafka threads": fmt_ms(cpu.get("workers_librdkafka"), 3),
        "CPU per message, all processes": fmt_ms(cpu.get("all"), 3),
        "  of which Kafka broker": fmt_ms(cpu.get("kafka"), 3),
        "    of which its JIT compiler": fmt_ms(cpu.get("kafka_jit"), 3),
        "  of which SDK clients": f"client {fmt_ms(cpu.get('client'), 3)}",
        "exactly once, in order": "yes" if peer["verified_exactly_once_in_order"] else "NO",
    }
    for load, label in (("loaded", "loaded"), ("unloaded", "1 at a time")):
        for p in ("p50", "p99"):
            cells[f"{p} latency ({label})"] = fmt_ms(peer[f"latency_{load}"][f"{p}_ms"])
    for p in ("p50", "p99"):
        cells[f"  {p} to RECEIVE, no commit"] = fmt_ms(peer["latency_delivered"][f"{p}_ms"])
    return cells


def ratios_over_peer(run: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """A KSB run's figures over the peer's, each like for like: throughput (up is good), loaded
    and one-at-a-time latencies, SEND -> RECEIVE against the peer's produce -> worker 2, and CPU
    per message of all processes (down is good)."""
    out = run_ratios(run, peer)
    out["cpu_all"] = ratio(run["cpu_ms_per_message"]["all"], peer["cpu_ms_per_message"]["all"])
    return out


def format_lines(
    peer: dict[str, Any], runs: list[dict[str, Any]], label: Callable[[dict[str, Any]], str]
) -> list[str]:
    """What the peer is, its runs, and each KSB run over it (the goal: throughput >= 1.0x)."""
    cfg = peer["config"]
    rates = " / ".join(f"{r:,.0f}" for r in peer["throughput_runs"])
    lines = [
        f"{COLUMN}: the exactly-once pipeline without KSB, with KSB's two crossings (client "
        f"produces; worker 1 re-produces in a transaction with its offsets; worker 2 reads "
        f"read_committed and acknowledges in a transaction with its offsets; the client reads "
        f"the acknowledgements read_committed), one process per worker, up to "
        f"{cfg['batch_max']} records a transaction, {cfg['messages']:,} x {cfg['body_bytes']} B "
        f"over {cfg['keys']:,} keys, {cfg['partitions']} partitions a topic; median of "
        f"{len(peer['throughput_runs'])} runs ({rates} msg/s)",
        "KSB over the EOS peer (throughput up is good, the rest down; goal: throughput >= 1.0x):",
    ]
    for r in runs:
        x = ratios_over_peer(r, peer)
        lines.append(
            f"  {label(r)}: throughput {fmt_x(x['throughput'])}, loaded p50 "
            f"{fmt_x(x['latency_loaded_p50'])} p99 {fmt_x(x['latency_loaded_p99'])}, 1 at a time "
            f"p50 {fmt_x(x['latency_unloaded_p50'])}, to RECEIVE p50 "
            f"{fmt_x(x.get('latency_delivered_p50'))}, CPU all processes {fmt_x(x['cpu_all'])}"
        )
    lines.extend(f"  problem (peer): {p}" for p in peer["problems"])
    return lines


if __name__ == "__main__":
    if sys.argv[1:2] != ["worker"]:
        print("usage: python -m bench.peer worker STAGE IN OUT GROUP TXN_ID BATCH", file=sys.stderr)
        sys.exit(2)
    sys.exit(worker_main(sys.argv[2:]))
