"""`python -m services.transmitter`: run the transmitter until SIGTERM or SIGINT."""

from __future__ import annotations

from ksb.runtime.service import run_main
from ksb.settings import TransmitterSettings
from services.transmitter.service import Transmitter


def main() -> None:
    run_main(lambda: Transmitter(TransmitterSettings.from_env()), "transmitter")


if __name__ == "__main__":
    main()
