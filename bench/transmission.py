"""The transmission scheduler alone (`ksb.transmission.scheduler.TransmissionScheduler`), in process.

No Kafka, no transport: a simulated sender that makes one `next()` decision every ``SLOT_US`` of a
virtual clock, with arrivals at random offsets between decisions, so a message that goes at the
next decision waits between 0 and one slot. The clock runs in microseconds (the scheduler's
``*_ms`` arguments are plain integers; the bound is passed in the same unit) and every figure is
converted back to ms. Three runs over the same clock:

* **idle**: level-10 arrivals only: the wait a level-10 message has with nothing else queued;
* **level-1 saturation** (as in the RECEIVE benchmark): a standing backlog of level-1 messages in
  many conversations, topped up after every decision, and sparse level-10 arrivals; level-10
  waits as a ratio to idle, and the level-1 waits against ``max_wait_ms``;
* **level-10 pressure** (the starvation bound at work): level-10 arrivals in every slot plus a
  trickle of level-1 ones, so level 1 gets almost no share and only the hard maximum wait moves it;
  its maximum wait against ``max_wait_ms`` (the scheduler module proves ``max_wait_ms`` plus one
  slot when arrivals do not outrun the sender; here they do, by the trickle).

And the wall-clock throughput of `next()` draining a backlog, with HONOR_BROKER_PRIORITY on (levels
1 and 10) and off (everything scheduled at 5), best of three interleaved tries each.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from bench.stats import fmt_ms, fmt_x
from ksb.transmission.scheduler import Pending, TransmissionScheduler

__all__ = ["SchedulerOptions", "format_lines", "run_scheduler"]

SLOT_US = 1_000
"""One send decision per simulated millisecond: a sender of 1,000 messages/s."""
_US_PER_MS = 1_000
_TRIES = 3


@dataclass(frozen=True)
class SchedulerOptions:
    slots: int = 60_000
    """Send decisions per run (60 s of simulated time by default)."""
    backlog: int = 5_000
    conversations: int = 500
    high_every: int = 20
    """Under level-1 saturation, a level-10 arrival every this many slots."""
    low_every: int = 100
    """Under level-10 pressure, a level-1 arrival every this many slots."""
    max_wait_ms: int = 10_000
    """The scheduler's starvation bound (its default)."""
    throughput_messages: int = 50_000
    seed: int = 7


class _Sim:
    """One run: a scheduler, a virtual clock in µs, and the waits of what it took, per level."""

    def __init__(self, opts: SchedulerOptions, honor: bool = True) -> None:
        self.s = TransmissionScheduler(honor, max_wait_ms=opts.max_wait_ms * _US_PER_MS)
        self.rng = random.Random(opts.seed)
        self.waits: dict[int, list[int]] = {1: [], 10: []}
        self.waiting = {1: 0, 10: 0}
        self.exceptions = 0
        self._n = 0
        self._seq: dict[str, int] = {}

    def add(self, level: int, conversation: str, at_us: int) -> None:
        seq = self._seq.get(conversation, 0)
        self._seq[conversation] = seq + 1
        self._n += 1
        self.s.add(Pending(f"m{self._n}", conversation, seq, level, "far", at_us))
        self.waiting[level] += 1

    def between(self, slot: int) -> int:
        """A random arrival time after decision ``slot - 1`` and at or before decision ``slot``."""
        return slot * SLOT_US - self.rng.randrange(SLOT_US)

    def decide(self, slot: int) -> None:
        taken = self.s.next(slot * SLOT_US)
        if taken is None:
            return
        level = taken.pending.level
        self.waiting[level] -= 1
        self.waits[level].append(taken.waited_ms)
        self.exceptions += taken.starvation_exception


def _ms(us: list[int]) -> dict[str, Any]:
    if not us:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    ordered = sorted(us)

    def pct(q: float) -> float:
        rank = max(1, -(-len(ordered) * q // 100))
        return ordered[int(rank) - 1] / _US_PER_MS

    return {
        "count": len(ordered),
        "p50_ms": pct(50),
        "p99_ms": pct(99),
        "max_ms": ordered[-1] / _US_PER_MS,
    }


def _idle(opts: SchedulerOptions) -> dict[str, Any]:
    sim = _Sim(opts)
    for slot in range(1, opts.slots // 10 + 1):
        sim.add(10, f"h{slot}", sim.between(slot))
        sim.decide(slot)
    return _ms(sim.waits[10])


def _low_saturation(opts: SchedulerOptions) -> dict[str, Any]:
    sim = _Sim(opts)
    for i in range(opts.backlog):
        sim.add(1, f"l{i % opts.conversations}", 0)
    for slot in range(1, opts.slots + 1):
        if slot % opts.high_every == 0:
            sim.add(10, f"h{slot}", sim.between(slot))
        while sim.waiting[1] < opts.backlog:  # the feeder: keep the level-1 backlog standing
            sim.add(1, f"l{slot % opts.conversations}", sim.between(slot))
        sim.decide(slot)
    return {
        "level10": _ms(sim.waits[10]),
        "level1": _ms(sim.waits[1]),
        "starvation_exceptions": sim.exceptions,
    }


def _high_pressure(opts: SchedulerOptions) -> dict[str, Any]:
    sim = _Sim(opts)
    for slot in range(1, opts.slots + 1):
        sim.add(10, f"h{slot}", sim.between(slot))
        if slot % opts.low_every == 0:
            sim.add(1, f"l{slot}", sim.between(slot))
        sim.decide(slot)
    return {
        "level10": _ms(sim.waits[10]),
        "level1": _ms(sim.waits[1]),
        "level1_left_waiting": sim.waiting[1],
        "starvation_exceptions": sim.exceptions,
    }


def _throughput(opts: SchedulerOptions, honor: bool) -> float:
    """next() calls per wall-clock second, draining a backlog of levels 1 and 10."""
    sim = _Sim(opts, honor)
    n = opts.throughput_messages
    for i in range(n):
        sim.add(10 if i % 2 else 1, f"c{i % opts.conversations}", i)
    now = n * SLOT_US  # after every arrival; nothing is overdue at the default bound
    started = time.perf_counter()
    while sim.s.next(now) is not None:
        pass
    return n / (time.perf_counter() - started)


def run_scheduler(opts: SchedulerOptions) -> dict[str, Any]:
    started = time.monotonic()
    idle = _idle(opts)
    sat = _low_saturation(opts)
    pressure = _high_pressure(opts)
    # Best of a few interleaved tries: a microbenchmark on a shared machine is only ever slowed.
    on = off = 0.0
    for _ in range(_TRIES):
        on, off = max(on, _throughput(opts, True)), max(off, _throughput(opts, False))

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b <= 0 else a / b

    return {
        "what": "TransmissionScheduler alone, in process, simulated clock (no Kafka)",
        "config": {
            "slot_ms": SLOT_US / _US_PER_MS,
            "slots": opts.slots,
            "backlog": opts.backlog,
            "conversations": opts.conversations,
            "high_every_slots": opts.high_every,
            "low_every_slots": opts.low_every,
            "max_wait_ms": opts.max_wait_ms,
            "throughput_messages": opts.throughput_messages,
            "throughput_tries": _TRIES,
        },
        "idle_level10": idle,
        "level1_saturation": {
            **sat,
            "level10_ratio_over_idle": {
                "p50": ratio(sat["level10"]["p50_ms"], idle["p50_ms"]),
                "p99": ratio(sat["level10"]["p99_ms"], idle["p99_ms"]),
            },
        },
        "level10_pressure": pressure,
        "next_per_s": {
            "honor_on": on,
            "honor_off": off,
            "ratio_on_over_off": ratio(on, off),
        },
        "seconds": round(time.monotonic() - started, 2),
    }


def format_lines(j: dict[str, Any]) -> list[str]:
    ms, x = fmt_ms, fmt_x
    cfg, idle, sat, pr, tp = (
        j["config"],
        j["idle_level10"],
        j["level1_saturation"],
        j["level10_pressure"],
        j["next_per_s"],
    )
    return [
        f"  transmission scheduler ALONE (in process, simulated {cfg['slot_ms']:g} ms per send "
        f"decision, {cfg['slots']:,} decisions, max_wait_ms {cfg['max_wait_ms']:,}):",
        f"    level-10 wait idle p50 {ms(idle['p50_ms'])}, p99 {ms(idle['p99_ms'])}; under a "
        f"standing level-1 backlog of {cfg['backlog']:,}: p50 {ms(sat['level10']['p50_ms'])} "
        f"({x(sat['level10_ratio_over_idle']['p50'])}), p99 {ms(sat['level10']['p99_ms'])} "
        f"({x(sat['level10_ratio_over_idle']['p99'])}); level-1 max wait "
        f"{ms(sat['level1']['max_ms'])} (p50 {ms(sat['level1']['p50_ms'])})",
        f"    level-10 in every slot + level 1 every {cfg['low_every_slots']} slots: level-1 max "
        f"wait {ms(pr['level1']['max_ms'])} vs bound {cfg['max_wait_ms']:,} ms "
        f"({pr['starvation_exceptions']:,} starvation exceptions), level-10 p99 "
        f"{ms(pr['level10']['p99_ms'])}",
        f"    next() throughput (best of {cfg['throughput_tries']}): honor on {tp['honor_on']:,.0f}/s, off {tp['honor_off']:,.0f}/s "
        f"({x(tp['ratio_on_over_off'])})",
    ]
