"""`python -m services.dispatcher`: run the dispatcher until SIGTERM or SIGINT."""

from __future__ import annotations

from ksb.runtime.service import run_main
from ksb.settings import DispatcherSettings
from services.dispatcher.service import Dispatcher


def _watched(d: Dispatcher) -> Dispatcher:
    d.watchdog.start()  # a process of its own: it may end itself when a Kafka call is stuck
    return d


def main() -> None:
    run_main(lambda: _watched(Dispatcher(DispatcherSettings.from_env())), "dispatcher")


if __name__ == "__main__":
    main()
