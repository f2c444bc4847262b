"""Prometheus metrics shared by the services, and the /metrics + /healthz endpoint."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, Info, generate_latest

__all__ = [
    "ASYNC_TASK_FAILURES",
    "BROKER_START_FAILURES",
    "BROKER_STATUS",
    "COMMITS",
    "CONNECTIONS",
    "ERRORS",
    "HEALTHY",
    "PURGES",
    "PURGE_REASONS",
    "QUEUE_DEPTH",
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
    "export_transport_defaults",
    "serve_metrics",
]

REQUESTS = Counter("ksb_requests_total", "Requests handled by the dispatcher", ["kind"])
ERRORS = Counter("ksb_errors_total", "Requests refused, with the reason code", ["code"])
COMMITS = Counter("ksb_commits_total", "Reader commits by outcome", ["outcome"])
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
    """Publish a shell's cross-instance gauges as 0: dashboards then show "none", not "no data".

    Labelled series only exist once set. The transmitter sets its own figures on every view
    refresh; the tick-driven shells (transport, forwarder) call this at start-up until they hold
    connections of their own (issue 5).
    """
    CONNECTIONS.labels(component).set(0)
    SUPPRESSED_DESTINATIONS.labels(component).set(0)


JsonRoute = Callable[[], Any]


def serve_metrics(
    port: int, routes: Mapping[str, JsonRoute] | None = None, *, host: str = "127.0.0.1"
) -> int:
    """Serve /metrics, /healthz and the service's JSON views on `host`; port 0 disables it.

    `host` is ``settings.metrics_host``: loopback by default, ``0.0.0.0`` in containers so that
    Prometheus and the health checks can reach it.

    Views (like /monitors and /tasks of the activation service) are callables returning JSON-able
    data, computed per request so they are never stale.
    """
    if port <= 0:
        return 0
    views = dict(routes or {})

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, generate_latest())
            elif path == "/healthz":
                self._reply(200, "application/json", b'{"status": "ok"}')
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

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="ksb-http", daemon=True).start()
    return server.server_address[1]
