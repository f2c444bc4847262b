"""What operators look at first about the dispatchers: who is a member, who owns which shard,
how often shards move, and whether a transaction is stuck open.

Computed when Prometheus scrapes (a collector, not gauges the loop sets), so they stay true while
the loop is stuck: a transaction that does not end shows its age growing, scrape after scrape.
Per member (label ``member``, `DispatcherSettings.member` or the random name a process takes):

* ``ksb_dispatcher_shards``: the instance's shard count as this member sees it (0 until started);
* ``ksb_dispatcher_shard_owned{shard}``: 1 for each shard this member owns, 0 for the others, so
  ``max by (shard)`` over the members is 0 for a shard nobody owns;
* ``ksb_dispatcher_owned_shards``: how many it owns; one series per live member, so counting
  them counts the members;
* ``ksb_dispatcher_txn_open_seconds``: how long the open Kafka transaction has been open (0: none);
* ``ksb_dispatcher_rebalances_total{kind}``: partitions given (``assigned``), taken back
  (``revoked``) or lost when the group fenced the member (``lost``), one per callback (the
  rebalance callbacks in `services.dispatcher.rebalance` call `rebalanced`).

One process may run several dispatchers (the integration tests do), so one collector serves every
member `watch` was given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import Counter
from prometheus_client.core import REGISTRY, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["REBALANCES", "MemberLook", "rebalanced", "unwatch", "watch"]

REBALANCES = Counter(
    "ksb_dispatcher_rebalances",
    "Rebalance callbacks with partitions: assigned, revoked, lost (the member was fenced)",
    ["kind"],
)
for _kind in ("assigned", "revoked", "lost"):
    REBALANCES.labels(_kind)


def rebalanced(kind: str, partitions: Sequence[object]) -> None:
    """Count one rebalance callback of `kind` that moved `partitions` (none: nothing moved)."""
    if partitions:
        REBALANCES.labels(kind).inc()


@dataclass(frozen=True)
class MemberLook:
    """One dispatcher as a scrape sees it."""

    shards: int
    """The instance's shard count (0 while the broker has not started)."""
    owned: frozenset[int]
    txn_open_s: float
    """How long the open transaction has been open; 0 when none is."""


class _Collector(Collector):
    def __init__(self) -> None:
        self.members: dict[str, Callable[[], MemberLook]] = {}
        self.lock = threading.Lock()

    def describe(self) -> list[Metric]:
        return []  # registered before any member runs; nothing to check names against

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            members = list(self.members.items())
        seen = [(member, look()) for member, look in members]
        shards = GaugeMetricFamily(
            "ksb_dispatcher_shards",
            "The instance's shard count (0: not started)",
            labels=["member"],
        )
        owned = GaugeMetricFamily(
            "ksb_dispatcher_shard_owned",
            "1 for each shard the member owns, 0 for the others",
            labels=["member", "shard"],
        )
        count = GaugeMetricFamily(
            "ksb_dispatcher_owned_shards", "Shards the member owns", labels=["member"]
        )
        txn = GaugeMetricFamily(
            "ksb_dispatcher_txn_open_seconds",
            "How long the member's open Kafka transaction has been open (0: none)",
            labels=["member"],
        )
        for member, look in seen:
            shards.add_metric([member], look.shards)
            count.add_metric([member], len(look.owned))
            txn.add_metric([member], look.txn_open_s)
            for shard in range(look.shards):
                owned.add_metric([member, str(shard)], float(shard in look.owned))
        yield from (shards, owned, count, txn)


_COLLECTOR = _Collector()
REGISTRY.register(_COLLECTOR)


def watch(member: str, look: Callable[[], MemberLook]) -> None:
    """Export the member from now on (the dispatcher's `open`)."""
    with _COLLECTOR.lock:
        _COLLECTOR.members[member] = look


def unwatch(member: str) -> None:
    """Stop exporting the member (its `close`)."""
    with _COLLECTOR.lock:
        _COLLECTOR.members.pop(member, None)
