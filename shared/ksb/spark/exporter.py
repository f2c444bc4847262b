"""Prometheus metrics of the audit job: the latest SLA window and the running audit totals.

The job's figures are computed by Spark, not counted in this process, so they are exported by a
custom collector that reports what the last micro-batches said, instead of prometheus-client
Counters that this process would increment: the inversion totals come from Spark's checkpointed state,
so after a restart they carry on from where they were instead of counting again from zero.
Each update is one micro-batch's rows, applied under a lock; a scrape reads a consistent copy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, CollectorRegistry

__all__ = ["METRIC_NAMES", "SlaExporter"]

METRIC_NAMES = (
    "ksb_sla_time_in_queue_ms",
    "ksb_sla_messages",
    "ksb_sla_breaches_total",
    "ksb_audit_inversions_total",
    "ksb_audit_starvation_exceptions_total",
    "ksb_activation_reaction_ms",
)
_QUANTILES = (("0.5", "tiq_p50_ms"), ("0.95", "tiq_p95_ms"), ("0.99", "tiq_p99_ms"))
_FINAL_AFTER_MS = 600_000
"""A window this far behind the newest is final: its breaches are folded into a base total."""


class SlaExporter:
    """A prometheus-client collector fed by the job's foreachBatch sinks."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self._lock = threading.Lock()
        # (queue, service, priority) -> (window start, row) of the newest window seen.
        self._latest: dict[tuple[str, str, int], tuple[int, Mapping[str, Any]]] = {}
        # (queue, priority) -> {(service, window start): breaches}, plus finalized windows' sum.
        self._breaches: dict[tuple[str, int], dict[tuple[str, int], int]] = {}
        self._breach_base: dict[tuple[str, int], int] = {}
        self._inversions: dict[tuple[str, str, int, int], tuple[int, int]] = {}
        self._reaction: dict[str, int] = {}
        self._registry = registry
        if registry is not None:
            registry.register(self)

    def close(self) -> None:
        if self._registry is not None:
            self._registry.unregister(self)
            self._registry = None

    # ----------------------------------------------------------------- updates (foreachBatch)
    def update_sla(self, rows: Iterable[Mapping[str, Any]]) -> None:
        with self._lock:
            for r in rows:
                key = (str(r["queue"]), str(r["service"]), int(r["priority"]))
                start = int(r["window_start_ms"])
                current = self._latest.get(key)
                if current is None or current[0] <= start:
                    self._latest[key] = (start, dict(r))
                per_window = self._breaches.setdefault((key[0], key[2]), {})
                per_window[(key[1], start)] = int(r.get("breaches") or 0)
            self._fold_final_windows()

    def _fold_final_windows(self) -> None:
        for qp, per_window in self._breaches.items():
            if not per_window:
                continue
            newest = max(start for _svc, start in per_window)
            final = [k for k in per_window if k[1] < newest - _FINAL_AFTER_MS]
            for k in final:
                self._breach_base[qp] = self._breach_base.get(qp, 0) + per_window.pop(k)

    def update_ordering(self, rows: Iterable[Mapping[str, Any]]) -> None:
        with self._lock:
            for r in rows:
                if r["row"] == "totals":
                    key = (str(r["queue"]), str(r["kind"]), int(r["high"]), int(r["low"]))
                    self._inversions[key] = (int(r["inversions"]), int(r["starvation_exceptions"]))
                elif r["row"] == "reaction":
                    self._reaction[str(r["queue"])] = int(r["reaction_ms"])

    # ----------------------------------------------------------------- the collector protocol
    def collect(self) -> Iterator[Metric]:
        with self._lock:
            latest = dict(self._latest)
            breaches = {
                qp: self._breach_base.get(qp, 0) + sum(w.values())
                for qp, w in self._breaches.items()
            }
            inversions = dict(self._inversions)
            reaction = dict(self._reaction)
        tiq = GaugeMetricFamily(
            "ksb_sla_time_in_queue_ms",
            "Time in queue of the messages received in the newest SLA window, by quantile",
            labels=["queue", "service", "priority", "quantile"],
        )
        messages = GaugeMetricFamily(
            "ksb_sla_messages",
            "Messages received (committed) in the newest SLA window",
            labels=["queue", "service", "priority"],
        )
        for (queue, service, priority), (_start, r) in sorted(latest.items()):
            labels = [queue, service, str(priority)]
            messages.add_metric(labels, float(r.get("received") or 0))
            for quantile, column in _QUANTILES:
                value = r.get(column)
                if value is not None:
                    tiq.add_metric([*labels, quantile], float(value))
        breach = CounterMetricFamily(
            "ksb_sla_breaches",
            "Received messages whose time in queue exceeded the catalog's target for their level",
            labels=["queue", "priority"],
        )
        for (queue, priority), n in sorted(breaches.items()):
            breach.add_metric([queue, str(priority)], float(n))
        inv = CounterMetricFamily(
            "ksb_audit_inversions",
            "RECEIVEs (kind=receive) or transmissions of a lower level while a higher-level unlocked "
            "group was ready",
            labels=["queue", "kind", "high", "low"],
        )
        starved: dict[str, int] = {}
        for (queue, kind, high, low), (n, s) in sorted(inversions.items()):
            inv.add_metric([queue, kind, str(high), str(low)], float(n))
            starved[queue] = starved.get(queue, 0) + s
        starv = CounterMetricFamily(
            "ksb_audit_starvation_exceptions",
            "Out-of-order takes flagged as starvation-prevention exceptions (not inversions)",
            labels=["queue"],
        )
        for queue, n in sorted(starved.items()):
            starv.add_metric([queue], float(n))
        react = GaugeMetricFamily(
            "ksb_activation_reaction_ms",
            "From the latest activation (task start or QUEUE_ACTIVATION) to the next RECEIVE",
            labels=["queue"],
        )
        for queue, ms in sorted(reaction.items()):
            react.add_metric([queue], float(ms))
        yield from (tiq, messages, breach, inv, starv, react)
