"""The Spark audit job on real Kafka: crafted events with known answers, restart, and real events.

One SparkSession for the whole session (a cold start costs ~10 s or more); each test uses its own
instance (topics) and its own checkpoint and output folders, and runs the queries with
trigger(availableNow=True) so that they stop once the topic is read.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from confluent_kafka import Producer
from prometheus_client import CollectorRegistry

from devtools.deployment import Deployment
from ksb.audit import KafkaAudit
from ksb.catalog.model import Catalog
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.kafka import client_security
from ksb.sdk.client import KsbClient
from ksb.security.principals import ADMIN, Role
from ksb.spark.report import load_outputs
from ksb.wire.audit import AuditEvent, AuditKind
from tests.conftest import Stack

from .conftest import ThreadDispatcher

pytestmark = [pytest.mark.integration, pytest.mark.spark]

WINDOW_MS = 10_000


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from ksb.spark.session import build_session

    session = build_session("ksb-audit-tests")
    try:
        yield session
    finally:
        session.stop()


def _job(
    spark: Any, settings: Deployment, tmp: Path, registry: CollectorRegistry, **kw: Any
) -> Any:
    from ksb.spark.exporter import SlaExporter
    from ksb.spark.job import AuditJob, JobConfig

    config = JobConfig(
        instance=settings.instance,
        bootstrap=settings.kafka_bootstrap,
        checkpoint_dir=tmp / "checkpoints",
        output_dir=tmp / "out",
        window_s=WINDOW_MS // 1000,
        **kw,
    ).logged_in(settings.as_service(Role.SPARK))
    return AuditJob(spark, config, exporter=SlaExporter(registry))


def _topics(settings: Deployment) -> None:
    names = Names(settings.instance)
    kafka.ensure_topics(
        kafka.admin(settings), [kafka.TopicSpec(names.audit, 1), kafka.TopicSpec(names.sla, 1)]
    )


def _produce(settings: Deployment, events: list[AuditEvent]) -> None:
    """Odd-numbered runs of five events one record each (as the SDK writes them), even-numbered
    runs as batch records (as the dispatcher does): the job must read both, in order. Written
    as the stack's admin: only KSB's services may write the audit topic."""
    admin = settings.as_principal(ADMIN)
    login = client_security(admin, admin.kafka_bootstrap)
    p = Producer(
        {"bootstrap.servers": settings.kafka_bootstrap, "enable.idempotence": True, **login}
    )
    audit = KafkaAudit(p, Names(settings.instance))
    for n, start in enumerate(range(0, len(events), 5)):
        run = events[start : start + 5]
        if n % 2:
            for e in run:
                audit.emit(e)
        else:
            audit.emit_batch(run)
    assert p.flush(30) == 0


def _latest(rows: list[dict[str, Any]], *key: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Update-mode rows: the newest batch's row per key is the current figure."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: r["batch_id"]):
        out[tuple(r[k] for k in key)] = r
    return out


class Events:
    """Crafted audit events for one instance, on a fixed window-aligned clock."""

    def __init__(self, instance: str, base_ms: int) -> None:
        self.instance = instance
        self.t = base_ms

    def __call__(self, kind: AuditKind, queue: str, **fields: Any) -> AuditEvent:
        self.t += 1
        return AuditEvent(kind=kind, event_ms=self.t, instance=self.instance, queue=queue, **fields)


def test_inversions_starvation_and_sla_percentiles_with_restart(
    spark: Any, settings: Deployment, tmp_path: Path
) -> None:
    _topics(settings)
    base = (int(time.time() * 1000) // WINDOW_MS) * WINDOW_MS
    e = Events(settings.instance, base)
    q = "Ordered"
    first = [
        e("enqueue", q, group="low", priority=3, service="//s"),
        e("enqueue", q, group="high", priority=8, service="//s"),
        e("enqueue", q, group="mid", priority=5, service="//s"),
        # Known inversion: level 3 taken while the unlocked level-8 group is ready.
        e("receive", q, group="low", priority=3, reader="r1"),
        e("commit", q, group="low", priority=3, service="//s", time_in_queue_ms=5),
        # A starvation-prevention exception: out of order on purpose, counted apart.
        e("receive", q, group="mid", priority=5, reader="r1", starvation_exception=True),
        e("commit", q, group="mid", priority=5, service="//s", time_in_queue_ms=6),
        e("receive", q, group="high", priority=8, reader="r2"),
        e("commit", q, group="high", priority=8, service="//s", time_in_queue_ms=7),
    ]
    # SLA: ten messages at level 5 with time in queue 10..100 ms; the target for 5 is 75 ms.
    s = "Timed"
    for i in range(1, 11):
        first.append(e("enqueue", s, group=f"g{i}", priority=5, service="//svc"))
        first.append(
            e(
                "commit",
                s,
                group=f"g{i}",
                priority=5,
                service="//svc",
                time_in_queue_ms=10 * i,
                end_to_end_ms=10 * i + 1,
            )
        )
    first.append(e("purge", s, group="gone", priority=5, service="//svc"))
    _produce(settings, first)

    registry = CollectorRegistry()
    started = time.monotonic()
    _job(spark, settings, tmp_path, registry, sla_targets_ms={5: 75}).run_available_now(120)
    first_run_s = time.monotonic() - started

    out = load_outputs(tmp_path / "out")
    windows = _latest(out["ordering"], "row", "queue", "kind", "high", "low", "window_start_ms")
    inv = {
        k[3:5]: (r["inversions"], r["starvation_exceptions"])
        for k, r in windows.items()
        if k[0] == "inversions" and k[1] == q
    }
    assert inv == {(8, 3): (1, 0), (8, 5): (0, 1)}

    sla = _latest(out["sla"], "queue", "service", "priority", "window_start_ms")
    timed = sla[(s, "//svc", 5, base)]
    assert (timed["enqueued"], timed["received"], timed["purged"]) == (10, 10, 1)
    assert (timed["tiq_p50_ms"], timed["tiq_p95_ms"], timed["tiq_p99_ms"]) == (50, 100, 100)
    assert timed["e2e_p50_ms"] == 51
    assert timed["breaches"] == 3 and timed["target_ms"] == 75

    value = registry.get_sample_value
    assert (
        value(
            "ksb_audit_inversions_total", {"queue": q, "kind": "receive", "high": "8", "low": "3"}
        )
        == 1
    )
    assert value("ksb_audit_starvation_exceptions_total", {"queue": q}) == 1
    assert value("ksb_sla_breaches_total", {"queue": s, "priority": "5"}) == 3
    assert (
        value(
            "ksb_sla_time_in_queue_ms",
            {"queue": s, "service": "//svc", "priority": "5", "quantile": "0.95"},
        )
        == 100
    )
    assert value("ksb_sla_messages", {"queue": s, "service": "//svc", "priority": "5"}) == 10

    # Restart from the checkpoints with new events: the old ones are not counted again, the state
    # (ready groups, open windows) carries on.
    second = [
        e("enqueue", q, group="x", priority=9, service="//s"),
        e("enqueue", q, group="y", priority=1, service="//s"),
        e("receive", q, group="y", priority=1, reader="r3"),
        # Still ready from the first run? No: "low", "mid" and "high" were committed; only x is.
        e("enqueue", s, group="g11", priority=5, service="//svc"),
        e("commit", s, group="g11", priority=5, service="//svc", time_in_queue_ms=110),
    ]
    _produce(settings, second)
    fresh_registry = CollectorRegistry()
    started = time.monotonic()
    _job(spark, settings, tmp_path, fresh_registry, sla_targets_ms={5: 75}).run_available_now(120)
    second_run_s = time.monotonic() - started

    out = load_outputs(tmp_path / "out")
    totals = _latest(out["ordering"], "row", "queue", "kind", "high", "low")
    got = {
        k[3:5]: (r["inversions"], r["starvation_exceptions"])
        for k, r in totals.items()
        if k[0] == "totals" and k[1] == q
    }
    assert got == {(8, 3): (1, 0), (8, 5): (0, 1), (9, 1): (1, 0)}
    sla = _latest(out["sla"], "queue", "service", "priority", "window_start_ms")
    timed = sla[(s, "//svc", 5, base)]
    assert (timed["enqueued"], timed["received"], timed["breaches"]) == (11, 11, 4)
    # A new process's exporter learns the running totals from the checkpointed state.
    value = fresh_registry.get_sample_value
    assert (
        value(
            "ksb_audit_inversions_total", {"queue": q, "kind": "receive", "high": "8", "low": "3"}
        )
        == 1
    )
    assert (
        value(
            "ksb_audit_inversions_total", {"queue": q, "kind": "receive", "high": "9", "low": "1"}
        )
        == 1
    )
    print(f"spark audit: first run {first_run_s:.1f} s, restart {second_run_s:.1f} s")


def test_dispatcher_events_produce_sla_rows(
    spark: Any,
    settings: Deployment,
    catalog: Catalog,
    dispatcher: ThreadDispatcher,
    client: KsbClient,
    stack: Stack,
    tmp_path: Path,
) -> None:
    n = 5
    for _ in range(n):
        h = client.begin_dialog("//t/Initiator", "//t/Target", "//t/Contract")
        client.send(h, "//t/Request", '{"n": 1}')
    client.flush()
    received = 0
    deadline = time.monotonic() + 60
    while received < n and time.monotonic() < deadline:
        with client.transaction() as tx:
            received += len(tx.receive("TargetQueue", waitfor_ms=1000))
    assert received == n
    client.wait_idle()
    _topics(settings)

    _job(spark, settings, tmp_path, CollectorRegistry()).run_available_now(120)

    out = load_outputs(tmp_path / "out")
    sla = [r for r in out["sla"] if r["queue"] == "TargetQueue"]
    latest = _latest(sla, "queue", "service", "priority", "window_start_ms")
    assert sum(r["received"] for r in latest.values()) == n
    assert sum(r["enqueued"] for r in latest.values()) == n
    assert sum(r["receives"] for r in latest.values()) >= 1
    assert all(
        r["tiq_p50_ms"] is not None and r["tiq_p50_ms"] >= 0
        for r in latest.values()
        if r["received"]
    )
    assert any(r["e2e_p50_ms"] is not None for r in latest.values() if r["received"])
    backlog = [r for r in out["ordering"] if r["row"] == "backlog" and r["queue"] == "TargetQueue"]
    assert backlog and backlog[-1]["ready_messages"] == 0
