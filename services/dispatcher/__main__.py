"""`python -m services.dispatcher`: run the dispatcher until SIGTERM or SIGINT."""

from __future__ import annotations

from ksb.runtime.metrics import serve_metrics
from ksb.runtime.service import configure_logging, stop_on_signals
from ksb.settings import load_settings
from services.dispatcher.service import Dispatcher


def main() -> None:
    configure_logging("dispatcher")
    settings = load_settings()
    stop = stop_on_signals()
    serve_metrics(settings.metrics_port, host=settings.metrics_host)
    Dispatcher(settings).run(stop)


if __name__ == "__main__":
    main()
