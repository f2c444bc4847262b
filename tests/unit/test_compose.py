"""docker-compose.yml read as YAML: what holds without running it (`make compose-test` runs it).

Every service under services/ runs in the compose file, and every long-running container has a
health check, a restart policy and (for KSB services) its metrics port on the container network,
which is what Prometheus scrapes; each container logs in as its own principal with a password file
from its own secret, the lease key goes to the dispatchers and the queue service only, and every
client of the queue service lists all its replicas; the catalog compose applies is the demo's
order conversation and grants what the order application needs.
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

from devtools.compose_env import main as compose_env_main
from devtools.compose_env import secret_names
from devtools.deployment import MODULE_ROLES, settings_model
from devtools.kafka_node import KAFKA_BROKER_SETTINGS
from ksb.activation.activated import resolve
from ksb.catalog.model import load_catalog_file
from ksb.security.plan import plan_instance
from ksb.security.principals import Role
from ksb.settings import (
    AuthoritySettings,
    ClientSettings,
    CliSettings,
    KsbSettings,
    QueueClientSettings,
    QueueServiceSettings,
)

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


def _running(package: str) -> list[str]:
    """The compose services that run `python -m services.<package>` (several for the queue
    service's replicas)."""
    command = ["python", "-m", f"services.{package}"]
    return sorted(n for n, svc in _compose()["services"].items() if svc.get("command") == command)


SECRETS = "/run/ksb/secrets/"
"""Where infra/compose/entrypoint.sh copies a KSB container's secrets for the image's user."""


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
        assert _running(name), f"services/{name} has no compose service"
        assert all(n == name or re.fullmatch(f"{name}-[0-9]+", n) for n in _running(name)), name
    assert len(_running("queue")) >= 2  # RECEIVE goes on when one replica fails
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


def test_published_ports_bind_loopback_unless_configured() -> None:
    """Nothing of the stack (Redis, Kafka, the queue service, Prometheus, Grafana) is reachable
    from other hosts unless PUBLISH_ADDRESS says so: every published port binds that variable,
    127.0.0.1 when unset (compose's own default syntax, which podman-compose reads too)."""
    published = [
        (name, str(port))
        for name, svc in _compose()["services"].items()
        for port in svc.get("ports") or []
    ]
    assert len(published) >= 6, published
    for name, port in published:
        assert port.startswith("${PUBLISH_ADDRESS:-127.0.0.1}:"), (name, port)


def test_ksb_services_serve_healthz_and_metrics_on_the_network() -> None:
    compose = _compose()
    services = compose["services"]
    for name in [n for p in _service_packages() for n in _running(p)] + ["spark"]:
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
    for name in [n for p in _service_packages() for n in _running(p)] + ["spark"]:
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


def _redis_secret_of(principal: str) -> str:
    return _secret_of(principal).replace("-password", "-redis-password")


def _redis_principals() -> set[str]:
    """The principals with a Redis user in the compose instance's plan."""
    catalog = load_catalog_file(COMPOSE_CATALOG)
    return set(plan_instance(KsbSettings(instance="local"), catalog).redis)


def _secret_of(principal: str) -> str:
    """The compose secret holding a principal's password (``ksb-local-<role>`` -> <role>-password)."""
    return f"{principal.removeprefix('ksb-local-')}-password"


def test_each_container_logs_in_as_its_own_principal_with_its_own_password_file() -> None:
    seen: dict[str, str] = {}
    for name, (module, env) in _python_containers().items():
        if module in APPS:
            principal = _interpolated(env["KSB_KAFKA_USERNAME"])
            assert principal in _granted_principals(), name
            assert "KSB_REDIS_USERNAME" not in env, f"{name}: an application has no Redis login"
        else:
            principal = f"ksb-local-{MODULE_ROLES[module].value}"
        assert _interpolated(env["KSB_KAFKA_USERNAME"]) == principal, name
        secret = _secret_of(principal)
        assert env["KSB_KAFKA_PASSWORD_FILE"] == SECRETS + secret, name
        assert _compose()["services"][name]["secrets"][0] == secret, name
        if module.startswith("services.queue"):  # the replicas are one principal
            secret = f"{secret}:{name}"
        assert seen.setdefault(secret, name) == name, f"{name} shares a password"
        if "KSB_REDIS_USERNAME" in env:  # the same principal in Redis, another password
            assert _interpolated(env["KSB_REDIS_USERNAME"]) == principal, name
            redis_secret = _redis_secret_of(principal)
            assert env["KSB_REDIS_PASSWORD_FILE"] == SECRETS + redis_secret, name
            assert redis_secret in _compose()["services"][name]["secrets"], name
        assert env["KSB_KAFKA_SECURITY_PROTOCOL"] != "PLAINTEXT", name
    for svc in _compose()["services"].values():
        assert "env_file" not in svc, "each container gets its own secrets, not the whole file"


def test_no_password_is_an_environment_value() -> None:
    """A value in a container's environment shows in `docker inspect` and reaches every process
    it starts: every password is a secret file, read through a *_FILE variable."""
    for name, svc in _compose()["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            assert not re.search(r"PASSWORD$|AUTH$|_KEY$", key), (name, key)
            assert "SECRETS_DIR" not in str(value), (name, key)
            if key.endswith("_FILE") and key.startswith("KSB_"):
                assert str(value).startswith(SECRETS), (name, key)
                assert str(value).removeprefix(SECRETS) in svc["secrets"], (name, key)


def test_the_lease_key_goes_to_the_dispatchers_and_the_queue_service_only() -> None:
    """They seal and open the leases of the group locks; a client with the key could forge one."""
    services = _compose()["services"]
    holders = {n for n, svc in services.items() if "lease-key" in (svc.get("secrets") or [])}
    assert holders == {*_running("dispatcher"), *_running("queue")}
    for name in holders:
        env = services[name]["environment"]
        assert env["KSB_LEASE_KEY_FILE"] == SECRETS + "lease-key", name
        model = settings_model(services[name]["command"][2])
        assert issubclass(model, AuthoritySettings), name  # it reads the key


def test_every_client_of_the_queue_service_lists_every_replica() -> None:
    services = _compose()["services"]
    port = QueueServiceSettings.model_fields["queue_port"].default
    replicas = _running("queue")
    want = {f"{name}:{port}" for name in replicas}
    clients = []
    for name, (module, env) in _python_containers().items():
        model = APPS.get(module) or settings_model(module)
        if issubclass(model, QueueClientSettings) and module != "ksb.activation.activated":
            assert set(env["KSB_QUEUE_ADDRESSES"].split(",")) == want, name
            for replica in replicas:  # started once RECEIVE can be served
                assert services[name]["depends_on"][replica] == {"condition": "service_healthy"}
            clients.append(name)
    assert sorted(clients) == ["activation", "external_activator", "orders"]
    published = [p for r in replicas for p in services[r]["ports"]]
    assert len({p.split(":")[-2] for p in published}) == len(replicas)  # one host port each
    for name in replicas:
        assert services[name]["environment"]["KSB_QUEUE_HOST"] == "0.0.0.0", name


def test_ksb_containers_hand_their_secrets_to_the_image_user() -> None:
    """Compose mounts a secret as the host file is (0600): a KSB container starts as root for the
    entry point to copy its secrets to a tmpfs for the image's user, which runs the command."""
    script = (ROOT / "infra/compose/entrypoint.sh").read_text()
    assert "install -o ksb -g ksb -m 0400" in script and "setpriv --reuid=ksb" in script
    for name, svc in _compose()["services"].items():
        if svc.get("image") != "ksb:local" or not svc.get("secrets"):
            continue
        assert svc["entrypoint"] == ["sh", "/app/infra/compose/entrypoint.sh"], name
        assert svc["user"] == "0" and "/run/ksb" in svc["tmpfs"], name


def test_grafana_asks_everyone_to_log_in() -> None:
    grafana = _compose()["services"]["grafana"]
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana-admin-password"
    assert grafana["secrets"] == ["grafana-admin-password"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env


def test_security_init_makes_the_instance_and_applies_its_catalog_before_any_service() -> None:
    services = _compose()["services"]
    init = {k: str(v) for k, v in services["security-init"]["environment"].items()}
    assert init["KSB_KAFKA_USERNAME"] == init["KSB_REDIS_USERNAME"] == "admin"
    assert init["KSB_KAFKA_PASSWORD_FILE"] != init["KSB_REDIS_PASSWORD_FILE"]  # admin's two
    assert _interpolated(init["CATALOG_FILE"]) == "infra/compose/catalog.yaml"
    script = (ROOT / "infra/compose/security-init.sh").read_text()
    steps = [
        line
        for line in script.splitlines()
        if line.startswith("retry") and re.search(r"\bksb (acl|catalog) apply", line)
    ]
    # the principals, then the catalog as admin (only admin and the owners write it), then the
    # ACLs that catalog calls for
    assert ["acl" in steps[0], "catalog" in steps[1], "acl" in steps[2]] == [True] * 3, steps
    assert steps[1].strip() == 'retry ksb catalog apply "${CATALOG_FILE:?}"', steps
    redis_roles = re.search(r"^for role in (.*); do\n.*redis\.password", script, re.M)
    assert redis_roles is not None
    for principal in _redis_principals():  # each Redis password is there to be stored
        assert principal.removeprefix("ksb-local-") in redis_roles.group(1).split(), principal
        assert _redis_secret_of(principal) in services["security-init"]["secrets"], principal
    apps = re.search(r"^for app in (.*); do$", script, re.M)
    assert apps is not None
    roles = re.search(r"^for role in (.*); do$", script, re.M)
    assert roles is not None
    secrets = services["security-init"]["secrets"]
    for role in Role:  # every principal's password is there to be stored
        assert role.value in roles.group(1).split(), role
        assert f"{role.value}-password" in secrets, role
    for app in _granted_principals():
        assert f"{app}-password" in secrets and app in apps.group(1).split(), app
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


def test_compose_kafka_has_the_local_stack_broker_settings() -> None:
    """The same group and transaction timings as every other stack KSB runs on: with Kafka's
    45 s consumer session, a killed dispatcher's shards stood still for 45 s in compose."""
    lines = set((ROOT / "infra/compose/kafka.sh").read_text().splitlines())
    for key, value in KAFKA_BROKER_SETTINGS.items():
        assert f"{key}={value}" in lines, key


def test_redis_keeps_its_acl_users_in_its_volume() -> None:
    """The principals' users (saved by `ksb acl apply`) are in the ACL file on the redis-data
    volume, which a restart keeps; only default's and admin's lines are written afresh."""
    redis = _compose()["services"]["redis"]
    data = next(v.split(":")[1] for v in redis["volumes"] if v.startswith("redis-data:"))
    command = " ".join(redis["command"])
    aclfile = re.search(r"--aclfile (\S+)", command)
    assert aclfile is not None and aclfile.group(1).startswith(data + "/")
    assert "grep -v -E '^user (default|admin) '" in command


def test_every_secret_compose_asks_for_is_generated(tmp_path: Path) -> None:
    out = tmp_path / ".env"
    assert compose_env_main(["--out", str(out)]) == 0
    folder = tmp_path / "secrets"
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    assert out.read_text() == f"SECRETS_DIR={folder}\n"
    files = {p.name: p for p in folder.iterdir()}
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in files.values())
    values = [p.read_text() for p in files.values()]
    assert len(set(values)) == len(values) and all(len(v) >= 32 for v in values)
    declared = _compose()["secrets"]
    assert set(files) == set(declared) == set(secret_names(COMPOSE.read_text()))
    passwords = {f"{r.value}-password" for r in Role} | {
        f"{p}-password" for p in _granted_principals()
    }
    passwords |= {_redis_secret_of(p) for p in _redis_principals()}
    cluster = {"broker-password", "admin-kafka-password", "admin-redis-password"}
    assert set(files) == passwords | cluster | {"lease-key", "grafana-admin-password"}
    assert compose_env_main(["--out", str(out)]) == 1  # never silently replaced
    assert compose_env_main(["--out", str(out), "--force"]) == 0
    assert [p.read_text() for p in sorted(folder.iterdir())] != sorted(values)
    for ignored in (".env", "/secrets/"):
        assert ignored in (ROOT / ".gitignore").read_text().split()
        assert ignored.strip("/") in (ROOT / ".dockerignore").read_text().split()


def test_env_names_the_secrets_folder_relative_to_the_compose_file_when_inside_it(
    tmp_path: Path,
) -> None:
    compose = tmp_path / "docker-compose.yml"
    compose.write_text(COMPOSE.read_text())
    assert compose_env_main(["--out", str(tmp_path / ".env"), "--compose-file", str(compose)]) == 0
    assert (tmp_path / ".env").read_text() == "SECRETS_DIR=./secrets\n"


def test_secret_names_reads_every_interpolation_form() -> None:
    text = (
        "${SECRETS_DIR:?x}/a ${SECRETS_DIR}/b-c ${SECRETS_DIR:-y}/a ${OTHER}/d ${SECRETS_DIR?z}/e.f"
    )
    assert secret_names(text) == ["a", "b-c", "e.f"]


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
    assert len(list((tmp_path / "secrets").iterdir())) == len(secret_names(COMPOSE.read_text()))
