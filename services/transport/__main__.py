"""`python -m services.transport`: run the transport's periodic timer until SIGTERM or SIGINT."""

from __future__ import annotations

from ksb.metrics import export_transport_defaults
from ksb.service import configure_logging, run_service
from ksb.settings import load_settings


def main() -> None:
    configure_logging("transport")
    export_transport_defaults("transport")  # zeros until issue 5 moves messages
    run_service("transport", load_settings())


if __name__ == "__main__":
    main()
