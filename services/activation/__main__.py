"""`python -m services.activation`: run the queue monitors until SIGTERM or SIGINT."""

from __future__ import annotations

from ksb.runtime.service import run_main
from ksb.settings import ActivationSettings
from services.activation.service import ActivationService


def main() -> None:
    run_main(lambda: ActivationService(ActivationSettings.from_env()), "activation")


if __name__ == "__main__":
    main()
