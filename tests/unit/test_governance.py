"""The catalog's governance rules, the activation host's configuration and a queue's status:
what a catalog may ask a host to run, as whom, and when a queue is OFF."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from ksb.activation.host import (
    ActivationHostConfig,
    TaskLogin,
    load_host_config,
    task_launch,
    task_settings,
)
from ksb.catalog.model import Activation, Catalog, parse_catalog
from ksb.catalog.queue_status import disabled_by_status, effective, reconcile
from ksb.errors import CatalogError
from ksb.security.governance import check_version, task_principal
from ksb.settings import ActivatedTaskSettings, ActivationSettings

INST = "inst"


def _with(**activation: Any) -> Catalog:
    return parse_catalog({"queues": [{"name": "Q", "activation": activation}]})


@pytest.mark.parametrize(
    "command",
    ["cat /etc/passwd", "reader; rm -rf /", "$(id)", "a b", "", "x" * 65, "../reader"],
)
def test_a_command_is_a_name_never_a_command_line(command: str) -> None:
    with pytest.raises(CatalogError, match="is not a command name") as refused:
        check_version(_with(status="OFF", command=command), INST)
    assert refused.value.code == "command_not_named"


@pytest.mark.parametrize("procedure", ["os.system('id')", "m:f x", "m:f:g", "1m:f", "m:"])
def test_a_procedure_is_a_python_name_never_code(procedure: str) -> None:
    with pytest.raises(CatalogError, match="Python callable"):
        check_version(_with(procedure=procedure), INST)


@pytest.mark.parametrize(
    ("who", "why"),
    [
        ("SELF", "not mapped"),
        ("OWNER", "not mapped"),
        ("self", "not mapped"),
        ("admin", "never runs as"),
        ("broker", "never runs as"),
        (f"ksb-{INST}-activation", "never runs as"),
        (f"ksb-{INST}-dispatcher", "never runs as"),
        ("two words", "1-64 letters"),
    ],
)
def test_execute_as_names_an_application_principal(who: str, why: str) -> None:
    catalog = _with(status="ON", procedure="m:f", execute_as=who)
    with pytest.raises(CatalogError, match=why):
        check_version(catalog, INST)


def test_a_version_by_the_rules_passes_and_names_its_task_principal() -> None:
    catalog = _with(status="ON", command="order-reader", execute_as="orders-app")
    check_version(catalog, INST)
    assert task_principal(catalog.queues[0].activation, INST) == "orders-app"
    # Another instance's service principal is just a name here (it is not this one's service).
    check_version(_with(status="ON", procedure="m:f", execute_as="ksb-other-activation"), INST)
    # Activation OFF does not need a principal yet (SQL Server's default is SELF).
    check_version(_with(status="OFF", procedure="pkg.mod:fn"), INST)


# ----------------------------------------------------------------- the host
HOST = ActivationHostConfig(
    commands={"order-reader": {"argv": ["python", "-m", "apps.reader"]}},
    logins={"orders-app": TaskLogin(kafka_password_file="/s/orders-app.password")},
)


def _launch(activation: Activation, *, secured: bool = True) -> Any:
    return task_launch(HOST, activation, instance=INST, queue="Q", task_id="t1", secured=secured)


def test_the_host_runs_its_named_command_as_the_principal_it_holds_a_login_for() -> None:
    launch = _launch(Activation(status="ON", command="order-reader", execute_as="orders-app"))
    assert launch.argv == ["python", "-m", "apps.reader"]
    assert launch.principal == "orders-app"
    assert launch.login == HOST.logins["orders-app"]
    procedure = _launch(Activation(status="ON", procedure="m:f", execute_as="orders-app"))
    assert procedure.argv == [sys.executable, "-m", "ksb.activation.activated", "Q", "m:f", "t1"]


@pytest.mark.parametrize(
    ("activation", "code"),
    [
        (Activation(status="ON", command="cat /etc/passwd", execute_as="orders-app"), "command"),
        (Activation(status="ON", command="unknown", execute_as="orders-app"), "command"),
        (Activation(status="ON", command="order-reader", execute_as="SELF"), "execute_as"),
        (Activation(status="ON", command="order-reader", execute_as="mallory"), "execute_as"),
        (Activation(status="ON", command="order-reader", execute_as="admin"), "execute_as"),
    ],
)
def test_the_host_refuses_what_it_does_not_define(activation: Activation, code: str) -> None:
    """What a stored version (before the rules) may still say is refused where it would run."""
    with pytest.raises(CatalogError) as refused:
        _launch(activation)
    assert refused.value.code.startswith(code), refused.value.code


def test_without_security_a_principal_needs_no_login_but_must_still_be_named() -> None:
    launch = _launch(Activation(status="ON", procedure="m:f", execute_as="anyone"), secured=False)
    assert launch.login is None
    with pytest.raises(CatalogError, match="not mapped"):
        _launch(Activation(status="ON", procedure="m:f"), secured=False)


def test_a_task_gets_its_principals_login_and_none_of_its_hosts_secrets() -> None:
    host = ActivationSettings(
        instance=INST,
        kafka_username=f"ksb-{INST}-activation",
        kafka_password="the-hosts-own",
        kafka_password_file="/s/act.password",
        redis_username=f"ksb-{INST}-activation",
        redis_password="the-hosts-redis",
        redis_password_file="/s/act.redis.password",
        kafka_remote_credentials="/s/remote.json",
        principal=f"ksb-{INST}-activation",
    )
    login = TaskLogin(
        kafka_password_file="/s/w.password", redis_password_file="/s/w.redis.password"
    )
    task = task_settings(host, ActivatedTaskSettings, "worker", login)
    assert (task.kafka_username, task.redis_username, task.principal) == ("worker",) * 3
    assert (task.kafka_password_file, task.redis_password_file) == (
        "/s/w.password",
        "/s/w.redis.password",
    )
    assert task.kafka_password == task.redis_password == task.kafka_remote_credentials == ""
    nobody = task_settings(host, ActivatedTaskSettings, "", None)
    assert nobody.kafka_username == nobody.kafka_password_file == nobody.kafka_password == ""


def test_a_host_config_is_refused_with_the_field_named(tmp_path: Path) -> None:
    path = tmp_path / "host.yaml"
    path.write_text("commands:\n  reader:\n    argv: []\n")
    with pytest.raises(CatalogError, match=r"commands\.reader\.argv"):
        load_host_config(str(path))
    path.write_text("commands:\n  'a b':\n    argv: [x]\n")
    with pytest.raises(CatalogError, match="not command names"):
        load_host_config(str(path))
    path.write_text("logins:\n  w:\n    kafka_password_file: /s/w\n    shell: yes\n")
    with pytest.raises(CatalogError, match="shell"):
        load_host_config(str(path))
    assert load_host_config("") == ActivationHostConfig()


# ----------------------------------------------------------------- a queue's status
def _queues(**status: str) -> Catalog:
    return parse_catalog(
        {"version": 3, "queues": [{"name": n, "status": s} for n, s in status.items()]}
    )


def test_a_status_record_turns_a_queue_off_and_the_catalogs_off_stays_off() -> None:
    stored = _queues(A="ON", B="ON", C="OFF")
    seen = effective(stored, {"A": "poison: 5 rollbacks in a row", "C": "poison"})
    assert {q.name: q.status for q in seen.queues} == {"A": "OFF", "B": "ON", "C": "OFF"}
    assert seen.version == 3  # the catalog's version: nobody wrote a new one
    assert disabled_by_status(stored, {"A": "r", "C": "r", "Gone": "r"}) == {"A": "r"}
    assert effective(stored, {}) is stored


def test_alter_queue_status_on_enables_a_poisoned_queue_by_a_record_not_the_catalog() -> None:
    stored = _queues(A="ON", B="ON")
    held = {"A": "poison", "B": "poison"}
    # The statements saw A and B OFF; they turned A ON and left B alone.
    changed = _queues(A="ON", B="OFF")
    to_store, enable = reconcile(stored, changed, held)
    assert enable == ["A"]
    assert {q.name: q.status for q in to_store.queues} == {"A": "ON", "B": "ON"}
    # Statements that touch nothing of it leave the record to keep B OFF.
    _, none = reconcile(stored, effective(stored, held), held)
    assert none == []
