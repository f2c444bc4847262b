"""`python -m services.transmitter`: run the transmitter's timer until SIGTERM or SIGINT."""

from __future__ import annotations

from ksb.service import configure_logging, run_service
from ksb.settings import load_settings


def main() -> None:
    configure_logging("transmitter")
    run_service("transmitter", load_settings())


if __name__ == "__main__":
    main()
