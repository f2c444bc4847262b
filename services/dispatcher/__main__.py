"""`python -m services.dispatcher`: run the dispatcher until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import threading

from ksb.metrics import serve_metrics
from ksb.settings import load_settings
from services.dispatcher.service import Dispatcher


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s dispatcher %(levelname)s %(message)s"
    )
    settings = load_settings()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve_metrics(settings.metrics_port, host=settings.metrics_host)
    Dispatcher(settings).run(stop)


if __name__ == "__main__":
    main()
