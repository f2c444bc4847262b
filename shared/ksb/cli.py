"""The ``ksb`` command: apply and show the catalog, run Service Broker DDL, inspect live state.

Each command is a few lines that call small functions; every state it shows is read from Kafka
(catalog, endpoints, errors and queue topics), so the CLI needs no service to be running. Bad
input (a catalog field, a DDL token, an unknown queue) is a `KsbError`, printed as
``error: <reason>`` with exit code 2 and no traceback, because the reason already says what to fix.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, ParamSpec

import redis
import typer
import yaml
from confluent_kafka import KafkaException, Message
from rich.console import Console
from rich.table import Table

from ksb import kafka
from ksb.catalog import Activation, Catalog, CatalogView, load_catalog_file
from ksb.catalog_store import apply_catalog, load_catalog
from ksb.ddl import parse
from ksb.ddl_apply import apply_script
from ksb.ddl_export import export_sql
from ksb.endpoint import Endpoint, State, decode_endpoint
from ksb.errors import DdlError, KsbError, ProtocolError
from ksb.names import Names
from ksb.protocol import (
    CommitOutcome,
    DeadLetterRecord,
    QueueMessage,
    ReplayRequest,
    dumps,
    parse_queue_record,
)
from ksb.queue_index import QueueIndex
from ksb.redis_view import read_transmission_view
from ksb.settings import Settings, load_settings
from ksb.views import endpoint_row, leaked

__all__ = ["app", "main"]

_P = ParamSpec("_P")

app = typer.Typer(
    name="ksb",
    help="Service Broker conversations on Kafka: catalog, DDL and live state.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
catalog_app = typer.Typer(help="The catalog: message types, contracts, queues, services.")
queue_app = typer.Typer(help="Look into a queue without receiving from it.")
app.add_typer(catalog_app, name="catalog")
app.add_typer(queue_app, name="queue")
dlq_app = typer.Typer(help="Dead letters: messages moved aside by a queue's dead-letter policy.")
app.add_typer(dlq_app, name="dlq")

_BAD_INPUT = 2
_UNAVAILABLE = 1


def _reported(command: Callable[_P, None]) -> Callable[_P, None]:
    """Turn errors into one line on stderr: a user needs the reason, not our stack."""

    @functools.wraps(command)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            command(*args, **kwargs)
        except KsbError as exc:
            typer.echo(f"error: {exc.reason}", err=True)
            raise typer.Exit(_BAD_INPUT) from None
        except (KafkaException, TimeoutError) as exc:
            typer.echo(f"error: Kafka request failed: {exc}", err=True)
            raise typer.Exit(_UNAVAILABLE) from None

    return run


def _settings() -> Settings:
    return load_settings()


_PIPE_WIDTH = 1_000


def _console() -> Console:
    """Built per command so output follows the stdout of the moment (tests swap it).

    Piped output gets a width no table reaches, so handles are never folded across lines and
    `ksb endpoints | grep <handle>` finds them.
    """
    console = Console()
    return console if console.is_terminal else Console(width=_PIPE_WIDTH)


def _echo_json(value: object) -> None:
    typer.echo(json.dumps(value, indent=2))


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


# --------------------------------------------------------------------------- catalog


def store_catalog(settings: Settings, catalog: Catalog) -> Catalog:
    """Apply as the next version, after the checks a service would otherwise fail on at reload."""
    CatalogView(catalog)  # builds the priority table: clashing rules are refused here, not later
    return apply_catalog(settings, catalog)


@catalog_app.command("apply")
@_reported
def catalog_apply(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="catalog YAML file")],
) -> None:
    """Validate a catalog file and store it as the next version."""
    applied = store_catalog(_settings(), load_catalog_file(file))
    typer.echo(f"applied catalog version {applied.version}")


@catalog_app.command("show")
@_reported
def catalog_show(
    as_json: Annotated[bool, typer.Option("--json", help="the catalog as JSON")] = False,
) -> None:
    """The current catalog version and its definitions."""
    settings = _settings()
    current = load_catalog(settings)
    if as_json:
        _echo_json(current.model_dump(mode="json", by_alias=True))
        return
    console = _console()
    console.print(f"catalog version {current.version} of instance {settings.instance}")
    for table in catalog_tables(current):
        console.print(table)


def catalog_tables(catalog: Catalog) -> list[Table]:
    """One table per non-empty kind of definition, in the order a reader follows references."""
    tables: list[Table] = []
    if catalog.message_types:
        t = _table("Message types", "name", "validation", "schema")
        for m in catalog.message_types:
            schema = m.xml_schema_collection or ("yes" if m.json_schema is not None else "")
            t.add_row(m.name, m.validation.value, schema)
        tables.append(t)
    if catalog.contracts:
        t = _table("Contracts", "name", "messages (SENT BY)")
        for c in catalog.contracts:
            t.add_row(c.name, "\n".join(f"{m.type} ({m.sent_by.value})" for m in c.messages))
        tables.append(t)
    if catalog.queues:
        t = _table("Queues", "name", "status", "retention", "partitions", "activation", "poison")
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
        t = _table("Services", "name", "queue", "contracts")
        for s in catalog.services:
            t.add_row(s.name, s.queue, ", ".join(s.contracts))
        tables.append(t)
    if catalog.routes:
        t = _table("Routes", "name", "service", "broker instance", "address", "lifetime_s")
        for r in catalog.routes:
            lifetime = "" if r.lifetime_s is None else str(r.lifetime_s)
            t.add_row(r.name, r.service_name, r.broker_instance, r.address, lifetime)
        tables.append(t)
    if catalog.event_notifications:
        t = _table("Event notifications", "name", "queue", "event", "timeout_s")
        for n in catalog.event_notifications:
            t.add_row(n.name, n.queue, n.event, str(n.timeout_s))
        tables.append(t)
    honor = "ON" if catalog.honor_broker_priority else "OFF"
    t = _table(
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
    """XML schema collections and grants (issue 15's DDL), after the rest."""
    tables: list[Table] = []
    if catalog.xml_schema_collections:
        t = _table("XML schema collections", "name", "XSD characters")
        for x in catalog.xml_schema_collections:
            t.add_row(x.name, str(len(x.xsd)))
        tables.append(t)
    if catalog.grants:
        t = _table("Grants", "permission", "on", "to")
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


def _table(title: str, *columns: str) -> Table:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold")
    return t


# --------------------------------------------------------------------------- sql


@app.command("sql")
@_reported
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
    settings = _settings()
    current = load_catalog(settings)
    changed = apply_script(current, parsed)
    if _definitions(changed) == _definitions(current):
        typer.echo(f"nothing to change: catalog stays at version {current.version}")
        return
    applied = store_catalog(settings, changed)
    typer.echo(f"applied {len(parsed)} statement(s): catalog version {applied.version}")


@catalog_app.command("export")
@_reported
def catalog_export(
    as_sql: Annotated[bool, typer.Option("--sql", help="as a script `ksb sql` applies")] = False,
) -> None:
    """The current catalog as YAML for `ksb catalog apply`, or as DDL for `ksb sql` (--sql)."""
    settings = _settings()
    current = load_catalog(settings)
    if as_sql:
        header = f"catalog version {current.version} of instance {settings.instance}"
        typer.echo(export_sql(current, header=header), nl=False)
        return
    typer.echo(yaml.safe_dump(_definitions(current), sort_keys=False), nl=False)


def _definitions(catalog: Catalog) -> dict[str, Any]:
    return catalog.model_dump(mode="json", by_alias=True, exclude={"version", "applied_ms"})


# --------------------------------------------------------------------------- endpoints


def read_endpoints(settings: Settings) -> dict[str, Endpoint]:
    """The latest state of every endpoint, from the compacted endpoints topic."""
    latest: dict[str, Endpoint] = {}

    def keep(m: Message) -> None:
        key, value = m.key(), m.value()
        if key is None:
            return
        if value is None:
            latest.pop(key.decode(), None)
        else:
            latest[key.decode()] = decode_endpoint(value)

    _read(settings, Names(settings.instance).endpoints, keep)
    return latest


@app.command("endpoints")
@_reported
def endpoints(
    only_leaked: Annotated[
        bool, typer.Option("--leaked", help="only conversations ended on one side, or idle")
    ] = False,
    idle_s: Annotated[
        int | None, typer.Option("--idle-s", min=1, help="idle threshold (default KSB_LEAK_IDLE_S)")
    ] = None,
    include_closed: Annotated[bool, typer.Option("--all", help="include CLOSED endpoints")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="rows as JSON")] = False,
) -> None:
    """Conversation endpoints, like sys.conversation_endpoints."""
    settings = _settings()
    eps = read_endpoints(settings)
    now = _now_ms()
    if only_leaked:
        threshold_ms = (idle_s if idle_s is not None else settings.leak_idle_s) * 1000
        rows = [
            {**endpoint_row(r.endpoint, now), "reason": r.reason}
            for r in leaked(eps, now, threshold_ms)
        ]
        title = "Leaked conversation endpoints"
    else:
        shown = sorted(eps.values(), key=lambda e: (e.created_ms, e.handle))
        rows = [
            endpoint_row(e, now) for e in shown if include_closed or e.state is not State.CLOSED
        ]
        title = "Conversation endpoints"
    if as_json:
        _echo_json(rows)
        return
    _print_rows(title, rows)


def _print_rows(title: str, rows: Sequence[dict[str, Any]]) -> None:
    console = _console()
    if not rows:
        console.print(f"{title}: none")
        return
    t = _table(f"{title} ({len(rows)})", *rows[0])
    for row in rows:
        t.add_row(*("" if v is None else str(v) for v in row.values()))
    console.print(t)


# --------------------------------------------------------------------------- errors


def read_errors(settings: Settings) -> list[dict[str, Any]]:
    """Every record of the error topic, oldest first, with its offset."""
    out: list[dict[str, Any]] = []

    def keep(m: Message) -> None:
        value = m.value()
        if value is None:
            return
        try:
            record = json.loads(value)
        except ValueError:
            record = {"code": "unreadable", "reason": value[:200].decode(errors="replace")}
        out.append({"offset": m.offset(), **record})

    _read(settings, Names(settings.instance).errors, keep)
    return out


@app.command("errors")
@_reported
def errors(
    as_json: Annotated[bool, typer.Option("--json", help="records as JSON")] = False,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="newest N records")] = 50,
) -> None:
    """Requests the dispatcher could not carry out, newest last."""
    records = read_errors(_settings())[-limit:]
    if as_json:
        _echo_json(records)
        return
    rows = [
        {
            "offset": r.get("offset"),
            "code": r.get("code"),
            "handle": r.get("handle"),
            "request_id": r.get("request_id"),
            "reason": r.get("reason"),
        }
        for r in records
    ]
    _print_rows("Errors", rows)


# --------------------------------------------------------------------------- queue peek


def ready_messages(settings: Settings, queue: str) -> list[QueueMessage]:
    """A queue's ready messages in the order RECEIVE would return them, group by group."""
    CatalogView(load_catalog(settings)).queue(queue)  # an unknown queue is an error, not "empty"
    index = QueueIndex(queue)

    def fold(m: Message) -> None:
        key = (m.key() or b"").decode()
        if key.startswith("commit/"):
            return
        try:
            value = parse_queue_record(m.value())
        except ProtocolError:
            return
        if isinstance(value, CommitOutcome):
            return
        index.apply(key, value, m.partition() or 0, m.offset() or 0)

    _read(settings, Names(settings.instance).queue(queue), fold)
    return [m for group in index.candidates() for m in index.take(group)]


@queue_app.command("peek")
@_reported
def queue_peek(
    queue: Annotated[str, typer.Argument(help="queue name")],
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="at most N messages")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="messages as JSON")] = False,
) -> None:
    """Ready messages in RECEIVE order, without locking or receiving them."""
    messages = ready_messages(_settings(), queue)
    shown = messages[:limit]
    if as_json:
        _echo_json([m.model_dump(mode="json", exclude_none=True) for m in shown])
        return
    rows = [
        {
            "group": m.conversation_group_id,
            "handle": m.conversation_handle,
            "seq": m.message_sequence_number,
            "priority": m.priority,
            "message type": m.message_type_name,
            "body": _preview(m),
            "message id": m.message_id,
        }
        for m in shown
    ]
    _print_rows(f"Queue {queue}: {len(messages)} ready, showing", rows)


def _preview(m: QueueMessage, width: int = 60) -> str:
    if m.body is not None:
        text = m.body
    elif m.body_b64 is not None:
        text = f"<{len(m.message_body)} bytes>"
    else:
        text = ""
    return text if len(text) <= width else text[: width - 1] + "…"


# --------------------------------------------------------------------------- activation views


def read_monitors(settings: Settings) -> list[dict[str, Any]]:
    """The activation service's queue monitors (like sys.dm_broker_queue_monitors)."""
    r = redis.Redis.from_url(settings.redis_url)
    try:
        raw = r.hgetall(Names(settings.instance).monitors_key)
    finally:
        r.close()
    return [json.loads(v) for _k, v in sorted(raw.items())]


def read_tasks(settings: Settings) -> list[dict[str, Any]]:
    """Running activated tasks from their heartbeats (like sys.dm_broker_activated_tasks)."""
    names = Names(settings.instance)
    now = _now_ms()
    r = redis.Redis.from_url(settings.redis_url)
    rows: list[dict[str, Any]] = []
    try:
        for queue in CatalogView(load_catalog(settings)).queues:
            live: list[tuple[bytes, float]] = r.zrangebyscore(  # type: ignore[assignment]
                names.tasks_key(queue), now, "+inf", withscores=True
            )
            for member, deadline in live:
                task = member.decode() if isinstance(member, bytes) else str(member)
                rows.append(
                    {"queue": queue, "task_id": task, "heartbeat_due_ms": int(deadline) - now}
                )
    finally:
        r.close()
    return rows


@app.command("monitors")
@_reported
def monitors(as_json: Annotated[bool, typer.Option("--json", help="rows as JSON")] = False) -> None:
    """Queue monitors: state, runnable work, waiting readers, running tasks, last activation."""
    rows = read_monitors(_settings())
    if as_json:
        _echo_json(rows)
        return
    shown = [{k: v for k, v in row.items() if k != "tasks"} for row in rows]
    _print_rows("Queue monitors", shown)


def read_transmission(settings: Settings) -> dict[str, Any]:
    """Unacknowledged messages (sys.transmission_queue) and connections (sys.dm_broker_connections)."""
    r = redis.Redis.from_url(settings.redis_url)
    try:
        return read_transmission_view(r, Names(settings.instance))
    finally:
        r.close()


@app.command("transmission")
@_reported
def transmission(
    as_json: Annotated[bool, typer.Option("--json", help="the view as JSON")] = False,
) -> None:
    """Messages waiting for another broker instance: priority, status, last failure; connections."""
    view = read_transmission(_settings())
    if as_json:
        _echo_json(view)
        return
    _print_rows("Transmission queue", view.get("messages", []))
    _print_rows("Connections", view.get("connections", []))


def read_forwarded(settings: Settings) -> list[dict[str, Any]]:
    """What the forwarder holds (sys.dm_broker_forwarded_messages): empty before it published."""
    r = redis.Redis.from_url(settings.redis_url)
    try:
        raw = r.get(Names(settings.instance).forwarded_view_key)
    finally:
        r.close()
    rows: list[dict[str, Any]] = json.loads(raw)["messages"] if raw else []
    return rows


@app.command("forwarded")
@_reported
def forwarded(
    as_json: Annotated[bool, typer.Option("--json", help="rows as JSON")] = False,
) -> None:
    """Messages the forwarder holds on their way to another instance: where to, how long, why."""
    rows = read_forwarded(_settings())
    if as_json:
        _echo_json(rows)
        return
    _print_rows("Forwarded messages", rows)


@app.command("tasks")
@_reported
def tasks(as_json: Annotated[bool, typer.Option("--json", help="rows as JSON")] = False) -> None:
    """Activated tasks that are running now (they heartbeat into Redis)."""
    rows = read_tasks(_settings())
    if as_json:
        _echo_json(rows)
        return
    _print_rows("Activated tasks", rows)


# --------------------------------------------------------------------------- dead letters


def read_dead_letters(settings: Settings, queue: str) -> list[DeadLetterRecord]:
    CatalogView(load_catalog(settings)).queue(queue)
    out: dict[str, DeadLetterRecord] = {}

    def keep(m: Message) -> None:
        value = m.value()
        if value is not None:
            record = DeadLetterRecord.model_validate_json(value)
            out[record.message.message_id] = record

    _read(settings, Names(settings.instance).dead_letters(queue), keep)
    return list(out.values())


@dlq_app.command("list")
@_reported
def dlq_list(
    queue: Annotated[str, typer.Argument(help="queue name")],
    as_json: Annotated[bool, typer.Option("--json", help="records as JSON")] = False,
) -> None:
    """Messages a queue's dead-letter policy moved aside, with the reason."""
    records = read_dead_letters(_settings(), queue)
    if as_json:
        _echo_json([r.model_dump(mode="json", exclude_none=True) for r in records])
        return
    rows = [
        {
            "message id": r.message.message_id,
            "handle": r.message.conversation_handle,
            "message type": r.message.message_type_name,
            "reason": r.reason,
            "body": _preview(r.message),
        }
        for r in records
    ]
    _print_rows(f"Dead letters of {queue}", rows)


@dlq_app.command("replay")
@_reported
def dlq_replay(
    queue: Annotated[str, typer.Argument(help="queue name")],
    message_id: Annotated[
        list[str] | None, typer.Option("--id", help="replay only these message ids")
    ] = None,
) -> None:
    """Put dead letters back into their queue, ready to RECEIVE again."""
    settings = _settings()
    records = read_dead_letters(settings, queue)
    chosen = [r for r in records if not message_id or r.message.message_id in message_id]
    p = kafka.producer(settings)
    topic = Names(settings.instance).requests
    for r in chosen:
        req = ReplayRequest(kind="replay", message=r.message)
        p.produce(topic, key=r.message.conversation_group_id.encode(), value=dumps(req))
    if p.flush(30) != 0:
        raise KsbError("replay requests were not acknowledged by Kafka")
    typer.echo(f"replayed {len(chosen)} message(s) into {queue}")


# --------------------------------------------------------------------------- plumbing


def _read(settings: Settings, topic: str, handle: Callable[[Message], None]) -> None:
    c = kafka.consumer(settings)
    try:
        kafka.read_to_end(c, topic, handle, timeout_s=30)
    finally:
        c.close()


def main() -> None:
    """Entry point of the ``ksb`` script."""
    app()
