"""The demo's `--keep-running` hint logs the CLI in as each instance's own operator."""

from __future__ import annotations

from pathlib import Path

from devtools.demo.processes import cli_hint
from devtools.deployment import Deployment
from ksb.security.principals import Role, service_principal
from ksb.settings import CliSettings


def _instance(name: str, credentials: Path) -> Deployment:
    return Deployment.model_validate(
        {
            "instance": name,
            "kafka_bootstrap": "127.0.0.1:19092",
            "redis_url": "redis://127.0.0.1:16379/0",
            "kafka_security_protocol": "SASL_PLAINTEXT",
            "credentials_dir": str(credentials),
        }
    )


def _shell(lines: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """The environment a pasted hint gives: the exports, then the second command's with its
    own assignments on top."""
    exported: dict[str, str] = {}
    for line in lines:
        if line.startswith("  export "):
            name, value = line.removeprefix("  export ").split("=", 1)
            exported[name] = value
    second = dict(exported)
    start = next(i for i, line in enumerate(lines) if "second instance" in line)
    for line in lines[start + 1 :]:
        if line.strip().startswith("KSB_"):
            name, value = line.strip().removesuffix(" \\").split("=", 1)
            second[name] = value
    return exported, second


def _assert_operator_of(env: dict[str, str], instance: str, credentials: Path) -> None:
    settings = CliSettings.from_env(env)
    operator = service_principal(instance, Role.OPERATOR)
    kafka_password = str(credentials / f"{operator}.password")
    redis_password = str(credentials / f"{operator}.redis.password")
    assert settings.instance == instance
    assert (settings.kafka_username, settings.redis_username) == (operator, operator)
    assert settings.kafka_password_file == kafka_password
    assert settings.redis_password_file == redis_password  # a principal's two passwords differ


def test_each_instance_is_given_its_own_operators_login(tmp_path: Path) -> None:
    lines = cli_hint(_instance("demo", tmp_path), _instance("demo-b", tmp_path))
    first, second = _shell(lines)
    _assert_operator_of(first, "demo", tmp_path)
    _assert_operator_of(second, "demo-b", tmp_path)
    assert lines[-1] == "  ksb transmission"
