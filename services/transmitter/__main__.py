"""`python -m services.transmitter`: run the transmitter and transport until SIGTERM or SIGINT."""

from __future__ import annotations

from ksb.runtime.service import configure_logging, stop_on_signals
from ksb.runtime.ticker import Intervals
from ksb.settings import load_settings
from services.transmitter.service import Transmitter


def main() -> None:
    configure_logging("transmitter")
    settings = load_settings()
    intervals = Intervals.from_env()
    stop = stop_on_signals()
    Transmitter(settings, intervals=intervals).run(stop)


if __name__ == "__main__":
    main()
