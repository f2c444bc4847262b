"""`python -m services.dispatcher`: run the dispatcher until SIGTERM or SIGINT."""

from __future__ import annotations

from ksb.runtime.service import run_main
from ksb.settings import DispatcherSettings
from services.dispatcher.service import Dispatcher


def main() -> None:
    run_main(lambda: Dispatcher(DispatcherSettings.from_env()), "dispatcher")


if __name__ == "__main__":
    main()
