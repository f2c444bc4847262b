"""`ksb catalog apply|show` and `ksb sql`: the catalog as YAML, and as Service Broker DDL."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ksb.catalog.ddl import AlterQueue, Statement, UseDatabase, apply_priority_statements, parse
from ksb.catalog.model import (
    Activation,
    Catalog,
    CatalogView,
    Queue,
    load_catalog_file,
    parse_catalog,
)
from ksb.cli.app import app, catalog_app, cli_settings, echo_json, make_console, reported
from ksb.errors import CatalogError, DdlError
from ksb.runtime.catalog_store import apply_catalog, load_catalog
from ksb.settings import KsbSettings

__all__ = ["apply_ddl", "catalog_tables", "store_catalog", "table"]


def store_catalog(settings: KsbSettings, catalog: Catalog) -> Catalog:
    """Apply as the next version, after the checks a service would otherwise fail on at reload."""
    CatalogView(catalog)  # builds the priority table: clashing rules are refused here, not later
    return apply_catalog(settings, catalog)


@catalog_app.command("apply")
@reported
def catalog_apply(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="catalog YAML file")],
) -> None:
    """Validate a catalog file and store it as the next version."""
    applied = store_catalog(cli_settings(), load_catalog_file(file))
    typer.echo(f"applied catalog version {applied.version}")


@catalog_app.command("show")
@reported
def catalog_show(
    as_json: Annotated[bool, typer.Option("--json", help="the catalog as JSON")] = False,
) -> None:
    """The current catalog version and its definitions."""
    settings = cli_settings()
    current = load_catalog(settings)
    if as_json:
        echo_json(current.model_dump(mode="json", by_alias=True))
        return
    console = make_console()
    console.print(f"catalog version {current.version} of instance {settings.instance}")
    for table in catalog_tables(current):
        console.print(table)


def catalog_tables(catalog: Catalog) -> list[Table]:
    """One table per non-empty kind of definition, in the order a reader follows references."""
    tables: list[Table] = []
    if catalog.message_types:
        t = table("Message types", "name", "validation", "schema")
        for m in catalog.message_types:
            t.add_row(m.name, m.validation.value, "yes" if m.json_schema is not None else "")
        tables.append(t)
    if catalog.contracts:
        t = table("Contracts", "name", "messages (SENT BY)")
        for c in catalog.contracts:
            t.add_row(c.name, "\n".join(f"{m.type} ({m.sent_by.value})" for m in c.messages))
        tables.append(t)
    if catalog.queues:
        t = table("Queues", "name", "status", "retention", "partitions", "activation", "poison")
        for q in catalog.queues:
            t.add_row(
                q.name,
                q.status,
                q.retention,
                str(q.partitions),
                _activation_text(q.activation),
                q.poison_message_handling,
            )
        tables.append(t)
    if catalog.services:
        t = table("Services", "name", "queue", "contracts")
        for s in catalog.services:
            t.add_row(s.name, s.queue, ", ".join(s.contracts))
        tables.append(t)
    if catalog.routes:
        t = table("Routes", "name", "service", "broker instance", "address", "lifetime_s")
        for r in catalog.routes:
            lifetime = "" if r.lifetime_s is None else str(r.lifetime_s)
            t.add_row(r.name, r.service_name, r.broker_instance, r.address, lifetime)
        tables.append(t)
    if catalog.event_notifications:
        t = table("Event notifications", "name", "queue", "event", "timeout_s")
        for n in catalog.event_notifications:
            t.add_row(n.name, n.queue, n.event, str(n.timeout_s))
        tables.append(t)
    honor = "ON" if catalog.honor_broker_priority else "OFF"
    t = table(
        f"Broker priorities (HONOR_BROKER_PRIORITY {honor})",
        "name",
        "contract",
        "local service",
        "remote service",
        "level",
    )
    for p in catalog.priorities:
        t.add_row(p.name, p.contract, p.local_service, p.remote_service, str(p.level))
    tables.append(t)
    return tables


def _activation_text(a: Activation) -> str:
    if a.status == "OFF" and a.procedure is None and a.command is None:
        return "OFF"
    program = a.procedure or a.command or "-"
    return f"{a.status} {program} readers={a.max_queue_readers} as {a.execute_as}"


def table(title: str, *columns: str) -> Table:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold")
    return t


@app.command("sql")
@reported
def sql(
    statements: Annotated[str | None, typer.Argument(help="Service Broker DDL text")] = None,
    file: Annotated[
        Path | None, typer.Option("--file", "-f", exists=True, dir_okay=False, help="a .sql file")
    ] = None,
) -> None:
    """Apply CREATE/ALTER/DROP BROKER PRIORITY and ALTER QUEUE to the catalog as a new version."""
    if (statements is None) == (file is None):
        raise DdlError("give the statements as an argument or with --file, not both or neither")
    text = statements if statements is not None else Path(str(file)).read_text()
    parsed = parse(text)
    settings = cli_settings()
    current = load_catalog(settings)
    changed = apply_ddl(current, parsed)
    if _definitions(changed) == _definitions(current):
        typer.echo(f"nothing to change: catalog stays at version {current.version}")
        return
    applied = store_catalog(settings, changed)
    typer.echo(f"applied {len(parsed)} statement(s): catalog version {applied.version}")


def apply_ddl(catalog: Catalog, statements: Sequence[Statement]) -> Catalog:
    """The catalog after the statements, re-validated as a whole; `catalog` is not changed.

    Load, transform and apply are not one atomic step: two operators running DDL at the same moment
    both build on the same version, and the later apply wins, as with two `catalog apply` runs.
    """
    _one_database(statements)
    rules = apply_priority_statements(list(catalog.priorities), statements)
    queues = [q.model_dump(mode="json") for q in catalog.queues]
    for statement in statements:
        if isinstance(statement, AlterQueue):
            _alter_queue(queues[_queue_position(catalog.queues, statement.name)], statement)
    data = catalog.model_dump(mode="json", by_alias=True)
    data["priorities"] = [r.model_dump(mode="json") for r in rules]
    data["queues"] = queues
    return parse_catalog(data)  # an impossible combination is refused here, with the field named


def _one_database(statements: Iterable[Statement]) -> None:
    """A script for two databases would merge two rule sets into one instance: refuse it."""
    names = list(dict.fromkeys(s.name for s in statements if isinstance(s, UseDatabase)))
    if len(names) > 1:
        raise DdlError(
            f"the script switches between databases {', '.join(map(repr, names))}; "
            "apply one database's statements per instance"
        )


def _queue_position(queues: Sequence[Queue], name: str) -> int:
    """Exact name first; a schema-qualified T-SQL name (dbo.Q) matches queue Q by its last part."""
    for candidate in (name, name.rsplit(".", 1)[-1]):
        for i, q in enumerate(queues):
            if q.name == candidate:
                return i
    raise CatalogError(f"ALTER QUEUE: unknown queue {name!r}", code="unknown_queue")


def _on_off(flag: bool) -> str:
    return "ON" if flag else "OFF"


def _alter_queue(queue: dict[str, Any], statement: AlterQueue) -> None:
    """Change only what the statement names, as ALTER QUEUE does."""
    if statement.status is not None:
        queue["status"] = _on_off(statement.status)
    if statement.poison_message_handling is not None:
        queue["poison_message_handling"] = _on_off(statement.poison_message_handling)
    activation = statement.activation
    if activation.get("drop"):
        queue["activation"] = Activation.model_validate({}).model_dump(mode="json")
        return
    target = queue["activation"]
    if "status" in activation:
        target["status"] = _on_off(bool(activation["status"]))
    if "procedure_name" in activation:
        target["procedure"] = activation["procedure_name"]
        target["command"] = None  # PROCEDURE_NAME replaces the program, whatever it was
    if "max_queue_readers" in activation:
        target["max_queue_readers"] = activation["max_queue_readers"]
    if "execute_as" in activation:
        target["execute_as"] = activation["execute_as"]


def _definitions(catalog: Catalog) -> dict[str, Any]:
    return catalog.model_dump(mode="json", by_alias=True, exclude={"version", "applied_ms"})
