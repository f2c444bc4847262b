"""Settings from the environment: one model per process, typos and foreign variables refused by name,
every interval of the seeds a field with the broker's default."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from devtools.deployment import SERVICE_SETTINGS, Deployment
from ksb.runtime.kafka import producer_conf
from ksb.settings import (
    ClientSettings,
    DispatcherSettings,
    ForwarderSettings,
    KsbSettings,
    ServiceSettings,
    SettingsError,
    TransmitterSettings,
    TransportSettings,
)

ROOT = Path(__file__).resolve().parents[2]


def test_a_misspelt_setting_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KSB_INSTANSE", "x")
    with pytest.raises(SettingsError, match="KSB_INSTANSE"):
        ClientSettings.from_env()


def test_a_setting_of_another_service_is_refused_by_name() -> None:
    env = {"KSB_TICK_MS": "250", "KSB_TRANSMITTER_MEMORY_BYTES": "1048576"}
    assert TransmitterSettings.from_env(env).transmitter_memory_bytes == 1_048_576
    with pytest.raises(SettingsError, match="KSB_TRANSMITTER_MEMORY_BYTES"):
        DispatcherSettings.from_env(env)


def test_the_intervals_follow_the_broker_by_default() -> None:
    assert ServiceSettings().tick_ms == 5000
    assert DispatcherSettings().inbound_stale_ms == 10_000
    transport = TransportSettings()
    assert transport.suppress_after_disconnect_ms == 15_000
    assert transport.suppress_after_failed_connect_ms == 60_000
    assert transport.idle_connection_ms == 90_000
    assert ForwarderSettings().forwarder_stale_ms == 60_000


def test_from_env_reads_each_field_and_keeps_defaults_for_unset_ones() -> None:
    env = {
        "KSB_TICK_MS": "100",
        "KSB_SUPPRESS_AFTER_DISCONNECT_MS": "300",
        "KSB_SUPPRESS_AFTER_FAILED_CONNECT_MS": "400",
        "KSB_IDLE_CONNECTION_MS": "600",
        "UNRELATED": "x",
    }
    s = TransportSettings.from_env(env)
    assert (s.tick_ms, s.suppress_after_disconnect_ms) == (100, 300)
    assert (s.suppress_after_failed_connect_ms, s.idle_connection_ms) == (400, 600)
    assert s.packet_ttl_ms == TransportSettings().packet_ttl_ms


def test_from_env_uses_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KSB_IDLE_CONNECTION_MS", "1234")
    assert TransportSettings.from_env().idle_connection_ms == 1234


def test_tooling_variables_do_not_stop_a_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KSB_KAFKA_LIBS", "/somewhere")
    assert DispatcherSettings.from_env().tick_ms == 5000


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "1.5"])
def test_a_bad_value_fails_naming_the_variable(raw: str) -> None:
    with pytest.raises(SettingsError, match="KSB_TICK_MS") as caught:
        DispatcherSettings.from_env({"KSB_TICK_MS": raw})
    assert caught.value.code == "invalid_setting"


def test_narrow_hands_a_process_the_variables_its_model_reads() -> None:
    deployment = Deployment(instance="i1", lock_renew_ms=1500, max_body_bytes=10, tick_ms=50)
    dispatcher = deployment.narrow(DispatcherSettings)
    assert (dispatcher.instance, dispatcher.max_body_bytes, dispatcher.tick_ms) == ("i1", 10, 50)
    assert deployment.narrow(ClientSettings).lock_renew_ms == 1500
    with pytest.raises(SettingsError, match="KSB_TICK_MS"):
        deployment.narrow(DispatcherSettings, tick_ms=0)


def _attributes_read(folder: Path) -> set[str]:
    """Every `x.<name>` attribute read in the Python files under `folder`."""
    names: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
    return names


@pytest.mark.parametrize("module", sorted(SERVICE_SETTINGS))
def test_every_setting_of_a_process_is_read_somewhere(module: str) -> None:
    """An unused setting is impossible: each field of each process's model is read in the code."""
    read = _attributes_read(ROOT / "shared") | _attributes_read(ROOT / "services")
    model: type[KsbSettings] = SERVICE_SETTINGS[module]
    unread = sorted(name for name in model.model_fields if name not in read)
    assert not unread, f"{model.__name__} has fields no code reads: {unread}"


def test_every_producer_compresses_as_the_setting_says() -> None:
    plain = {"KSB_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT"}
    assert producer_conf(ClientSettings.from_env(plain))["compression.type"] == "lz4"
    zstd = ClientSettings.from_env({**plain, "KSB_KAFKA_COMPRESSION": "zstd"})
    assert producer_conf(zstd, transactional_id="t")["compression.type"] == "zstd"
    with pytest.raises(SettingsError, match="KSB_KAFKA_COMPRESSION"):
        ClientSettings.from_env({"KSB_KAFKA_COMPRESSION": "brotli"})
