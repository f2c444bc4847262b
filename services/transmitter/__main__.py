"""`python -m services.transmitter`: run the transmitter and transport until SIGTERM or SIGINT."""

from __future__ import annotations

import signal
import threading

from ksb.service import configure_logging
from ksb.settings import load_settings
from ksb.ticker import Intervals
from services.transmitter.service import Transmitter


def main() -> None:
    configure_logging("transmitter")
    settings = load_settings()
    intervals = Intervals.from_env()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _s, _f: stop.set())
    Transmitter(settings, intervals=intervals).run(stop)


if __name__ == "__main__":
    main()
