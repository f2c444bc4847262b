"""`python -m services.queue`: run one replica of the queue service until SIGTERM or SIGINT."""

from __future__ import annotations

from ksb.runtime.service import run_main
from ksb.settings import QueueServiceSettings
from services.queue.service import QueueService


def main() -> None:
    run_main(lambda: QueueService(QueueServiceSettings.from_env()), "queue")


if __name__ == "__main__":
    main()
