"""Prometheus metrics shared by the services, and the /metrics + /healthz endpoint.

/healthz is what docker-compose's health checks (and any orchestrator) ask, so it must say "no"
while a service is up but not doing its job: a dispatcher whose broker has not started keeps its
process alive and retries, and a 200 would hide exactly that. A component reports itself unhealthy
in two ways, both per component so every service gets the rule without its own endpoint code:

* its `HEALTHY` gauge (``ksb_service_up``) is 0: starting, stopping or stopped;
* a health check it registered (`register_health_check`) returns a reason: the one line that
  /healthz answers with, so an operator reading ``docker inspect`` sees why, not only that.

The decision is the pure `health_problems`; `process_health` feeds it from this process.

/metrics labels every sample with the process's broker instance, ``ksb_instance`` (not
``instance``, which Prometheus gives each target it scrapes): one Prometheus watches several
instances (`make run` runs two), and dashboards and alert rules pick one by it
(`InstanceLabelled`). The registry itself stays unlabelled, so code and tests read their own
metrics as they were set.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

__all__ = [
    "ASYNC_TASK_FAILURES",
    "BROKER_START_FAILURES",
    "BROKER_STATUS",
    "COMMITS",
    "CONNECTIONS",
    "ERRORS",
    "HEALTHY",
    "INSTANCE_LABEL",
    "POISON_RECORDS",
    "PURGES",
    "PURGE_REASONS",
    "QUEUE_DEPTH",
    "RELAYED",
    "REQUESTS",
    "RUNNABLE_GROUPS",
    "SUPPRESSED_DESTINATIONS",
    "TASKS_RUNNING",
    "TASKS_STARTED",
    "TASK_HANDLERS",
    "TASK_HANDLER_RESTARTS",
    "TIME_IN_QUEUE",
    "TRANSMISSION_DEPTH",
    "TXN_SECONDS",
    "WAITING_READERS",
    "Children",
    "HealthCheck",
    "InstanceLabelled",
    "export_transport_defaults",
    "health_problems",
    "metrics_server",
    "process_health",
    "register_health_check",
    "serve_metrics",
    "unregister_health_check",
]

log = logging.getLogger("ksb.runtime.metrics")


class Children:
    """A one-label metric's children by label value, made once: on a hot path `labels()`
    (which checks and joins its arguments every call) costs more than the increment."""

    def __init__(self, metric: Counter) -> None:
        self._metric = metric
        self._children: dict[str, Counter] = {}

    def __getitem__(self, value: str) -> Counter:
        child = self._children.get(value)
        if child is None:
            child = self._children[value] = self._metric.labels(value)
        return child


REQUESTS = Counter("ksb_requests_total", "Requests handled by the dispatcher", ["kind"])
ERRORS = Counter("ksb_errors_total", "Requests refused, with the reason code", ["code"])
RELAYED = Counter(
    "ksb_relayed_total",
    "Work another dispatcher handed over, applied by the owner of its shard",
    ["kind"],
)
COMMITS = Counter("ksb_commits_total", "Reader commits by outcome", ["outcome"])
POISON_RECORDS = Counter(
    "ksb_poison_records_total",
    "Records set aside because their transaction failed alone (refused, or skipped)",
    ["outcome"],
)
TXN_SECONDS = Histogram(
    "ksb_dispatcher_txn_seconds",
    "Dispatcher transaction duration (one batch of requests)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
QUEUE_DEPTH = Gauge("ksb_queue_depth", "Messages waiting in a queue", ["queue"])
HEALTHY = Gauge("ksb_service_up", "1 while the service loop runs", ["service"])
RUNNABLE_GROUPS = Gauge(
    "ksb_queue_runnable_groups",
    "Conversation groups with ready messages and no lock holder: work a new reader could do",
    ["queue"],
)
TASKS_RUNNING = Gauge("ksb_activated_tasks", "Activated tasks running for a queue", ["queue"])
TASKS_STARTED = Counter("ksb_activations_total", "Activated tasks started", ["queue"])
WAITING_READERS = Gauge(
    "ksb_queue_waiting_readers", "Sessions waiting in RECEIVE without WHERE", ["queue"]
)
TIME_IN_QUEUE = Histogram(
    "ksb_time_in_queue_seconds",
    "Time from enqueue to the commit that received the message (dispatcher clock)",
    ["queue", "priority"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
PURGES = Counter(
    "ksb_purges_total",
    "Messages that left a queue unreceived (reason: conversation_closed, dead_letter)",
    ["queue", "reason"],
)
PURGE_REASONS = ("conversation_closed", "dead_letter")
TRANSMISSION_DEPTH = Gauge(
    "ksb_transmission_queue_depth",
    "Messages waiting in the transmission queue, per assigned priority level (transmitter)",
    ["priority"],
)
CONNECTIONS = Gauge(
    "ksb_transport_connections", "Open connections to remote broker instances", ["component"]
)
SUPPRESSED_DESTINATIONS = Gauge(
    "ksb_suppressed_destinations",
    "Destinations whose retries are suppressed until their deadline",
    ["component"],
)

TASK_HANDLERS = Gauge(
    "ksb_task_handlers", "Task handlers running for a service's async tasks", ["service"]
)
TASK_HANDLER_RESTARTS = Counter(
    "ksb_task_handler_restarts_total",
    "Task handlers found dead (or never started) on a tick and restarted",
    ["service"],
)
ASYNC_TASK_FAILURES = Counter(
    "ksb_async_task_failures_total",
    "Async tasks that raised; logged, and their handler went on",
    ["service"],
)
BROKER_START_FAILURES = Counter(
    "ksb_broker_start_failures_total",
    "Failed broker start attempts, by reason code (retried every 5th tick)",
    ["service", "code"],
)
BROKER_STATUS = Info(
    "ksb_broker", "The broker's state and, while it is not started, the reason", ["service"]
)


def export_transport_defaults(component: str) -> None:
    """Publish a service's cross-instance gauges as 0: dashboards then show "none", not "no data".

    Labelled series only exist once set; the transport sets its own on every view refresh, the
    forwarder calls this at start-up (it counts producers as they open).
    """
    CONNECTIONS.labels(component).set(0)
    SUPPRESSED_DESTINATIONS.labels(component).set(0)


HealthCheck = Callable[[], str | None]
"""Returns None while its component is healthy, otherwise why not (one line, for people)."""

NOT_UP = "ksb_service_up is 0 (starting, stopping or stopped)"
"""The reason given for a component whose gauge is 0 and whose check (if any) says nothing more."""

_checks: dict[str, HealthCheck] = {}
_checks_lock = threading.Lock()


def register_health_check(component: str, check: HealthCheck) -> None:
    """Make /healthz ask `check` about `component` (one check per component; the newest wins)."""
    with _checks_lock:
        _checks[component] = check


def unregister_health_check(component: str, check: HealthCheck) -> None:
    """Forget `check`, unless another one has replaced it since (a newer instance's)."""
    with _checks_lock:
        if _checks.get(component) == check:
            del _checks[component]


def health_problems(up: Mapping[str, float], reasons: Mapping[str, str | None]) -> dict[str, str]:
    """Component -> why it is unhealthy, for each one whose gauge is 0 or whose check objects.

    A component without a gauge sample has not said anything yet and counts as healthy unless its
    check objects; the check's reason is preferred to the gauge's because it says why.
    """
    problems: dict[str, str] = {}
    for component in sorted(up.keys() | reasons.keys()):
        reason = reasons.get(component)
        if reason:
            problems[component] = reason
        elif up.get(component, 1.0) == 0:
            problems[component] = NOT_UP
    return problems


def process_health(components: Collection[str] | None = None) -> dict[str, str]:
    """`health_problems` of this process's components (all of them, or only `components`).

    A check that raises reports the exception as its reason: a broken check must not pass.
    """
    up = {s.labels["service"]: s.value for family in HEALTHY.collect() for s in family.samples}
    with _checks_lock:
        checks = dict(_checks)
    if components is not None:
        wanted = set(components)
        up = {c: v for c, v in up.items() if c in wanted}
        checks = {c: fn for c, fn in checks.items() if c in wanted}
    return health_problems(up, {c: _ask(c, fn) for c, fn in checks.items()})


def _ask(component: str, check: HealthCheck) -> str | None:
    try:
        return check()
    except Exception as exc:
        log.exception("health check of %s raised", component)
        return f"health check raised {type(exc).__name__}: {exc}"


def _healthz_reply(problems: Mapping[str, str]) -> tuple[int, bytes]:
    if not problems:
        return 200, b'{"status": "ok"}'
    return 503, json.dumps({"status": "unhealthy", "problems": dict(problems)}).encode()


JsonRoute = Callable[[], Any]

INSTANCE_LABEL = "ksb_instance"


class InstanceLabelled(Collector):
    """The default registry's samples, each with ``ksb_instance`` added: what /metrics serves."""

    def __init__(self, instance: str) -> None:
        self.instance = instance

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for family in REGISTRY.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [
                s._replace(labels={**s.labels, INSTANCE_LABEL: self.instance})
                for s in family.samples
            ]
            yield labelled


def _exposition(instance: str | None) -> Callable[[], bytes]:
    if instance is None:
        return lambda: generate_latest(REGISTRY)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(InstanceLabelled(instance))
    return lambda: generate_latest(registry)


def serve_metrics(
    port: int,
    routes: Mapping[str, JsonRoute] | None = None,
    *,
    host: str = "127.0.0.1",
    components: Collection[str] | None = None,
    instance: str | None = None,
) -> int:
    """Serve /metrics, /healthz and the service's JSON views on `host`; port 0 disables it.

    `host` is ``settings.metrics_host``: loopback by default, ``0.0.0.0`` in containers so that
    Prometheus and the health checks can reach it.

    Views (like /monitors and /tasks of the activation service) are callables returning JSON-able
    data, computed per request so they are never stale.

    /healthz answers 200 ``{"status": "ok"}``, or 503 with ``{"status": "unhealthy", "problems":
    {component: reason}}`` while a component reports itself unhealthy (`process_health`).
    `components` limits that to some components; None means every component of the process, which
    in production is one service. `instance` is the broker instance every sample is labelled
    with (``ksb_instance``); None serves the samples as they are.
    """
    if port <= 0:
        return 0
    server = metrics_server(port, routes, host=host, components=components, instance=instance)
    threading.Thread(target=server.serve_forever, name="ksb-http", daemon=True).start()
    return server.server_address[1]


def metrics_server(
    port: int,
    routes: Mapping[str, JsonRoute] | None = None,
    *,
    host: str = "127.0.0.1",
    components: Collection[str] | None = None,
    instance: str | None = None,
) -> ThreadingHTTPServer:
    """The server `serve_metrics` runs, bound (port 0: any free port) but not yet serving.

    For callers that own its life (tests): ``serve_forever`` in a thread, then ``shutdown``.
    """
    views = dict(routes or {})
    only = None if components is None else frozenset(components)
    exposition = _exposition(instance)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, exposition())
            elif path == "/healthz":
                code, body = _healthz_reply(process_health(only))
                self._reply(code, "application/json", body)
            elif path in views:
                body = json.dumps(views[path](), default=str).encode()
                self._reply(200, "application/json", body)
            else:
                self._reply(404, "application/json", b'{"error": "not found"}')

        def _reply(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return

    return ThreadingHTTPServer((host, port), Handler)
