"""`python -m services.external_activator`: follow activation events until SIGTERM or SIGINT.

Reads the per-queue commands from the YAML file named by ``KSB_EXTERNAL_ACTIVATOR_CONFIG``. The
faust worker owns the event loop and the signal handlers; the reader commands are stopped when the
worker stops and, as a backstop, when it returns or fails.
"""

from __future__ import annotations

import tempfile

import ksb.runtime.kafka as kafka
from ksb.activation.external import ActivationPlanner, load_config
from ksb.backoff import Backoff
from ksb.names import Names
from ksb.runtime.metrics import serve_metrics
from ksb.runtime.service import configure_logging
from ksb.settings import ExternalActivatorSettings, SettingsError
from services.external_activator.service import ActivatorWorker, ReaderSupervisor, build_app


def activation_partitions(settings: ExternalActivatorSettings) -> int:
    """Create the activation topic if missing (as the activation service would) and count it."""
    names = Names(settings.instance)
    admin = kafka.admin(settings)
    spec = next(t for t in kafka.core_topics(names, settings) if t.name == names.activation)
    kafka.ensure_topics(admin, [spec])
    meta = admin.list_topics(names.activation, timeout=10).topics[names.activation]
    return len(meta.partitions)


def main() -> None:
    configure_logging("external_activator")
    settings = ExternalActivatorSettings.from_env()
    configure_logging("external_activator", settings.log_format, {"instance": settings.instance})
    if not settings.external_activator_config:
        raise SettingsError("KSB_EXTERNAL_ACTIVATOR_CONFIG names no file")
    planner = ActivationPlanner(
        load_config(settings.external_activator_config),
        settings.instance,
        backoff=Backoff(initial_ms=settings.restart_initial_ms, max_ms=settings.restart_max_ms),
    )
    supervisor = ReaderSupervisor(settings, planner)
    serve_metrics(
        settings.metrics_port,
        {"/readers": supervisor.view},
        host=settings.metrics_host,
        instance=settings.instance,
    )
    partitions = activation_partitions(settings)
    with tempfile.TemporaryDirectory(prefix="ksb-external-activator-") as datadir:
        app = build_app(settings, supervisor, partitions=partitions, datadir=datadir)
        # Our log format, not faust's; no banner; print() stays print().
        worker = ActivatorWorker(
            app,
            supervisor,
            loglevel="info",
            quiet=True,
            override_logging=False,
            redirect_stdouts=False,
        )
        try:
            worker.execute_from_commandline()
        finally:
            supervisor.close()


if __name__ == "__main__":
    main()
