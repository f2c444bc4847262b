"""`ksb endpoints|errors|queue peek|queue depth|monitors|tasks|transmission|forwarded|dlq`:
live state.

Each command reads through `ksb.cli.readers` and prints a table (or JSON with ``--json``), the
KSB counterparts of Service Broker's catalog views and DMVs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from rich.text import Text

from ksb.cli.app import app, cli_settings, dlq_app, echo_json, make_console, queue_app, reported
from ksb.cli.catalog import table
from ksb.cli.readers import (
    read_dead_letters,
    read_depths,
    read_endpoints,
    read_errors,
    read_forwarded,
    read_monitors,
    read_tasks,
    read_transmission,
    ready_messages,
)
from ksb.dialog.views import endpoint_row, leaked
from ksb.errors import KsbError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.wire.endpoint import State
from ksb.wire.protocol import QueueMessage, ReplayRequest, dumps, to_dict

__all__: list[str] = []


@app.command("endpoints")
@reported
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
    settings = cli_settings()
    eps = read_endpoints(settings)
    now = time.time_ns() // 1_000_000
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
        echo_json(rows)
        return
    _print_rows(title, rows)


def _print_rows(title: str, rows: Sequence[dict[str, Any]]) -> None:
    console = make_console()
    if not rows:
        console.print(Text(f"{title}: none"))
        return
    t = table(f"{title} ({len(rows)})", *rows[0])
    for row in rows:
        t.add_row(*("" if v is None else str(v) for v in row.values()))
    console.print(t)


@app.command("errors")
@reported
def errors(
    as_json: Annotated[bool, typer.Option("--json", help="records as JSON")] = False,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="newest N records")] = 50,
    principal: Annotated[
        str | None,
        typer.Option("--principal", help="whose requests (default: yours; operators may read all)"),
    ] = None,
) -> None:
    """Requests the dispatcher could not carry out, newest last."""
    records = read_errors(cli_settings(), principal)[-limit:]
    if as_json:
        echo_json(records)
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


@queue_app.command("peek")
@reported
def queue_peek(
    queue: Annotated[str, typer.Argument(help="queue name")],
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="at most N messages")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="messages as JSON")] = False,
) -> None:
    """Ready messages in RECEIVE order, without locking or receiving them."""
    messages = ready_messages(cli_settings(), queue)
    shown = messages[:limit]
    if as_json:
        echo_json([to_dict(m) for m in shown])
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


@queue_app.command("depth")
@reported
def queue_depth(
    as_json: Annotated[bool, typer.Option("--json", help="rows as JSON")] = False,
) -> None:
    """Unreceived messages per queue and shard, as the dispatchers last wrote them (what SDK
    senders with a queue-depth limit wait on)."""
    depths = read_depths(cli_settings())
    rows = [{"queue": d.queue, "shard": d.shard, "depth": d.depth} for d in depths]
    if as_json:
        echo_json(rows)
        return
    _print_rows("Queue depth per shard", rows)


def _preview(m: QueueMessage, width: int = 60) -> str:
    if m.body is not None:
        text = m.body
    elif m.body_b64 is not None:
        text = f"<{len(m.message_body)} bytes>"
    else:
        text = ""
    return text if len(text) <= width else text[: width - 1] + "…"


@app.command("monitors")
@reported
def monitors(as_json: Annotated[bool, typer.Option("--json", help="rows as JSON")] = False) -> None:
    """Queue monitors: state, runnable work, waiting readers, running tasks, last activation."""
    rows = read_monitors(cli_settings())
    if as_json:
        echo_json(rows)
        return
    shown = [{k: v for k, v in row.items() if k != "tasks"} for row in rows]
    _print_rows("Queue monitors", shown)


@app.command("transmission")
@reported
def transmission(
    as_json: Annotated[bool, typer.Option("--json", help="the view as JSON")] = False,
) -> None:
    """Messages waiting for another broker instance: priority, status, last failure; connections."""
    view = read_transmission(cli_settings())
    if as_json:
        echo_json(view)
        return
    _print_rows("Transmission queue", view.get("messages", []))
    _print_rows("Connections", view.get("connections", []))


@app.command("forwarded")
@reported
def forwarded(
    as_json: Annotated[bool, typer.Option("--json", help="rows as JSON")] = False,
) -> None:
    """Messages the forwarder holds on their way to another instance: where to, how long, why."""
    rows = read_forwarded(cli_settings())
    if as_json:
        echo_json(rows)
        return
    _print_rows("Forwarded messages", rows)


@app.command("tasks")
@reported
def tasks(as_json: Annotated[bool, typer.Option("--json", help="rows as JSON")] = False) -> None:
    """Activated tasks that are running now (they heartbeat into Redis)."""
    rows = read_tasks(cli_settings())
    if as_json:
        echo_json(rows)
        return
    _print_rows("Activated tasks", rows)


@dlq_app.command("list")
@reported
def dlq_list(
    queue: Annotated[str, typer.Argument(help="queue name")],
    as_json: Annotated[bool, typer.Option("--json", help="records as JSON")] = False,
) -> None:
    """Messages a queue's dead-letter policy moved aside, with the reason."""
    records = [r for _, r in read_dead_letters(cli_settings(), queue)]
    if as_json:
        echo_json([to_dict(r) for r in records])
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
@reported
def dlq_replay(
    queue: Annotated[str, typer.Argument(help="queue name")],
    message_id: Annotated[
        list[str] | None, typer.Option("--id", help="replay only these message ids")
    ] = None,
) -> None:
    """Put dead letters back into their queue, ready to RECEIVE again."""
    settings = cli_settings()
    records = read_dead_letters(settings, queue)
    chosen = [r for r in records if not message_id or r[1].message.message_id in message_id]
    p = kafka.producer(settings)
    topic = Names(settings.instance).requests_for(settings.sender)
    for offset, r in chosen:
        req = ReplayRequest(queue=queue, message_id=r.message.message_id, offset=offset)
        p.produce(topic, key=r.message.conversation_group_id.encode(), value=dumps(req))
    if p.flush(30) != 0:
        raise KsbError("replay requests were not acknowledged by Kafka")
    typer.echo(f"replayed {len(chosen)} message(s) into {queue}")
