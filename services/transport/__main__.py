"""`python -m services.transport`: run the transport until SIGTERM or SIGINT."""

from __future__ import annotations

from ksb.runtime.service import run_main
from ksb.settings import TransportSettings
from services.transport.service import Transport


def main() -> None:
    run_main(lambda: Transport(TransportSettings.from_env()), "transport")


if __name__ == "__main__":
    main()
