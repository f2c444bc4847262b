"""Every Grafana panel's PromQL returns data from a real Prometheus scraping the running services.

The live test starts the dispatcher, the queue service, the activation service and the tick-driven
shells as child processes (each with its own metrics port), Debian's `prometheus` scraping them
every second with KSB's alert rules loaded, drives request/reply traffic with activation on the
target queue plus a refused request, dead-letters a message and keeps a reader's transaction open
(a stalled reader) on a queue of their own, then queries every `targets[].expr` of every dashboard
under infra/grafana/dashboards through /api/v1/query, its variables set to the test's instance and
every queue. While the reader stays stalled, the gauges operators look at first must say so, and
every alert rule must evaluate without error (the disabled queue's alert going off).

Panels fed only by the Spark audit job's exporter carry ``"ksbRequires": ["spark"]``. The static
checks below make that tag honest: a panel is tagged exactly when its queries use a Spark metric, and
every metric a panel names is one the services register or one the Spark exporter publishes, so a
typo fails here even when the Spark job does not run. The live test asserts tagged panels whenever
`python -m ksb.spark` exists (it is started too); without it they must still parse in Prometheus.
"""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import prometheus_client
import pytest

import ksb.runtime.metrics  # noqa: F401  (registers the services' metrics in the default registry)
import services.dispatcher.gauges
import services.queue.gauges  # noqa: F401  (their collectors, in the same registry)
from devtools.deployment import Deployment, process_settings
from devtools.local_prometheus import Prometheus
from devtools.localstack import free_port
from devtools.queue_services import with_queues
from devtools.runner import REPO_ROOT, ServiceProcess
from ksb.catalog.model import parse_catalog
from ksb.runtime.catalog_store import apply_catalog
from ksb.sdk.client import KsbClient, Transaction
from ksb.settings import settings_env
from tests.integration.conftest import BASIC_CATALOG
from tests.integration.support import receive_all

DASHBOARDS = REPO_ROOT / "infra" / "grafana" / "dashboards"
SHELLS = ("transmitter", "transport", "forwarder")
SPARK_MAIN = REPO_ROOT / "shared" / "ksb" / "spark" / "__main__.py"
# What `python -m ksb.spark` exports (sample names as Prometheus stores them).
SPARK_METRICS = frozenset(
    {
        "ksb_sla_time_in_queue_ms",
        "ksb_sla_messages",
        "ksb_sla_breaches_total",
        "ksb_audit_inversions_total",
        "ksb_audit_starvation_exceptions_total",
        "ksb_activation_reaction_ms",
    }
)
_METRIC = re.compile(r"\bksb_[a-z0-9_]+\b")
_SELECTOR = re.compile(r"\b(ksb_[a-z0-9_]+)(\{[^}]*\})?")
_LABEL_VALUES = re.compile(r"^label_values\((.+), *([a-z_]+)\)$")
I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    expr: str
    needs_spark: bool

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel}: {self.expr}"


def _set(expr: str, instance: str, queue: str) -> str:
    """`expr` with the dashboards' variables set as Grafana sets them (a regex each)."""
    return expr.replace("$instance", instance).replace("$queue", queue)


def panel_queries(instance: str = ".*", queue: str = ".*") -> list[PanelQuery]:
    """Every panel's query, its variables set (every instance and queue, unless named)."""
    queries = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            needs_spark = "spark" in panel.get("ksbRequires", [])
            for target in panel["targets"]:
                expr = _set(target["expr"], instance, queue)
                queries.append(PanelQuery(path.stem, panel["title"], expr, needs_spark))
    return queries


def variable_queries(instance: str = ".*") -> list[tuple[str, str, str]]:
    """(dashboard, variable, PromQL) for each variable: Grafana's ``label_values(sel, label)``
    as the query that returns the same label values, ``count by (label) (sel)``."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for var in json.loads(path.read_text())["templating"]["list"]:
            match = _LABEL_VALUES.match(var["query"]["query"])
            assert match, f"{path.stem} / {var['name']}: not label_values(...)"
            selector, label = match.groups()
            promql = f"count by ({label}) ({_set(selector, instance, '.*')})"
            out.append((path.stem, var["name"], promql))
    return out


def service_sample_names() -> set[str]:
    """Sample names of every metric `ksb.runtime.metrics` registers, as Prometheus would store them."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "gauge": ("",),
        "summary": ("", "_count", "_sum", "_created"),
    }
    names: set[str] = set()
    for family in prometheus_client.REGISTRY.collect():
        if family.name.startswith("ksb_"):
            names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


# ----------------------------------------------------------------------------- static checks
def test_dashboards_exist_and_every_panel_has_a_prometheus_query() -> None:
    assert sorted(p.stem for p in DASHBOARDS.glob("*.json")) == [
        "activation",
        "overview",
        "priorities",
        "sla",
        "transport",
    ]
    uids = set()
    for path in DASHBOARDS.glob("*.json"):
        dash = json.loads(path.read_text())
        uids.add(dash["uid"])
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), path.name
        for panel in dash["panels"]:
            assert panel["datasource"]["uid"] == "prometheus", panel["title"]
            assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"])
    assert len(uids) == 5


def test_every_panel_metric_is_exported_and_spark_panels_are_tagged_exactly() -> None:
    known = service_sample_names()
    assert "ksb_time_in_queue_seconds_bucket" in known  # the registry walk works
    assert "ksb_queue_oldest_ready_age_seconds" in known  # and finds the services' collectors
    for q in panel_queries():
        used = set(_METRIC.findall(q.expr)) - {"ksb_instance"}
        assert used, f"no ksb metric in {q}"
        unknown = used - known - SPARK_METRICS
        assert not unknown, f"{q} names metrics nobody exports: {sorted(unknown)}"
        assert q.needs_spark == bool(used & SPARK_METRICS), (
            f"{q}: tagged needs_spark={q.needs_spark} but uses {sorted(used)}"
        )


def test_every_dashboard_is_filtered_by_its_variables() -> None:
    """Each dashboard has the instance variable (and the queue one when a panel has queues), and
    every metric each panel reads is selected by them, so picking an instance or a queue changes
    every panel; the overview leads with what operators look at first."""
    for path in sorted(DASHBOARDS.glob("*.json")):
        dash = json.loads(path.read_text())
        variables = [v["name"] for v in dash["templating"]["list"]]
        assert variables[0] == "instance", path.stem
        for panel in dash["panels"]:
            for target in panel["targets"]:
                for name, labels in _SELECTOR.findall(target["expr"]):
                    if name == "ksb_instance":
                        continue
                    assert 'ksb_instance=~"$instance"' in labels, f"{path.stem}: {name}"
                    if name.startswith("ksb_queue_") or 'queue=~"$queue"' in labels:
                        assert "queue" in variables, f"{path.stem}: {name}"
    overview = json.loads((DASHBOARDS / "overview.json").read_text())["panels"]
    first = [p for p in overview if p["gridPos"]["y"] == 0]
    assert [p["title"] for p in first] == [
        "Oldest message age",
        "Messages: ready and locked",
        "Conversation groups: ready and locked",
    ]


# ----------------------------------------------------------------------------- the live check
def problem(prom: Prometheus, q: PanelQuery, *, need_data: bool) -> str | None:
    """Why `q` fails (None if it passes): a parse/eval error, or no finite sample."""
    body = prom.answer(q.expr)
    if body.get("status") != "success":
        return f"{q}: {body.get('errorType')}: {body.get('error')}"
    if not need_data:
        return None
    result = body["data"]["result"]
    if not result:
        return f"{q}: empty result"
    values = [float(r["value"][1]) for r in result]
    if not any(math.isfinite(v) for v in values):
        return f"{q}: only non-finite values {values}"
    return None


class SparkExporter:
    """`python -m ksb.spark` with its exporter on `port` (only when the module exists)."""

    def __init__(self, settings: Deployment, log_path: Path) -> None:
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ksb.spark"],
                cwd=log_path.parent,
                # As the Spark job's own principal (it may write the sla topic; the owner may not).
                env=settings_env(process_settings(settings, "ksb.spark")),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def running() -> Iterator[list[ServiceProcess | Prometheus | SparkExporter]]:
    started: list[ServiceProcess | Prometheus | SparkExporter] = []
    try:
        yield started
    finally:
        for item in reversed(started):
            item.stop()


def _catalog() -> dict[str, Any]:
    cat = copy.deepcopy(BASIC_CATALOG)
    for q in cat["queues"]:
        if q["name"] == "TargetQueue":
            q["activation"] = {
                "status": "ON",
                "procedure": "tests.integration.activation_procs:reply",
                "max_queue_readers": 2,
            }
    # Two levels in the data: the target side at 8, the initiator's replies at the default 5.
    cat["priorities"] = [{"name": "target-hi", "contract": C, "local_service": T, "level": 8}]
    # A queue of its own for the stalled reader and the dead letter (no activation competes for
    # its messages), with an SLA target its stalled message soon passes; and a disabled one.
    cat["queues"] += [
        {"name": "HoldQueue", "partitions": 1, "dead_letter": {"max_rollbacks": 1}},
        {"name": "OffQueue", "partitions": 1, "status": "OFF"},
    ]
    cat["services"] += [
        {"name": HOLD, "queue": "HoldQueue", "contracts": [C]},
        {"name": "//t/Off", "queue": "OffQueue", "contracts": [C]},
    ]
    cat["sla_targets_ms"] = {5: 2_000}
    return cat


HOLD = "//t/Hold"


def _traffic_round(settings: Deployment) -> int:
    """Request/reply through activated readers, and one refused request (an unknown handle)."""
    with KsbClient(settings) as client:
        sent = 0
        for h in [client.begin_dialog(I, T, C) for _ in range(3)]:
            for i in range(2):
                client.send(h, "//t/Request", json.dumps({"i": i}))
                sent += 1
        client.send(f"no-such-handle-{uuid.uuid4().hex[:6]}", "//t/Request", "{}")
        client.flush()
        receive_all(client, "InitiatorQueue", 6, timeout_s=15)
    return sent


def _traffic(settings: Deployment, stop: threading.Event) -> None:
    while not stop.is_set():
        _traffic_round(settings)
        stop.wait(0.5)


def _stall_a_reader(settings: Deployment) -> tuple[KsbClient, Transaction]:
    """Dead-letter one message of HoldQueue (one rollback is its policy's limit), then RECEIVE
    another and leave the transaction open: a reader stalled with its lock held. The caller
    rolls it back."""
    client = KsbClient(settings)
    for body in ("dead", "held"):
        client.send(client.begin_dialog(I, HOLD, C), "//t/Request", json.dumps({"m": body}))
    client.flush()
    tx = client.transaction()
    assert tx.receive("HoldQueue", top=1, waitfor_ms=10_000)
    tx.rollback()
    tx = client.transaction()
    deadline = time.monotonic() + 15
    while not (got := tx.receive("HoldQueue", waitfor_ms=1000)):
        assert time.monotonic() < deadline, "the second message never came"
    assert [json.loads(m.message_body) for m in got] == [{"m": "held"}]
    return client, tx


def _value(prom: Prometheus, expr: str) -> float:
    result = prom.query(expr)
    assert len(result) == 1, f"{expr}: {result}"
    return float(result[0]["value"][1])


def _seen_while_stalled(prom: Prometheus, instance: str, stalled_s: float) -> dict[str, float]:
    """What the gauges say about HoldQueue, the dispatcher and the alerts while the reader is
    stalled: each must say it (asserted here), and the figures go into the test's report."""
    hold = f'{{ksb_instance="{instance}", queue="HoldQueue"}}'
    mine = f'{{ksb_instance="{instance}"}}'
    seen = {
        "oldest age s": _value(prom, f"max(ksb_queue_oldest_ready_age_seconds{hold})"),
        "SLA overdue s": _value(prom, f"max(ksb_queue_sla_overdue_seconds{hold})"),
        "messages": _value(prom, f"max(ksb_queue_messages{hold})"),
        "locked messages": _value(prom, f"sum(ksb_queue_locked_messages{hold})"),
        "locked groups": _value(prom, f"sum(ksb_queue_locked_groups{hold})"),
        "lock held s": _value(prom, f"max(ksb_queue_lock_held_max_seconds{hold})"),
        "dead letters": _value(prom, f"max(ksb_queue_dead_letters{hold})"),
        "drained": _value(prom, f"sum(ksb_queue_drained_total{hold})"),
        "OffQueue disabled": _value(
            prom, f'max(ksb_queue_disabled{{ksb_instance="{instance}", queue="OffQueue"}})'
        ),
        "members": _value(prom, f"count(ksb_dispatcher_owned_shards{mine})"),
        "shards": _value(prom, f"max(ksb_dispatcher_shards{mine})"),
        "shards owned": _value(prom, f"sum(ksb_dispatcher_shard_owned{mine})"),
        "rebalances assigned": _value(
            prom,
            f'sum(ksb_dispatcher_rebalances_total{{ksb_instance="{instance}", kind="assigned"}})',
        ),
        "open txn s": _value(prom, f"max(ksb_dispatcher_txn_open_seconds{mine})"),
    }
    assert seen["oldest age s"] >= stalled_s and seen["lock held s"] >= stalled_s - 2, seen
    assert seen["SLA overdue s"] > 0 and seen["OffQueue disabled"] == 1, seen
    assert seen["messages"] == seen["locked messages"] == seen["locked groups"] == 1, seen
    assert seen["dead letters"] == 1 and seen["drained"] >= 1, seen
    assert seen["members"] == 1 and seen["shards owned"] == seen["shards"] >= 1, seen
    assert seen["rebalances assigned"] >= 1 and seen["open txn s"] < 5, seen
    return seen


@pytest.mark.integration
@pytest.mark.timeout(480)  # the Spark job, when present, takes minutes to show windows
def test_every_dashboard_panel_returns_data_from_a_real_prometheus(
    settings: Deployment,
    tmp_path: Path,
    running: list[ServiceProcess | Prometheus | SparkExporter],
) -> None:
    fast = settings.model_copy(
        update={"tick_ms": 500, "activated_idle_ms": 800, "activation_empty_grace_ms": 1000}
    )
    apply_catalog(fast, parse_catalog(_catalog()))
    # The queue service as a process of its own, with a metrics port, and every client on it.
    queue_port = free_port()
    ports = {"queue": free_port()}
    queue = ServiceProcess(
        "queue",
        fast.model_copy(
            update={
                "metrics_port": ports["queue"],
                "queue_port": queue_port,
                "queue_store_dir": str(tmp_path / "queue-store"),
            }
        ),
        tmp_path / "queue.log",
    ).start()
    running.append(queue)
    queue.wait_ready("listening on")
    fast = with_queues(fast, [f"127.0.0.1:{queue_port}"])
    names = ["dispatcher", "activation"] + [
        n for n in SHELLS if (REPO_ROOT / "services" / n / "__main__.py").exists()
    ]
    ports |= {name: free_port() for name in names}
    procs = []
    for name in names:
        s = fast.model_copy(update={"metrics_port": ports[name]})
        proc = ServiceProcess(name, s, tmp_path / f"{name}.log").start()
        running.append(proc)
        procs.append(proc)
    for proc in procs:
        proc.wait_ready(f"{proc.name} ready")
    spark_running = SPARK_MAIN.exists()
    if spark_running:
        ports["spark"] = free_port()
        spark_settings = fast.model_copy(update={"metrics_port": ports["spark"]})
        running.append(SparkExporter(spark_settings, tmp_path / "spark.log"))

    prom = Prometheus(tmp_path / "prometheus", ports)
    running.append(prom)
    prom.wait_ready()
    prom.wait_targets_up(timeout_s=180 if spark_running else 30)

    # Traffic keeps flowing while the panels are polled: rate() over [1m] turns NaN once a
    # histogram stops moving (an idle dashboard shows the same), so polling after the traffic
    # would fail for the wrong reason.
    assert _traffic_round(fast) == 6
    reader, stalled = _stall_a_reader(fast)
    stalled_at = time.monotonic()
    stop_traffic = threading.Event()
    traffic = threading.Thread(target=_traffic, args=(fast, stop_traffic), daemon=True)
    traffic.start()
    queries = panel_queries(instance=fast.instance)
    live = [q for q in queries if not q.needs_spark or spark_running]
    try:
        deadline = time.monotonic() + (300 if spark_running else 30)  # Spark is slow when busy
        failures = [p for q in live if (p := problem(prom, q, need_data=True))]
        while failures and time.monotonic() < deadline:
            time.sleep(1)
            failures = [p for q in live if (p := problem(prom, q, need_data=True))]
        # The reader has been stalled this long at least; give the gauges two scrapes.
        time.sleep(max(0.0, 8 - (time.monotonic() - stalled_at)))
        stalled_s = time.monotonic() - stalled_at - 2 * prom.scrape_s
        seen = _seen_while_stalled(prom, fast.instance, stalled_s)
        rules = prom.rules()
    finally:
        stalled.rollback()
        reader.close()
        stop_traffic.set()
        traffic.join(30)
    for dashboard, variable, promql in variable_queries(instance=fast.instance):
        values = {v for r in prom.query(promql) for v in r["metric"].values()}
        wanted = {fast.instance} if variable == "instance" else {"HoldQueue", "TargetQueue"}
        assert wanted <= values, f"{dashboard} / ${variable}: {promql} gave {values}"
    broken = [f"{r['name']}: {r.get('lastError')}" for r in rules if r["health"] != "ok"]
    assert len(rules) == 6 and not broken, broken
    disabled = next(r for r in rules if r["name"] == "KsbQueueDisabled")
    assert [a["labels"]["queue"] for a in disabled["alerts"]] == ["OffQueue"], disabled
    print(f"\nwhile a reader was stalled {stalled_s:.1f} s or more: {seen}")
    print("alerts: " + ", ".join(f"{r['name']} {r['state']}" for r in rules))
    # Spark panels without the Spark job: they must still parse and evaluate.
    parse_only = [q for q in queries if q not in live]
    failures += [p for q in parse_only if (p := problem(prom, q, need_data=False))]
    assert not failures, "panels without data:\n" + "\n".join(failures)
    if parse_only:
        print(
            f"\n{len(parse_only)} Spark panel queries parsed but not asserted for data "
            f"({SPARK_MAIN.relative_to(REPO_ROOT)} does not exist):\n"
            + "\n".join(f"  {q}" for q in parse_only)
        )
    assert len(live) + len(parse_only) == len(queries) >= 25
