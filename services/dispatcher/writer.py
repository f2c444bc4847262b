"""Writing the engine's outputs into the open Kafka transaction.

Everything a batch of requests produces goes out in the batch's one transaction, with the consumed
offsets: queue records, endpoint changes, errors, dead letters, records for other instances, acks,
work relayed to the owners of other shards, and audit events, so none of it is visible unless all
of it is. Endpoint records are coalesced over the whole transaction: the endpoints topic is
compacted, so only each endpoint's last state in a batch is worth writing, and one record per
changed endpoint per batch is what keeps the records per message down.
"""

from __future__ import annotations

from confluent_kafka import Producer

from ksb.audit import Audit, dispatcher_events
from ksb.dialog.outputs import Outputs
from ksb.names import Names
from ksb.wire.audit import AuditEvent
from ksb.wire.depth import QueueDepth, depth_key
from ksb.wire.endpoint import Endpoint, encode_endpoint
from ksb.wire.partitioning import shard_of
from ksb.wire.protocol import dumps
from ksb.wire.relay import relay_key

__all__ = ["OutputWriter"]

_POLL_EVERY = 50_000
"""Serve delivery reports when this many records are queued, so the producer's queue never fills."""


class OutputWriter:
    """Produces one transaction's outputs; `flush` writes the coalesced endpoint records."""

    def __init__(self, producer: Producer, names: Names, shards: int, audit: Audit) -> None:
        self._p = producer
        self._names = names
        self._shards = shards
        self._audit = audit
        self._endpoints: dict[str, Endpoint] = {}
        self._queue_topics: dict[str, str] = {}
        self._events: list[AuditEvent] = []

    def write(self, out: Outputs, now_ms: int, instance: str) -> None:
        p = self._p
        for w in out.queue:
            topic = self._queue_topics.get(w.queue)
            if topic is None:
                topic = self._queue_topics[w.queue] = self._names.queue(w.queue)
            value = None if w.value is None else dumps(w.value)
            p.produce(topic, key=w.key.encode(), value=value, partition=w.partition)
        for ep in out.endpoints:
            self._endpoints[ep.handle] = ep
        if out.errors:
            # Only the sender may read its errors topic (docs/protocol.md, "Errors").
            errors = self._names.errors_for(out.principal)
            for e in out.errors:
                p.produce(errors, key=(e.request_id or "").encode(), value=dumps(e))
        for d in out.dead_letters:
            topic = self._names.dead_letters(d.message.queue)
            p.produce(topic, key=d.message.message_id.encode(), value=dumps(d))
        self._remote(out)
        if len(p) > _POLL_EVERY:
            p.poll(0)
        if self._audit.enabled:
            self._events += dispatcher_events(out, now_ms, instance)

    def _remote(self, out: Outputs) -> None:
        """Records for other instances and for the owners of other shards, in the same
        transaction as the queue writes they belong with: a transmission is durable the moment
        the SEND is, an acknowledgement is written only with what it acknowledges, and relayed
        work is handed over exactly when the work that caused it is."""
        p = self._p
        for t in out.transmissions:
            p.produce(self._names.transmission, key=t.key.encode(), value=dumps(t))
        for a in out.acks:
            p.produce(Names(a.to_instance).acks, key=a.conversation_id.encode(), value=dumps(a))
        for r in out.relays:
            key = relay_key(r)
            partition = shard_of(key, self._shards)
            p.produce(self._names.relay, key=key.encode(), value=dumps(r), partition=partition)

    def flush(self, depths: list[QueueDepth]) -> int:
        """Write each endpoint changed in this transaction once, in its shard's partition, the
        queue depths it changed (``depth``, keyed by queue and shard), and the
        transaction's audit events in as few records as their queues allow."""
        self._audit.emit_batch(self._events)
        self._events = []
        for d in depths:
            self._p.produce(self._names.depth, key=depth_key(d).encode(), value=dumps(d))
        n = len(self._endpoints)
        for ep in self._endpoints.values():
            self._p.produce(
                self._names.endpoints,
                key=ep.handle.encode(),
                value=encode_endpoint(ep),
                partition=shard_of(ep.group, self._shards),
            )
        self._endpoints.clear()
        return n

    def discard(self) -> None:
        """The transaction was aborted: forget what it would have written."""
        self._endpoints.clear()
        self._events = []
