"""`python -m services.activation`: run the queue monitors until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import threading

from ksb.metrics import serve_metrics
from ksb.settings import load_settings
from services.activation.service import ActivationService


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s activation %(levelname)s %(message)s"
    )
    settings = load_settings()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    service = ActivationService(settings)
    serve_metrics(
        settings.metrics_port,
        {"/monitors": service.monitors, "/tasks": service.tasks},
        host=settings.metrics_host,
    )
    service.run(stop)


if __name__ == "__main__":
    main()
