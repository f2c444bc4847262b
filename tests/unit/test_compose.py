"""docker-compose.yml: `docker compose config` where a Docker client exists, and YAML-level checks.

The YAML checks need no Docker: every service under services/ runs in the compose file, and every
long-running container has a health check, a restart policy and (for KSB services) its metrics port
on the container network, which is what Prometheus scrapes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.compose_env import env_name
from devtools.compose_env import main as compose_env_main
from devtools.deployment import MODULE_ROLES, settings_model
from ksb.security.principals import Role
from ksb.settings import CliSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def _service_packages() -> list[str]:
    return sorted(p.parent.name for p in (ROOT / "services").glob("*/__main__.py"))


def _docker_compose_works() -> str | None:
    """None if `docker compose` is usable, else why not."""
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    probe = subprocess.run(
        ["docker", "compose", "version"], capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        return f"`docker compose version` failed: {(probe.stderr or probe.stdout).strip()}"
    return None


def test_docker_compose_config_is_valid() -> None:
    reason = _docker_compose_works()
    if reason is not None:
        pytest.skip(f"docker compose unavailable ({reason}); the YAML checks still run")
    result = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_every_service_package_runs_in_compose() -> None:
    services = _compose()["services"]
    for name in _service_packages():
        assert name in services, f"services/{name} has no compose service"
        assert services[name]["command"] == ["python", "-m", f"services.{name}"]
    assert services["spark"]["command"] == ["python", "-m", "ksb.spark"]
    for infra in ("kafka", "redis", "prometheus", "grafana"):
        assert infra in services


def test_every_long_running_service_has_a_healthcheck_and_restart_policy() -> None:
    for name, svc in _compose()["services"].items():
        if svc.get("restart") == "no":
            continue  # one-shot jobs (catalog-init) run to completion
        check = svc.get("healthcheck") or {}
        assert not check.get("disable"), f"{name}: health check disabled"
        assert check.get("test"), f"{name}: no health check"
        assert svc.get("restart") in ("always", "unless-stopped", "on-failure"), name


def test_ksb_services_serve_healthz_and_metrics_on_the_network() -> None:
    compose = _compose()
    services = compose["services"]
    for name in [*_service_packages(), "spark"]:
        svc = services[name]
        env = svc["environment"]
        assert env["KSB_METRICS_HOST"] == "0.0.0.0", name
        port = env["KSB_METRICS_PORT"]
        assert f"127.0.0.1:{port}/healthz" in " ".join(svc["healthcheck"]["test"]), name
        assert {"kafka", "redis"} <= set(svc["depends_on"]), name
    assert set(compose["volumes"]) >= {
        "kafka-data",
        "redis-data",
        "prometheus-data",
        "grafana-data",
    }


def test_prometheus_scrapes_every_ksb_service_and_the_spark_exporter() -> None:
    services = _compose()["services"]
    prom = yaml.safe_load((ROOT / "infra/prometheus/prometheus.yml").read_text())
    targets = {
        t
        for job in prom["scrape_configs"]
        for sc in job.get("static_configs", [])
        for t in sc["targets"]
    } | {
        f"{name}:{sd['port']}"
        for job in prom["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
        for name in sd["names"]
    }
    for name in [*_service_packages(), "spark"]:
        port = services[name]["environment"]["KSB_METRICS_PORT"]
        assert f"{name}:{port}" in targets, name


def test_grafana_provisions_the_dashboards_and_the_datasource() -> None:
    grafana = _compose()["services"]["grafana"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    assert mounts["./infra/grafana/provisioning"] == "/etc/grafana/provisioning"
    dash_dir = mounts["./infra/grafana/dashboards"]
    provider = yaml.safe_load((ROOT / "infra/grafana/provisioning/dashboards/ksb.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == dash_dir
    ds = yaml.safe_load(
        (ROOT / "infra/grafana/provisioning/datasources/prometheus.yaml").read_text()
    )
    assert ds["datasources"][0]["uid"] == "prometheus"
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    dashboards = sorted(p.stem for p in (ROOT / "infra/grafana/dashboards").glob("*.json"))
    assert dashboards == ["activation", "overview", "priorities", "sla", "transport"]


def test_every_ksb_container_reads_exactly_its_own_settings() -> None:
    """What a container's environment holds, its process's settings model reads (no unknown or
    foreign KSB_* variable would stop it at start-up)."""
    for svc in _compose()["services"].values():
        command = svc.get("command") or []
        if command[:2] == ["python", "-m"]:
            model = settings_model(command[2])
        elif command[:1] == ["ksb"]:
            model = CliSettings
        else:
            continue  # not a KSB process (Kafka, Redis, Spark, Prometheus, Grafana)
        env = {k: _interpolated(str(v)) for k, v in (svc.get("environment") or {}).items()}
        model.from_env(env)  # raises, naming the variable, on anything the model does not read


def _interpolated(value: str) -> str:
    """Compose's `${VAR:-default}` as compose fills it in when VAR is unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def _ksb_containers() -> dict[str, tuple[str, dict[str, str]]]:
    """Container -> (its module, its environment as compose fills it in) for KSB services."""
    out = {}
    for name, svc in _compose()["services"].items():
        command = svc.get("command") or []
        if command[:2] == ["python", "-m"]:
            env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
            out[name] = (command[2], env)
    return out


def test_each_ksb_container_logs_in_as_its_own_principal_with_its_own_password() -> None:
    seen: dict[str, str] = {}
    for name, (module, env) in _ksb_containers().items():
        role = MODULE_ROLES[module]
        principal = f"ksb-local-{role.value}"
        assert _interpolated(env["KSB_KAFKA_USERNAME"]) == principal, name
        variable = re.fullmatch(r"\$\{(PASSWORD_\w+):\?[^}]*\}", env["KSB_KAFKA_PASSWORD"])
        assert variable is not None, f"{name}: the password comes from .env"
        assert seen.setdefault(variable.group(1), name) == name, f"{name} shares a password"
        assert variable.group(1) == env_name(role.value), name
        if "KSB_REDIS_USERNAME" in env:  # the same principal in Redis
            assert _interpolated(env["KSB_REDIS_USERNAME"]) == principal, name
            assert env["KSB_REDIS_PASSWORD"] == env["KSB_KAFKA_PASSWORD"], name
        assert env["KSB_KAFKA_SECURITY_PROTOCOL"] != "PLAINTEXT", name
    for svc in _compose()["services"].values():
        assert "env_file" not in svc, "each container gets its own secrets, not the whole file"


def test_security_init_and_the_catalog_run_as_admin_and_operator() -> None:
    services = _compose()["services"]
    init = {k: str(v) for k, v in services["security-init"]["environment"].items()}
    CliSettings.from_env({k: _interpolated(v) for k, v in init.items() if k.startswith("KSB_")})
    assert init["KSB_KAFKA_USERNAME"] == init["KSB_REDIS_USERNAME"] == "admin"
    script = (ROOT / "infra/compose/security-init.sh").read_text()
    assert "ksb acl apply" in script
    for role in Role:  # every principal's password is there to be stored
        assert env_name(role.value) in init, role
    catalog = services["catalog-init"]["environment"]
    assert _interpolated(str(catalog["KSB_KAFKA_USERNAME"])) == "ksb-local-operator"
    for name in _ksb_containers():
        assert services[name]["depends_on"]["security-init"] == {
            "condition": "service_completed_successfully"
        }, name


def test_kafka_and_redis_refuse_whoever_has_no_login() -> None:
    script = (ROOT / "infra/compose/kafka.sh").read_text()
    for line in (
        "allow.everyone.if.no.acl.found=false",
        "super.users=User:broker;User:admin",
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "sasl.enabled.mechanisms=SCRAM-SHA-512",
        "listener.security.protocol.map=INTERNAL:SASL_PLAINTEXT,HOST:SASL_PLAINTEXT,"
        "CONTROLLER:SASL_PLAINTEXT",
    ):
        assert line in script, line
    assert "PLAINTEXT:PLAINTEXT" not in script
    redis = " ".join(_compose()["services"]["redis"]["command"])
    assert "user default off" in redis and "--aclfile" in redis


def test_every_password_compose_asks_for_is_generated(tmp_path: Path) -> None:
    out = tmp_path / ".env"
    assert compose_env_main(["--out", str(out)]) == 0
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    generated = {line.split("=", 1)[0] for line in out.read_text().splitlines()}
    asked = set(re.findall(r"\$\{(PASSWORD_\w+)", COMPOSE.read_text()))
    assert asked <= generated, asked - generated
    assert compose_env_main(["--out", str(out)]) == 1  # never silently replaced
    assert ".env" in (ROOT / ".gitignore").read_text().split()
