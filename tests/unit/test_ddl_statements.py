"""Each DDL statement kind and clause parsed into catalog terms; each refusal at its token."""

from __future__ import annotations

import pytest

from ksb.catalog.ddl import parse
from ksb.catalog.ddl_statements import Alter, Create, DatabaseOption, Drop, Permission, UseDatabase
from ksb.errors import DdlError


def one(text: str) -> object:
    (statement,) = parse(text)
    return statement


def refusal(text: str) -> DdlError:
    with pytest.raises(DdlError) as caught:
        parse(text)
    return caught.value


NO_SCHEMA = {"schema": None, "xml_schema_collection": None}


@pytest.mark.parametrize(
    ("clause", "fields"),
    [
        ("", {}),
        ("VALIDATION = NONE", {"validation": "NONE", **NO_SCHEMA}),
        ("VALIDATION = EMPTY", {"validation": "EMPTY", **NO_SCHEMA}),
        ("VALIDATION = WELL_FORMED_XML", {"validation": "WELL_FORMED_XML", **NO_SCHEMA}),
        ("VALIDATION = WELL_FORMED_JSON", {"validation": "WELL_FORMED_JSON", **NO_SCHEMA}),
        (
            "VALIDATION = VALID_XML WITH SCHEMA COLLECTION [Reports]",
            {"validation": "VALID_XML", "schema": None, "xml_schema_collection": "Reports"},
        ),
        (
            'VALIDATION = VALID_JSON WITH SCHEMA N\'{"type": "object"}\'',
            {"validation": "SCHEMA", "schema": {"type": "object"}, "xml_schema_collection": None},
        ),
        ("AUTHORIZATION dbo VALIDATION = EMPTY", {"validation": "EMPTY", **NO_SCHEMA}),
    ],
)
def test_create_message_type_each_validation(clause: str, fields: dict[str, object]) -> None:
    assert one(f"CREATE MESSAGE TYPE [//x/M] {clause}") == Create("MESSAGE TYPE", "//x/M", fields)


def test_alter_and_drop_message_type() -> None:
    assert one("ALTER MESSAGE TYPE [//x/M] VALIDATION = WELL_FORMED_XML") == Alter(
        "MESSAGE TYPE", "//x/M", {"validation": "WELL_FORMED_XML", **NO_SCHEMA}
    )
    assert one("DROP MESSAGE TYPE [//x/M]") == Drop("MESSAGE TYPE", "//x/M")


def test_contract_with_default_and_each_sent_by() -> None:
    statement = one(
        "CREATE CONTRACT [//x/C] AUTHORIZATION dbo ([//x/A] SENT BY INITIATOR, "
        "[//x/B] SENT BY TARGET, [DEFAULT] SENT BY ANY)"
    )
    assert statement == Create(
        "CONTRACT",
        "//x/C",
        {
            "messages": [
                {"type": "//x/A", "sent_by": "INITIATOR"},
                {"type": "//x/B", "sent_by": "TARGET"},
                {"type": "DEFAULT", "sent_by": "ANY"},
            ]
        },
    )
    assert one("DROP CONTRACT [//x/C]") == Drop("CONTRACT", "//x/C")


def test_create_queue_every_clause() -> None:
    statement = one(
        "CREATE QUEUE dbo.Q WITH STATUS = OFF, RETENTION = ON, PARTITIONS = 4,\n"
        "  ACTIVATION (STATUS = OFF, PROCEDURE_NAME = [app.readers:handle],\n"
        "    MAX_QUEUE_READERS = 3, EXECUTE AS 'reader'),\n"
        "  POISON_MESSAGE_HANDLING (STATUS = OFF),\n"
        "  DEAD_LETTER (MAX_ROLLBACKS = 2, ERROR_CODE = -50)\n"
        "  ON [DEFAULT]"
    )
    assert statement == Create(
        "QUEUE",
        "Q",
        {
            "status": "OFF",
            "retention": "ON",
            "partitions": 4,
            "activation": {
                "status": "OFF",
                "procedure": "app.readers:handle",
                "command": None,
                "max_queue_readers": 3,
                "execute_as": "reader",
            },
            "poison_message_handling": "OFF",
            "dead_letter": {"max_rollbacks": 2, "error_code": -50},
        },
    )


def test_activation_in_create_defaults_to_on_and_command_replaces_procedure() -> None:
    created = one("CREATE QUEUE Q WITH ACTIVATION (COMMAND = N'python -m reader')")
    assert created == Create(
        "QUEUE",
        "Q",
        {"activation": {"command": "python -m reader", "procedure": None, "status": "ON"}},
    )
    altered = one("ALTER QUEUE Q WITH ACTIVATION (PROCEDURE_NAME = p), DEAD_LETTER (DROP)")
    assert altered == Alter(
        "QUEUE", "Q", {"activation": {"procedure": "p", "command": None}, "dead_letter": None}
    )
    assert one("DROP QUEUE [dbo].[Q]") == Drop("QUEUE", "Q")


def test_service_forms() -> None:
    assert one("CREATE SERVICE [//x/S] ON QUEUE [dbo].[Q]") == Create(
        "SERVICE", "//x/S", {"queue": "Q", "contracts": []}
    )
    assert one("CREATE SERVICE S AUTHORIZATION dbo ON QUEUE Q ([//x/C], [DEFAULT])") == Create(
        "SERVICE", "S", {"queue": "Q", "contracts": ["//x/C", "DEFAULT"]}
    )
    assert one("CREATE SERVICE S AUTHORIZATION [olga] ON QUEUE Q") == Create(
        "SERVICE", "S", {"queue": "Q", "contracts": [], "owner": "olga"}
    )
    assert one("ALTER SERVICE S ON QUEUE Q2") == Alter("SERVICE", "S", {"queue": "Q2"})
    assert one("ALTER SERVICE S (ADD CONTRACT A, DROP CONTRACT B, ADD CONTRACT C)") == Alter(
        "SERVICE", "S", {"add_contracts": ["A", "C"], "drop_contracts": ["B"]}
    )
    assert one("DROP SERVICE S") == Drop("SERVICE", "S")


def test_route_forms_and_addresses() -> None:
    assert one(
        "CREATE ROUTE R WITH SERVICE_NAME = N'//x/S', BROKER_INSTANCE = 'b-1', LIFETIME = 60,\n"
        "  ADDRESS = 'TCP://kafka-b:9092', VIA = 'hop'"
    ) == Create(
        "ROUTE",
        "R",
        {
            "service_name": "//x/S",
            "broker_instance": "b-1",
            "lifetime_s": 60,
            "address": "kafka-b:9092",
            "via": "hop",
        },
    )
    assert one("ALTER ROUTE R WITH ADDRESS = 'local'") == Alter("ROUTE", "R", {"address": "LOCAL"})
    assert one("ALTER ROUTE R WITH ADDRESS = 'k1:9092,k2:9092'") == Alter(
        "ROUTE", "R", {"address": "k1:9092,k2:9092"}
    )
    assert one("DROP ROUTE R") == Drop("ROUTE", "R")


def test_schema_collection_keeps_the_xsd_text() -> None:
    xsd = "<xsd:schema xmlns:xsd='http://www.w3.org/2001/XMLSchema'/>"
    escaped = xsd.replace("'", "''")
    assert one(f"CREATE XML SCHEMA COLLECTION S AS N'{escaped}'") == Create(
        "XML SCHEMA COLLECTION", "S", {"xsd": xsd}
    )
    assert one("DROP XML SCHEMA COLLECTION S") == Drop("XML SCHEMA COLLECTION", "S")


def test_grant_and_revoke_forms() -> None:
    assert one("GRANT SEND ON SERVICE::[//x/S] TO [app], other") == Permission(
        "GRANT", "SEND", "//x/S", ("app", "other")
    )
    for on in ("[Q]", "dbo.Q", "OBJECT::[dbo].[Q]"):
        assert one(f"GRANT RECEIVE ON {on} TO app") == Permission("GRANT", "RECEIVE", "Q", ("app",))
    assert one("REVOKE SEND ON SERVICE::S FROM app CASCADE") == Permission(
        "REVOKE", "SEND", "S", ("app",)
    )
    assert one("REVOKE RECEIVE ON Q TO app") == Permission("REVOKE", "RECEIVE", "Q", ("app",))


def test_use_and_database_options() -> None:
    assert one("USE [Orders]") == UseDatabase("Orders")
    assert one("ALTER DATABASE CURRENT SET HONOR_BROKER_PRIORITY OFF") == DatabaseOption(
        "CURRENT", "HONOR_BROKER_PRIORITY", False
    )
    assert one("ALTER DATABASE Orders SET ENABLE_BROKER") == DatabaseOption(
        "Orders", "ENABLE_BROKER"
    )


def test_statements_know_where_they_stand() -> None:
    first, second = parse("GO\n  CREATE QUEUE [Q];\nDROP MESSAGE TYPE [//x/M]")
    assert (first.at.line, first.at.column, first.at.statement) == (2, 3, "CREATE QUEUE Q")
    assert (second.at.line, second.at.statement) == (3, "DROP MESSAGE TYPE //x/M")


@pytest.mark.parametrize(
    ("text", "line_column", "fragment"),
    [
        # statements KSB does not have, named at their first word
        ("CREATE CERTIFICATE c WITH SUBJECT = 'x'", (1, 1), "CREATE CERTIFICATE is not supported"),
        ("CREATE MASTER KEY ENCRYPTION BY PASSWORD = 'p'", (1, 1), "CREATE MASTER KEY"),
        (
            "USE d;\nCREATE REMOTE SERVICE BINDING b TO SERVICE 's' WITH USER = u",
            (2, 1),
            "CREATE REMOTE SERVICE BINDING is not supported: KSB has no dialog security",
        ),
        (
            "CREATE ENDPOINT e STATE = STARTED AS TCP (LISTENER_PORT = 4022)\n"
            "  FOR SERVICE_BROKER (ENCRYPTION = REQUIRED)",
            (1, 1),
            "CREATE ENDPOINT is not supported",
        ),
        ("CREATE USER u WITHOUT LOGIN", (1, 1), "CREATE USER is not supported"),
        ("CREATE EVENT NOTIFICATION n ON QUEUE q", (1, 1), "event_notifications in the YAML"),
        ("ALTER CONTRACT c", (1, 1), "SQL Server has no ALTER CONTRACT"),
        ("ALTER XML SCHEMA COLLECTION s ADD N''", (1, 1), "one schema document per collection"),
        ("ALTER AUTHORIZATION ON SERVICE::s TO u", (1, 1), "no object owners"),
        ("DENY SEND ON SERVICE::s TO u", (1, 1), "DENY is not supported"),
        (
            "BEGIN DIALOG @h FROM SERVICE a TO SERVICE 'b' WITH ENCRYPTION = ON",
            (1, 1),
            "BEGIN DIALOG is not supported: it is not DDL",
        ),
        ("CREATE QUEUE q\nRECEIVE * FROM q", (2, 1), "RECEIVE is not supported"),
        # clauses KSB cannot carry out, at their token
        (
            "CREATE ROUTE r WITH SERVICE_NAME = 's', BROKER_INSTANCE = 'b', ADDRESS = 'LOCAL',\n"
            "  MIRROR_ADDRESS = 'TCP://m:4022'",
            (2, 3),
            "CREATE ROUTE r: MIRROR_ADDRESS is not supported",
        ),
        (
            "CREATE ROUTE r WITH SERVICE_NAME = 's', BROKER_INSTANCE = 'b', ADDRESS = 'TRANSPORT'",
            (1, 74),
            "ADDRESS 'TRANSPORT' is not supported",
        ),
        ("CREATE ROUTE r WITH ADDRESS = 'LOCAL'", (1, 1), "SERVICE_NAME is missing"),
        (
            "CREATE ROUTE r WITH SERVICE_NAME = 's', ADDRESS = 'LOCAL'",
            (1, 1),
            "BROKER_INSTANCE is missing",
        ),
        ("CREATE QUEUE q ON ExpenseWorkFileGroup", (1, 19), "a filegroup cannot be chosen"),
        (
            "ALTER QUEUE q WITH PARTITIONS = 2",
            (1, 20),
            "PARTITIONS is fixed when a queue is created",
        ),
        ("CREATE QUEUE q WITH PARTITIONS = 65", (1, 34), "PARTITIONS 65 is outside 1..64"),
        (
            "CREATE QUEUE q WITH ACTIVATION (PROCEDURE_NAME = p, COMMAND = 'c')",
            (1, 53),
            "PROCEDURE_NAME or COMMAND, not both",
        ),
        ("ALTER QUEUE q WITH ACTIVATION (MAX_QUEUE_READERS = 40000)", (1, 52), "outside 0..32767"),
        (
            "GRANT SEND ON SERVICE::s TO u WITH GRANT OPTION",
            (1, 31),
            "grant option is not supported",
        ),
        ("REVOKE GRANT OPTION FOR SEND ON SERVICE::s TO u", (1, 8), "grant option"),
        ("GRANT SEND ON SERVICE::s TO u AS dbo", (1, 31), "AS grantor is not supported"),
        ("GRANT CONTROL ON SERVICE::s TO u", (1, 7), "CONTROL ON SERVICE is not supported"),
        ("GRANT SEND ON q TO u", (1, 7), "SEND ON OBJECT is not supported"),
        ("GRANT RECEIVE ON SERVICE::s TO u", (1, 7), "RECEIVE ON SERVICE is not supported"),
        ("GRANT SEND ON CONTRACT::c TO u", (1, 7), "SEND ON CONTRACT is not supported"),
        ("GRANT SEND, RECEIVE ON SERVICE::s TO u", (1, 13), "one permission per statement"),
        ("GRANT SEND ON SERVICE::s TO u, u", (1, 32), "principal 'u' is listed twice"),
        ("ALTER DATABASE d SET NEW_BROKER", (1, 22), "SET NEW_BROKER is not supported"),
        ("CREATE SERVICE dbo.S ON QUEUE q", (1, 16), "cannot be qualified by a schema"),
        ("CREATE MESSAGE TYPE a.b", (1, 21), "cannot be qualified by a schema"),
        (
            "CREATE CONTRACT c (a SENT BY TARGET)",
            (1, 1),
            "a contract must let the initiator send",
        ),
        ("CREATE CONTRACT c (a SENT BY ANY, a SENT BY TARGET)", (1, 35), "listed twice"),
        ("CREATE SERVICE s ON QUEUE q (c, c)", (1, 33), "contract 'c' is listed twice"),
        (
            "CREATE MESSAGE TYPE m VALIDATION = VALID_JSON WITH SCHEMA '{nope'",
            (1, 59),
            "the JSON schema is not JSON",
        ),
        ("CREATE MESSAGE TYPE m VALIDATION = VALID_JSON WITH SCHEMA '[1]'", (1, 59), "JSON object"),
        ("CREATE ROUTE r WITH LIFETIME = 0, ADDRESS = 'LOCAL'", (1, 32), "LIFETIME 0 is outside"),
        (
            "CREATE QUEUE q WITH STATUS = ON, STATUS = OFF",
            (1, 34),
            "STATUS is given more than once",
        ),
        ("CREATE MESSAGE TYPE m VALIDATION = XML", (1, 36), "unexpected 'XML'"),
    ],
)
def test_refusals_name_the_statement_line_and_column(
    text: str, line_column: tuple[int, int], fragment: str
) -> None:
    error = refusal(text)
    assert (error.line, error.column) == line_column, error.reason
    assert fragment in error.reason
    assert error.reason.startswith(f"line {line_column[0]}, column {line_column[1]}: ")
