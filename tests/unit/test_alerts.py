"""KSB's alert rules as files: each is tested, names only what the services export, and both
Prometheus deployments load it.

Whether each rule fires when it should is `promtool test rules` (make test-alerts, run by
`make test`); that they evaluate against what the running services export is
tests/integration/test_dashboards.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import prometheus_client
import yaml

import ksb.runtime.metrics  # noqa: F401  (registers the services' metrics)
import services.dispatcher.gauges
import services.queue.gauges  # noqa: F401
from devtools.local_prometheus import ALERT_RULES

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "infra" / "prometheus"
_METRIC = re.compile(r"\bksb_[a-z0-9_]+\b")


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _rules() -> list[dict[str, Any]]:
    return [rule for group in _load(PROMETHEUS / "alerts.yml")["groups"] for rule in group["rules"]]


def _sample_names() -> set[str]:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
    names: set[str] = set()
    for family in prometheus_client.REGISTRY.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def test_the_issue_s_alerts_are_there() -> None:
    assert {r["alert"] for r in _rules()} == {
        "KsbQueueNotDraining",
        "KsbQueueOldestMessagePastSla",
        "KsbShardWithoutOwner",
        "KsbNoDispatcher",
        "KsbQueueDisabled",
        "KsbDispatcherStuckInTransaction",
    }


def test_every_alert_has_a_promtool_case_where_it_fires() -> None:
    cases = _load(PROMETHEUS / "alerts.test.yml")
    assert cases["rule_files"] == ["alerts.yml"]
    firing = {
        t["alertname"]
        for case in cases["tests"]
        for t in case["alert_rule_test"]
        if t["exp_alerts"]
    }
    assert firing == {r["alert"] for r in _rules()}


def test_every_metric_an_alert_names_is_exported() -> None:
    known = _sample_names()
    for rule in _rules():
        used = set(_METRIC.findall(rule["expr"])) - {"ksb_instance"}
        assert used and used <= known, f"{rule['alert']}: {sorted(used - known)}"
        assert "ksb_instance" in rule["expr"], f"{rule['alert']} must keep the broker instance"


def test_compose_and_the_local_prometheus_load_the_same_rules() -> None:
    config = _load(PROMETHEUS / "prometheus.yml")
    assert config["rule_files"] == ["alerts.yml"]
    volumes = _load(ROOT / "docker-compose.yml")["services"]["prometheus"]["volumes"]
    assert "./infra/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in volumes
    assert "./infra/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in volumes
    assert PROMETHEUS / "alerts.yml" == ALERT_RULES
