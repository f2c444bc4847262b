"""Reading what the broker recorded in a round, for `devtools.chaos.invariants`.

Every topic is read committed from its beginning to its current end (a round's instances are new,
so their topics hold only the round). The readers' line files are read here too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import Message, TopicPartition
from confluent_kafka.admin._group import MemberDescription

from devtools.chaos.invariants import Side
from devtools.deployment import Deployment
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.redis_client import redis_client
from ksb.wire.audit import parse_audit_record
from ksb.wire.endpoint import decode_endpoint
from ksb.wire.protocol import (
    CommitOutcome,
    DeadLetterRecord,
    QueueMessage,
    parse_queue_record,
    parse_record,
)

__all__ = ["applied_batches", "dispatcher_group", "pending_transmissions", "read_side"]


def _fold(settings: Deployment, topic: str, handle: Callable[[Message], None]) -> None:
    c = kafka.consumer(settings)
    try:
        kafka.read_to_end(c, topic, handle, timeout_s=120)
    finally:
        c.close()


def read_side(settings: Deployment, queue: str, *, dead_letters: bool) -> Side:
    """What `settings`' instance recorded about `queue`: its topic, the audit's receipts, the
    dead-letter topic (when asked) and the endpoints."""
    names = Names(settings.instance)
    side = Side()
    by_partition: dict[int, list[CommitOutcome]] = {}

    def on_queue(m: Message) -> None:
        value = parse_queue_record(m.value())
        if isinstance(value, CommitOutcome):
            by_partition.setdefault(m.partition() or 0, []).append(value)
        elif isinstance(value, QueueMessage) and value.status == 1:
            side.messages.append(value)

    def on_audit(m: Message) -> None:
        for event in parse_audit_record(m.value() or b""):
            if event.kind == "commit" and event.queue == queue and event.message_id:
                side.committed.append(event.message_id)

    def on_dead(m: Message) -> None:
        side.dead_lettered.append(parse_record(DeadLetterRecord, m.value(), "dead letter").message)

    def on_endpoint(m: Message) -> None:
        key = (m.key() or b"").decode()
        raw = m.value()
        if raw is None:
            side.endpoints[key] = None
            return
        ep = decode_endpoint(raw)
        side.endpoints[key] = ep.state.value
        side.notes[key] = (
            f"timer due {ep.timer_deadline_ms}, updated {ep.updated_ms}, "
            f"enqueued {ep.enqueued}, outstanding {ep.outstanding}, group {ep.group}"
        )

    _fold(settings, names.queue(queue), on_queue)
    side.outcomes = [by_partition[p] for p in sorted(by_partition)]
    _fold(settings, names.audit, on_audit)
    if dead_letters:
        _fold(settings, names.dead_letters(queue), on_dead)
    _fold(settings, names.endpoints, on_endpoint)
    return side


def applied_batches(files: list[Path]) -> list[list[str]]:
    """The message ids of each batch the readers' line files show as applied (``R`` then ``C``
    with the same transaction number; a line cut short by SIGKILL is ignored)."""
    out: list[list[str]] = []
    for path in files:
        if not path.exists():
            continue
        pending: dict[int, list[str]] = {}
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec["s"] == "R":
                pending[rec["t"]] = [m[0] for m in rec["m"]]
            elif rec["s"] == "C" and rec["t"] in pending:
                out.append(pending.pop(rec["t"]))
    return out


def pending_transmissions(settings: list[Deployment]) -> tuple[int, float]:
    """Messages the instances' transmission queues and forwarders still hold, from their Redis
    views, and the age in seconds of the oldest view read (a dead publisher's view is stale)."""
    total, oldest_ms = 0, 0.0
    for s in settings:
        names = Names(s.instance)
        r = redis_client(s)
        try:
            for key in (names.transmission_view_key, names.forwarded_view_key):
                raw = r.get(key)
                if raw is None:
                    continue
                view = json.loads(raw)
                total += len(view.get("messages", []))
                oldest_ms = max(oldest_ms, _age_ms(view.get("updated_ms")))
        finally:
            r.close()
    return total, oldest_ms / 1000


def _age_ms(updated_ms: object) -> float:
    import time

    if not isinstance(updated_ms, int):
        return 0.0
    return max(0.0, time.time() * 1000 - updated_ms)


def dispatcher_group(settings: Deployment) -> str:
    """The coordinator's view of the instance's dispatcher group: each member's client id, the
    shards it holds and the ones it is meant to hold (a shard in no one's holding for minutes is
    what a round that does not drain shows)."""
    names = Names(settings.instance)
    group = names.dispatcher_group
    admin = kafka.admin(settings)  # held until it answers: a dropped client never does
    desc = admin.describe_consumer_groups([group], request_timeout=15)[group].result(timeout=30)
    members = "; ".join(
        _member(m, names.relay) for m in sorted(desc.members, key=lambda m: m.client_id)
    )
    return f"{group} ({desc.state}): {members or 'no members'}"


def _member(m: MemberDescription, relay: str) -> str:
    """One member: the relay partitions (shards) it holds, and the ones it is meant to hold."""
    held = _shards(m.assignment.topic_partitions, relay)
    target = _shards(m.target_assignment.topic_partitions, relay) if m.target_assignment else None
    return f"{m.client_id} ({m.member_id[:8]}) holds {held} target {target}"


def _shards(parts: list[TopicPartition], relay: str) -> list[int]:
    return sorted(tp.partition for tp in parts if tp.topic == relay)
