"""The DDL parser: pasted SQL Server scripts in, typed statements out, errors at the token.

Broker priorities and ALTER QUEUE; the other statement kinds are in test_ddl_statements.py, their
application to a catalog in test_ddl_apply.py.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from ksb.catalog.ddl import parse
from ksb.catalog.ddl_apply import apply_script
from ksb.catalog.ddl_statements import Alter, Create, Drop, Statement, UseDatabase
from ksb.catalog.model import Catalog, parse_catalog
from ksb.catalog.priorities import ANY, BrokerPriority, PriorityTable, endpoint_levels
from ksb.errors import DdlError

ORDERS_SCRIPT = """\
USE OrdersDB;
GO
CREATE BROKER PRIORITY OrdersOutbound
    FOR CONVERSATION
    SET (CONTRACT_NAME = [//shop/OrderContract],
         LOCAL_SERVICE_NAME = OrderService,
         REMOTE_SERVICE_NAME = N'ShippingService',
         PRIORITY_LEVEL = 7);
GO
"""

SHIPPING_SCRIPT = """\
use ShippingDB
go
create broker priority ShippingInbound
    for conversation
    set (contract_name = [//shop/OrderContract],
         local_service_name = ShippingService,
         remote_service_name = N'OrderService',
         priority_level = 7)
GO 2
"""


def _priority(name: str, **fields: Any) -> Create:
    return Create("BROKER PRIORITY", name, fields)


def apply_priority_statements(
    rules: list[BrokerPriority], statements: list[Statement]
) -> list[BrokerPriority]:
    """The priorities after the statements, applied to a catalog holding only `rules`."""
    catalog = parse_catalog({"priorities": [r.model_dump() for r in rules]})
    return list(apply_script(catalog, statements).priorities)


def _rules(text: str) -> list[BrokerPriority]:
    return apply_priority_statements([], parse(text))


def _error(text: str) -> DdlError:
    with pytest.raises(DdlError) as caught:
        parse(text)
    return caught.value


def test_orders_script_parses_to_the_use_and_the_rule() -> None:
    assert parse(ORDERS_SCRIPT) == [
        UseDatabase("OrdersDB"),
        _priority(
            "OrdersOutbound",
            contract="//shop/OrderContract",
            local_service="OrderService",
            remote_service="ShippingService",
            level=7,
        ),
    ]


def test_each_database_script_covers_its_own_endpoint() -> None:
    endpoint = {
        "contract": "//shop/OrderContract",
        "initiator_service": "OrderService",
        "target_service": "ShippingService",
    }
    assert endpoint_levels(PriorityTable(_rules(ORDERS_SCRIPT)), **endpoint) == (7, 5)
    assert endpoint_levels(PriorityTable(_rules(SHIPPING_SCRIPT)), **endpoint) == (5, 7)


def test_set_clause_and_every_item_are_optional() -> None:
    (bare,) = parse("CREATE BROKER PRIORITY Catchall FOR CONVERSATION")
    assert bare == _priority("Catchall")
    assert _rules("CREATE BROKER PRIORITY Catchall FOR CONVERSATION") == [
        BrokerPriority(name="Catchall")
    ]
    (partial,) = parse("CREATE BROKER PRIORITY p FOR CONVERSATION SET (PRIORITY_LEVEL = 2)")
    assert partial == _priority("p", level=2)


def test_any_default_any_order_and_optional_commas() -> None:
    (statement,) = parse(
        "Create Broker Priority p For Conversation Set (PRIORITY_LEVEL = DEFAULT "
        "remote_service_name = any, CONTRACT_NAME = 'c' LOCAL_SERVICE_NAME = ANY);"
    )
    assert statement == _priority("p", contract="c", local_service=ANY, remote_service=ANY, level=5)


def test_name_forms_and_their_escapes() -> None:
    (statement,) = parse(
        "CREATE BROKER PRIORITY [odd]]name] FOR CONVERSATION SET ("
        "CONTRACT_NAME = N'it''s', LOCAL_SERVICE_NAME = [a-b.c/d], REMOTE_SERVICE_NAME = 'x')"
    )
    assert statement == _priority(
        "odd]name", contract="it's", local_service="a-b.c/d", remote_service="x"
    )


def test_keywords_that_are_not_expected_can_be_bare_names() -> None:
    (statement,) = parse("CREATE BROKER PRIORITY Status FOR CONVERSATION SET (CONTRACT_NAME = Set)")
    assert statement == _priority("Status", contract="Set")


def test_several_statements_with_comments_and_without_semicolons() -> None:
    statements = parse(
        "-- tiers\n"
        "CREATE BROKER PRIORITY gold FOR CONVERSATION\n"
        "SET (CONTRACT_NAME = Gold, PRIORITY_LEVEL = 9)\n"
        "/* background\n work */ CREATE BROKER PRIORITY bulk FOR CONVERSATION "
        "SET (CONTRACT_NAME = Bulk, PRIORITY_LEVEL = 1)\n"
        ";;\n"
    )
    assert [s.name for s in statements if isinstance(s, Create)] == ["gold", "bulk"]
    assert parse("") == []
    assert parse("GO\n  go  \n") == []


def test_alter_and_drop() -> None:
    statements = parse(
        "CREATE BROKER PRIORITY p FOR CONVERSATION SET (CONTRACT_NAME = c, PRIORITY_LEVEL = 2);\n"
        "ALTER BROKER PRIORITY p FOR CONVERSATION SET (PRIORITY_LEVEL = 9);\n"
        "ALTER BROKER PRIORITY p FOR CONVERSATION SET (LOCAL_SERVICE_NAME = s);\n"
    )
    assert statements[1] == Alter("BROKER PRIORITY", "p", {"level": 9})
    rules = apply_priority_statements([], statements)
    assert rules == [BrokerPriority(name="p", contract="c", local_service="s", level=9)]
    (drop,) = parse("DROP BROKER PRIORITY [p]")
    assert drop == Drop("BROKER PRIORITY", "p")
    assert apply_priority_statements(rules, [drop]) == []
    assert len(rules) == 1  # the input list is left alone


def test_alter_queue_forms() -> None:
    statements = parse(
        "ALTER QUEUE dbo.[Order Queue] WITH STATUS = OFF;\n"
        "ALTER QUEUE q WITH ACTIVATION (STATUS = ON, PROCEDURE_NAME = dbo.HandleOrder,\n"
        "    MAX_QUEUE_READERS = 4, EXECUTE AS OWNER), POISON_MESSAGE_HANDLING (STATUS = OFF);\n"
        "ALTER QUEUE q WITH ACTIVATION (EXECUTE AS 'order_reader');\n"
        "ALTER QUEUE q WITH ACTIVATION (EXECUTE AS SELF) STATUS = ON;\n"
        "ALTER QUEUE q WITH ACTIVATION (DROP);\n"
    )
    assert statements == [
        Alter("QUEUE", "Order Queue", {"status": "OFF"}),  # a queue's schema is dropped
        Alter(
            "QUEUE",
            "q",
            {
                "activation": {
                    "status": "ON",
                    "procedure": "dbo.HandleOrder",
                    "command": None,
                    "max_queue_readers": 4,
                    "execute_as": "OWNER",
                },
                "poison_message_handling": "OFF",
            },
        ),
        Alter("QUEUE", "q", {"activation": {"execute_as": "order_reader"}}),
        Alter("QUEUE", "q", {"status": "ON", "activation": {"execute_as": "SELF"}}),
        Alter("QUEUE", "q", {"activation": None}),
    ]


def test_use_and_queue_statements_leave_priorities_alone() -> None:
    catalog = parse_catalog({"queues": [{"name": "q", "status": "OFF"}]})
    after = apply_script(catalog, parse("USE db; ALTER QUEUE q WITH STATUS = ON"))
    assert after.priorities == ()
    assert after.queues[0].status == "ON"
    assert apply_script(Catalog(), parse("USE db; USE [db]")) == Catalog()


def test_misspelled_item_points_at_it() -> None:
    text = "CREATE BROKER PRIORITY p FOR CONVERSATION SET (CONTRACT_NAME = c, PRIORITY_LEVL = 3)"
    error = _error(text)
    assert (error.line, error.column) == (1, 67)
    message = str(error)
    assert message.startswith("line 1, column 67: unexpected 'PRIORITY_LEVL'; expected one of ")
    assert "CONTRACT_NAME, LOCAL_SERVICE_NAME, PRIORITY_LEVEL, REMOTE_SERVICE_NAME" in message
    assert message.endswith(f"\n{text}\n" + " " * 66 + "^")


def test_error_on_a_later_line_reports_that_line() -> None:
    text = "GO\nCREATE BROKER PRIORITY p\n    FOR CONVERSATON SET (PRIORITY_LEVEL = 3)"
    error = _error(text)
    assert (error.line, error.column) == (3, 9)
    assert "unexpected 'CONVERSATON'; expected CONVERSATION" in str(error)
    assert str(error).endswith("\n    FOR CONVERSATON SET (PRIORITY_LEVEL = 3)\n        ^")


@pytest.mark.parametrize("value", ["0", "11", "-1"])
def test_level_out_of_range_points_at_the_number(value: str) -> None:
    error = _error(f"CREATE BROKER PRIORITY p FOR CONVERSATION SET (PRIORITY_LEVEL = {value})")
    assert (error.line, error.column) == (1, 65)
    assert f"PRIORITY_LEVEL {value} is outside 1..10" in str(error)


@pytest.mark.parametrize(
    ("text", "column", "fragment"),
    [
        ("CREATE BROKER PRIORITY p FOR CONVERSATION SET (", 48, "unexpected end of input"),
        ("CREATE BROKER PRIORITY p FOR CONVERSATION SET ()", 48, "unexpected ')'"),
        ("SELECT 1", 1, "unexpected 'SELECT'; expected one of ALTER, CREATE, DROP, GRANT"),
        ("ALTER QUEUE q WITH RETENTON = ON", 20, "unexpected 'RETENTON'"),
        ("ALTER QUEUE q WITH STATUS = ON, STATUS = OFF", 33, "STATUS is given more than once"),
        ("CREATE BROKER PRIORITY p FOR CONVERSATION SET (CONTRACT_NAME = $)", 64, "'$'"),
        ("CREATE BROKER PRIORITY p FOR CONVERSATION SET (CONTRACT_NAME = [])", 64, "empty name"),
        (
            "CREATE BROKER PRIORITY p FOR CONVERSATION SET (PRIORITY_LEVEL = 1, "
            "PRIORITY_LEVEL = 2)",
            68,
            "PRIORITY_LEVEL is given more than once",
        ),
    ],
)
def test_syntax_errors_point_at_the_token(text: str, column: int, fragment: str) -> None:
    error = _error(text)
    assert (error.line, error.column) == (1, column)
    assert fragment in str(error)


@pytest.mark.parametrize(
    ("script", "name"),
    [
        (
            "CREATE BROKER PRIORITY p FOR CONVERSATION; CREATE BROKER PRIORITY p FOR CONVERSATION "
            "SET (CONTRACT_NAME = c)",
            "'p' already exists",
        ),
        ("ALTER BROKER PRIORITY ghost FOR CONVERSATION SET (PRIORITY_LEVEL = 2)", "'ghost'"),
        ("DROP BROKER PRIORITY ghost", "'ghost' does not exist"),
        (
            "CREATE BROKER PRIORITY a FOR CONVERSATION; CREATE BROKER PRIORITY b FOR CONVERSATION",
            "'b' has the same contract and services as 'a'",
        ),
    ],
)
def test_apply_refuses_conflicts_naming_the_priority(script: str, name: str) -> None:
    with pytest.raises(DdlError, match=name):
        apply_priority_statements([], parse(script))


@pytest.mark.parametrize(
    ("clause", "name", "column"),
    [
        ("PARTITIONS = 9{n}", "PARTITIONS", 34),
        ("DEAD_LETTER (ERROR_CODE = -9{n})", "ERROR_CODE", 47),
        ("ACTIVATION (MAX_QUEUE_READERS = 9{n})", "MAX_QUEUE_READERS", 53),
    ],
)
def test_a_number_with_thousands_of_digits_is_out_of_range_not_a_crash(
    clause: str, name: str, column: int
) -> None:
    """Python refuses to convert more than 4,300 digits (ValueError); the parser never tries."""
    error = _error("CREATE QUEUE q WITH " + clause.replace("{n}", "9" * 5000))
    assert (error.line, error.column) == (1, column)
    assert re.search(f"{name} -?9+\\.\\.\\. is outside", str(error)), str(error)[:200]


def test_error_code_is_a_32_bit_number_like_sql_servers() -> None:
    error = _error("CREATE QUEUE q WITH DEAD_LETTER (ERROR_CODE = 2147483648)")
    assert "ERROR_CODE 2147483648 is outside -2147483648..2147483647" in str(error)
