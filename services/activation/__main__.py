"""`python -m services.activation`: run the queue monitors until SIGTERM or SIGINT."""

from __future__ import annotations

from ksb.runtime.metrics import serve_metrics
from ksb.runtime.service import configure_logging, stop_on_signals
from ksb.settings import load_settings
from services.activation.service import ActivationService


def main() -> None:
    configure_logging("activation")
    settings = load_settings()
    stop = stop_on_signals()
    service = ActivationService(settings)
    serve_metrics(
        settings.metrics_port,
        {"/monitors": service.monitors, "/tasks": service.tasks},
        host=settings.metrics_host,
    )
    service.run(stop)


if __name__ == "__main__":
    main()
