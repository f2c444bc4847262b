"""`python -m services.forwarder`: run the forwarder until SIGTERM or SIGINT."""

from __future__ import annotations

from ksb.runtime.service import run_main
from ksb.settings import ForwarderSettings
from services.forwarder.service import Forwarder


def main() -> None:
    run_main(lambda: Forwarder(ForwarderSettings.from_env()), "forwarder")


if __name__ == "__main__":
    main()
