"""Injecting a round's fault schedule into its topology and stack, and healing each fault.

`Injector.run` walks the schedule on its own thread: each fault fires once the round's progress
reaches its point (or `MAX_GAP_S` after the previous one), is injected at once, and is healed on a
thread of its own after its duration, so faults overlap when the next one comes first. A fault
whose target is already under another fault goes to the next free one of its kind, or is
skipped. Healing is retried until it succeeds (a catalog cannot be applied while Kafka is down),
and `heal_all` waits for every heal before the round drains.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from devtools.chaos.hostile import Refusal, Volley
from devtools.chaos.schedule import (
    MAX_GAP_S,
    QUEUE_REPLICAS,
    READERS,
    SERVICES,
    Fault,
    FaultKind,
)
from devtools.chaos.stack import ChaosStack
from devtools.chaos.topology import Topology
from devtools.chaos.workload import TARGET_QUEUE
from devtools.chaos.zombie import zombie_commit

__all__ = ["Injector"]

log = logging.getLogger("devtools.chaos")
HEAL_RETRY_S = 300.0


@dataclass
class Injector:
    topology: Topology
    stack: ChaosStack
    schedule: list[Fault]
    progress: Callable[[], float]
    """The share of the round's expected replies delivered so far."""
    injected: Counter[FaultKind] = field(default_factory=Counter)
    skipped: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    zombies: list[str] = field(default_factory=list)
    """What became of each zombie commit (`devtools.chaos.zombie`)."""
    handles: list[str] = field(default_factory=list)
    """A's workload dialogs as begun so far (a hostile volley's victim is one of them)."""
    refusals: list[Refusal] = field(default_factory=list)
    """What became of each hostile record (`devtools.chaos.hostile`)."""
    heal_failures: list[str] = field(default_factory=list)
    remedies: list[str] = field(default_factory=list)
    """Broker restarts the harness made for a Kafka bug, not for its schedule
    (`devtools.chaos.remedy`)."""
    _busy: set[str] = field(default_factory=set)
    _heals: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _started: float = field(default_factory=time.monotonic)

    def start(self) -> Injector:
        self._thread = threading.Thread(target=self.run, name="chaos-injector", daemon=True)
        self._thread.start()
        return self

    def run(self) -> None:
        last = time.monotonic()
        for fault in self.schedule:
            while not self._stop.is_set():
                if self.progress() >= fault.at or time.monotonic() - last > MAX_GAP_S:
                    break
                time.sleep(0.05)
            if self._stop.is_set():
                self.skipped.append(f"{fault.describe()}: the round ended first")
                continue
            try:
                self._inject(fault)
            except Exception as exc:
                log.exception("injecting %s", fault.describe())
                self.skipped.append(f"{fault.describe()}: {type(exc).__name__}: {exc}")
            last = time.monotonic()

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def finish(self, timeout_s: float) -> None:
        """Let the schedule run out (no longer than `timeout_s`), then wait for every heal."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
        for t in list(self._heals):
            t.join(HEAL_RETRY_S + 60)

    # ----------------------------------------------------------------- injection
    def _note(self, text: str) -> None:
        at = time.monotonic() - self._started
        self.events.append(f"{at:7.1f}s {text}")
        log.info("chaos: %s", text)

    def _claim(self, fault: Fault) -> str | None:
        """The fault's target, or the next free one of its kind; None when all are busy."""
        pool: tuple[str, ...] = (fault.target,)
        if fault.kind in (FaultKind.KILL, FaultKind.PAUSE):
            pool = SERVICES
        elif fault.kind in (FaultKind.READER_KILL, FaultKind.READER_PAUSE):
            pool = READERS
        elif fault.kind in (FaultKind.QUEUE_KILL, FaultKind.QUEUE_PAUSE):
            pool = QUEUE_REPLICAS
        start = pool.index(fault.target) if fault.target in pool else 0
        for name in pool[start:] + pool[:start]:
            if self._take(f"link.{name}" if fault.kind is FaultKind.LINK else name):
                return name
        return None

    def _take(self, resource: str) -> bool:
        """Mark `resource` as under a fault (or a remedy); False when it already is."""
        with self._lock:
            if resource in self._busy:
                return False
            self._busy.add(resource)
            return True

    def _release(self, resource: str) -> None:
        with self._lock:
            self._busy.discard(resource)

    def _inject(self, fault: Fault) -> None:
        target = self._claim(fault)
        if target is None:
            self.skipped.append(f"{fault.describe()}: every target busy")
            return
        resource = f"link.{target}" if fault.kind is FaultKind.LINK else target
        self.injected[fault.kind] += 1
        self._note(f"{fault.kind.value} {target} for {fault.duration_s:.1f}s")
        t, k = self.topology, fault.kind
        heal: Callable[[], None]
        if k in (FaultKind.KILL, FaultKind.READER_KILL, FaultKind.QUEUE_KILL):
            t.kill(target)
            heal = lambda: t.restart(target)  # noqa: E731
        elif k in (FaultKind.PAUSE, FaultKind.READER_PAUSE, FaultKind.QUEUE_PAUSE):
            t.pause(target)
            heal = lambda: t.resume(target)  # noqa: E731
        elif k is FaultKind.KAFKA:
            self.stack.kill_kafka()
            heal = self._restart_kafka
        elif k is FaultKind.KAFKA_STALL:
            self.stack.pause_kafka()
            heal = self.stack.resume_kafka
        elif k is FaultKind.REDIS:
            self.stack.kill_redis()
            heal = self._restart_redis
        elif k is FaultKind.REDIS_AOF:
            self.stack.persist_redis()
            self.stack.kill_redis()
            heal = self._restart_redis_on_its_data
        elif k is FaultKind.REDIS_STALL:
            self.stack.pause_redis()
            heal = self.stack.resume_redis
        elif k is FaultKind.LINK:
            t.cut_link(target)
            heal = lambda: t.restore_link(target)  # noqa: E731
        elif k is FaultKind.HOSTILE:
            heal = self._hostile
        else:
            heal = self._zombie
        thread = threading.Thread(
            target=self._heal,
            args=(fault, resource, heal),
            name=f"chaos-heal-{k.value}",
            daemon=True,  # an interrupted run must not wait for it
        )
        self._heals.append(thread)
        thread.start()

    def _heal(self, fault: Fault, resource: str, heal: Callable[[], None]) -> None:
        time.sleep(fault.duration_s)
        try:
            if self._until_done(heal, fault.describe()):
                self._note(f"healed {fault.kind.value} {resource}")
        finally:
            self._release(resource)

    def _until_done(self, action: Callable[[], None], what: str) -> bool:
        """`action`, retried for up to `HEAL_RETRY_S`; False (and a heal failure) after that."""
        deadline = time.monotonic() + HEAL_RETRY_S
        while True:
            try:
                action()
                return True
            except Exception as exc:
                if time.monotonic() > deadline:
                    self.heal_failures.append(f"{what}: {exc}")
                    log.exception("could not heal %s", what)
                    return False
                log.warning("healing %s failed (%s); retrying", what, exc)
                time.sleep(1.0)

    def remedy_kafka(self, why: str) -> bool:
        """Restart the broker on its data for `why`; False while a Kafka fault holds it (that
        fault's heal starts it again anyway, and the watch asks again after it)."""
        if not self._take("kafka"):
            return False
        try:
            self.remedies.append(why)
            self._note(f"remedy: {why}; kafka restarted on its data")
            self.stack.kill_kafka()
            self._until_done(self._restart_kafka, f"remedy for {why}")
            return True
        finally:
            self._release("kafka")

    def _restart_kafka(self) -> None:
        took = self.stack.start_kafka()
        self._note(f"kafka back on its data in {took:.1f}s")

    def _restart_redis(self) -> None:
        self.stack.start_redis()
        self.topology.secure()  # an empty Redis has no ACL users: the instances' plans again

    def _restart_redis_on_its_data(self) -> None:
        self.stack.start_redis(keep_data=True)

    def _hostile(self) -> None:
        t = self.topology
        volley = Volley(t.owner["a"], t.base["b"], t.base["f"].instance, list(self.handles))
        try:
            got = volley.fire()
        except Exception as exc:
            self._note(f"hostile volley not written: {type(exc).__name__}: {exc}")
            raise
        self.refusals += got
        bad = [r for r in got if not r.ok]
        self._note(f"hostile volley: {len(got) - len(bad)}/{len(got)} refused with their code")

    def _zombie(self) -> None:
        owner = self.topology.owner["b"]
        queue = next(q for q in self.topology.catalogs["b"].queues if q.name == TARGET_QUEUE)
        try:
            result = zombie_commit(owner, TARGET_QUEUE, queue.partitions)
        except Exception as exc:
            result = f"skipped: {type(exc).__name__}: {exc}"
        self.zombies.append(result)
        self._note(f"zombie commit: {result}")
