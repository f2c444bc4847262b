"""Every Grafana panel's PromQL returns data from a real Prometheus scraping the running services.

The live test starts the dispatcher, the activation service and the tick-driven shells as child
processes (each with its own metrics port), Debian's `prometheus` scraping them every second, drives
request/reply traffic with activation on the target queue plus a refused request, then queries every
`targets[].expr` of every dashboard under infra/grafana/dashboards through /api/v1/query.

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
from devtools.deployment import Deployment, owner_of, process_settings
from devtools.local_prometheus import Prometheus
from devtools.localstack import free_port
from devtools.runner import REPO_ROOT, ServiceProcess
from ksb.catalog.model import parse_catalog
from ksb.runtime.catalog_store import apply_catalog
from ksb.sdk.client import KsbClient
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
I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    expr: str
    needs_spark: bool

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel}: {self.expr}"


def panel_queries() -> list[PanelQuery]:
    queries = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            needs_spark = "spark" in panel.get("ksbRequires", [])
            for target in panel["targets"]:
                queries.append(PanelQuery(path.stem, panel["title"], target["expr"], needs_spark))
    return queries


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
    for q in panel_queries():
        used = set(_METRIC.findall(q.expr))
        assert used, f"no ksb metric in {q}"
        unknown = used - known - SPARK_METRICS
        assert not unknown, f"{q} names metrics nobody exports: {sorted(unknown)}"
        assert q.needs_spark == bool(used & SPARK_METRICS), (
            f"{q}: tagged needs_spark={q.needs_spark} but uses {sorted(used)}"
        )


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


def _catalog(instance: str) -> dict[str, Any]:
    cat = copy.deepcopy(BASIC_CATALOG)
    for q in cat["queues"]:
        if q["name"] == "TargetQueue":
            q["activation"] = {
                "status": "ON",
                "procedure": "tests.integration.activation_procs:reply",
                "max_queue_readers": 2,
                "execute_as": owner_of(instance),  # the tools' activation host holds its login
            }
    # Two levels in the data: the target side at 8, the initiator's replies at the default 5.
    cat["priorities"] = [{"name": "target-hi", "contract": C, "local_service": T, "level": 8}]
    return cat


@pytest.mark.integration
@pytest.mark.timeout(480)  # the Spark job, when present, takes minutes to show windows
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


def test_every_dashboard_panel_returns_data_from_a_real_prometheus(
    settings: Deployment,
    tmp_path: Path,
    running: list[ServiceProcess | Prometheus | SparkExporter],
) -> None:
    fast = settings.model_copy(
        update={"tick_ms": 500, "activated_idle_ms": 800, "activation_empty_grace_ms": 1000}
    )
    apply_catalog(fast, parse_catalog(_catalog(fast.instance)))
    names = ["dispatcher", "activation"] + [
        n for n in SHELLS if (REPO_ROOT / "services" / n / "__main__.py").exists()
    ]
    ports = {name: free_port() for name in names}
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
    stop_traffic = threading.Event()
    traffic = threading.Thread(target=_traffic, args=(fast, stop_traffic), daemon=True)
    traffic.start()
    queries = panel_queries()
    live = [q for q in queries if not q.needs_spark or spark_running]
    try:
        deadline = time.monotonic() + (300 if spark_running else 30)  # Spark is slow when busy
        failures = [p for q in live if (p := problem(prom, q, need_data=True))]
        while failures and time.monotonic() < deadline:
            time.sleep(1)
            failures = [p for q in live if (p := problem(prom, q, need_data=True))]
    finally:
        stop_traffic.set()
        traffic.join(30)
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
