"""What a run that stopped short was waiting for: a report for its timeout error.

A run ends when every message sent has been delivered and committed. When it stops short the
cause is one of few: a message never put in the queue (a dialog short, or a gap in its order), a
commit whose outcome never came (its group stays locked by the reader that renews it), or a
partition a ``read_committed`` consumer cannot read past (a transaction left open in it holds
its last stable offset back, so neither the reader's index nor a dispatcher sees what follows).
The report names each, so one failed run says which it was.
"""

from __future__ import annotations

from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._listoffsets import OffsetSpec

from ksb.runtime import kafka
from ksb.sdk.client import KsbClient
from ksb.settings import KsbSettings

__all__ = ["held_back", "stuck_report"]


def stuck_report(receiver: KsbClient, queue: str, short: dict[int, tuple[int, str]]) -> str:
    """`short`: dialog number -> (messages delivered in order, handle) of the dialogs short of
    theirs. The reader of `queue` tells its commits waiting and groups held; Kafka, the
    partitions held back by an open transaction."""
    shown = ", ".join(f"{d} at {n} ({h})" for d, (n, h) in list(short.items())[:10])
    names = receiver.names
    topics = [names.queue(queue), names.requests_for(receiver.settings.sender), names.relay]
    return (
        f"{len(short)} dialogs short: {shown}; reader: {receiver.reader(queue).describe()}; "
        f"held back by an open transaction: {held_back(receiver.settings, topics) or 'none'}"
    )


def held_back(settings: KsbSettings, topics: list[str]) -> str:
    """The partitions of `topics` whose last stable offset is behind their end, as
    ``topic[partition] stable/end``; what Kafka failed to answer, in its place."""
    admin = kafka.admin(settings)
    try:
        meta = admin.list_topics(timeout=10).topics
        tps = [TopicPartition(t, p) for t in topics if t in meta for p in meta[t].partitions]
        ends = _offsets(admin, tps, IsolationLevel.READ_UNCOMMITTED)
        stable = _offsets(admin, tps, IsolationLevel.READ_COMMITTED)
    except KafkaException as exc:
        return f"not known ({exc})"
    return ", ".join(
        f"{t}[{p}] {stable[(t, p)]}/{end}"
        for (t, p), end in sorted(ends.items())
        if stable.get((t, p), end) < end
    )


def _offsets(
    admin: AdminClient, tps: list[TopicPartition], level: IsolationLevel
) -> dict[tuple[str, int], int]:
    futures = admin.list_offsets(
        {tp: OffsetSpec.latest() for tp in tps},  # type: ignore[no-untyped-call]
        isolation_level=level,
        request_timeout=10,
    )
    return {(tp.topic, tp.partition): f.result().offset for tp, f in futures.items()}
