"""The RECEIVE side of the SDK: one queue's index, group locks and commit outcomes.

A background thread folds the queue topic into a `QueueIndex`; RECEIVE asks the index for candidate
groups (best first) and locks the first free one with a single Lua call. The index holds no bodies:
the messages RECEIVE returns come from a bounded cache of records or are read back from the topic
(`ksb.sdk.bodies`), so what a reader holds per waiting message is a few dozen bytes. A commit's outcome comes back
through the same topic, and only then is the group lock released, with the outcome's position recorded
so that the next holder waits until its own index has read that far.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Container
from concurrent.futures import Future
from typing import Any

import redis
from confluent_kafka import KafkaError, Message, TopicPartition

from ksb.clock import SystemClock
from ksb.errors import CommitRefused, NotAuthorized, ProtocolError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.redis_client import best_effort
from ksb.sdk.bodies import BodyCache, messages_from
from ksb.sdk.fetch import RecordFetcher
from ksb.sdk.locks import GroupLocks, Lease
from ksb.sdk.queue_index import QueueIndex, Ready, pack_position
from ksb.sdk.stalls import CommitStalls
from ksb.settings import ClientSettings
from ksb.wire.partitioning import partition_for
from ksb.wire.protocol import CommitOutcome, QueueMessage, parse_queue_record

__all__ = ["QueueReader"]

log = logging.getLogger("ksb.sdk.reader")
_CANDIDATES_PER_TRY = 32
_FOLLOW_PREFETCH_KB = 16384
_FETCHERS = 4


class QueueReader:
    """Everything one process needs to RECEIVE from one queue."""

    def __init__(
        self,
        settings: ClientSettings,
        queue: str,
        redis_client: redis.Redis,
        *,
        partitions: int | None = None,
        holder: str | None = None,
    ) -> None:
        self.settings = settings
        self.queue = queue
        self.names = Names(settings.instance)
        self.topic = self.names.queue(queue)
        self.index = QueueIndex(queue)
        self.bodies = BodyCache(settings.reader_cache_bytes)
        self._fetchers: dict[int, RecordFetcher] = {}
        self._fetchers_lock = threading.Lock()
        self.holder = holder or f"reader-{uuid.uuid4().hex[:12]}"
        self.locks = GroupLocks(
            redis_client, self.names, queue, holder=self.holder, ttl_ms=settings.lock_ttl_ms
        )
        self.held: set[str] = set()
        self._leases: dict[str, Lease] = {}
        self._renew_at = 0.0
        self._redis = redis_client
        self._cond = threading.Condition()
        self._pending: dict[str, tuple[Lease, Future[CommitOutcome]]] = {}
        self.stalls = CommitStalls(settings.stalled_commit_ms)
        self._clock = SystemClock()
        self._eof: dict[int, int] = {}
        self._stop = threading.Event()
        # librdkafka reads ahead 64 MiB by default; a quarter keeps the follower as fast here.
        prefetch: dict[str, Any] = {"queued.max.messages.kbytes": _FOLLOW_PREFETCH_KB}
        self._consumer = kafka.consumer(settings, **prefetch)
        # Offsets are queried on a second handle: the follower thread is blocked in consume().
        self._probe = kafka.consumer(settings)
        md = self._consumer.list_topics(self.topic, timeout=30).topics[self.topic]
        if md.error is not None:
            self._consumer.close()
            self._probe.close()
            if md.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                raise NotAuthorized(f"RECEIVE on {queue}: Kafka refused its topic: {md.error}")
            raise ProtocolError(f"queue topic {self.topic} is not available: {md.error}")
        self.partitions = partitions or len(md.partitions)
        self._consumer.assign([TopicPartition(self.topic, p, -2) for p in sorted(md.partitions)])
        self._thread = threading.Thread(
            target=self._follow, name=f"ksb-reader-{queue}", daemon=True
        )
        self._thread.start()

    # ----------------------------------------------------------------- following the topic
    def _follow(self) -> None:
        """The follower thread: a failure in one round is logged and retried, never fatal, since
        every pending commit waits on this thread."""
        while not self._stop.is_set():
            try:
                self._follow_once()
            except Exception:
                if self._stop.is_set():
                    return  # the consumer was closed under us during shutdown
                log.exception("reader of %s: follower round failed; retrying", self.queue)
                time.sleep(0.1)

    def _follow_once(self) -> None:
        self._renew()
        msgs = kafka.consume_batch(self._consumer, 1000, 0.05)
        if not msgs:
            return
        outcomes: list[tuple[CommitOutcome, int, int]] = []
        with self._cond:
            for m in msgs:
                self._apply(m, outcomes)
            self._cond.notify_all()
        if outcomes:
            self._resolve(outcomes)

    def _apply(self, m: Message, outcomes: list[tuple[CommitOutcome, int, int]]) -> None:
        err = m.error()
        part = m.partition() or 0
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                self._eof[part] = max(self._eof.get(part, 0), m.offset() or 0)
            return
        key = (m.key() or b"").decode()
        offset = m.offset() or 0
        self._eof[part] = max(self._eof.get(part, 0), offset + 1)
        try:
            value = parse_queue_record(m.value())
        except ProtocolError as exc:
            log.warning("skipping bad queue record at %s/%d: %s", part, offset, exc)
            return
        if isinstance(value, CommitOutcome):
            outcomes.append((value, part, offset))
            return
        if key.startswith("commit/"):
            return
        gone = self.index.apply(key, value, part, offset)
        if gone is not None:
            self.bodies.discard(gone.position)
        elif value is not None and value.status == 1 and m.value() is not None:
            self.bodies.put(pack_position(part, offset), m.value() or b"")

    def _renew(self) -> None:
        """Keep held locks alive while their transactions run (a lock lasts until commit or
        rollback); a crashed process stops renewing, so its locks expire after one TTL."""
        now = time.monotonic()
        if now < self._renew_at:
            return
        self._renew_at = now + self.settings.lock_ttl_ms / 3000
        with self._cond:
            leases = list(self._leases.values())
        if leases:
            self.locks.extend_all(leases)

    def _resolve(self, outcomes: list[tuple[CommitOutcome, int, int]]) -> None:
        """The commits these outcomes answer: their locks released in one pipelined round trip
        (a busy reader reads several outcomes per fetch), then their futures resolved."""
        answered = []
        for outcome, partition, offset in outcomes:
            pending = self.forget(outcome.request_id)
            if pending is not None:
                answered.append((outcome, (partition, offset), *pending))
        if not answered:
            return
        # The outcomes are read and gone from the consumer: they must still reach their commits
        # when Redis fails (found by the chaos harness: a Redis restart left commits waiting
        # forever for outcomes already applied).
        self._give_back([(lease, at, o.applied) for o, at, lease, _f in answered])
        for outcome, _at, _lease, fut in answered:
            if outcome.applied:
                fut.set_result(outcome)
            else:
                fut.set_exception(CommitRefused(outcome.reason))

    # ----------------------------------------------------------------- RECEIVE
    def lock_group(
        self, *, waitfor_ms: int, group: str | None = None, handle: str | None = None
    ) -> Lease | None:
        """Lock the best free group with ready messages (or the named one), waiting up to waitfor_ms.

        A RECEIVE without WHERE that has to wait registers itself as a waiting session, and one that
        comes back empty stamps the time: both are what the queue monitor decides activation on.
        """
        unfiltered = group is None and handle is None
        session: str | None = None
        deadline = time.monotonic() + waitfor_ms / 1000
        try:
            while True:
                lease = self._try_lock(group, handle)
                if lease is not None:
                    return lease
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if unfiltered:
                        self._note_empty()
                    return None
                if unfiltered and session is None:
                    session = f"{self.holder}:{uuid.uuid4().hex[:8]}"
                    until_ms = int((time.time() + remaining) * 1000)
                    self._redis.zadd(self.names.waiting_key(self.queue), {session: until_ms})
                with self._cond:
                    # Locks held elsewhere are released without a topic event: re-try every 20 ms.
                    self._cond.wait(min(remaining, 0.02))
        finally:
            if session is not None:
                self._leave_waiting(session)

    def _leave_waiting(self, session: str) -> None:
        """Unregister a waiting session; if Redis cannot be told, the entry's score (the time
        its wait ends) lets the queue monitor pass over it once that time is gone."""
        with best_effort(log, f"waiting session {session} not unregistered; it lapses"):
            self._redis.zrem(self.names.waiting_key(self.queue), session)

    def _try_lock(self, group: str | None, handle: str | None) -> Lease | None:
        with self._cond:
            stalled = self.stalls.stalled(self._clock.now_ms())
            later = (lambda g: self._partition_of(g) in stalled) if stalled else None
            cands = self.index.lock_candidates(self.held, _CANDIDATES_PER_TRY, group, handle, later)
        if not cands:
            return None
        lease = self.locks.acquire_first(cands)
        if lease is None:
            return None
        with self._cond:
            self.held.add(lease.group)
            self._leases[lease.group] = lease
        self._catch_up(lease)
        with self._cond:
            if self.index.has_group(lease.group):
                return lease
        self.release(lease, None)
        return None

    def _note_empty(self) -> None:
        now_ms = int(time.time() * 1000)
        self._redis.hset(self.names.activity_key(self.queue), "last_empty_ms", now_ms)

    def note_rollback(self, message_ids: list[str]) -> list[str]:
        """Count a rollback per queue (poison detection) and per message, in one round trip.

        Returns the messages that have now reached the queue's dead-letter limit, if it has one.
        With Redis failing the rollback is not counted (the counts live there, as after a
        flush) rather than failing: a rollback always gives the messages back.
        """
        pipe = self._redis.pipeline(transaction=False)
        pipe.hget(self.names.dead_letter_policy_key, self.queue)
        pipe.incr(self.names.rollbacks_key(self.queue))
        for mid in message_ids:
            pipe.hincrby(self.names.message_rollbacks_key(self.queue), mid, 1)
        try:
            limit, _n, *counts = pipe.execute()
        except redis.RedisError as exc:
            log.warning("rollback of %d messages not counted (%s)", len(message_ids), exc)
            return []
        if not limit:
            return []
        return [mid for mid, c in zip(message_ids, counts, strict=True) if int(c) >= int(limit)]

    def wait_gone(self, message_ids: list[str], timeout_s: float = 10.0) -> bool:
        """Wait until the index no longer holds these messages (dead-lettered or received)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while any(mid in self.index for mid in message_ids):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def _catch_up(self, lease: Lease, timeout_s: float = 10.0) -> None:
        """Wait until the index has read what the previous holder committed.

        A group with no earlier holder has nothing to wait for. After a Redis flush that is not
        certain, but the dispatcher still refuses a second receipt of any message, so the cost of
        skipping the wait is at worst a refused commit, never a duplicate.
        """
        if lease.first and lease.after is None:
            return
        part = self._partition_of(lease.group)
        if lease.after is not None:
            p, off = lease.after
            target = off + 1
            part = p
        else:
            _low, high = self._probe.get_watermark_offsets(
                TopicPartition(self.topic, part), timeout=5, cached=False
            )
            target = high
        if target <= 0:
            return
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._eof.get(part, 0) < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning(
                        "index did not reach %d on partition %d in time (at %s)",
                        target,
                        part,
                        self._eof,
                    )
                    return
                self._cond.wait(remaining)

    def levels(self, group: str) -> tuple[int, int | None]:
        """The group's level, and the highest level among the other ready groups this process does
        not hold: what this reader saw when it RECEIVEd, for the audit's receive events."""
        with self._cond:
            top = next(iter(self.index.candidates(self.held)), None)
            return self.index.level_of(group), None if top is None else self.index.level_of(top)

    def candidates(self, limit: int) -> tuple[list[str], int]:
        """Up to `limit` groups with ready messages, best first, and the ready message count:
        what a queue monitor looks at, read in one consistent moment."""
        with self._cond:
            groups = list(itertools.islice(self.index.candidates(), limit))
            return groups, self.index.ready_messages

    def ready_message(self, message_id: str) -> QueueMessage | None:
        """The message if it is still waiting in the queue."""
        with self._cond:
            ref = self.index.find(message_id)
        got = [] if ref is None else self._read([ref])
        return got[0] if got else None

    def messages(
        self,
        lease: Lease,
        top: int | None,
        handle: str | None = None,
        skip: Container[str] = (),
    ) -> list[QueueMessage]:
        """The locked group's ready messages in RECEIVE order, bodies included (`skip`: those this
        transaction already received)."""
        with self._cond:
            refs = self.index.take(lease.group, top, handle, skip)
        return self._read(refs)

    def _read(self, refs: list[Ready]) -> list[QueueMessage]:
        """Bodies from the cache, the others read back from the topic in one pass."""
        records: dict[int, bytes] = {}
        with self._cond:
            for ref in refs:
                raw = self.bodies.get(ref.position)
                if raw is not None:
                    records[ref.position] = raw
        missing: dict[int, list[tuple[int, int]]] = {}
        for r in refs:
            if r.position not in records:
                missing.setdefault(r.partition % _FETCHERS, []).append((r.partition, r.offset))
        for slot, wanted in missing.items():
            for (p, off), m in self._fetcher(slot).fetch(wanted, self._keep_passed).items():
                records[pack_position(p, off)] = m.value() or b""
        return messages_from(refs, records)

    @property
    def fetchers(self) -> list[RecordFetcher]:
        """The read-back consumers made so far."""
        with self._fetchers_lock:
            return list(self._fetchers.values())

    def _fetcher(self, slot: int) -> RecordFetcher:
        """A read-back consumer, made on the first cache miss (a reader that keeps up needs none).
        Partitions share `_FETCHERS` of them, each keeping its place in its own partitions, so
        RECEIVEs of groups in different partitions do not seek each other's consumer away."""
        with self._fetchers_lock:
            f = self._fetchers.get(slot)
            if f is None:
                f = self._fetchers[slot] = RecordFetcher(self.settings, self.topic)
            return f

    def _keep_passed(self, msgs: list[Message]) -> None:
        """Records a read-back passed over: the ready ones are what the next RECEIVEs want."""
        with self._cond:
            for m in msgs:
                key, raw = m.key(), m.value()
                part, off = m.partition() or 0, m.offset() or 0
                if key and raw and self.index.holds_at(key.decode(), part, off):
                    self.bodies.put(pack_position(part, off), raw)

    def release(self, lease: Lease, after: tuple[int, int] | None) -> None:
        """Give a group back without a commit (rollback).

        Nothing new was committed, so the next holder must still read as far as the last commit
        did: pass on the position this lease was given (unknown stays unknown, which makes the next
        holder catch up with the partition's end).
        """
        self._give_back([(lease, after if after is not None else lease.after, False)])

    def _give_back(self, releases: list[tuple[Lease, tuple[int, int] | None, bool]]) -> None:
        """Release (lease, after, committed) in one script call and forget the leases here. With
        Redis failing the locks expire after their TTL instead (the next holders, finding no
        position in them, catch up with their partitions' ends), and this reader forgets them all
        the same: left held, they would be renewed for as long as the reader lives."""
        try:
            with best_effort(log, f"{len(releases)} group locks not released; they expire"):
                self.locks.release_all(releases)
        finally:
            with self._cond:
                for lease, _after, _committed in releases:
                    self.held.discard(lease.group)
                    self._leases.pop(lease.group, None)
                self._cond.notify_all()

    def expect_outcome(self, request_id: str, lease: Lease) -> Future[CommitOutcome]:
        fut: Future[CommitOutcome] = Future()
        with self._cond:
            self._pending[request_id] = (lease, fut)
            self.stalls.sent(self._partition_of(lease.group), self._clock.now_ms())
        return fut

    def forget(self, request_id: str) -> tuple[Lease, Future[CommitOutcome]] | None:
        """The commit no longer waits here (answered, or given up); what it was waiting with."""
        with self._cond:
            pending = self._pending.pop(request_id, None)
            if pending is not None:
                self.stalls.answered(self._partition_of(pending[0].group))
        return pending

    def _partition_of(self, group: str) -> int:
        """The group's queue partition: its shard's, in a queue co-partitioned with the shards."""
        return partition_for(group, self.partitions)

    def describe(self) -> str:
        """What this reader holds now, for a report on a run that stopped short: commits
        waiting for an outcome (request id, group, fencing token), groups locked, and the
        messages the index counts ready."""
        with self._cond:
            pending = [
                f"{rid} on {lease.group} (token {lease.token})"
                for rid, (lease, _f) in list(self._pending.items())[:10]
            ]
            return (
                f"{len(self._pending)} commits waiting [{', '.join(pending)}], "
                f"{len(self.held)} groups held, {self.index.ready_messages} messages ready"
            )

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Block until every commit this reader sent has its outcome."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{len(self._pending)} commits without an outcome")
                self._cond.wait(remaining)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._consumer.close()
        self._probe.close()
        for f in self.fetchers:
            f.close()
