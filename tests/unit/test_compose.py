"""docker-compose.yml read as YAML: what holds without running it (`make compose-test` runs it).

Every service under services/ runs in the compose file, and every long-running container has a
health check, a restart policy and (for KSB services) its metrics port on the container network,
which is what Prometheus scrapes; each container logs in as its own principal; the catalog compose
applies is the demo's order conversation and grants what the order application needs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.compose_env import env_name, password_variables
from devtools.compose_env import main as compose_env_main
from devtools.deployment import MODULE_ROLES, settings_model
from ksb.activation.activated import resolve
from ksb.catalog.model import load_catalog_file
from ksb.security.principals import Role
from ksb.settings import ClientSettings, CliSettings, KsbSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_CATALOG = ROOT / "infra" / "compose" / "catalog.yaml"
APPS = {"apps.orders": ClientSettings}
"""Applications compose runs on the KSB image (not KSB services): the model each reads."""


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def _service_packages() -> list[str]:
    return sorted(p.parent.name for p in (ROOT / "services").glob("*/__main__.py"))


def test_podman_compose_reads_the_file_with_the_test_override(tmp_path: Path) -> None:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (make compose-test installs it); the YAML checks run")
    env = tmp_path / ".env"
    assert compose_env_main(["--out", str(env)]) == 0
    result = subprocess.run(
        [str(Path(sys.executable).parent / "podman-compose"), "--env-file", str(env),
         "-f", str(COMPOSE), "-f", str(ROOT / "infra/compose/test-override.yml"), "config"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    merged = yaml.safe_load(result.stdout)
    assert "grafana" not in merged["services"]  # the one service that cannot run here
    assert set(merged["services"]) == set(_compose()["services"]) - {"grafana"}
    assert merged["networks"]["default"]["external"] is True


def test_every_service_package_runs_in_compose() -> None:
    services = _compose()["services"]
    for name in _service_packages():
        assert name in services, f"services/{name} has no compose service"
        assert services[name]["command"] == ["python", "-m", f"services.{name}"]
    assert services["spark"]["command"] == ["python", "-m", "ksb.spark"]
    assert services["orders"]["command"][:3] == ["python", "-m", "apps.orders"]
    for infra in ("kafka", "redis", "prometheus", "grafana"):
        assert infra in services


def test_every_long_running_service_has_a_healthcheck_and_restart_policy() -> None:
    for name, svc in _compose()["services"].items():
        if svc.get("restart") == "no":
            continue  # one-shot jobs (security-init) run to completion
        check = svc.get("healthcheck") or {}
        assert not check.get("disable"), f"{name}: health check disabled"
        assert check.get("test"), f"{name}: no health check"
        assert svc.get("restart") in ("always", "unless-stopped", "on-failure"), name


def test_published_ports_bind_loopback_only() -> None:
    """Nothing of the stack (Redis, Kafka, Prometheus, Grafana) is reachable from other hosts."""
    for name, svc in _compose()["services"].items():
        for port in svc.get("ports") or []:
            assert str(port).startswith("127.0.0.1:"), (name, port)


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


def test_prometheus_scrapes_every_ksb_service_the_spark_exporter_and_the_client() -> None:
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
    assert "orders:9100" in targets


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


def _model(command: list[str]) -> type[KsbSettings] | None:
    if command[:2] == ["python", "-m"]:
        return APPS.get(command[2]) or settings_model(command[2])
    if command[:1] == ["ksb"] or command[-1:] == ["/app/infra/compose/security-init.sh"]:
        return CliSettings
    return None  # not a KSB process (Kafka, Redis, Spark, Prometheus, Grafana)


def test_every_ksb_container_reads_exactly_its_own_settings() -> None:
    """What a container's environment holds, its process's settings model reads (no unknown or
    foreign KSB_* variable would stop it at start-up)."""
    for svc in _compose()["services"].values():
        model = _model(list(svc.get("command") or []))
        if model is None:
            continue
        env = {k: _interpolated(str(v)) for k, v in (svc.get("environment") or {}).items()}
        model.from_env(env)  # raises, naming the variable, on anything the model does not read


def test_the_image_sets_no_ksb_variable() -> None:
    """A KSB_* variable in the image reaches every container, and every process whose model does
    not read it refuses to start (the `ksb` CLI refused KSB_METRICS_PORT and KSB_SPARK_JARS)."""
    env_lines = re.findall(r"^ENV\s+(.*?)(?<!\\)$", (ROOT / "Dockerfile").read_text(), re.M | re.S)
    assert env_lines and not any("KSB_" in line for line in env_lines)


def _interpolated(value: str) -> str:
    """Compose's `${VAR:-default}` as compose fills it in when VAR is unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def _python_containers() -> dict[str, tuple[str, dict[str, str]]]:
    """Container -> (its module, its environment as written) for `python -m` containers."""
    out = {}
    for name, svc in _compose()["services"].items():
        command = svc.get("command") or []
        if command[:2] == ["python", "-m"]:
            env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
            out[name] = (command[2], env)
    return out


def _granted_principals() -> set[str]:
    return {g.principal for g in load_catalog_file(COMPOSE_CATALOG).grants}


def test_each_container_logs_in_as_its_own_principal_with_its_own_password() -> None:
    seen: dict[str, str] = {}
    for name, (module, env) in _python_containers().items():
        if module in APPS:
            principal = _interpolated(env["KSB_KAFKA_USERNAME"])
            assert principal in _granted_principals(), name
        else:
            principal = f"ksb-local-{MODULE_ROLES[module].value}"
        assert _interpolated(env["KSB_KAFKA_USERNAME"]) == principal, name
        variable = re.fullmatch(r"\$\{(PASSWORD_\w+):\?[^}]*\}", env["KSB_KAFKA_PASSWORD"])
        assert variable is not None, f"{name}: the password comes from .env"
        assert seen.setdefault(variable.group(1), name) == name, f"{name} shares a password"
        assert variable.group(1) == env_name(principal.removeprefix("ksb-local-")), name
        if "KSB_REDIS_USERNAME" in env:  # the same principal in Redis
            assert _interpolated(env["KSB_REDIS_USERNAME"]) == principal, name
            assert env["KSB_REDIS_PASSWORD"] == env["KSB_KAFKA_PASSWORD"], name
        assert env["KSB_KAFKA_SECURITY_PROTOCOL"] != "PLAINTEXT", name
    for svc in _compose()["services"].values():
        assert "env_file" not in svc, "each container gets its own secrets, not the whole file"


def test_security_init_makes_the_instance_and_applies_its_catalog_before_any_service() -> None:
    services = _compose()["services"]
    init = {k: str(v) for k, v in services["security-init"]["environment"].items()}
    assert init["KSB_KAFKA_USERNAME"] == init["KSB_REDIS_USERNAME"] == "admin"
    assert _interpolated(init["CATALOG_FILE"]) == "infra/compose/catalog.yaml"
    script = (ROOT / "infra/compose/security-init.sh").read_text()
    steps = [line for line in script.splitlines() if re.search(r"\bksb (acl|catalog) apply", line)]
    # the principals, then the catalog as the operator, then the ACLs that catalog calls for
    assert ["acl" in steps[0], "catalog" in steps[1], "acl" in steps[2]] == [True] * 3, steps
    assert 'KSB_KAFKA_USERNAME="ksb-$KSB_INSTANCE-operator"' in script
    for role in Role:  # every principal's password is there to be stored
        assert env_name(role.value) in init, role
    for app in _granted_principals():
        assert env_name(app) in init and f"for app in {app}" in script, app
    for name in _python_containers():
        assert services[name]["depends_on"]["security-init"] == {
            "condition": "service_completed_successfully"
        }, name


def test_the_compose_catalog_is_the_demo_order_conversation_without_a_route() -> None:
    """It repeats the demo catalog's order conversation (kept equal here) and has no route: the
    demo's route names an instance compose does not run."""
    compose, demo = (
        load_catalog_file(COMPOSE_CATALOG),
        load_catalog_file(ROOT / "infra/demo/catalog.yaml"),
    )
    for kind in ("message_types", "contracts", "queues", "services", "priorities"):
        ours = {x.name: x for x in getattr(compose, kind)}
        theirs = {x.name: x for x in getattr(demo, kind) if x.name in ours}
        assert ours == theirs, kind
    assert compose.routes == ()


def test_the_external_activator_runs_a_procedure_the_image_has_on_an_activated_queue() -> None:
    config = yaml.safe_load((ROOT / "infra/demo/external-activator.yaml").read_text())
    notified = {e.queue for e in load_catalog_file(COMPOSE_CATALOG).event_notifications}
    for queue, spec in config["queues"].items():
        assert queue in notified, f"{queue}: no QUEUE_ACTIVATION event would start its readers"
        procedure = spec["command"].split()[4]
        assert procedure.split(".")[0] in {"apps", "services", "ksb"}, procedure  # in the image
        assert callable(resolve(procedure))
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY apps apps" in dockerfile


def test_the_spark_worker_has_a_work_directory_it_can_write() -> None:
    worker = _compose()["services"]["spark-worker"]
    mount = next(v.split(":")[1] for v in worker["volumes"] if v.startswith("spark-data:"))
    assert worker["environment"]["SPARK_WORKER_DIR"].startswith(mount + "/")


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


def test_redis_keeps_its_acl_users_in_its_volume() -> None:
    """The principals' users (saved by `ksb acl apply`) are in the ACL file on the redis-data
    volume, which a restart keeps; only default's and admin's lines are written afresh."""
    redis = _compose()["services"]["redis"]
    data = next(v.split(":")[1] for v in redis["volumes"] if v.startswith("redis-data:"))
    command = " ".join(redis["command"])
    aclfile = re.search(r"--aclfile (\S+)", command)
    assert aclfile is not None and aclfile.group(1).startswith(data + "/")
    assert "grep -v -E '^user (default|admin) '" in command


def test_every_password_compose_asks_for_is_generated(tmp_path: Path) -> None:
    out = tmp_path / ".env"
    assert compose_env_main(["--out", str(out)]) == 0
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    generated = {line.split("=", 1)[0] for line in out.read_text().splitlines()}
    asked = set(re.findall(r"\$\{(PASSWORD_\w+)", COMPOSE.read_text()))
    assert generated == asked
    roles = {env_name(r.value) for r in Role} | {"PASSWORD_BROKER", "PASSWORD_ADMIN"}
    assert roles | {env_name(p) for p in _granted_principals()} == asked
    assert compose_env_main(["--out", str(out)]) == 1  # never silently replaced
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def test_password_variables_reads_every_interpolation_form() -> None:
    text = "${PASSWORD_A:?x} ${PASSWORD_B} ${PASSWORD_A:-y} ${OTHER} ${PASSWORD_C?z}"
    assert password_variables(text) == ["PASSWORD_A", "PASSWORD_B", "PASSWORD_C"]


def test_compose_env_runs_on_a_bare_python(tmp_path: Path) -> None:
    """No venv, no site-packages: what a host that deploys with compose has."""
    out = tmp_path / ".env"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run(
        [sys.executable, "-S", "-s", "-E", "-c",
         "import sys; import devtools.compose_env as m; "
         "assert 'pydantic' not in sys.modules and 'ksb' not in sys.modules; "
         f"raise SystemExit(m.main(['--out', {str(out)!r}]))"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(out.read_text().splitlines()) == len(password_variables(COMPOSE.read_text()))
