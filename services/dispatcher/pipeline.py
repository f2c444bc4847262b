"""The loop of a started dispatcher: one batch of records in, one Kafka transaction out.

A `Pipeline` is what a successful start builds (`services.dispatcher.startup`): the transactional
producer, the group member, the engine and the writer. `apply_batch` consumes a batch, runs every
record through the engine (`ksb.dialog.engine`) and writes the outputs, the due timers' outputs
and the consumed offsets in one transaction, which is what makes delivery exactly-once. A failed
transaction is `services.dispatcher.recovery`'s.

The per-commit metrics stay inline on purpose: they are CPU work that a thread hop under the GIL
would only make slower.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaException, Message

from ksb.audit import Audit
from ksb.clock import Clock
from ksb.dialog.engine import Engine
from ksb.dialog.outputs import Outputs
from ksb.dialog.sources import Source
from ksb.errors import PoisonRecord, ProtocolError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.metrics import (
    COMMITS,
    ERRORS,
    POISON_RECORDS,
    RELAYED,
    REQUESTS,
    TXN_SECONDS,
    Children,
)
from ksb.settings import DispatcherSettings
from ksb.wire.fragments import Reassembler
from ksb.wire.protocol import AnyRequest, CommitRequest, FragmentRecord, dumps
from ksb.wire.relay import RelayRequest
from services.dispatcher.isolation import Coord, Isolation, Verdict
from services.dispatcher.journal import TXN_CALL_TIMEOUT_S, JournaledProducer
from services.dispatcher.queue_metrics import QueueMetrics
from services.dispatcher.rebalance import ShardKeeper
from services.dispatcher.routing import Router, handed_over
from services.dispatcher.watchdog import Watchdog
from services.dispatcher.writer import OutputWriter

__all__ = ["Pipeline"]

log = logging.getLogger("ksb.dispatcher")


@dataclass
class Counts:
    """What a dispatcher has done, for its log line and the bench's comparison of members."""

    applied: int = 0
    """Requests and relayed records applied (committed)."""
    transactions: int = 0
    """Transactions committed."""


@dataclass
class Pipeline:
    """A started broker: its clients, its engine, and the batch loop over them."""

    settings: DispatcherSettings
    names: Names
    clock: Clock
    member: str
    producer: JournaledProducer
    engine: Engine
    writer: OutputWriter
    router: Router
    shards: ShardKeeper
    audit: Audit
    watchdog: Watchdog
    queue_metrics: QueueMetrics
    counts: Counts
    isolation: Isolation
    consumer: Consumer | None = None
    pieces: Reassembler = field(default_factory=Reassembler)
    """Fragments of large inbound messages (memory only: the origin resends what is lost)."""
    batch: int = 0
    """Records in the open transaction (counted as applied once it commits)."""
    open_records: list[Coord] = field(default_factory=list)
    """Where the open transaction's records are: a failure counts against them
    (`services.dispatcher.isolation`)."""
    _requests: Children = field(default_factory=lambda: Children(REQUESTS))
    _errors: Children = field(default_factory=lambda: Children(ERRORS))
    _commits: Children = field(default_factory=lambda: Children(COMMITS))
    _relayed: Children = field(default_factory=lambda: Children(RELAYED))

    # ----------------------------------------------------------------- membership
    def subscribe(self) -> None:
        """Join the dispatchers' group: every requests topic, the relay and every inbound one."""
        s = self.settings
        self.consumer = kafka.group_consumer(
            s,
            group=self.names.dispatcher_group,
            rebalance_timeout_ms=s.rebalance_timeout_ms,
            assignor=s.group_assignor,
            **{"client.id": f"dispatcher-{self.member}"},
        )
        self.consumer.subscribe(
            [self.names.requests_pattern, self.names.relay, self.names.inbound_pattern],
            on_assign=self.shards.on_assign,
            on_revoke=self.shards.on_revoke,
            on_lost=self.shards.on_lost,
        )

    def close_consumer(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None

    # ----------------------------------------------------------------- the loop
    def apply_batch(self) -> int:
        """Handle one batch of records and due timers in one transaction; returns records seen.
        Raises Kafka's exception when the transaction fails (`services.dispatcher.recovery`)."""
        assert self.consumer is not None
        self.shards.take_pending(self.consumer)  # shards given while their last owner's txn ran
        now = self.clock.now_ms()
        deadline = self.engine.next_deadline_ms()
        # Never a zero wait: librdkafka counts the time inside a non-blocking poll, rebuilding
        # shards in the assignment callback included, against max.poll.interval.ms.
        wait_s = 0.1 if deadline is None else min(0.1, max(0.001, (deadline - now) / 1000))
        # Polling (and so any rebalance) happens here, never inside a transaction.
        msgs = kafka.consume_batch(self.consumer, self.settings.batch_max, wait_s)
        records = [m for m in msgs if _is_record(m)]
        now = self.clock.now_ms()
        if len(self.pieces):
            self.pieces.purge(now, self.settings.reassembly_stale_ms)
        deadline = self.engine.next_deadline_ms()
        if not records and (deadline is None or deadline > now):
            return 0
        coords = [_coord(m) for m in records]
        if self.isolation.suspect(coords):
            self._isolated(records, now)
        else:
            self._around_poison(records, coords, now)
        return len(records)

    def _around_poison(self, records: list[Message], coords: list[Coord], now: int) -> None:
        """The batch in one transaction, or, when it holds records to set aside, the records
        between them in transactions of their own, in their order (`isolation`)."""
        start = 0
        for i, where in enumerate(coords):
            verdict = self.isolation.verdict(where)
            if verdict is Verdict.APPLY:
                continue
            if i > start:
                self._transaction(records[start:i], now)
            self._set_aside(records[i], verdict, now)
            start = i + 1
        if start < len(records) or start == 0:
            self._transaction(records[start:], now)

    def _isolated(self, records: list[Message], now: int) -> None:
        """The records of a batch Kafka refused, one transaction each, so that the one it
        refuses is found and set aside and the others are applied (`isolation`)."""
        for m in records:
            verdict = self.isolation.verdict(_coord(m))
            if verdict is Verdict.APPLY:
                self._transaction([m], now, timers=False)
            else:
                self._set_aside(m, verdict, now)

    def _set_aside(self, m: Message, verdict: Verdict, now: int) -> None:
        """A poison record: refused with an error record (or only skipped, when writing that
        failed too), in a transaction that commits its offset and nothing it asked for."""
        topic, partition, offset = where = _coord(m)
        reason = self.isolation.reason(where)
        POISON_RECORDS.labels(verdict.value).inc()
        log.error(
            "record %s[%d]@%d %s: its transaction failed alone (%s)",
            topic, partition, offset, verdict.value, reason,
        )  # fmt: skip
        out = Outputs()
        if verdict is Verdict.REFUSE:
            exc = PoisonRecord(
                f"this record's transaction failed twice, alone, so it was not applied: {reason}"
            )
            out = Engine.malformed(
                exc, topic=topic, partition=partition, offset=offset, raw=m.value()
            )
            out.principal = self.router.principal_of(topic)
            self._errors[exc.code].inc()
        self._transaction([m], now, timers=False, outputs=lambda _m, _now: out)

    def _transaction(
        self,
        records: list[Message],
        now: int,
        *,
        timers: bool = True,
        outputs: Callable[[Message, int], Outputs] | None = None,
    ) -> None:
        """`records` (their `outputs`: the engine's by default) and, with `timers`, the due
        timers, in one transaction with the records' offsets."""
        assert self.consumer is not None
        started = time.perf_counter()
        handle = outputs or self._handle
        self.open_records = [_coord(m) for m in records]
        p = self.producer
        p.begin_transaction()
        for m in records:
            p.source = _coord(m)
            try:
                self._write(handle(m, now), now)
            except KafkaException as exc:  # an output refused before it was sent: too large
                p.refused.append((p.source, exc.args[0]))
                raise
        p.source = None
        if timers:
            self._write(self.engine.tick(now), now)
        self.writer.flush(self.engine.changed_depths(now))
        offsets = self.shards.transaction_offsets(self.consumer, records)
        self.batch = len(records)
        if offsets:
            # With a time limit: without one, librdkafka waits forever while the coordinator
            # answers CONCURRENT_TRANSACTIONS after a broker restart (found by the chaos harness).
            with self.watchdog.guard("send_offsets_to_transaction"):
                p.send_offsets_to_transaction(
                    offsets, self.consumer.consumer_group_metadata(), TXN_CALL_TIMEOUT_S
                )
        with self.watchdog.guard("commit_transaction"):
            p.commit_transaction(TXN_CALL_TIMEOUT_S)
        self.isolation.applied(self.open_records)
        self.counts.applied += len(records)
        self.counts.transactions += 1
        TXN_SECONDS.observe(time.perf_counter() - started)
        self.queue_metrics.export_depth(self.engine)

    def _write(self, out: Outputs, now: int) -> None:
        if out.received or out.purged or out.dead_letters:
            self.queue_metrics.observe(out, now)
        self.writer.write(out, now, self.settings.instance)

    def _handle(self, m: Message, now: int) -> Outputs:
        try:
            incoming = self.router.read(m)
            if incoming.elsewhere is not None:
                return handed_over(incoming.elsewhere)
            if incoming.relayed is not None:
                self._relayed[incoming.relayed.action.kind].inc()
                return self.engine.handle_relayed(incoming.relayed, now)
            request = incoming.request
            assert request is not None  # Incoming always holds one of the three
            if isinstance(request, FragmentRecord):
                joined = self._joined(request, m, now)
                if joined is None:
                    return Outputs()
                if isinstance(joined, RelayRequest):
                    return handed_over(joined)
                request = joined
        except ProtocolError as exc:
            self._errors[exc.code].inc()
            out = Engine.malformed(
                exc,
                topic=m.topic() or "",
                partition=m.partition() or 0,
                offset=m.offset() or 0,
                raw=m.value(),
            )
            out.principal = self.router.principal_of(m.topic() or "")
            return out
        self._requests[request.kind].inc()
        permissions = self.engine.permissions
        peer = incoming.peer
        source = Source.PEER if peer is not None else permissions.source_of(incoming.principal)
        out = self.engine.handle(
            request,
            now,
            sent_ms=incoming.sent_ms,
            principal=incoming.principal,
            source=source,
            peer=peer,
        )
        for e in out.errors:
            self._errors[e.code].inc()
        if isinstance(request, CommitRequest) and request.receipt is not None:
            self._commits["refused" if out.errors else "applied"].inc()
        return out

    def _joined(
        self, piece: FragmentRecord, m: Message, now: int
    ) -> AnyRequest | RelayRequest | None:
        """A fragment of a large inbound message: the whole message once its last piece is in
        (or, when it belongs to another shard, the relay to its owner), None until then."""
        if piece.to_instance != self.settings.instance:
            return None  # passing through: the forwarder's
        try:
            whole = self.pieces.offer(piece, now)
        except ValueError as exc:
            raise ProtocolError(f"fragments of {piece.message_id} do not join: {exc}") from exc
        if whole is not None and self.router.elsewhere(whole.key, m.partition() or 0):
            writer = (m.topic() or "")[len(self.names.inbound_prefix) :]
            return self.router.to_owner(whole.key, dumps(whole), "inbound", writer, None)
        return whole


def _coord(m: Message) -> Coord:
    return (m.topic() or "", m.partition() or 0, m.offset() or 0)


def _is_record(m: Message) -> bool:
    kafka.log_consumer_error(m, log)  # an end-of-partition marker is not worth a line
    return m.error() is None
