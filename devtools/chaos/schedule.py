"""A round's fault schedule, drawn from its seed: which fault, on what, when, for how long.

Faults are placed by progress, not by the clock (a loaded machine would otherwise put every fault
before or after the traffic): each fires once the round has delivered its share ``at`` of the
replies A expects, or `MAX_GAP_S` after the previous one if progress stalls. A round's first faults
are one of each kind, in a seeded order, so every round exercises every kind when it has as many
faults as there are kinds; the rest are drawn by weight. Targets are named here too
(`Topology` maps a name to its process), so a seed replays the same schedule; what the processes
happen to be doing when it hits is not reproducible.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "MAX_GAP_S",
    "QUEUE_REPLICAS",
    "READERS",
    "SERVICES",
    "Fault",
    "FaultKind",
    "draw_schedule",
]


class FaultKind(str, Enum):
    KILL = "kill"
    """SIGKILL of a service process, started again after ``duration_s``."""
    PAUSE = "pause"
    """SIGSTOP of a service process for ``duration_s`` (longer than the lock TTL), then SIGCONT."""
    QUEUE_KILL = "qkill"
    """SIGKILL of a queue service replica: its clients go on on the other one, the locks it
    handed out expire by their lease (none outlives `lock_ttl_ms` unrenewed)."""
    QUEUE_PAUSE = "qpause"
    """SIGSTOP of a queue service replica, past the lock TTL: its calls fail by their keepalive
    and move to the other replica."""
    READER_KILL = "rkill"
    READER_PAUSE = "rpause"
    KAFKA = "kafka"
    """kill -9 of the Kafka broker, restarted on the same data after ``duration_s``."""
    KAFKA_STALL = "kstall"
    """The broker SIGSTOPped: every connection to it stalls (a stalled network on loopback)."""
    REDIS = "redis"
    """kill -9 of Redis, restarted empty after ``duration_s`` (its ACL users applied again)."""
    REDIS_AOF = "raof"
    """kill -9 of Redis with its append-only file on (turned on just before), restarted on its
    data: the locks, fences and lease counters survive, as in a deployment with persistence."""
    REDIS_STALL = "rstall"
    LINK = "link"
    """The link between A and B cut: one side's direct route points at an address where nothing
    listens for ``duration_s``, then is restored (two catalog versions)."""
    HOSTILE = "hostile"
    """A volley of hostile and malformed records, one of every class, written as an application
    of A and as B's transport (`devtools.chaos.hostile`): each must be refused with its code."""
    ZOMBIE = "zombie"
    """A reader's commit delayed past its lease while a newer holder commits the same group:
    the dispatcher must refuse it (fencing token)."""


_WEIGHTS: dict[FaultKind, int] = {
    FaultKind.KILL: 6,
    FaultKind.PAUSE: 4,
    FaultKind.QUEUE_KILL: 2,
    FaultKind.QUEUE_PAUSE: 2,
    FaultKind.READER_KILL: 3,
    FaultKind.READER_PAUSE: 3,
    FaultKind.KAFKA: 1,
    FaultKind.KAFKA_STALL: 1,
    FaultKind.REDIS: 1,
    FaultKind.REDIS_AOF: 1,
    FaultKind.REDIS_STALL: 1,
    FaultKind.LINK: 2,
    FaultKind.ZOMBIE: 2,
    FaultKind.HOSTILE: 1,
}

SERVICES = (
    "a.d1",
    "a.d2",
    "a.q1",
    "a.q2",
    "a.transmitter",
    "a.transport",
    "a.activation",
    "b.d1",
    "b.d2",
    "b.q1",
    "b.q2",
    "b.transmitter",
    "b.transport",
    "b.activation",
    "f.forwarder",
)
"""The service processes of a round (instance, process), in start order: the queue replicas
before the activation service, which looks at the queues through them."""
QUEUE_REPLICAS = tuple(name for name in SERVICES if name.split(".")[1].startswith("q"))
"""The queue service replicas, two per instance that RECEIVEs."""
READERS = ("a.r1", "a.r2", "b.r1", "b.r2")
"""The reader processes: two on A's initiator queue, two on B's target queue."""
_LINKS = ("a", "b")
"""Whose direct route a LINK cut rewrites."""
MAX_GAP_S = 20.0


@dataclass(frozen=True)
class Fault:
    at: float
    """The share of the round's replies delivered when it fires (0..1)."""
    kind: FaultKind
    target: str
    """A process name (`SERVICES`, `READERS`), ``a``/``b`` for a link, ``kafka``, ``redis``."""
    duration_s: float

    def describe(self) -> str:
        return f"{self.kind.value} {self.target} {self.duration_s:.1f}s @{self.at:.2f}"


def _target(kind: FaultKind, rng: random.Random) -> str:
    if kind in (FaultKind.KILL, FaultKind.PAUSE):
        return rng.choice(SERVICES)
    if kind in (FaultKind.READER_KILL, FaultKind.READER_PAUSE):
        return rng.choice(READERS)
    if kind in (FaultKind.QUEUE_KILL, FaultKind.QUEUE_PAUSE):
        return rng.choice(QUEUE_REPLICAS)
    if kind is FaultKind.LINK:
        return rng.choice(_LINKS)
    if kind in (FaultKind.KAFKA, FaultKind.KAFKA_STALL):
        return "kafka"
    if kind in (FaultKind.REDIS, FaultKind.REDIS_AOF, FaultKind.REDIS_STALL):
        return "redis"
    if kind is FaultKind.HOSTILE:
        return "a"
    return "b"  # a zombie commit on B's target queue


def _duration(kind: FaultKind, lock_ttl_s: float, rng: random.Random) -> float:
    if kind in (FaultKind.PAUSE, FaultKind.READER_PAUSE, FaultKind.QUEUE_PAUSE):
        return lock_ttl_s + rng.uniform(1.0, 5.0)  # longer than the lock TTL
    if kind in (FaultKind.KAFKA_STALL, FaultKind.REDIS_STALL, FaultKind.LINK):
        return rng.uniform(3.0, 8.0)
    if kind in (FaultKind.KAFKA, FaultKind.REDIS, FaultKind.REDIS_AOF):
        return rng.uniform(0.5, 3.0)
    if kind in (FaultKind.ZOMBIE, FaultKind.HOSTILE):
        return 0.0
    return rng.uniform(0.0, 3.0)  # a killed process is started again after this


def draw_schedule(
    seed: int,
    faults: int,
    *,
    lock_ttl_s: float,
    kinds: tuple[FaultKind, ...] = tuple(FaultKind),
) -> list[Fault]:
    """`faults` faults of `kinds` for the round with `seed`, in firing order."""
    rng = random.Random(seed ^ 0x5EED)
    first = list(kinds)
    rng.shuffle(first)
    chosen = first[:faults]
    weights = [_WEIGHTS[k] for k in kinds]
    chosen += rng.choices(kinds, weights, k=max(0, faults - len(chosen)))
    # Spread over the traffic: a point in each equal slice between 5 % and 90 % of it.
    span = 0.85 / max(1, faults)
    out = []
    for i, kind in enumerate(chosen):
        at = 0.05 + span * (i + rng.random() * 0.8)
        out.append(Fault(round(at, 3), kind, _target(kind, rng), _duration(kind, lock_ttl_s, rng)))
    return out
