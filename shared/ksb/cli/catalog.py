"""`ksb catalog apply|show` and `ksb sql`: the catalog as YAML, and as Service Broker DDL.

Writing the catalog is for its writers, ``admin`` and the instance's owners (Kafka refuses
anyone else, and the command says so); every version is checked against the governance rules
first (`ksb.security.governance`: commands by name, ``EXECUTE AS`` a real principal) and records
who wrote it. A queue poison-message handling disabled is enabled again by ``ksb sql "ALTER
QUEUE q WITH STATUS = ON"``, which writes a queue-status record (`ksb.catalog.queue_status`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import RenderableType
from rich.style import StyleType
from rich.table import Table
from rich.text import Text

from ksb.catalog.ddl import parse
from ksb.catalog.ddl_apply import apply_script
from ksb.catalog.ddl_export import export_sql
from ksb.catalog.model import (
    Activation,
    Catalog,
    CatalogView,
    load_catalog_file,
)
from ksb.catalog.queue_status import effective, reconcile
from ksb.cli.app import app, catalog_app, cli_settings, echo_json, make_console, reported
from ksb.errors import DdlError
from ksb.runtime.catalog_store import (
    apply_catalog,
    load_catalog,
    load_statuses,
    load_view,
    write_queue_status,
)
from ksb.security.governance import check_version
from ksb.settings import KsbSettings
from ksb.wire.queue_status import QueueStatus

__all__ = ["LiteralTable", "catalog_tables", "store_catalog", "table"]


def store_catalog(settings: KsbSettings, catalog: Catalog) -> Catalog:
    """Apply as the next version, after the checks a service would otherwise fail on at reload
    and the governance rules (what a catalog may ask a host to run)."""
    CatalogView(catalog)  # builds the priority table: clashing rules are refused here, not later
    check_version(catalog, settings.instance)
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
    view = load_view(settings)
    current = view.catalog
    if as_json:
        echo_json(current.model_dump(mode="json", by_alias=True))
        return
    console = make_console()
    writer = f", written by {current.written_by}" if current.written_by else ""
    console.print(
        Text(f"catalog version {current.version} of instance {settings.instance}{writer}")
    )
    for queue, reason in sorted(view.held_off.items()):
        console.print(Text(f"queue {queue} is disabled outside the catalog: {reason}"))
    for table in catalog_tables(current):
        console.print(table)


def catalog_tables(catalog: Catalog) -> list[Table]:
    """One table per non-empty kind of definition, in the order a reader follows references."""
    tables: list[Table] = []
    if catalog.message_types:
        t = table("Message types", "name", "validation", "schema")
        for m in catalog.message_types:
            schema = m.xml_schema_collection or ("yes" if m.json_schema is not None else "")
            t.add_row(m.name, m.validation.value, schema)
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
    tables.extend(_ddl_tables(catalog))
    return tables


def _ddl_tables(catalog: Catalog) -> list[Table]:
    """XML schema collections and grants, after the rest."""
    tables: list[Table] = []
    if catalog.xml_schema_collections:
        t = table("XML schema collections", "name", "XSD characters")
        for x in catalog.xml_schema_collections:
            t.add_row(x.name, str(len(x.xsd)))
        tables.append(t)
    if catalog.grants:
        t = table("Grants", "permission", "on", "to")
        for g in catalog.grants:
            on = f"SERVICE::{g.target}" if g.permission == "SEND" else f"QUEUE {g.target}"
            t.add_row(g.permission, on, g.principal)
        tables.append(t)
    return tables


def _activation_text(a: Activation) -> str:
    if a.status == "OFF" and a.procedure is None and a.command is None:
        return "OFF"
    program = a.procedure or a.command or "-"
    return f"{a.status} {program} readers={a.max_queue_readers} as {a.execute_as}"


class LiteralTable(Table):
    """A table whose text cells are shown as written, never read as rich markup.

    Cells hold names and reasons taken from records: a `not_authorized` reason quotes
    ``GRANT SEND ON SERVICE::[//t/Initiator]``, which rich would read as a closing tag and refuse
    (`MarkupError`), and a ``[bold]`` in a name would vanish into a style.
    """

    def add_row(
        self,
        *renderables: RenderableType | None,
        style: StyleType | None = None,
        end_section: bool = False,
    ) -> None:
        cells = (Text(r) if isinstance(r, str) else r for r in renderables)
        super().add_row(*cells, style=style, end_section=end_section)


def table(title: str, *columns: str) -> LiteralTable:
    """Title and headers are literal text too: they name queues and record fields."""
    t = LiteralTable(title=Text(title, style="table.title"), title_justify="left")
    for c in columns:
        t.add_column(Text(c), overflow="fold")
    return t


@app.command("sql")
@reported
def sql(
    statements: Annotated[str | None, typer.Argument(help="Service Broker DDL text")] = None,
    file: Annotated[
        Path | None, typer.Option("--file", "-f", exists=True, dir_okay=False, help="a .sql file")
    ] = None,
) -> None:
    """Apply Service Broker DDL (CREATE/ALTER/DROP, GRANT/REVOKE) as ONE new catalog version."""
    if (statements is None) == (file is None):
        raise DdlError("give the statements as an argument or with --file, not both or neither")
    text = statements if statements is not None else Path(str(file)).read_text()
    parsed = parse(text)
    settings = cli_settings()
    current = load_catalog(settings)
    disabled = {q: s.reason for q, s in load_statuses(settings).items() if s.disabled}
    # The statements see the queues as the services do: one poison handling disabled is OFF.
    changed, enable = reconcile(
        current, apply_script(effective(current, disabled), parsed), disabled
    )
    if _definitions(changed) == _definitions(current) and not enable:
        typer.echo(f"nothing to change: catalog stays at version {current.version}")
        return
    version = current.version
    if _definitions(changed) != _definitions(current):
        version = store_catalog(settings, changed).version
    for queue in enable:
        write_queue_status(settings, _enabled(settings, queue))
        typer.echo(f"queue {queue} enabled again (it was disabled: {disabled[queue]})")
    typer.echo(f"applied {len(parsed)} statement(s): catalog version {version}")


def _enabled(settings: KsbSettings, queue: str) -> QueueStatus:
    return QueueStatus(
        instance=settings.instance,
        queue=queue,
        disabled=False,
        reason="ALTER QUEUE ... WITH STATUS = ON",
        event_ms=int(time.time() * 1000),
        by=settings.acting_principal,
    )


@catalog_app.command("export")
@reported
def catalog_export(
    as_sql: Annotated[bool, typer.Option("--sql", help="as a script `ksb sql` applies")] = False,
) -> None:
    """The current catalog as YAML for `ksb catalog apply`, or as DDL for `ksb sql` (--sql)."""
    settings = cli_settings()
    current = load_catalog(settings)
    if as_sql:
        header = f"catalog version {current.version} of instance {settings.instance}"
        typer.echo(export_sql(current, header=header), nl=False)
        return
    typer.echo(yaml.safe_dump(_definitions(current), sort_keys=False), nl=False)


def _definitions(catalog: Catalog) -> dict[str, Any]:
    return catalog.model_dump(
        mode="json", by_alias=True, exclude={"version", "applied_ms", "written_by"}
    )
