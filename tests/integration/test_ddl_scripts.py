"""Service Broker's own documentation scripts through `ksb sql`, then a real dialog on the result.

The scripts in tests/data/sql are pasted unchanged from the documentation; each test applies some
through the CLI as an operator would, starts a dispatcher on the resulting catalog and holds a
dialog with the SDK: BEGIN, SEND, RECEIVE, reply, END on both sides. Where a documentation script
defines only one side (a message type, a service), a short KSB script adds the rest.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from devtools.deployment import Deployment, secure_instance
from ksb.catalog.model import END_DIALOG, ERROR
from ksb.sdk.client import KsbClient
from tests.integration.conftest import ThreadDispatcher, secure
from tests.integration.support import receive_all, wait_endpoint, wait_error
from tests.integration.test_cli import ksb, ok, refused, shown

pytestmark = pytest.mark.integration

DATA = Path(__file__).parents[1] / "data" / "sql"
EXPENSES = "//Adventure-Works.com/Expenses"
REPORT_NS = "http://Adventure-Works.com/schemas/expenseReport"


def apply_files(settings: Deployment, *names: str) -> None:
    for name in names:
        ok(ksb(settings, "sql", "--file", str(DATA / name)))


def dialog(
    client: KsbClient,
    settings: Deployment,
    names: tuple[str, str, str],
    queues: tuple[str, str],
    request: tuple[str, str],
    reply: tuple[str, str],
) -> None:
    """BEGIN and SEND the request, RECEIVE it and reply and END, then RECEIVE the reply and END."""
    initiator, target, contract = names
    initiator_queue, target_queue = queues
    handle = client.begin_dialog(initiator, target, contract)
    client.send(handle, *request)
    client.flush()
    [got] = receive_all(client, target_queue, 1)
    assert (got.message_type_name, got.message_body.decode()) == request
    assert got.service_name == target and got.service_contract_name == contract
    assert got.validation == "X"  # every request type in these scripts is validated as XML
    with client.transaction() as tx:
        tx.send(got.conversation_handle, *reply)
        tx.end_conversation(got.conversation_handle)
    answers = receive_all(client, initiator_queue, 2)
    assert [(m.message_type_name, m.message_body.decode()) for m in answers] == [
        reply,
        (END_DIALOG, ""),
    ]
    client.end_conversation(handle)
    client.flush()
    wait_endpoint(settings, handle, "CLOSED")
    wait_endpoint(settings, got.conversation_handle, "CLOSED")


def test_single_database_tutorial_and_priority_scripts(
    settings: Deployment, client: KsbClient
) -> None:
    apply_files(
        settings,
        "lesson1-conversation-objects.sql",
        "priority-initiator.sql",
    )
    catalog = shown(settings)
    assert catalog["version"] == 2
    [rule] = catalog["priorities"]
    assert (rule["local_service"], rule["level"]) == ("InitiatorSerivce", 3)  # pasted as is
    # The target database's script is for another database: alone it applies.
    apply_files(settings, "priority-target.sql")
    assert len(shown(settings)["priorities"]) == 2
    d = ThreadDispatcher(settings)
    try:
        dialog(
            client,
            settings,
            (
                "//AWDB/1DBSample/InitiatorService",
                "//AWDB/1DBSample/TargetService",
                "//AWDB/1DBSample/SampleContract",
            ),
            ("InitiatorQueue1DB", "TargetQueue1DB"),
            (
                "//AWDB/1DBSample/RequestMessage",
                "<RequestMsg>Message for Target service.</RequestMsg>",
            ),
            (
                "//AWDB/1DBSample/ReplyMessage",
                "<ReplyMsg>Message for Initiator service.</ReplyMsg>",
            ),
        )
        # WELL_FORMED_XML is checked at SEND: a body that is not XML errors its dialog.
        bad = client.begin_dialog(
            "//AWDB/1DBSample/InitiatorService",
            "//AWDB/1DBSample/TargetService",
            "//AWDB/1DBSample/SampleContract",
        )
        client.send(bad, "//AWDB/1DBSample/RequestMessage", "<RequestMsg>unclosed")
        client.flush()
        [err] = receive_all(client, "InitiatorQueue1DB", 1)
        assert err.message_type_name == ERROR and err.conversation_handle == bad
        assert "well-formed XML" in json.loads(err.message_body)["description"]
        wait_endpoint(settings, bad, "ERROR")
    finally:
        d.stop()


def test_expense_scripts_with_activation_route_and_grants(
    settings: Deployment, client: KsbClient
) -> None:
    apply_files(
        settings,
        "expense-contract.sql",
        "expense-queue.sql",
        "expense-service.sql",
        "expense-route.sql",
    )
    ok(
        ksb(
            settings,
            "sql",
            "CREATE QUEUE ExpenseClientQueue;\n"
            f"CREATE SERVICE [{EXPENSES}/Client] ON QUEUE ExpenseClientQueue;\n"
            "CREATE QUEUE StoreFrontQueue; CREATE SERVICE StoreFront ON QUEUE StoreFrontQueue;\n"
            "CREATE QUEUE OrderingQueue; CREATE SERVICE Ordering ON QUEUE OrderingQueue ([DEFAULT]);",
        )
    )
    apply_files(settings, "local-service-permissions.sql")
    catalog = shown(settings)
    expense_queue = next(q for q in catalog["queues"] if q["name"] == "ExpenseQueue")
    assert expense_queue["activation"] == {
        "status": "ON",
        "procedure": "expense_procedure",
        "command": None,
        "max_queue_readers": 5,
        "execute_as": "ExpenseUser",
    }
    assert catalog["routes"][0]["address"] == "www.Adventure-Works.com:1234"
    assert catalog["grants"] == [
        {"permission": "SEND", "target": "Ordering", "principal": "BrokerApplicationUser"},
        {
            "permission": "RECEIVE",
            "target": "StoreFrontQueue",
            "principal": "BrokerApplicationUser",
        },
    ]
    table = ok(ksb(settings, "catalog", "show"))
    assert "Grants" in table and "SERVICE::Ordering" in table and "BrokerApplicationUser" in table
    d = ThreadDispatcher(settings)
    try:
        dialog(
            client,
            settings,
            (f"{EXPENSES}/Client", EXPENSES, f"{EXPENSES}/ExpenseSubmission"),
            ("ExpenseClientQueue", "ExpenseQueue"),
            (f"{EXPENSES}/SubmitExpense", "<expense amount='12.50'/>"),
            (f"{EXPENSES}/ExpenseApprovedOrDenied", "<approved/>"),
        )
        _grants_mean_what_sql_server_means(settings, client)
    finally:
        d.stop()


def _grants_mean_what_sql_server_means(settings: Deployment, client: KsbClient) -> None:
    """The pasted grants, as SQL Server means them: BrokerApplicationUser, which may RECEIVE
    from StoreFrontQueue, acts as StoreFront, and SEND on Ordering lets it begin dialogs with
    Ordering; it does not let it act as Ordering."""
    if not settings.secured:
        return
    app = secure(settings).as_principal("BrokerApplicationUser")
    with KsbClient(app) as store_front:
        handle = store_front.begin_dialog("StoreFront", "Ordering", "DEFAULT")
        store_front.send(handle, "DEFAULT", "order 1")
        posing = store_front.begin_dialog("Ordering", "StoreFront", "DEFAULT")
        store_front.flush()
        err = wait_error(app, lambda r: r.get("handle") == posing)
        assert err["code"] == "not_authorized" and "as service 'Ordering'" in err["reason"], err
    [order] = receive_all(client, "OrderingQueue", 1)
    assert order.message_body.decode() == "order 1" and order.conversation_id == handle


def expense_report(total: str) -> str:
    item = (
        f"<ItemDetail><Date>2026-11-23</Date><CostCenter>R&amp;D</CostCenter><Total>{total}</Total>"
        "<Currency>EUR</Currency><Description>train</Description></ItemDetail>"
    )
    return (
        f'<ExpenseReport xmlns="{REPORT_NS}"><EmployeeName>Ana</EmployeeName>'
        f"<EmployeeID>42</EmployeeID>{item}</ExpenseReport>"
    )


def test_typed_xml_message_type_validates_every_send(
    settings: Deployment, client: KsbClient
) -> None:
    apply_files(settings, "expense-report-schema.sql")
    ok(
        ksb(
            settings,
            "sql",
            f"CREATE MESSAGE TYPE [{EXPENSES}/Approved] VALIDATION = EMPTY;\n"
            f"CREATE CONTRACT [{EXPENSES}/Typed] ([{EXPENSES}/SubmitExpense] SENT BY INITIATOR,\n"
            f"  [{EXPENSES}/Approved] SENT BY TARGET);\n"
            "CREATE QUEUE Clerk; CREATE QUEUE Accounts;\n"
            "CREATE SERVICE Clerk ON QUEUE Clerk;\n"
            f"CREATE SERVICE Accounts ON QUEUE Accounts ([{EXPENSES}/Typed]);",
        )
    )
    # The collection is used by the message type: SQL Server refuses to drop it, so do we.
    still_used = refused(ksb(settings, "sql", "DROP XML SCHEMA COLLECTION ExpenseReportSchema"))
    assert "still used by message type" in still_used
    d = ThreadDispatcher(settings)
    try:
        dialog(
            client,
            settings,
            ("Clerk", "Accounts", f"{EXPENSES}/Typed"),
            ("Clerk", "Accounts"),
            (f"{EXPENSES}/SubmitExpense", expense_report("12.50")),
            (f"{EXPENSES}/Approved", ""),
        )
        bad = client.begin_dialog("Clerk", "Accounts", f"{EXPENSES}/Typed")
        client.send(bad, f"{EXPENSES}/SubmitExpense", expense_report("a lot"))
        client.flush()
        [err] = receive_all(client, "Clerk", 1)
        assert err.message_type_name == ERROR and err.conversation_handle == bad
        assert "xs:decimal" in json.loads(err.message_body)["description"]
        wait_endpoint(settings, bad, "ERROR")
    finally:
        d.stop()


def test_export_sql_rebuilds_the_catalog_on_a_fresh_instance(
    settings: Deployment, tmp_path: Path
) -> None:
    apply_files(settings, "lesson1-conversation-objects.sql", "expense-report-schema.sql")
    ok(ksb(settings, "sql", "GRANT RECEIVE ON TargetQueue1DB TO app"))
    before = shown(settings)
    # A script that fails on its last statement stores nothing, not even its first one.
    reason = refused(ksb(settings, "sql", "CREATE QUEUE Extra;\nDROP QUEUE TargetQueue1DB"))
    assert reason.startswith("error: line 2, column 1: DROP QUEUE TargetQueue1DB: ")
    assert "still used by service '//AWDB/1DBSample/TargetService'" in reason
    assert shown(settings) == before

    script = tmp_path / "export.sql"
    script.write_text(ok(ksb(settings, "catalog", "export", "--sql")))
    assert script.read_text().startswith(f"-- catalog version {before['version']} of instance ")
    fresh = secure_instance(settings.model_copy(update={"instance": f"{settings.instance}x"}))
    ok(ksb(fresh, "sql", "--file", str(script)))
    after = shown(fresh)
    assert after["version"] == 1

    def definitions(catalog: dict[str, object]) -> dict[str, object]:
        return {k: v for k, v in catalog.items() if k not in {"version", "applied_ms"}}

    assert definitions(after) == definitions(before)
    as_yaml = yaml.safe_load(ok(ksb(settings, "catalog", "export")))
    assert as_yaml == definitions(before)
