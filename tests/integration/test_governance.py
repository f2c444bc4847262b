"""Issue 38, "the catalog runs shell commands": each attack, as its attacker would make it.

The attack: ``ALTER QUEUE ... ACTIVATION (COMMAND = '...')`` by the operator (not an admin) made
the activation service run a shell, under its own login, that listed the credential store and
read the admin's password; the activation principal could itself write the catalog, and
``EXECUTE AS`` was accepted and ignored. Each test below is one way in, tried with the login
its attacker has, and the refusal it now meets (`ksb.security.governance`, `ksb.activation.host`,
`ksb.runtime.confinement`); each passed before the fix, where the attacker got through.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, Producer
from typer.testing import CliRunner

from devtools.deployment import Deployment, owner_of
from ksb.catalog.model import Grant, parse_catalog
from ksb.cli import app
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.catalog_store import apply_catalog, load_catalog
from ksb.sdk.client import KsbClient
from ksb.security.principals import ADMIN, Role, service_principal
from ksb.settings import CliSettings, settings_env
from tests.conftest import Stack
from tests.integration.conftest import BASIC_CATALOG, ThreadDispatcher, make_application
from tests.integration.support import read_topic, receive_all, wait_for
from tests.integration.test_activation import ThreadActivation

pytestmark = pytest.mark.integration

I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741
QUEUE = "TargetQueue"


@pytest.fixture(autouse=True)
def _secured(stack: Stack) -> None:
    if not stack.security.enabled:
        pytest.skip("the stack runs without security (KSB_STACK_SECURITY=plaintext)")


@pytest.fixture
def stop_all() -> Iterator[list[Any]]:
    running: list[Any] = []
    yield running
    for r in reversed(running):
        r.stop()


def _ksb(login: Deployment, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env=settings_env(login.narrow(CliSettings)))
    return result.exit_code, result.output


def _activated(settings: Deployment, **activation: Any) -> dict[str, Any]:
    cat = copy.deepcopy(BASIC_CATALOG)
    for q in cat["queues"]:
        if q["name"] == QUEUE:
            q["activation"] = {"status": "ON", "max_queue_readers": 1, **activation}
    return cat


def _write(settings: Deployment, topic: str) -> KafkaError | None:
    """One record produced to `topic` as `settings`' principal: the delivery's error, if any."""
    reports: list[KafkaError | None] = []
    p = Producer(
        {
            "bootstrap.servers": settings.kafka_bootstrap,
            **kafka.client_security(settings, settings.kafka_bootstrap),
            "enable.idempotence": False,
            "message.timeout.ms": 10_000,
        }
    )
    p.produce(topic, key=QUEUE.encode(), value=b"{}", on_delivery=lambda e, _m: reports.append(e))
    p.flush(15)
    assert reports, f"no delivery report for {topic}"
    return reports[0]


# ----------------------------------------------------------------- who writes the catalog
def test_the_operator_cannot_change_activation_and_a_writer_cannot_give_it_shell_text(
    settings: Deployment, tmp_path: Path
) -> None:
    """The issue's attack, through the CLI: refused to the operator by Kafka (only admin and
    the owners write the catalog), and to a writer by the governance rule (a command is a name
    of the host's configuration). The catalog keeps its version either way."""
    apply_catalog(settings, parse_catalog(BASIC_CATALOG))
    before = load_catalog(settings).version
    marker = tmp_path / "pwned"
    shell = (
        f"ALTER QUEUE {QUEUE} WITH ACTIVATION (STATUS = ON, "
        f"COMMAND = 'cat /etc/hostname > {marker}', EXECUTE AS 'alice')"
    )
    operator = settings.as_service(Role.OPERATOR)
    for statements in (
        f"GRANT RECEIVE ON [{QUEUE}] TO [mallory]",
        f"ALTER QUEUE {QUEUE} WITH ACTIVATION (STATUS = ON, COMMAND = 'reader', "
        "EXECUTE AS 'mallory')",
    ):
        code, out = _ksb(operator, "sql", statements)
        assert code == 2, out
        assert f"ksb-{settings.instance}-operator may not write" in out and "admin" in out, out
    for login in (operator, settings):  # the owner is a writer, but no writer gives shell text
        code, out = _ksb(login, "sql", shell)
        assert code == 2 and "is not a command name" in out, out
    assert load_catalog(settings).version == before
    assert not marker.exists()


def test_the_activation_principal_cannot_write_the_catalog_only_a_queues_status(
    settings: Deployment,
) -> None:
    """It used to write the catalog (the poison rule's STATUS = OFF); now that has a record of
    its own, which no application may write either."""
    apply_catalog(settings, parse_catalog(BASIC_CATALOG))
    names = Names(settings.instance)
    activation = settings.as_service(Role.ACTIVATION)
    refused = _write(activation, names.catalog)
    assert refused is not None and refused.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert _write(activation, names.queue_status) is None
    alice = make_application(
        settings, "alice", [Grant(permission="RECEIVE", target=QUEUE, principal="alice")]
    )
    for topic in (names.catalog, names.queue_status):  # no application enables a queue again
        refused = _write(alice, topic)
        assert refused is not None and refused.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED


@pytest.mark.parametrize(
    "who", ["SELF", "OWNER", "'{activation}'", "'admin'"], ids=["self", "owner", "service", "admin"]
)
def test_execute_as_must_name_a_principal_that_is_neither_a_service_nor_the_cluster(
    settings: Deployment, who: str
) -> None:
    """``EXECUTE AS`` was accepted and ignored: tasks ran as the activation service."""
    apply_catalog(settings, parse_catalog(BASIC_CATALOG))
    before = load_catalog(settings).version
    user = who.format(activation=service_principal(settings.instance, Role.ACTIVATION))
    code, out = _ksb(
        settings,
        "sql",
        f"ALTER QUEUE {QUEUE} WITH ACTIVATION (STATUS = ON, "
        f"PROCEDURE_NAME = [tests.integration.activation_procs:reply], EXECUTE AS {user})",
    )
    assert code == 2 and "execute_as" in out, out
    assert ("not mapped" in out) if who in ("SELF", "OWNER") else ("never runs as" in out), out
    assert load_catalog(settings).version == before


def test_every_catalog_version_records_the_principal_that_wrote_it(settings: Deployment) -> None:
    apply_catalog(settings, parse_catalog(BASIC_CATALOG))
    code, out = _ksb(settings, "sql", "CREATE QUEUE Audited")
    assert code == 0, out
    stored = load_catalog(settings)
    assert stored.written_by == owner_of(settings.instance)
    code, out = _ksb(settings.as_service(Role.OPERATOR), "catalog", "show")
    assert code == 0 and f"written by {owner_of(settings.instance)}" in out, out


# ----------------------------------------------------------------- what the host runs
def test_a_stored_version_with_shell_text_or_self_runs_nothing_on_the_host(
    settings: Deployment, stop_all: list[Any], tmp_path: Path
) -> None:
    """A version stored before the rule (or written around the CLI) still says COMMAND = <shell
    text>, or EXECUTE AS SELF: the host starts nothing, and says why."""
    marker = tmp_path / "pwned"
    fast = settings.model_copy(update={"activation_retry_ms": 200})
    command = _activated(fast, command=f"touch {marker}", execute_as=owner_of(fast.instance))
    apply_catalog(fast, parse_catalog(command))  # the library: below the CLI's check
    stop_all.append(ThreadDispatcher(fast))
    act = ThreadActivation(fast)
    stop_all.append(act)
    with KsbClient(fast) as client:
        client.send(client.begin_dialog(I, T, C), "//t/Request", "{}")
        client.flush()
        wait_for(
            "the host to refuse the command",
            lambda: (act.service.watches[QUEUE].refused or "").startswith("COMMAND"),
            30,
        )
        time.sleep(1)  # a few more monitor checks: still nothing
        assert not marker.exists(), "the catalog's shell text ran"
        assert act.service.watches[QUEUE].activations == 0
        procedure = _activated(fast, procedure="tests.integration.activation_procs:reply")
        apply_catalog(fast, parse_catalog(procedure))  # EXECUTE AS SELF, the model's default
        wait_for(
            "the host to refuse SELF",
            lambda: "not mapped" in (act.service.watches[QUEUE].refused or ""),
            30,
        )
        assert act.service.watches[QUEUE].activations == 0
        assert receive_all(client, QUEUE, 1, timeout_s=15)  # the message waited, untouched


def test_an_activated_task_logs_in_as_its_principal_and_reads_none_of_its_hosts_secrets(
    stack: Stack, settings: Deployment, stop_all: list[Any]
) -> None:
    """A procedure is code the catalog's queue runs: as an attacker's, it looks for secrets in
    its environment and on disk. It finds its own login and nothing of the activation
    service's, the admin's or anyone else's."""
    host = settings.model_copy(update={"task_principals": "worker", "activated_idle_ms": 800})
    inventory = "tests.integration.activation_procs:inventory"
    apply_catalog(host, parse_catalog(_activated(host, procedure=inventory, execute_as="worker")))
    worker = make_application(  # its grants, and the ACLs (ksb acl apply) the catalog calls for
        host,
        "worker",
        [
            Grant(permission="RECEIVE", target=QUEUE, principal="worker"),
            Grant(permission="SEND", target=T, principal="worker"),
        ],
    )
    stop_all.append(ThreadDispatcher(host))
    stop_all.append(ThreadActivation(host))
    store = stack.security.store
    activation = host.as_service(Role.ACTIVATION)
    theirs = [
        activation.kafka_password_file,
        activation.redis_password_file,
        str(store.path(ADMIN)),
        str(store.path(owner_of(host.instance))),
        str(store.path(service_principal(host.instance, Role.DISPATCHER))),
        str(store.lease_key(host.instance)),
    ]
    own = worker.kafka_password_file
    with KsbClient(host) as client:
        client.send(
            client.begin_dialog(I, T, C), "//t/Request", json.dumps({"read": [*theirs, own]})
        )
        client.flush()
        [reply] = receive_all(client, "InitiatorQueue", 1, timeout_s=60)
    found = json.loads(reply.message_body)
    assert found["user"] == "worker"
    # Its environment names its own password files, and holds no password.
    assert found["env"] == {
        "KSB_KAFKA_PASSWORD": "",
        "KSB_KAFKA_PASSWORD_FILE": own,
        "KSB_REDIS_PASSWORD": "",
        "KSB_REDIS_PASSWORD_FILE": str(store.redis_path("worker")),
    }
    assert found["files"][own] == "read"
    for path in theirs:
        assert found["files"][path] == "EACCES", (path, found["files"][path])
    # Its requests went out on its own principal's topic, not the activation service's.
    names = Names(host.instance)
    assert read_topic(host, names.requests_of("worker"))
    assert not read_topic(
        host, names.requests_of(service_principal(host.instance, Role.ACTIVATION))
    )
