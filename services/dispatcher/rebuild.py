"""Rebuilding the engine from Kafka: endpoints, waiting messages and fences.

The dispatcher's state is derived from compacted topics, so a dispatcher that starts, or whose
transaction failed, reads them to their end and is exactly where the last committed transaction
left it: endpoints from ``endpoints``, the messages still waiting from each queue topic (a message
record adds, a tombstone removes), and the fences from the commit outcomes still there.
"""

from __future__ import annotations

from confluent_kafka import Message

from ksb.catalog.model import CatalogView
from ksb.dialog.endpoint import decode_endpoint
from ksb.dialog.engine import Engine
from ksb.errors import ProtocolError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.settings import DispatcherSettings
from ksb.wire.protocol import CommitOutcome, parse_queue_record

__all__ = ["rebuild_engine"]

REBUILD_TIMEOUT_S = 120


def rebuild_engine(settings: DispatcherSettings, view: CatalogView) -> Engine:
    """A fresh engine for `view`, loaded from the instance's endpoints and queue topics."""
    names = Names(settings.instance)
    engine = Engine(view, instance=settings.instance, max_body_bytes=settings.max_body_bytes)
    c = kafka.consumer(settings)
    try:
        kafka.read_to_end(
            c, names.endpoints, lambda m: _load_endpoint(engine, m), timeout_s=REBUILD_TIMEOUT_S
        )
        for queue in view.queues.values():
            kafka.read_to_end(
                c,
                names.queue(queue.name),
                lambda m: _load_queue(engine, m),
                timeout_s=REBUILD_TIMEOUT_S,
            )
    finally:
        c.close()
    return engine


def _load_endpoint(engine: Engine, m: Message) -> None:
    value = m.value()
    if value is not None:
        engine.load_endpoint(decode_endpoint(value))


def _queue_of(m: Message) -> str:
    """The queue a queue-topic record belongs to, from its topic name."""
    return (m.topic() or "").rsplit(".queue.", 1)[-1]


def _load_queue(engine: Engine, m: Message) -> None:
    key = (m.key() or b"").decode()
    try:
        value = parse_queue_record(m.value())
    except ProtocolError:
        return
    if key.startswith("commit/") and value is None:
        return  # an outcome's tombstone
    if isinstance(value, CommitOutcome):
        # The newest outcome of each group survives compaction and carries the group's fence;
        # an outcome written before outcomes carried it gives its token if it applied.
        fence = value.fence or (value.token if value.applied else 0)
        engine.fences.applied(_queue_of(m), value.group, fence)
        return
    engine.load_queue_record(key, value, m.partition() or 0)
