"""Prometheus metrics shared by the services, and the /metrics + /healthz endpoint."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

__all__ = [
    "COMMITS",
    "ERRORS",
    "HEALTHY",
    "QUEUE_DEPTH",
    "REQUESTS",
    "RUNNABLE_GROUPS",
    "TASKS_RUNNING",
    "TASKS_STARTED",
    "TXN_SECONDS",
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


def serve_metrics(port: int) -> int:
    """Serve /metrics on 127.0.0.1; port 0 disables it. Returns the port used."""
    if port <= 0:
        return 0
    start_http_server(port, addr="127.0.0.1")
    return port
