"""One chaos round: new instances, the workload, the fault schedule, the drain, the verdict.

1. Instances A, B and F are made (principals, topics, ACLs, catalogs) and every process started
   (`devtools.chaos.topology`); nothing is sent before both instances' dispatchers own every shard.
2. The driver (this process, as A's owner) BEGINs every dialog and SENDs every request, round-robin
   over the dialogs; the readers answer and end them (`devtools.chaos.workload`), while the
   injector fires the schedule at its progress points (`devtools.chaos.faults`).
3. Once A has received every reply and every closing message (or the round's time is up), the rest
   of the schedule fires, every fault is healed, and the round drains: every endpoint CLOSED on
   both sides and nothing left in a transmission queue, or the drain's time is up.
4. The processes stop and the invariants are checked on what Kafka recorded
   (`devtools.chaos.invariants`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devtools.chaos.facts import (
    applied_batches,
    dispatcher_group,
    pending_transmissions,
    read_side,
)
from devtools.chaos.faults import Injector
from devtools.chaos.hostile import Refusal, is_hostile_endpoint
from devtools.chaos.invariants import Verdict, check_round
from devtools.chaos.remedy import CoordinatorWatch
from devtools.chaos.schedule import FaultKind, draw_schedule
from devtools.chaos.stack import ChaosStack
from devtools.chaos.topology import Crash, Topology
from devtools.chaos.workload import (
    CONTRACT,
    INITIATOR_QUEUE,
    REQUEST,
    TARGET_QUEUE,
    Workload,
    plan_workload,
    request_body,
)
from devtools.deployment import Deployment
from devtools.processes import LogTail
from ksb.errors import KsbError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.sdk.client import KsbClient

__all__ = ["RoundOptions", "RoundResult", "run_round"]

log = logging.getLogger("devtools.chaos")


@dataclass(frozen=True)
class RoundOptions:
    messages: int = 10_000
    dialogs: int = 1_000
    faults: int = 12
    shards: int = 2
    lock_ttl_ms: int = 3_000
    flow_timeout_s: float = 300.0
    """How long the workload may take to reach A before the round stops waiting."""
    drain_timeout_s: float = 120.0
    kinds: tuple[FaultKind, ...] = tuple(FaultKind)


@dataclass
class RoundResult:
    round_no: int
    seed: int
    workload: Workload
    verdict: Verdict
    injected: Counter[FaultKind]
    received: int
    seconds: float
    crashes: list[Crash] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    zombies: list[str] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    """Each hostile record and its refusal (`devtools.chaos.hostile`)."""
    remedies: list[str] = field(default_factory=list)
    """Broker restarts for a Kafka bug (`devtools.chaos.remedy`), outside the schedule."""
    errors: list[str] = field(default_factory=list)
    """What went wrong with the harness itself (a fault it could not heal, a stuck driver)."""

    @property
    def ok(self) -> bool:
        return self.verdict.ok and not self.errors


class Progress:
    """Distinct messages A's readers saw applied, read from their line files at most every
    half second (the injector asks often)."""

    def __init__(self, topology: Topology, expected: int) -> None:
        self.topology = topology
        self.expected = expected
        self._tails: dict[Path, LogTail] = {}
        self._batches: dict[tuple[Path, int], list[str]] = {}
        self.delivered: set[str] = set()
        self._read_at = 0.0
        self._lock = threading.Lock()

    def fraction(self) -> float:
        with self._lock:
            if time.monotonic() - self._read_at > 0.5:
                self._read()
            return len(self.delivered) / max(1, self.expected)

    def complete(self) -> bool:
        return self.fraction() >= 1.0

    def _read(self) -> None:
        self._read_at = time.monotonic()
        for path in self.topology.reader_files("a"):
            tail = self._tails.setdefault(path, LogTail(path, from_start=True))
            for line in tail.new_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    self._line(path, json.loads(line))

    def _line(self, path: Path, rec: dict[str, Any]) -> None:
        key = (path, int(rec["t"]))
        if rec["s"] == "R":
            self._batches[key] = [m[0] for m in rec["m"]]
        elif rec["s"] == "C":
            self.delivered.update(self._batches.pop(key, []))
        else:
            self._batches.pop(key, None)


def _drive(owner: Deployment, workload: Workload, handles: list[str], errors: list[str]) -> None:
    """BEGIN every dialog, then SEND every request round-robin over them, all at once (Kafka
    holds what the dispatchers have not applied yet; the SDK's back-pressure is off: see
    docs/reliability.md, "Not covered")."""
    settings = owner.model_copy(update={"max_inflight_requests": 0})
    try:
        with KsbClient(settings) as client:
            for d in workload.dialogs:
                related = handles[d.related_to] if d.related_to is not None else None
                initiator, target = d.services
                handles.append(
                    client.begin_dialog(initiator, target, CONTRACT, related_conversation=related)
                )
            for seq in range(max(d.requests for d in workload.dialogs)):
                for d in workload.dialogs:
                    if seq < d.requests:
                        _send(client, handles[d.number], request_body(d, seq))
            client.flush(900)
    except Exception as exc:
        log.exception("the driver failed")
        errors.append(f"driver: {type(exc).__name__}: {exc}")


def _send(client: KsbClient, handle: str, body: str) -> None:
    while True:
        try:
            client.send(handle, REQUEST, body)
            return
        except BufferError:  # the producer's local queue is full: let it drain
            with contextlib.suppress(KsbError):
                client.flush(0.1)


def _closed(settings: Deployment, count: int) -> tuple[int, int]:
    """(endpoints, of which CLOSED or gone) on `settings`' instance; the hostile volleys' own
    dialogs (`devtools.chaos.hostile`) are not the workload's and stay open."""
    states: dict[str, bool] = {}
    hostile: set[str] = set()

    def one(m: Any) -> None:
        key, value = (m.key() or b"").decode(), m.value()
        states[key] = value is None or b'"state":"CLOSED"' in value
        if value is not None and b"Mallory" in value and is_hostile_endpoint(json.loads(value)):
            hostile.add(key)

    c = kafka.consumer(settings)
    try:
        kafka.read_to_end(c, Names(settings.instance).endpoints, one, timeout_s=60)
    finally:
        c.close()
    kept = [closed for key, closed in states.items() if key not in hostile]
    return len(kept), sum(kept)


def _drain(topology: Topology, dialogs: int, timeout_s: float) -> tuple[int, str]:
    """Wait until both sides' endpoints are all CLOSED and nothing is left to transmit; returns
    what is left in the transmission queues and a note on what did not drain."""
    deadline = time.monotonic() + timeout_s
    owners = [topology.owner[s] for s in ("a", "b", "f")]
    pending, note = 0, ""
    while True:
        try:
            a_total, a_closed = _closed(topology.owner["a"], dialogs)
            b_total, b_closed = _closed(topology.owner["b"], dialogs)
            pending, age_s = pending_transmissions(owners)
            note = (
                f"A {a_closed}/{a_total} closed, B {b_closed}/{b_total} closed, "
                f"{pending} pending (views {age_s:.1f}s old)"
            )
            if (
                a_closed == a_total == dialogs
                and b_closed == b_total == dialogs
                and pending == 0
                and age_s < 5
            ):
                return 0, ""
        except Exception as exc:
            note = f"drain check failed: {type(exc).__name__}: {exc}"
            log.warning(note)
        if time.monotonic() > deadline:
            return pending, f"not drained in {timeout_s:.0f}s: {note}"
        time.sleep(2.0)


def _group_views(topology: Topology) -> list[str]:
    """What each side's group coordinator says its dispatchers hold, for a round that did not
    drain (their logs carry librdkafka's ``cgrp`` lines for the rest)."""
    views = []
    for side in ("a", "b"):
        try:
            views.append(dispatcher_group(topology.owner[side]))
        except Exception as exc:
            views.append(f"{side}'s dispatcher group not described: {type(exc).__name__}: {exc}")
    return views


_STORY = re.compile(r"^\d{4}-.*(WARNING|ERROR|shards \[|given; taking|rejoin|ready \()")
"""The lines of a dispatcher's own log (not librdkafka's) that tell what became of its shards."""


def _dispatcher_stories(topology: Topology, lines: int = 12) -> list[str]:
    """The last of each dispatcher's shard lines (`_STORY`), for a round that did not drain: what
    CI keeps of a failed round is its report, not the round's logs."""
    out = []
    for name, m in topology.processes():
        if not re.fullmatch(r"[ab]\.d\d+", name):
            continue
        story = [line for line in m.tail(1_000_000).splitlines() if _STORY.search(line)]
        out += [f"{name}: {line[:240]}" for line in story[-lines:]]
    return out


def run_round(
    stack: ChaosStack, opts: RoundOptions, round_no: int, seed: int, workdir: Path, run_id: str
) -> RoundResult:
    started = time.monotonic()
    workload = plan_workload(seed, opts.dialogs, opts.messages)
    schedule = draw_schedule(
        seed, opts.faults, lock_ttl_s=opts.lock_ttl_ms / 1000, kinds=opts.kinds
    )
    topology = Topology(
        stack,
        f"ch{run_id}r{round_no}",
        workdir / f"round-{round_no}",
        shards=opts.shards,
        lock_ttl_ms=opts.lock_ttl_ms,
    )
    errors: list[str] = []
    handles: list[str] = []
    progress = Progress(topology, workload.replies + len(workload.dialogs))
    injector = Injector(topology, stack, schedule, progress.fraction, handles=handles)
    watch = CoordinatorWatch(stack.broker_log, injector.remedy_kafka)
    try:
        watch.check()  # what the last round's broker left broken, mended before this one starts
        watch.start()
        topology.setup()
        topology.start()
        log.info(
            "round %d: %d dialogs, %d requests, schedule %s",
            round_no,
            len(workload.dialogs),
            workload.requests,
            "; ".join(f.describe() for f in schedule),
        )
        injector.start()
        driver = threading.Thread(
            target=_drive, args=(topology.owner["a"], workload, handles, errors), name="driver"
        )
        driver.start()
        # A's readers' own lines say when the workload is through; a reader killed between its
        # commit and its line leaves a few messages unseen there, so the round also stops
        # waiting once both sides have drained (what Kafka recorded decides the verdict).
        deadline = time.monotonic() + opts.flow_timeout_s
        next_check = time.monotonic() + 10
        while not progress.complete() and time.monotonic() < deadline:
            if errors and not driver.is_alive():
                break  # the driver gave up: nothing more is coming
            if time.monotonic() > next_check and not driver.is_alive():
                if not _drain(topology, len(workload.dialogs), 0)[1]:
                    break
                next_check = time.monotonic() + 10
            time.sleep(0.5)
        injector.finish(timeout_s=MAX_SCHEDULE_S)
        errors += [f"heal failed: {h}" for h in injector.heal_failures]
        driver.join(60)
        if driver.is_alive():
            errors.append("the driver was still sending at the end of the round")
        pending, note = _drain(topology, len(workload.dialogs), opts.drain_timeout_s)
        if note:
            errors.append(note)
            errors += _group_views(topology)
            errors += _dispatcher_stories(topology)
    finally:
        watch.stop()
        topology.stop()
    a = read_side(topology.owner["a"], INITIATOR_QUEUE, dead_letters=False)
    b = read_side(topology.owner["b"], TARGET_QUEUE, dead_letters=True)
    a.applied_batches = applied_batches(topology.reader_files("a"))
    b.applied_batches = applied_batches(topology.reader_files("b"))
    verdict = check_round(workload, handles, a, b, pending)
    for r in injector.refusals:
        if not r.ok:
            expected = "/".join(sorted(r.expected))
            verdict.add(
                "refused", 1, f"{r.name} ({r.request_id}): {r.got or 'no refusal'}, not {expected}"
            )
    return RoundResult(
        round_no=round_no,
        seed=seed,
        workload=workload,
        verdict=verdict,
        injected=injector.injected,
        received=len(set(a.committed)) + len(set(b.committed)) + len(b.dead_lettered),
        seconds=time.monotonic() - started,
        crashes=topology.crashes,
        events=injector.events,
        skipped=injector.skipped,
        zombies=injector.zombies,
        refusals=injector.refusals,
        remedies=injector.remedies,
        errors=errors,
    )


MAX_SCHEDULE_S = 300.0
"""How long the rest of the schedule may take to fire once the workload has reached A."""
