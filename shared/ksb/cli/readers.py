"""Reading an instance's live state: what the `ksb` commands show and the demo checks.

Every reader folds a topic from its beginning to its end (endpoints, errors, a queue, dead letters)
or reads a view a service keeps in Redis (monitors, tasks, transmission, forwarded messages), so
nothing needs a running service to answer, and the demo's checks see exactly what an operator
would.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Message

from ksb.catalog.model import CatalogView
from ksb.errors import ProtocolError
from ksb.names import Names
from ksb.queue.index import QueueIndex, pack_position
from ksb.runtime import kafka
from ksb.runtime.catalog_store import load_catalog
from ksb.runtime.redis_client import redis_client
from ksb.runtime.redis_view import read_transmission_view
from ksb.settings import KsbSettings
from ksb.wire.depth import QueueDepth, parse_depth
from ksb.wire.endpoint import Endpoint, decode_endpoint
from ksb.wire.protocol import (
    CommitOutcome,
    DeadLetterRecord,
    QueueMessage,
    parse_queue_record,
    parse_record,
)

__all__ = [
    "read_dead_letters",
    "read_depths",
    "read_endpoints",
    "read_errors",
    "read_forwarded",
    "read_monitors",
    "read_tasks",
    "read_topic",
    "read_transmission",
    "ready_messages",
]


def read_endpoints(settings: KsbSettings) -> dict[str, Endpoint]:
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

    read_topic(settings, Names(settings.instance).endpoints, keep)
    return latest


def read_depths(settings: KsbSettings) -> list[QueueDepth]:
    """Each queue's unreceived messages per shard, as its dispatchers last wrote them (the
    compacted depth topic: the last record of each ``<queue>/<shard>``)."""
    latest: dict[str, QueueDepth] = {}

    def keep(m: Message) -> None:
        key, value = m.key(), m.value()
        if key is not None and value is not None:
            latest[key.decode()] = parse_depth(value)

    read_topic(settings, Names(settings.instance).depth, keep)
    return sorted(latest.values(), key=lambda d: (d.queue, d.shard))


def read_errors(settings: KsbSettings, principal: str | None = None) -> list[dict[str, Any]]:
    """Every error record of `principal`'s requests (default: this process's own; the shared
    topic without security), oldest first, with its offset."""
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

    topic = Names(settings.instance).errors_for(principal or settings.sender)
    read_topic(settings, topic, keep)
    return out


def ready_messages(settings: KsbSettings, queue: str) -> list[QueueMessage]:
    """A queue's ready messages in the order RECEIVE would return them, group by group."""
    CatalogView(load_catalog(settings)).queue(queue)  # an unknown queue is an error, not "empty"
    index = QueueIndex(queue)
    ready: dict[int, QueueMessage] = {}

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
        part, off = m.partition() or 0, m.offset() or 0
        gone = index.apply(key, value, part, off)
        if gone is not None:
            ready.pop(gone.position, None)
        elif value is not None and value.status == 1:
            ready[pack_position(part, off)] = value

    read_topic(settings, Names(settings.instance).queue(queue), fold)
    return [ready[r.position] for r in index.peek(len(ready) or 1) if r.position in ready]


def read_monitors(settings: KsbSettings) -> list[dict[str, Any]]:
    """The activation service's queue monitors (like sys.dm_broker_queue_monitors)."""
    r = redis_client(settings)
    try:
        raw = r.hgetall(Names(settings.instance).monitors_key)
    finally:
        r.close()
    return [json.loads(v) for _k, v in sorted(raw.items())]


def read_tasks(settings: KsbSettings) -> list[dict[str, Any]]:
    """Running activated tasks from their heartbeats (like sys.dm_broker_activated_tasks)."""
    names = Names(settings.instance)
    now = time.time_ns() // 1_000_000
    r = redis_client(settings)
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


def read_transmission(settings: KsbSettings) -> dict[str, Any]:
    """Unacknowledged messages (sys.transmission_queue) and connections (sys.dm_broker_connections)."""
    r = redis_client(settings)
    try:
        return read_transmission_view(r, Names(settings.instance))
    finally:
        r.close()


def read_forwarded(settings: KsbSettings) -> list[dict[str, Any]]:
    """What the forwarder holds (sys.dm_broker_forwarded_messages): empty before it published."""
    r = redis_client(settings)
    try:
        raw = r.get(Names(settings.instance).forwarded_view_key)
    finally:
        r.close()
    rows: list[dict[str, Any]] = json.loads(raw)["messages"] if raw else []
    return rows


def read_dead_letters(settings: KsbSettings, queue: str) -> list[tuple[int, DeadLetterRecord]]:
    """Each message of `queue`'s dead-letter topic, its latest record and that record's
    offset (a replay names it: the dispatcher reads the message back from there)."""
    CatalogView(load_catalog(settings)).queue(queue)
    out: dict[str, tuple[int, DeadLetterRecord]] = {}

    def keep(m: Message) -> None:
        value = m.value()
        if value is not None:
            record = parse_record(DeadLetterRecord, value, "dead-letter record")
            out[record.message.message_id] = (m.offset() or 0, record)

    read_topic(settings, Names(settings.instance).dead_letters(queue), keep)
    return list(out.values())


def read_topic(settings: KsbSettings, topic: str, handle: Callable[[Message], None]) -> None:
    """Fold `topic` from its beginning to its current end into `handle`."""
    c = kafka.consumer(settings)
    try:
        kafka.read_to_end(c, topic, handle, timeout_s=30)
    finally:
        c.close()
