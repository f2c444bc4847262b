"""One typed settings object, read from the environment (prefix ``KSB_``).

Unknown ``KSB_`` variables fail at start-up with the variable named, so a typo never silently falls
back to a default.
"""

from __future__ import annotations

import os

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from ksb.errors import CatalogError

__all__ = ["Settings", "load_settings", "settings_env"]

_PREFIX = "KSB_"
# Variables that belong to other parts of the toolchain (the local stack, tests), not to a service.
_FOREIGN = {"KSB_KAFKA_LIBS", "KSB_SPARK_JARS"}
# The housekeeping intervals have their own reader, which refuses unknown names itself
# (`ksb.runtime.ticker.Intervals.from_env`).
_INTERVALS_PREFIX = "KSB_INTERVAL_"


class Settings(BaseSettings):
    """Everything a KSB service or client needs to know about its environment."""

    model_config = SettingsConfigDict(env_prefix=_PREFIX, extra="forbid", frozen=True)

    instance: str = Field("local", pattern=r"^[A-Za-z0-9_-]+$")
    kafka_bootstrap: str = "127.0.0.1:9092"
    redis_url: str = "redis://127.0.0.1:6379/0"
    request_partitions: int = Field(1, ge=1)
    max_body_bytes: int = Field(1_048_576, ge=0)
    fragment_bytes: int = Field(262_144, ge=1024)
    """Inbound records longer than this cross instances as fragments (`ksb.wire.fragments`)."""
    transmitter_memory_bytes: int = Field(64 * 1024 * 1024, ge=4096)
    """What the transmitter may hold in memory; beyond it, dialogs wait unclassified (issue 5)."""
    lock_ttl_ms: int = Field(30_000, ge=100)
    txn_timeout_ms: int = Field(10_000, ge=1000)
    batch_max: int = Field(500, ge=1)
    batch_linger_ms: int = Field(5, ge=0)
    fetch_wait_max_ms: int = Field(10, ge=0)
    session_timeout_ms: int = Field(6_000, ge=500)
    leak_idle_s: int = Field(3600, ge=1)
    metrics_port: int = Field(0, ge=0)
    metrics_host: str = "127.0.0.1"
    tick_ms: int = Field(5_000, ge=1)
    activated_idle_ms: int = Field(2_000, ge=0)
    activation_check_ms: int = Field(100, ge=10)
    activation_empty_grace_ms: int = Field(5_000, ge=0)
    poison_rollbacks: int = Field(5, ge=1)
    # The external activator (python -m services.external_activator): its per-queue YAML file.
    external_activator_config: str = ""
    # The Spark audit job (python -m ksb.spark): where it checkpoints and writes, and its windows.
    spark_checkpoint_dir: str = "var/spark/checkpoints"
    spark_master: str = "local[2]"
    spark_driver_host: str = "127.0.0.1"
    spark_output_dir: str = "var/spark"
    spark_window_s: int = Field(10, ge=1)
    spark_watermark_s: int = Field(30, ge=0)
    spark_trigger_s: int = Field(5, ge=1)


def load_settings(**overrides: object) -> Settings:
    """Read settings from ``KSB_*`` variables; refuse unknown ones by name."""
    known = {f"{_PREFIX}{name.upper()}" for name in Settings.model_fields}
    unknown = sorted(
        k
        for k in os.environ
        if k.startswith(_PREFIX)
        and k not in known
        and k not in _FOREIGN
        and not k.startswith(_INTERVALS_PREFIX)
    )
    if unknown:
        raise CatalogError(f"unknown setting(s) in the environment: {', '.join(unknown)}")
    return Settings(**overrides)  # type: ignore[arg-type]


def settings_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment a child process (a service, an activated task) reads `settings` from: the
    parent's variables without its own ``KSB_*`` ones, then one ``KSB_*`` variable per field."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PREFIX)}
    for name, value in settings.model_dump().items():
        env[f"{_PREFIX}{name.upper()}"] = str(value)
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env
