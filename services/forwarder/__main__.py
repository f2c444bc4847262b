"""`python -m services.forwarder`: run the forwarder's periodic timer until SIGTERM or SIGINT."""

from __future__ import annotations

from ksb.metrics import export_transport_defaults
from ksb.service import configure_logging, run_service
from ksb.settings import load_settings


def main() -> None:
    configure_logging("forwarder")
    export_transport_defaults("forwarder")  # zeros until issue 5 moves messages
    run_service("forwarder", load_settings())


if __name__ == "__main__":
    main()
