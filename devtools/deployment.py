"""One broker instance's variables as a deployment holds them: what the tools start services from.

A compose file (or a `.env` file) holds every ``KSB_*`` variable of an instance in one place, and
each service reads the part its own settings model knows. `Deployment` is that place for the tools
that start a whole instance on this machine (the demo, the benchmarks, the tests): one object with
every field of every service's model, which each process receives narrowed to its own model
(`KsbSettings.narrow`, `SERVICE_SETTINGS`), so what a test starts is what a deployment runs.
"""

from __future__ import annotations

from devtools.processes import REPO_ROOT
from ksb.settings import (
    ActivatedTaskSettings,
    ActivationSettings,
    CliSettings,
    DispatcherSettings,
    ExternalActivatorSettings,
    ForwarderSettings,
    KsbSettings,
    SparkSettings,
    TransmitterSettings,
    TransportSettings,
)

__all__ = ["SERVICE_SETTINGS", "Deployment", "settings_model"]


class Deployment(
    DispatcherSettings,
    TransmitterSettings,
    TransportSettings,
    ForwarderSettings,
    ActivationSettings,
    ExternalActivatorSettings,
    SparkSettings,
    CliSettings,
    ActivatedTaskSettings,
):
    """Every variable of one broker instance (a tool's view; no service reads this model)."""

    spark_jars: str = str(REPO_ROOT / ".cache" / "spark" / "jars")
    """Where `make` fetched the connector, wherever a tool starts the job from."""


SERVICE_SETTINGS: dict[str, type[KsbSettings]] = {
    "services.dispatcher": DispatcherSettings,
    "services.transmitter": TransmitterSettings,
    "services.transport": TransportSettings,
    "services.forwarder": ForwarderSettings,
    "services.activation": ActivationSettings,
    "services.external_activator": ExternalActivatorSettings,
    "ksb.spark": SparkSettings,
    "ksb.activation.activated": ActivatedTaskSettings,
}
"""The settings model each runnable module reads (`python -m <module>`)."""


def settings_model(module: str) -> type[KsbSettings]:
    """The model `python -m module` reads its settings with."""
    try:
        return SERVICE_SETTINGS[module]
    except KeyError:
        raise KeyError(f"no settings model known for module {module!r}") from None
