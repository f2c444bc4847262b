"""DDL applied to a catalog as SQL Server runs a script: existence, references, ALTER, atomicity."""

from __future__ import annotations

from pathlib import Path

import pytest

from ksb.catalog.ddl import parse
from ksb.catalog.ddl_apply import apply_script
from ksb.catalog.model import Catalog, Grant, Validation, parse_catalog
from ksb.errors import DdlError, ValidationFailed

DATA = Path(__file__).parents[1] / "data" / "sql"

BASE = """\
CREATE MESSAGE TYPE [//x/Req] VALIDATION = WELL_FORMED_XML;
CREATE MESSAGE TYPE [//x/Rep] VALIDATION = NONE;
CREATE CONTRACT [//x/C] ([//x/Req] SENT BY INITIATOR, [//x/Rep] SENT BY TARGET);
CREATE QUEUE Q1;
CREATE QUEUE Q2 WITH PARTITIONS = 2;
CREATE SERVICE [//x/Client] ON QUEUE Q1;
CREATE SERVICE [//x/Server] ON QUEUE Q2 ([//x/C]);
"""


def run(text: str, catalog: Catalog | None = None) -> Catalog:
    return apply_script(catalog if catalog is not None else Catalog(), parse(text))


@pytest.fixture
def base() -> Catalog:
    return run(BASE)


def refused(text: str, catalog: Catalog) -> DdlError:
    with pytest.raises(DdlError) as caught:
        run(text, catalog)
    return caught.value


def test_base_script_builds_the_catalog(base: Catalog) -> None:
    assert [m.name for m in base.message_types] == ["//x/Req", "//x/Rep"]
    assert base.message_types[0].validation is Validation.WELL_FORMED_XML
    assert [(q.name, q.partitions) for q in base.queues] == [("Q1", 1), ("Q2", 2)]
    assert base.services[1].contracts == ("//x/C",)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("CREATE QUEUE Q1", "queue 'Q1' already exists"),
        ("CREATE MESSAGE TYPE [DEFAULT]", "message type 'DEFAULT' already exists"),
        ("CREATE CONTRACT [//x/C] ([//x/Req] SENT BY ANY)", "contract '//x/C' already exists"),
        ("CREATE SERVICE [//x/Client] ON QUEUE Q1", "service '//x/Client' already exists"),
        ("ALTER QUEUE Nope WITH STATUS = OFF", "queue 'Nope' does not exist"),
        ("DROP SERVICE Nope", "service 'Nope' does not exist"),
        ("DROP CONTRACT [DEFAULT]", "contract 'DEFAULT' is built in"),
        ("CREATE SERVICE S ON QUEUE Nope", "queue 'Nope' does not exist"),
        ("CREATE SERVICE S ON QUEUE Q1 (Nope)", "contract 'Nope' does not exist"),
        ("CREATE CONTRACT C2 (Nope SENT BY ANY)", "message type 'Nope' does not exist"),
        (
            "CREATE MESSAGE TYPE M VALIDATION = VALID_XML WITH SCHEMA COLLECTION Nope",
            "XML schema collection 'Nope' does not exist",
        ),
        ("ALTER SERVICE [//x/Server] (ADD CONTRACT [//x/C])", "already has contract '//x/C'"),
        ("ALTER SERVICE [//x/Server] (DROP CONTRACT [DEFAULT])", "has no contract 'DEFAULT'"),
        ("GRANT SEND ON SERVICE::Nope TO app", "service 'Nope' does not exist"),
        ("GRANT RECEIVE ON Nope TO app", "queue 'Nope' does not exist"),
        ("CREATE QUEUE [Order Queue]", "name: String should match pattern"),
        ("CREATE XML SCHEMA COLLECTION S AS N'<notxsd/>'", "not xsd:schema"),
        (
            "CREATE BROKER PRIORITY a FOR CONVERSATION; CREATE BROKER PRIORITY b FOR CONVERSATION",
            "'b' has the same contract and services as 'a'",
        ),
    ],
)
def test_sql_server_refusals_name_the_object(base: Catalog, text: str, fragment: str) -> None:
    error = refused(text, base)
    assert fragment in error.reason, error.reason
    assert error.line == 1 and error.column >= 1


@pytest.mark.parametrize(
    ("text", "users"),
    [
        ("DROP MESSAGE TYPE [//x/Req]", "contract '//x/C'"),
        ("DROP CONTRACT [//x/C]", "service '//x/Server'"),
        ("DROP QUEUE Q2", "service '//x/Server'"),
    ],
)
def test_drop_of_an_object_still_in_use_is_refused(base: Catalog, text: str, users: str) -> None:
    assert f"is still used by {users}" in refused(text, base).reason


def test_drop_in_dependency_order_empties_the_catalog(base: Catalog) -> None:
    after = run(
        "DROP SERVICE [//x/Server]; DROP SERVICE [//x/Client]; DROP CONTRACT [//x/C];\n"
        "DROP MESSAGE TYPE [//x/Req]; DROP MESSAGE TYPE [//x/Rep]; DROP QUEUE Q1; DROP QUEUE Q2",
        base,
    )
    assert after == Catalog()


def test_drop_of_a_queue_used_by_an_event_notification_is_refused() -> None:
    catalog = parse_catalog(
        {"queues": [{"name": "Q"}], "event_notifications": [{"name": "n", "queue": "Q"}]}
    )
    assert "event notification 'n'" in refused("DROP QUEUE Q", catalog).reason


def test_alter_changes_only_the_clauses_given(base: Catalog) -> None:
    started = run(
        "ALTER QUEUE Q2 WITH RETENTION = ON, ACTIVATION (STATUS = ON, PROCEDURE_NAME = [m:f],"
        " MAX_QUEUE_READERS = 4)",
        base,
    )
    q2 = started.queues[1]
    assert (q2.status, q2.retention, q2.partitions) == ("ON", "ON", 2)
    assert (q2.activation.status, q2.activation.procedure, q2.activation.max_queue_readers) == (
        "ON",
        "m:f",
        4,
    )
    off = run("ALTER QUEUE Q2 WITH ACTIVATION (STATUS = OFF)", started).queues[1]
    assert (off.activation.status, off.activation.procedure, off.retention) == ("OFF", "m:f", "ON")
    command = run("ALTER QUEUE Q2 WITH ACTIVATION (COMMAND = 'run')", started).queues[1]
    assert (command.activation.procedure, command.activation.command) == (None, "run")
    dropped = run("ALTER QUEUE Q2 WITH ACTIVATION (DROP)", started).queues[1]
    assert dropped.activation == type(dropped.activation)()
    assert dropped.retention == "ON"
    with_dead = run("ALTER QUEUE Q2 WITH DEAD_LETTER (MAX_ROLLBACKS = 2)", base)
    again = run("ALTER QUEUE Q2 WITH DEAD_LETTER (ERROR_CODE = 7)", with_dead).queues[1]
    assert again.dead_letter is not None
    assert (again.dead_letter.max_rollbacks, again.dead_letter.error_code) == (2, 7)
    assert run("ALTER QUEUE Q2 WITH DEAD_LETTER (DROP)", with_dead).queues[1].dead_letter is None


def test_alter_service_route_message_type_and_database(base: Catalog) -> None:
    after = run(
        "ALTER SERVICE [//x/Server] ON QUEUE Q1 (ADD CONTRACT [DEFAULT], DROP CONTRACT [//x/C]);\n"
        "CREATE ROUTE R WITH SERVICE_NAME = '//far/S', BROKER_INSTANCE = 'far', ADDRESS = 'LOCAL';\n"
        "ALTER ROUTE R WITH LIFETIME = 30;\n"
        "ALTER MESSAGE TYPE [//x/Req] VALIDATION = EMPTY;\n"
        "ALTER DATABASE CURRENT SET HONOR_BROKER_PRIORITY OFF;\n"
        "ALTER DATABASE CURRENT SET ENABLE_BROKER;",
        base,
    )
    server = after.services[1]
    assert (server.queue, server.contracts) == ("Q1", ("DEFAULT",))
    route = after.routes[0]
    assert (route.service_name, route.broker_instance, route.address, route.lifetime_s) == (
        "//far/S",
        "far",
        "LOCAL",
        30,
    )
    assert after.message_types[0].validation is Validation.EMPTY
    assert after.honor_broker_priority is False


def test_grant_and_revoke(base: Catalog) -> None:
    granted = run(
        "GRANT SEND ON SERVICE::[//x/Server] TO app, ops;\n"
        "GRANT RECEIVE ON OBJECT::dbo.Q2 TO app;\n"
        "GRANT SEND ON SERVICE::[//x/Server] TO app;",  # again: nothing more, as in SQL Server
        base,
    )
    assert granted.grants == (
        Grant(permission="SEND", target="//x/Server", principal="app"),
        Grant(permission="SEND", target="//x/Server", principal="ops"),
        Grant(permission="RECEIVE", target="Q2", principal="app"),
    )
    revoked = run(
        "REVOKE SEND ON SERVICE::[//x/Server] FROM ops; REVOKE RECEIVE ON Q2 FROM nobody", granted
    )
    assert [g.principal for g in revoked.grants] == ["app", "app"]
    # Dropping an object drops the permissions on it, as SQL Server does.
    dropped = run("DROP SERVICE [//x/Server]", revoked)
    assert dropped.grants == (Grant(permission="RECEIVE", target="Q2", principal="app"),)


def test_catalog_refuses_bad_grants() -> None:
    base = {"queues": [{"name": "Q"}], "services": [{"name": "S", "queue": "Q"}]}
    grant = {"permission": "SEND", "target": "S", "principal": "p"}
    for grants, fragment in (
        ([grant, grant], "duplicate grant"),
        ([{**grant, "target": "Q"}], "SEND on unknown service 'Q'"),
        ([{**grant, "permission": "RECEIVE"}], "RECEIVE on unknown queue 'S'"),
        ([{**grant, "extra": 1}], "grants.0.extra"),
        ([{**grant, "permission": "CONTROL"}], "grants.0.permission"),
    ):
        with pytest.raises(Exception, match=fragment):
            parse_catalog({**base, "grants": grants})


def test_a_failing_statement_leaves_the_catalog_untouched(base: Catalog) -> None:
    before = base.model_dump()
    with pytest.raises(DdlError) as caught:
        run("CREATE QUEUE Q3;\nCREATE SERVICE S3 ON QUEUE Q3;\nDROP QUEUE Q3", base)
    assert caught.value.line == 3
    assert "DROP QUEUE Q3: queue 'Q3' is still used by service 'S3'" in caught.value.reason
    assert base.model_dump() == before


def test_one_database_per_script() -> None:
    with pytest.raises(DdlError) as caught:
        run("USE a; CREATE QUEUE Q;\nUSE b;\nCREATE QUEUE R")
    assert caught.value.line == 3
    assert "databases 'a' and 'b'" in caught.value.reason
    # The tutorials' `USE master; ALTER DATABASE ... SET ENABLE_BROKER; USE App;` is fine.
    assert run((DATA / "lesson1-conversation-objects.sql").read_text()).services


def test_xml_schema_collection_validates_bodies_and_cannot_go_while_used() -> None:
    catalog = run((DATA / "expense-report-schema.sql").read_text())
    [collection] = catalog.xml_schema_collections
    assert collection.name == "ExpenseReportSchema" and "UTF-16" in collection.xsd
    [message_type] = catalog.message_types
    ns = "http://Adventure-Works.com/schemas/expenseReport"
    message_type.validate_body(
        f'<ExpenseReport xmlns="{ns}"><EmployeeName>a</EmployeeName><EmployeeID>1</EmployeeID>'
        "<ItemDetail><Date>2026-01-01</Date><CostCenter>c</CostCenter><Total>1</Total>"
        "<Currency>E</Currency><Description>d</Description></ItemDetail></ExpenseReport>".encode()
    )
    with pytest.raises(ValidationFailed, match="fails its XML schema"):
        message_type.validate_body(f'<ExpenseReport xmlns="{ns}"/>'.encode())
    error = refused("DROP XML SCHEMA COLLECTION ExpenseReportSchema", catalog)
    assert "still used by message type '//Adventure-Works.com/Expenses/SubmitExpense'" in (
        error.reason
    )
    emptied = run(
        "DROP MESSAGE TYPE [//Adventure-Works.com/Expenses/SubmitExpense];\n"
        "DROP XML SCHEMA COLLECTION ExpenseReportSchema",
        catalog,
    )
    assert emptied == Catalog()
