"""`python -m services.forwarder`: run the forwarder until SIGTERM or SIGINT."""

from __future__ import annotations

from ksb.runtime.service import configure_logging, stop_on_signals
from ksb.runtime.ticker import Intervals
from ksb.settings import load_settings
from services.forwarder.service import Forwarder


def main() -> None:
    configure_logging("forwarder")
    settings = load_settings()
    intervals = Intervals.from_env()
    stop = stop_on_signals()
    Forwarder(settings, intervals=intervals).run(stop)


if __name__ == "__main__":
    main()
