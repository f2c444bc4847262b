"""The `ksb` command against the real stack: catalog, DDL, endpoints, errors and queue peek."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner, Result

from devtools.deployment import Deployment, owner_of
from ksb.catalog.model import END_DIALOG, Catalog
from ksb.cli import app
from ksb.dialog.views import ONE_SIDED_GRACE_MS
from ksb.sdk.client import KsbClient
from ksb.security.principals import Role
from ksb.settings import CliSettings, settings_env
from tests.integration.conftest import BASIC_CATALOG, ThreadDispatcher
from tests.integration.support import errors, receive_all, wait_endpoint, wait_for

pytestmark = pytest.mark.integration

INITIATOR, T, C = "//t/Initiator", "//t/Target", "//t/Contract"


def operator_env(settings: Deployment) -> dict[str, str]:
    """The ``KSB_*`` variables of the test instance's operator."""
    operator = settings.as_service(Role.OPERATOR).narrow(CliSettings)
    return {k: v for k, v in settings_env(operator).items() if k.startswith("KSB_")}


def writer_env(settings: Deployment) -> dict[str, str]:
    """The ``KSB_*`` variables of the test instance's owner, a writer of its catalog."""
    owner = settings.as_principal(owner_of(settings.instance)).narrow(CliSettings)
    return {k: v for k, v in settings_env(owner).items() if k.startswith("KSB_")}


def ksb(settings: Deployment, *args: str) -> Result:
    """Run `ksb ARGS` with the test instance's settings in the environment, as a user would:
    the instance's operator, or for a change of the catalog its owner (only the catalog's
    writers change it, issue 38)."""
    writes = args[:1] == ("sql",) or args[:2] == ("catalog", "apply")
    return CliRunner().invoke(
        app, list(args), env=writer_env(settings) if writes else operator_env(settings)
    )


def ok(result: Result) -> str:
    assert result.exit_code == 0, f"exit {result.exit_code}: {result.output}"
    return result.stdout


def refused(result: Result) -> str:
    """A refusal is exit code 2 and one reason on stderr, never a traceback."""
    assert result.exit_code == 2, f"exit {result.exit_code}: {result.output}"
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    assert result.stderr.startswith("error: ")
    return result.stderr


def shown(settings: Deployment) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(ok(ksb(settings, "catalog", "show", "--json")))
    return value


def test_catalog_apply_then_show(settings: Deployment, tmp_path: Path) -> None:
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(BASIC_CATALOG))
    assert "applied catalog version 1" in ok(ksb(settings, "catalog", "apply", str(path)))
    table = ok(ksb(settings, "catalog", "show"))
    assert f"catalog version 1 of instance {settings.instance}" in table
    for name in ("TargetQueue", "InitiatorQueue", "//t/Contract", "//t/Order", "WELL_FORMED_JSON"):
        assert name in table
    as_json = shown(settings)
    assert as_json["version"] == 1
    assert [q["name"] for q in as_json["queues"]] == ["InitiatorQueue", "TargetQueue"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"queus": [{"name": "Q"}]}, "queus"),
        (
            {"message_types": [{"name": "//t/X", "validation": "XML"}]},
            "message_types.0.validation",
        ),
    ],
)
def test_invalid_catalog_is_refused_naming_the_field(
    settings: Deployment, tmp_path: Path, change: dict[str, Any], field: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**BASIC_CATALOG, **change}))
    reason = refused(ksb(settings, "catalog", "apply", str(path)))
    assert field in reason
    assert shown(settings)["version"] == 0  # nothing was applied


def test_sql_applies_priority_and_queue_changes(
    settings: Deployment, catalog: Catalog, tmp_path: Path
) -> None:
    create = (
        "CREATE BROKER PRIORITY TargetHigh FOR CONVERSATION\n"
        "  SET (CONTRACT_NAME = [//t/Contract], LOCAL_SERVICE_NAME = [//t/Target],\n"
        "       REMOTE_SERVICE_NAME = ANY, PRIORITY_LEVEL = 8);"
    )
    out = ok(ksb(settings, "sql", create))
    assert f"catalog version {catalog.version + 1}" in out
    table = ok(ksb(settings, "catalog", "show"))
    assert "TargetHigh" in table and "//t/Target" in table
    [rule] = shown(settings)["priorities"]
    assert rule == {
        "name": "TargetHigh",
        "contract": C,
        "local_service": T,
        "remote_service": "ANY",
        "level": 8,
    }

    script = tmp_path / "queue.sql"
    script.write_text(
        "USE Orders\nGO\n"
        "ALTER QUEUE dbo.TargetQueue WITH STATUS = OFF,\n"
        "  POISON_MESSAGE_HANDLING (STATUS = OFF);\n"
        "ALTER BROKER PRIORITY TargetHigh FOR CONVERSATION SET (PRIORITY_LEVEL = 3)\n"
    )
    ok(ksb(settings, "sql", "--file", str(script)))
    after = shown(settings)
    assert after["version"] == catalog.version + 2
    target = next(q for q in after["queues"] if q["name"] == "TargetQueue")
    assert (target["status"], target["poison_message_handling"]) == ("OFF", "OFF")
    assert after["priorities"][0]["level"] == 3


def test_sql_bad_statement_points_at_the_token(settings: Deployment, catalog: Catalog) -> None:
    reason = refused(ksb(settings, "sql", "CREATE BROKER PRIORTY p FOR CONVERSATION"))
    first, source, caret = reason.splitlines()[:3]
    assert first.startswith("error: line 1, column 15: unexpected 'PRIORTY'")
    assert source == "CREATE BROKER PRIORTY p FOR CONVERSATION"
    assert caret == " " * 14 + "^"
    out_of_range = refused(
        ksb(settings, "sql", "CREATE BROKER PRIORITY p FOR CONVERSATION SET (PRIORITY_LEVEL = 11)")
    )
    assert "PRIORITY_LEVEL 11 is outside 1..10" in out_of_range
    unknown = refused(ksb(settings, "sql", "ALTER QUEUE NoSuchQueue WITH STATUS = OFF"))
    assert "NoSuchQueue" in unknown
    assert shown(settings)["version"] == catalog.version


def test_endpoints_leaked_errors_and_queue_peek(
    settings: Deployment, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    # A: the target ends WITH CLEANUP, so the initiator is left open with nobody on the far side.
    cleaned = client.begin_dialog(INITIATOR, T, C)
    client.send(cleaned, "//t/Request", "{}")
    client.flush()
    [first] = receive_all(client, "TargetQueue", 1)
    client.end_conversation(first.conversation_handle, cleanup=True)
    # B: the initiator ends; the target is told but never ends its side.
    ended = client.begin_dialog(INITIATOR, T, C)
    client.send(ended, "//t/Request", '{"n": 1}')
    client.end_conversation(ended)
    # C: a healthy conversation in progress.
    healthy = client.begin_dialog(INITIATOR, T, C)
    client.send(healthy, "//t/Request", '{"n": 2}')
    client.begin_dialog(INITIATOR, "//t/Nobody", C)
    client.flush()
    wait_endpoint(settings, first.conversation_handle, "CLOSED")
    ended_target = wait_endpoint(settings, ended, "DISCONNECTED_OUTBOUND").far_handle
    assert ended_target is not None
    wait_endpoint(settings, ended_target, "DISCONNECTED_INBOUND")
    errors(settings)

    listed = json.loads(ok(ksb(settings, "endpoints", "--json")))
    states = {row["handle"]: row["state"] for row in listed}
    assert first.conversation_handle not in states  # CLOSED ones only with --all
    assert states[ended_target] == "DISCONNECTED_INBOUND"
    assert states[healthy] == "CONVERSING"
    everything = json.loads(ok(ksb(settings, "endpoints", "--all", "--json")))
    assert any(row["handle"] == first.conversation_handle for row in everything)

    leaks = json.loads(ok(ksb(settings, "endpoints", "--leaked", "--json")))
    by_handle = {row["handle"]: row for row in leaks}
    # The far side was cleaned up: reported at once. (The one-sided end may also show up already
    # if this machine is slow enough for its 5 s grace to pass; it is checked below.)
    assert by_handle[cleaned]["role"] == "initiator"
    assert "still CONVERSING" in by_handle[cleaned]["reason"]
    assert set(by_handle) <= {cleaned, ended_target}

    time.sleep(ONE_SIDED_GRACE_MS / 1000 + 0.5)
    leaks = json.loads(ok(ksb(settings, "endpoints", "--leaked", "--json")))
    by_handle = {row["handle"]: row for row in leaks}
    assert set(by_handle) == {cleaned, ended_target}
    assert "never ended" in by_handle[ended_target]["reason"]
    table = ok(ksb(settings, "endpoints", "--leaked"))
    assert ended_target in table and "DISCONNECTED_INBOUND" in table
    idle = json.loads(ok(ksb(settings, "endpoints", "--leaked", "--idle-s", "1", "--json")))
    assert healthy in {row["handle"] for row in idle}

    # The refusals go to the sender's errors topic: the operator reads the owner's by name.
    sender = settings.sender or ""
    whose = ["--principal", sender] if sender else []
    [error] = json.loads(ok(ksb(settings, "errors", "--json", *whose)))
    assert error["code"] == "unknown_service"
    assert "unknown_service" in ok(ksb(settings, "errors", *whose))

    ready = json.loads(ok(ksb(settings, "queue", "peek", "TargetQueue", "--json")))
    by_conversation: dict[str, list[str]] = {}
    for m in ready:
        by_conversation.setdefault(m["conversation_id"], []).append(m["message_type_name"])
    assert by_conversation == {ended: ["//t/Request", END_DIALOG], healthy: ["//t/Request"]}
    first_only = ok(ksb(settings, "queue", "peek", "TargetQueue", "--limit", "1"))
    assert "3 ready" in first_only
    assert ready[0]["message_id"] in first_only and ready[-1]["message_id"] not in first_only
    assert "NoSuchQueue" in refused(ksb(settings, "queue", "peek", "NoSuchQueue"))

    def target_depth() -> int:
        rows = json.loads(ok(ksb(settings, "queue", "depth", "--json")))
        return sum(r["depth"] for r in rows if r["queue"] == "TargetQueue")

    wait_for("the target queue's depth written", lambda: target_depth() == len(ready), 10, 0.2)
    assert "TargetQueue" in ok(ksb(settings, "queue", "depth"))


def test_principal_add_by_a_non_admin_is_one_line_not_a_crash(
    settings: Deployment, tmp_path: Path
) -> None:
    """`ksb principal add` as the operator aborted with ``munmap_chunk(): invalid pointer``
    (exit 134): librdkafka frees a string it does not own when Kafka refuses a SCRAM describe.
    Run as a real process, since a regression kills the process that runs it."""
    if not settings.secured:
        pytest.skip("a stack without ACLs refuses nobody")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KSB_")}
    command = "from ksb.cli import main; main()"
    args = ["principal", "add", "erin", "--store", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, "-c", command, *args],
        env={**env, **operator_env(settings)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, f"exit {result.returncode}: {result.stderr}"
    [line] = result.stderr.splitlines()
    assert line.startswith("error: this Kafka login may not manage users"), line
    assert "run it as admin" in line
    assert list(tmp_path.iterdir()) == []  # no password was generated for a refused command
