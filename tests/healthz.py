"""/healthz served on a free port for a test, and read without raising on 503."""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from ksb.runtime.metrics import metrics_server

__all__ = ["get", "serving_healthz"]


@contextlib.contextmanager
def serving_healthz(component: str) -> Iterator[str]:
    """The URL of /healthz on a server that only judges `component`, as its service serves it."""
    server = metrics_server(0, components=[component])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/healthz"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def get(url: str) -> tuple[int, Any]:
    """Status and JSON body; a 503 is an answer here, not an error."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())
