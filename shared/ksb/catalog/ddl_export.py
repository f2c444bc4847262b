"""Write a catalog back as the Service Broker DDL that `ksb sql` reads.

The script is the whole catalog: applied to an empty instance it gives back an equal catalog
(tests/unit/test_ddl_export.py checks that over generated catalogs). Every name is [bracketed]
and every string an N'...' literal, so no name can be read back as a keyword. KSB settings with
no T-SQL form use the extension clauses `ksb sql` reads (PARTITIONS, COMMAND, DEAD_LETTER, VIA,
VALID_JSON WITH SCHEMA); event notifications and SLA targets have none, so a catalog with them is
refused instead of exported without them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from ksb.catalog.model import (
    Activation,
    Catalog,
    Contract,
    DeadLetter,
    Grant,
    MessageType,
    Queue,
    Route,
    Service,
    Validation,
    XmlSchemaCollection,
)
from ksb.catalog.priorities import ANY, BrokerPriority
from ksb.errors import DdlError

__all__ = ["export_sql"]


def export_sql(catalog: Catalog, *, header: str = "") -> str:
    """The catalog as a T-SQL script, one statement per definition, in dependency order."""
    missing = [
        field
        for field, present in (
            ("event_notifications", bool(catalog.event_notifications)),
            ("sla_targets_ms", bool(catalog.sla_targets_ms)),
        )
        if present
    ]
    if missing:
        raise DdlError(
            f"the catalog has {' and '.join(missing)}, which have no DDL form: "
            "export it as YAML (ksb catalog export) instead"
        )
    lines = [f"-- {line}" for line in header.splitlines()]
    lines.extend(f"{statement};" for statement in _statements(catalog))
    return "\n".join(lines) + "\n"


def _statements(catalog: Catalog) -> Iterator[str]:
    if not catalog.honor_broker_priority:
        yield "ALTER DATABASE CURRENT SET HONOR_BROKER_PRIORITY OFF"
    yield from (_schema_collection(x) for x in catalog.xml_schema_collections)
    yield from (_message_type(m) for m in catalog.message_types)
    yield from (_contract(c) for c in catalog.contracts)
    yield from (_queue(q) for q in catalog.queues)
    yield from (_service(s) for s in catalog.services)
    yield from (_route(r) for r in catalog.routes)
    yield from (_priority(p) for p in catalog.priorities)
    yield from (_grant(g) for g in catalog.grants)


def _bracketed(name: str) -> str:
    """A T-SQL delimited identifier: [name], with ']' doubled."""
    return "[" + name.replace("]", "]]") + "]"


def _literal(text: str) -> str:
    """A T-SQL Unicode string literal: N'text', with quotes doubled."""
    return "N'" + text.replace("'", "''") + "'"


def _schema_collection(x: XmlSchemaCollection) -> str:
    return f"CREATE XML SCHEMA COLLECTION {_bracketed(x.name)} AS {_literal(x.xsd)}"


def _validation(m: MessageType) -> str:
    if m.validation is Validation.VALID_XML:
        assert m.xml_schema_collection is not None
        return f"VALID_XML WITH SCHEMA COLLECTION {_bracketed(m.xml_schema_collection)}"
    if m.validation is Validation.SCHEMA:
        return f"VALID_JSON WITH SCHEMA {_literal(json.dumps(m.json_schema, sort_keys=True))}"
    return str(m.validation.value)


def _message_type(m: MessageType) -> str:
    return f"CREATE MESSAGE TYPE {_bracketed(m.name)} VALIDATION = {_validation(m)}"


def _contract(c: Contract) -> str:
    items = ", ".join(f"{_bracketed(m.type)} SENT BY {m.sent_by.value}" for m in c.messages)
    return f"CREATE CONTRACT {_bracketed(c.name)} ({items})"


def _activation(a: Activation) -> str:
    items = [f"STATUS = {a.status}"]
    if a.procedure is not None:
        items.append(f"PROCEDURE_NAME = {_bracketed(a.procedure)}")
    if a.command is not None:
        items.append(f"COMMAND = {_literal(a.command)}")
    items.append(f"MAX_QUEUE_READERS = {a.max_queue_readers}")
    user = a.execute_as if a.execute_as in {"SELF", "OWNER"} else _literal(a.execute_as)
    items.append(f"EXECUTE AS {user}")
    return f"ACTIVATION ({', '.join(items)})"


def _dead_letter(d: DeadLetter) -> str:
    return f"DEAD_LETTER (MAX_ROLLBACKS = {d.max_rollbacks}, ERROR_CODE = {d.error_code})"


def _queue(q: Queue) -> str:
    options = [
        f"STATUS = {q.status}",
        f"RETENTION = {q.retention}",
        f"PARTITIONS = {q.partitions}",
        f"POISON_MESSAGE_HANDLING (STATUS = {q.poison_message_handling})",
    ]
    if q.activation != Activation():
        options.append(_activation(q.activation))
    if q.dead_letter is not None:
        options.append(_dead_letter(q.dead_letter))
    return f"CREATE QUEUE {_bracketed(q.name)} WITH {', '.join(options)}"


def _service(s: Service) -> str:
    contracts = f" ({', '.join(_bracketed(c) for c in s.contracts)})" if s.contracts else ""
    owner = f" AUTHORIZATION {_bracketed(s.owner)}" if s.owner else ""
    return f"CREATE SERVICE {_bracketed(s.name)}{owner} ON QUEUE {_bracketed(s.queue)}{contracts}"


def _route(r: Route) -> str:
    options = [
        f"SERVICE_NAME = {_literal(r.service_name)}",
        f"BROKER_INSTANCE = {_literal(r.broker_instance)}",
    ]
    if r.lifetime_s is not None:
        options.append(f"LIFETIME = {r.lifetime_s}")
    options.append(f"ADDRESS = {_literal(r.address)}")
    if r.via is not None:
        options.append(f"VIA = {_literal(r.via)}")
    return f"CREATE ROUTE {_bracketed(r.name)} WITH {', '.join(options)}"


def _name_or_any(name: str) -> str:
    return "ANY" if name == ANY else _bracketed(name)


def _priority(p: BrokerPriority) -> str:
    items = ", ".join(
        [
            f"CONTRACT_NAME = {_name_or_any(p.contract)}",
            f"LOCAL_SERVICE_NAME = {_name_or_any(p.local_service)}",
            f"REMOTE_SERVICE_NAME = {_name_or_any(p.remote_service)}",
            f"PRIORITY_LEVEL = {p.level}",
        ]
    )
    return f"CREATE BROKER PRIORITY {_bracketed(p.name)} FOR CONVERSATION SET ({items})"


def _grant(g: Grant) -> str:
    on = (
        f"SERVICE::{_bracketed(g.target)}"
        if g.permission == "SEND"
        else f"OBJECT::{_bracketed(g.target)}"
    )
    return f"GRANT {g.permission} ON {on} TO {_bracketed(g.principal)}"
