"""`python -m services.forwarder`: run the forwarder until SIGTERM or SIGINT."""

from __future__ import annotations

import signal
import threading

from ksb.service import configure_logging
from ksb.settings import load_settings
from ksb.ticker import Intervals
from services.forwarder.service import Forwarder


def main() -> None:
    configure_logging("forwarder")
    settings = load_settings()
    intervals = Intervals.from_env()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _s, _f: stop.set())
    Forwarder(settings, intervals=intervals).run(stop)


if __name__ == "__main__":
    main()
