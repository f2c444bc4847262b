"""What a run that stopped short was waiting for: a report for its timeout error.

A run ends when every message sent has been delivered and committed. When it stops short the
cause is one of few: a message never put in the queue (a dialog short, or a gap in its order), a
commit whose outcome never came (its group stays locked by the reader that renews it), or a
partition a ``read_committed`` consumer cannot read past (a transaction left open in it holds
its last stable offset back, so neither the reader's index nor a dispatcher sees what follows).
The report names each, so one failed run says which it was.
"""

from __future__ import annotations

from collections.abc import Iterable

from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._listoffsets import OffsetSpec

from ksb.runtime import kafka
from ksb.sdk.backpressure import CommittedOffsets
from ksb.sdk.client import KsbClient
from ksb.settings import ClientSettings, KsbSettings

__all__ = ["held_back", "stuck_report", "unconsumed"]


def stuck_report(receiver: KsbClient, queue: str, short: dict[int, tuple[int, str]]) -> str:
    """`short`: dialog number -> (messages delivered in order, handle) of the dialogs short of
    theirs. The reader of `queue` tells its commits waiting and groups held; Kafka, the
    partitions held back by an open transaction and those the dispatchers have not consumed
    to their end."""
    shown = ", ".join(f"{d} at {n} ({h})" for d, (n, h) in list(short.items())[:10])
    names, settings = receiver.names, receiver.settings
    inputs = [names.requests_for(settings.sender), names.relay]
    try:
        held = held_back(settings, [names.queue(queue), *inputs])
        behind = unconsumed(settings, inputs)
    except Exception as exc:  # the report must not hide the timeout it explains
        held = behind = f"not known ({exc!r})"
    return (
        f"{len(short)} dialogs short: {shown}; reader: {receiver.describe()}; "
        f"queue service: {_queue_state(receiver, queue)}; "
        f"held back by an open transaction: {held}; not consumed by the dispatchers: {behind}"
    )


def _queue_state(receiver: KsbClient, queue: str) -> str:
    """What the queue service holds of `queue`: the groups locked and the messages ready."""
    try:
        state = receiver.queue_state(queue)
    except Exception as exc:  # as above: the report must not hide what it explains
        return f"not known ({exc!r})"
    caught_up = "" if state.caught_up else " (not caught up with the queue's topic)"
    return (
        f"{state.locked_groups} groups held, {state.ready_messages} messages ready in "
        f"{state.ready_groups} groups{caught_up}"
    )


def held_back(settings: KsbSettings, topics: list[str]) -> str:
    """The partitions of `topics` whose last stable offset is behind their end, as
    ``topic[partition] stable/end`` ('none' if none); what Kafka failed to answer instead."""
    try:
        ends, stable = _offsets(
            settings, topics, IsolationLevel.READ_UNCOMMITTED, IsolationLevel.READ_COMMITTED
        )
    except KafkaException as exc:
        return f"not known ({exc})"
    return _listed(
        f"{t}[{p}] {stable[(t, p)]}/{end}"
        for (t, p), end in sorted(ends.items())
        if stable.get((t, p), end) < end
    )


def unconsumed(settings: ClientSettings, topics: list[str]) -> str:
    """The partitions of `topics` whose offset committed by the instance's dispatchers is
    behind their last stable offset, as ``topic[partition] committed/stable`` ('none' if none):
    records nobody has applied, such as a partition its owner never fetches."""
    committed = CommittedOffsets(settings)  # what back-pressure reads them with
    try:
        (stable,) = _offsets(settings, topics, IsolationLevel.READ_COMMITTED)
        done = committed(list(stable), 10)
    except KafkaException as exc:
        return f"not known ({exc})"
    finally:
        committed.close()
    return _listed(
        f"{t}[{p}] {done.get((t, p), 0)}/{end}"
        for (t, p), end in sorted(stable.items())
        if done.get((t, p), 0) < end
    )


def _listed(items: Iterable[str]) -> str:
    return ", ".join(items) or "none"


Offsets = dict[tuple[str, int], int]


def _offsets(settings: KsbSettings, topics: list[str], *levels: IsolationLevel) -> list[Offsets]:
    """Every partition's latest offset at each isolation level: its end (read_uncommitted),
    its last stable offset (read_committed)."""
    admin = kafka.admin(settings)
    meta = admin.list_topics(timeout=10).topics
    tps = [TopicPartition(t, p) for t in topics if t in meta for p in meta[t].partitions]
    return [_latest(admin, tps, level) for level in levels]


def _latest(admin: AdminClient, tps: list[TopicPartition], level: IsolationLevel) -> Offsets:
    futures = admin.list_offsets(
        {tp: OffsetSpec.latest() for tp in tps},  # type: ignore[no-untyped-call]
        isolation_level=level,
        request_timeout=10,
    )
    return {(tp.topic, tp.partition): f.result().offset for tp, f in futures.items()}
