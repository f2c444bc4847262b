"""What operators look at first about a queue, exported by the queue service, which holds it.

Every figure is computed when Prometheus scrapes (a collector, not gauges set by the loop), from
the replica's indexes and the locks it took, so each stays true while readers are stalled: the
age of the oldest message grows every second nobody receives it, a lock held by a reader that
hangs ages with it, and a queue nobody reads still shows its backlog.

Per queue and replica (label ``replica``, the replica's name; ``ksb_instance`` comes with every
sample, `ksb.runtime.metrics`):

* ``ksb_queue_messages`` and ``ksb_queue_groups``: unreceived messages, and the groups they are
  in, as the replica's index holds them (every replica holds all: take the max);
* ``ksb_queue_locked_groups`` and ``ksb_queue_locked_messages``: the groups whose locks this
  replica took and still counts held, and their messages (each lock is one replica's: take the
  sum). Ready = messages - locked;
* ``ksb_queue_oldest_ready_age_seconds``: how long ago the oldest unreceived message was enqueued
  (0 when there is none), locked groups included: it is the queue's age;
* ``ksb_queue_sla_overdue_seconds``: how far the oldest message of a priority level is past
  that level's target in the catalog's ``sla_targets_ms`` (the worst level; 0 when none is past,
  or the catalog sets no target);
* ``ksb_queue_lock_held_max_seconds``: how long the oldest lock this replica took has been held;
* ``ksb_queue_drained_total``: messages that left the queue (received, purged, dead-lettered)
  since the replica started, its first read of the topics included;
* ``ksb_queue_disabled``: 1 while the catalog has the queue's STATUS OFF (poison messages, or
  ALTER QUEUE);
* ``ksb_queue_dead_letters``: the messages in the queue's dead-letter topic
  (`services.queue.dead_letters`).

One process may run several replicas (the integration tests do), so one collector serves every
replica that `watch` was given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ksb.clock import Clock
from ksb.queue.held import HeldLocks
from services.queue.queues import Queues

__all__ = ["QueueGauges", "unwatch", "watch"]

LABELS = ("queue", "replica")


@dataclass(frozen=True)
class QueueGauges:
    """Where one replica's figures come from."""

    replica: str
    queues: Queues
    held: HeldLocks
    """Read under ``queues.cond``, as the replica's calls write it."""
    clock: Clock
    disabled: Callable[[], Collection[str]]
    """The queues the newest catalog has STATUS OFF."""
    dead_letters: Callable[[], Mapping[str, int]]
    sla_targets_ms: Callable[[], Mapping[int, int]]
    """The catalog's time-in-queue target per priority level."""


@dataclass(frozen=True)
class Look:
    """One queue as one replica sees it at a scrape."""

    queue: str
    messages: int
    groups: int
    locked_groups: int
    locked_messages: int
    oldest_age_s: float
    sla_overdue_s: float
    lock_held_max_s: float
    drained: int
    disabled: bool
    dead_letters: int


def looks(g: QueueGauges) -> list[Look]:
    """Every queue the replica serves, under one hold of its lock (a scrape every few seconds
    costs each queue's lanes and this replica's own locks, not its backlog)."""
    now = g.clock.now_ms()
    disabled, dead, targets = set(g.disabled()), g.dead_letters(), g.sla_targets_ms()
    out = []
    with g.queues.cond:
        taken = g.held.taken_since(now)
        for fold in g.queues.folds():
            index = fold.index
            mine = taken.get(fold.queue, {})
            locked = [group for group in mine if index.has_group(group)]
            oldest = index.oldest_ready_ms()
            by_level = index.oldest_ready_by_level() if targets else {}
            overdue_ms = max(
                (now - since - targets[lv] for lv, since in by_level.items() if lv in targets),
                default=0,
            )
            out.append(
                Look(
                    queue=fold.queue,
                    messages=index.ready_messages,
                    groups=index.ready_groups,
                    locked_groups=len(locked),
                    locked_messages=sum(index.group_size(group) for group in locked),
                    oldest_age_s=0.0 if oldest is None else max(0, now - oldest) / 1000,
                    sla_overdue_s=max(0, overdue_ms) / 1000,
                    lock_held_max_s=max((now - s for s in mine.values()), default=0) / 1000,
                    drained=fold.drained,
                    disabled=fold.queue in disabled,
                    dead_letters=dead.get(fold.queue, 0),
                )
            )
    return out


_GAUGES: tuple[tuple[str, str, Callable[[Look], float]], ...] = (
    ("ksb_queue_messages", "Unreceived messages, locked groups' included", lambda q: q.messages),
    ("ksb_queue_groups", "Conversation groups with unreceived messages", lambda q: q.groups),
    (
        "ksb_queue_locked_groups",
        "Groups whose locks this replica took and counts held (sum over replicas)",
        lambda q: q.locked_groups,
    ),
    (
        "ksb_queue_locked_messages",
        "Unreceived messages in the groups this replica holds locks on (sum over replicas)",
        lambda q: q.locked_messages,
    ),
    (
        "ksb_queue_oldest_ready_age_seconds",
        "Age of the oldest unreceived message (0: none), locked groups' included",
        lambda q: q.oldest_age_s,
    ),
    (
        "ksb_queue_sla_overdue_seconds",
        "How far the oldest message of a level is past the catalog's SLA target (0: none)",
        lambda q: q.sla_overdue_s,
    ),
    (
        "ksb_queue_lock_held_max_seconds",
        "How long the oldest lock this replica took has been held (0: none)",
        lambda q: q.lock_held_max_s,
    ),
    ("ksb_queue_disabled", "1 while the queue's STATUS is OFF", lambda q: float(q.disabled)),
    (
        "ksb_queue_dead_letters",
        "Messages in the queue's dead-letter topic (what `ksb dlq list` shows)",
        lambda q: q.dead_letters,
    ),
)


class _Collector(Collector):
    def __init__(self) -> None:
        self.replicas: dict[str, QueueGauges] = {}
        self.lock = threading.Lock()

    def describe(self) -> list[Metric]:
        return []  # registered before any replica runs; nothing to check names against

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            replicas = list(self.replicas.values())
        seen = [(g.replica, looks(g)) for g in replicas]
        for name, doc, value in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            for replica, queues in seen:
                for q in queues:
                    family.add_metric([q.queue, replica], value(q))
            yield family
        drained = CounterMetricFamily(
            "ksb_queue_drained",
            "Messages that left the queue (received, purged, dead-lettered) since the replica "
            "started, its first read of the topic included",
            labels=LABELS,
        )
        for replica, queues in seen:
            for q in queues:
                drained.add_metric([q.queue, replica], q.drained)
        yield drained


_COLLECTOR = _Collector()
REGISTRY.register(_COLLECTOR)


def watch(gauges: QueueGauges) -> None:
    """Export `gauges`' replica from now on (the service's `open`)."""
    with _COLLECTOR.lock:
        _COLLECTOR.replicas[gauges.replica] = gauges


def unwatch(replica: str) -> None:
    """Stop exporting the replica (its `close`)."""
    with _COLLECTOR.lock:
        _COLLECTOR.replicas.pop(replica, None)
