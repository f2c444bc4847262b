"""Activation benchmark: how fast internal activation reacts to a burst, and how it winds down.

A burst of ``dialogs`` x ``per_dialog`` messages (one conversation group per dialog) lands on a queue
with internal activation: the procedure `bench.activation_task.work` takes ``WORK_MS`` per message,
MAX_QUEUE_READERS is 4.
The activation service runs as a child process (``python -m bench.activation service``) with one
addition: it records in Redis when it started each task, why, and when it reaped it. Each task's
procedure records its first RECEIVE, its last finished message and how many it processed. From those:

* **first RECEIVE after activation**: a task's first RECEIVE that returned messages minus the moment
  the monitor found activation necessary and started it (they coincide below MAX_QUEUE_READERS), as
  median and p95 in ms and in ticks;
* **time to MAX_QUEUE_READERS**: from the first SEND to the start (and to the first RECEIVE) of the
  task that made the running count reach the maximum;
* **retirement**: from the last processed message to the last task reaped, and per task from its last
  message to its exit;
* **wasted activations**: tasks whose `run_task` processed nothing (the procedure never ran).

Every time is wall-clock milliseconds (`time.time`) on this one host, shared by the bench, the
service and the tasks.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from confluent_kafka import Message

from bench.activation_task import HARNESS_LOGIN, WORK_MS, Keys, harness_redis, now_ms
from bench.queues import DEFAULT_REPLICAS, running_queues
from devtools.deployment import Deployment, process_settings, secure_instance
from devtools.runner import REPO_ROOT, ServiceProcess
from ksb.activation.monitor import Decision
from ksb.catalog.model import Catalog, parse_catalog
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.catalog_store import apply_catalog
from ksb.runtime.redis_client import redis_client
from ksb.sdk.client import KsbClient
from ksb.security.principals import ADMIN
from ksb.settings import ActivationSettings, settings_env
from services.activation.launcher import ActivationHooks
from services.activation.service import ActivationService
from services.activation.watch import QueueWatch

__all__ = [
    "ActivationOptions",
    "ActivationResult",
    "RecordingHooks",
    "activation_catalog",
    "format_lines",
    "run_activation",
]

log = logging.getLogger("bench.activation")

INITIATOR, TARGET, CONTRACT = "//bench/act/Initiator", "//bench/act/Target", "//bench/act/Contract"
MESSAGE_TYPE = "//bench/act/Job"
INITIATOR_QUEUE, TARGET_QUEUE = "ActBenchInitiatorQueue", "ActBenchTargetQueue"
MAX_QUEUE_READERS = 4


@dataclass(frozen=True)
class ActivationOptions:
    rounds: int = 3
    """Bursts, one after the other once the readers of the previous one retired."""
    dialogs: int = 200
    per_dialog: int = 5
    partitions: int = 4
    timeout_s: float = 45.0
    """How long all the rounds may take; a round that would not fit is skipped."""
    queue_replicas: int = DEFAULT_REPLICAS
    """Queue service replicas of the section's instance (its activation service and its tasks
    RECEIVE through them)."""


# --------------------------------------------------------------------------- the recording monitor
class RecordingHooks(ActivationHooks):
    """Records in Redis when the activation service starts a task (and why) and when it reaps
    one: what the bench reads its figures from."""

    def __init__(self, settings: ActivationSettings) -> None:
        self._settings = settings

    @functools.cached_property
    def bench_redis(self) -> redis.Redis:
        return harness_redis(self._settings)

    def started(self, w: QueueWatch, task_id: str, decision: Decision) -> None:
        row = {"ms": now_ms(), "reason": decision.reason, "running": len(w.tasks)}
        keys = Keys(self._settings.instance)
        self.bench_redis.hset(keys.activated, task_id, json.dumps(row))

    def exited(self, w: QueueWatch, task_ids: list[str]) -> None:
        keys = Keys(self._settings.instance)
        self.bench_redis.hset(keys.exited, mapping=dict.fromkeys(task_ids, now_ms()))


def _serve() -> None:
    """`python -m bench.activation service`: run the recording service until SIGTERM or SIGINT."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s activation %(levelname)s %(message)s"
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    settings = ActivationSettings.from_env()
    ActivationService(settings, hooks=RecordingHooks(settings)).run(stop)


def _harness_env(settings: Deployment) -> dict[str, str]:
    admin = settings.as_principal(ADMIN)
    return {HARNESS_LOGIN: admin.redis_password_file} if admin.redis_password_file else {}


def _start_recording_service(settings: Deployment, log_path: Path) -> ServiceProcess:
    """The activation service with `RecordingHooks`, as a child process, driven like any `ServiceProcess`."""
    service = ServiceProcess("activation", settings, log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        service.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.activation", "service"],
            cwd=REPO_ROOT,
            env=settings_env(
                process_settings(settings, "services.activation"),
                **_harness_env(settings),
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return service


# --------------------------------------------------------------------------- the run
def activation_catalog(partitions: int) -> Catalog:
    return parse_catalog(
        {
            "message_types": [{"name": MESSAGE_TYPE, "validation": "NONE"}],
            "contracts": [
                {"name": CONTRACT, "messages": [{"type": MESSAGE_TYPE, "sent_by": "INITIATOR"}]}
            ],
            "queues": [
                {"name": INITIATOR_QUEUE, "partitions": 1},
                {
                    "name": TARGET_QUEUE,
                    "partitions": partitions,
                    "activation": {
                        "status": "ON",
                        "procedure": "bench.activation_task:work",
                        "max_queue_readers": MAX_QUEUE_READERS,
                    },
                },
            ],
            "services": [
                {"name": INITIATOR, "queue": INITIATOR_QUEUE},
                {"name": TARGET, "queue": TARGET_QUEUE, "contracts": [CONTRACT]},
            ],
        }
    )


@dataclass(frozen=True)
class _Task:
    task_id: str
    round: int
    activated_ms: int
    reason: str
    running: int
    first_ms: int | None
    last_ms: int | None
    exited_ms: int | None
    processed: int


@dataclass(frozen=True)
class _Round:
    burst_ms: int
    """Wall time of the round's first SEND."""
    sent_ms: int


@dataclass
class ActivationResult:
    settings: Deployment
    opts: ActivationOptions
    rounds: list[_Round]
    tasks: list[_Task]
    seen: dict[str, int]
    max_live_tasks: int
    problems: list[str] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        return not self.problems

    def as_json(self) -> dict[str, Any]:
        s, tick = self.settings, self.settings.tick_ms
        first_after = sorted(t.first_ms - t.activated_ms for t in self.tasks if t.first_ms)
        per_task_retire = sorted(
            t.exited_ms - t.last_ms for t in self.tasks if t.exited_ms and t.last_ms
        )
        reasons: dict[str, int] = {}
        for t in self.tasks:
            reasons[t.reason] = reasons.get(t.reason, 0) + 1
        per_round = [self._round(i) for i in range(len(self.rounds))]

        def column(name: str) -> list[int | None]:
            return [r[name] for r in per_round]

        def p50(name: str) -> int | None:
            return _pct(sorted(v for v in column(name) if v is not None), 50)

        wasted = [t for t in self.tasks if t.processed == 0]
        return {
            "config": {
                "rounds": self.opts.rounds,
                "dialogs": self.opts.dialogs,
                "messages_per_round": self.opts.dialogs * self.opts.per_dialog,
                "work_ms_per_message": WORK_MS,
                "max_queue_readers": MAX_QUEUE_READERS,
                "partitions": self.opts.partitions,
                "tick_ms": tick,
                "activation_check_ms": s.activation_check_ms,
                "activation_empty_grace_ms": s.activation_empty_grace_ms,
                "activated_idle_ms": s.activated_idle_ms,
            },
            "rounds_completed": len(self.rounds),
            "activations": len(self.tasks),
            "activations_by_reason": reasons,
            "max_live_tasks": self.max_live_tasks,
            "first_receive_after_activation": {
                "count": len(first_after),
                "p50_ms": _pct(first_after, 50),
                "p95_ms": _pct(first_after, 95),
                "max_ms": first_after[-1] if first_after else None,
                "p50_ticks": _ticks(_pct(first_after, 50), tick),
                "p95_ticks": _ticks(_pct(first_after, 95), tick),
            },
            "first_receive_after_burst_ms": column("first_receive"),
            "time_to_max_queue_readers": {
                "started_ms": column("max_started"),
                "receiving_ms": column("max_receiving"),
                "started_p50_ms": p50("max_started"),
                "started_p50_ticks": _ticks(p50("max_started"), tick),
                "receiving_p50_ms": p50("max_receiving"),
                "receiving_p50_ticks": _ticks(p50("max_receiving"), tick),
            },
            "retire_after_load": {
                "all_retired_ms": column("retired"),
                "all_retired_p50_ms": p50("retired"),
                "all_retired_p50_ticks": _ticks(p50("retired"), tick),
                "per_task_p50_ms": _pct(per_task_retire, 50),
                "per_task_max_ms": per_task_retire[-1] if per_task_retire else None,
            },
            "drain_ms": column("drain"),
            "send_ms": [r.sent_ms - r.burst_ms for r in self.rounds],
            "wasted_activations": len(wasted),
            "wasted_reasons": [t.reason for t in wasted],
            "procedure_runs": sum(self.seen.values()),
            "procedure_reruns": sum(n - 1 for n in self.seen.values() if n > 1),
            "verified_exactly_once": self.verified,
            "problems": self.problems,
            "tasks": [
                {
                    "task_id": t.task_id,
                    "round": t.round,
                    "reason": t.reason,
                    "running": t.running,
                    "processed": t.processed,
                    **{
                        f"{name}_ms": None if at is None else at - self.rounds[t.round].burst_ms
                        for name, at in (
                            ("activated", t.activated_ms),
                            ("first_receive", t.first_ms),
                            ("last_work", t.last_ms),
                            ("exited", t.exited_ms),
                        )
                    },
                }
                for t in self.tasks
            ],
        }

    def _round(self, i: int) -> dict[str, int | None]:
        """One round's figures, in ms from its first SEND (None when it did not happen)."""
        burst = self.rounds[i].burst_ms
        tasks = [t for t in self.tasks if t.round == i]
        firsts = [t.first_ms for t in tasks if t.first_ms]
        lasts = [t.last_ms for t in tasks if t.last_ms]
        exits = [t.exited_ms for t in tasks if t.exited_ms]
        to_max = next((t for t in tasks if t.running >= MAX_QUEUE_READERS), None)
        return {
            "first_receive": min(firsts) - burst if firsts else None,
            "max_started": to_max.activated_ms - burst if to_max else None,
            "max_receiving": to_max.first_ms - burst if to_max and to_max.first_ms else None,
            "retired": max(exits) - max(lasts) if exits and lasts else None,
            "drain": max(lasts) - burst if lasts else None,
        }


def _pct(ordered: list[int], q: float) -> int | None:
    """Nearest-rank percentile of an ascending list."""
    if not ordered:
        return None
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def _ticks(ms: int | None, tick_ms: int) -> float | None:
    return None if ms is None else round(ms / tick_ms, 3)


def run_activation(base: Deployment, opts: ActivationOptions, log_dir: Path) -> ActivationResult:
    """The whole section on the running stack: its own instance, dispatcher and activation service."""
    settings = secure_instance(base.model_copy(update={"instance": f"{base.instance}act"}))
    apply_catalog(settings, activation_catalog(opts.partitions))
    with running_queues(settings, log_dir / "act-queue", opts.queue_replicas) as (settings, _q):
        return _run(settings, opts, log_dir)


def _run(settings: Deployment, opts: ActivationOptions, log_dir: Path) -> ActivationResult:
    keys = Keys(settings.instance)
    r = redis_client(settings.as_principal(ADMIN))  # the bench's keys and KSB's, read as admin
    procs: list[ServiceProcess] = []
    try:
        dispatcher = ServiceProcess("dispatcher", settings, log_dir / "act-dispatcher.log")
        procs.append(dispatcher.start())
        service = _start_recording_service(settings, log_dir / "activation.log")
        procs.append(service)
        dispatcher.wait_ready("dispatcher ready")
        service.wait_ready("activation ready")
        r.delete(keys.total, *keys.all())
        rounds: list[_Round] = []
        most = 0
        problems: list[str] = []
        deadline = time.monotonic() + opts.timeout_s
        with KsbClient(settings) as client:
            handles = [
                client.begin_dialog(INITIATOR, TARGET, CONTRACT) for _ in range(opts.dialogs)
            ]
            client.flush()
            for i in range(opts.rounds):
                if rounds and deadline - time.monotonic() < opts.timeout_s / opts.rounds:
                    break  # keep the section bounded: fewer rounds on a slow machine
                burst_ms = now_ms()
                for seq in range(opts.per_dialog):
                    for d, h in enumerate(handles):
                        _send(client, h, f"{i}:{d}:{seq}")
                client.flush(60)
                rounds.append(_Round(burst_ms, now_ms()))
                expected = len(rounds) * opts.dialogs * opts.per_dialog
                most = max(most, _wait_round(r, settings, keys, expected, deadline, problems))
                if problems:
                    break
        return _result(r, opts, settings, keys, rounds, most, problems)
    finally:
        for p in reversed(procs):
            p.stop()
        r.close()


def _send(client: KsbClient, handle: str, body: str) -> None:
    while True:
        try:
            client.send(handle, MESSAGE_TYPE, body)
            return
        except BufferError:  # the producer's local queue is full: let it drain
            client.flush(1)


def _wait_round(
    r: redis.Redis,
    settings: Deployment,
    keys: Keys,
    expected: int,
    deadline: float,
    problems: list[str],
) -> int:
    """Until ``expected`` messages are processed and every task is reaped; the most live tasks."""
    tasks_key = Names(settings.instance).tasks_key(TARGET_QUEUE)
    most = 0
    done = False
    while True:
        pipe = r.pipeline(transaction=False)
        pipe.zcount(tasks_key, now_ms(), "+inf")
        pipe.get(keys.total)
        pipe.hlen(keys.activated)
        pipe.hlen(keys.exited)
        live, total, started, exited = pipe.execute()
        most = max(most, int(live))
        if not done and int(total or 0) >= expected:
            done = True  # the load has stopped: now the readers retire
            deadline = max(deadline, time.monotonic() + settings.activated_idle_ms / 1000 + 5)
        if done and int(live) == 0 and int(exited) >= int(started):
            return most
        if time.monotonic() > deadline:
            what = "retire" if done else f"drain ({int(total or 0)} of {expected} processed)"
            problems.append(f"readers did not {what} in time")
            return most
        time.sleep(0.02)


def _receipts(settings: Deployment) -> dict[str, list[int]]:
    """Per message id in the target queue topic: [message records, receipt tombstones]."""
    counts: dict[str, list[int]] = {}

    def fold(m: Message) -> None:
        key = (m.key() or b"").decode()
        if not key.startswith("commit/"):
            counts.setdefault(key, [0, 0])[0 if m.value() is not None else 1] += 1

    c = kafka.consumer(settings)
    try:
        kafka.read_to_end(c, Names(settings.instance).queue(TARGET_QUEUE), fold, timeout_s=30)
    finally:
        c.close()
    return counts


def _result(
    r: redis.Redis,
    opts: ActivationOptions,
    settings: Deployment,
    keys: Keys,
    rounds: list[_Round],
    most: int,
    problems: list[str],
) -> ActivationResult:
    def strs(key: str) -> dict[str, str]:
        raw: dict[bytes, bytes] = r.hgetall(key)  # type: ignore[assignment]
        return {k.decode(): v.decode() for k, v in raw.items()}

    activated, first, last = strs(keys.activated), strs(keys.first), strs(keys.last)
    exited, processed = strs(keys.exited), strs(keys.processed)
    seen = {k: int(v) for k, v in strs(keys.seen).items()}
    tasks = []
    for task, raw in activated.items():
        row = json.loads(raw)
        at = int(row["ms"])
        tasks.append(
            _Task(
                task_id=task,
                round=max(i for i, rd in enumerate(rounds) if rd.burst_ms <= at or i == 0),
                activated_ms=at,
                reason=str(row["reason"]),
                running=int(row["running"]),
                first_ms=int(first[task]) if task in first else None,
                last_ms=int(last[task]) if task in last else None,
                exited_ms=int(exited[task]) if task in exited else None,
                processed=int(processed.get(task, 0)),
            )
        )
    tasks.sort(key=lambda t: t.activated_ms)
    # Exactly once is the broker's record: each message stored once and received (tombstoned)
    # once. The procedure may run twice on a message whose first commit was refused.
    expected = len(rounds) * opts.dialogs * opts.per_dialog
    receipts = _receipts(settings)
    received = sum(1 for c in receipts.values() if c == [1, 1])
    if len(receipts) != expected or received != expected:
        problems.append(
            f"{expected} messages sent, {len(receipts)} stored, {received} received exactly once"
        )
    if most > MAX_QUEUE_READERS:
        problems.append(f"{most} tasks ran at once, above MAX_QUEUE_READERS {MAX_QUEUE_READERS}")
    return ActivationResult(settings, opts, rounds, tasks, seen, most, problems)


def format_lines(j: dict[str, Any]) -> list[str]:
    """The section's lines for the bench table."""

    def ms(v: Any) -> str:
        if isinstance(v, list):
            return "/".join("n/a" if x is None else f"{x:,}" for x in v) + " ms"
        return "n/a" if v is None else f"{v:,} ms"

    def ticks(v: Any) -> str:
        return "n/a" if v is None else f"{v:.2f} ticks"

    cfg, fr = j["config"], j["first_receive_after_activation"]
    tm, rt = j["time_to_max_queue_readers"], j["retire_after_load"]
    lines = [
        f"activation: {j['rounds_completed']} burst(s) of {cfg['messages_per_round']:,} messages "
        f"over {cfg['dialogs']:,} groups, {cfg['work_ms_per_message']} ms each, "
        f"MAX_QUEUE_READERS {cfg['max_queue_readers']}, tick {cfg['tick_ms']:,} ms, "
        f"idle exit {cfg['activated_idle_ms']:,} ms (per-burst figures joined by /)",
        f"  next reader's first RECEIVE after activation: p50 {ms(fr['p50_ms'])} "
        f"({ticks(fr['p50_ticks'])}), p95 {ms(fr['p95_ms'])} ({ticks(fr['p95_ticks'])}) "
        f"over {fr['count']} readers; first RECEIVE after the burst began "
        f"{ms(j['first_receive_after_burst_ms'])}",
        f"  MAX_QUEUE_READERS reached: started {ms(tm['started_ms'])} (p50 "
        f"{ticks(tm['started_p50_ticks'])}), all receiving {ms(tm['receiving_ms'])} "
        f"after the burst; most live tasks {j['max_live_tasks']}",
        f"  readers retired {ms(rt['all_retired_ms'])} after the last message (p50 "
        f"{ticks(rt['all_retired_p50_ticks'])}; per task p50 {ms(rt['per_task_p50_ms'])}, "
        f"max {ms(rt['per_task_max_ms'])}); drained {ms(j['drain_ms'])} after the burst",
        f"  activations {j['activations']} {j['activations_by_reason']}, wasted (found no work) "
        f"{j['wasted_activations']}; messages the procedure ran on again after a refused commit "
        f"{j['procedure_reruns']}; exactly once: {'yes' if j['verified_exactly_once'] else 'NO'}",
    ]
    lines.extend(f"  problem: {p}" for p in j["problems"])
    return lines


if __name__ == "__main__":
    if sys.argv[1:] != ["service"]:
        print("usage: python -m bench.activation service", file=sys.stderr)
        sys.exit(2)
    _serve()
