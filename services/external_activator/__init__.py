"""The external activator: runs a configured reader command per queue on activation events."""

from services.external_activator.service import ActivatorWorker, ReaderSupervisor, build_app

__all__ = ["ActivatorWorker", "ReaderSupervisor", "build_app"]
