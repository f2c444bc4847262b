"""RECEIVE in the queue service: lock a group, hand out its ready messages, give the lock back.

A RECEIVE asks the queue's index for the candidate groups, best first (`ksb.queue.index`), and
locks the first free one with one Lua call in Redis (`ksb.queue.locks`, shared by the replicas:
whichever replica a client calls, a group has one holder). Before it returns messages it makes
sure this replica has read as far as the group's previous holder committed (the position the
lock remembers), so nothing that holder received comes back. The lock is handed to the client as
a sealed lease (`ksb.security.leases`): every later call of the transaction, and the commit
record the dispatcher applies, carries it, and any replica can renew or release it.

A RECEIVE without WHERE that has to wait registers its session in Redis (the activation monitors
count waiting readers) and waits on the follower's batches; one that comes back empty stamps the
time (an empty RECEIVE tells the monitor readers keep up).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis
from confluent_kafka import Consumer, TopicPartition

from ksb.clock import Clock
from ksb.errors import LeaseInvalid, LockLost, QueueDisabled
from ksb.names import Names
from ksb.queue.fold import Outcome, QueueFold
from ksb.queue.held import HeldLocks
from ksb.queue.locks import GroupLocks, Lease
from ksb.queue.stalls import CommitStalls
from ksb.runtime.redis_client import best_effort
from ksb.security.leases import LeaseClaims, LeaseSeal
from ksb.settings import QueueServiceSettings
from ksb.wire.partitioning import partition_for
from ksb.wire.protocol import QueueMessage
from services.queue.fencing import Fencing
from services.queue.queues import Queues

__all__ = ["Granted", "QueueLook", "Receiving"]

log = logging.getLogger("ksb.queue")

NEW_QUEUE_WAIT_S = 2.0
"""How long a RECEIVE on a queue this replica does not know yet waits for the catalog that adds it."""
CANDIDATES_PER_TRY = 32
"""Groups one lock call tries at most (best first)."""
HELD_RETRIED = 8
"""Groups this replica counts held that one lock call tries too, after the others."""
CATCH_UP_S = 10.0
"""How long a RECEIVE waits for this replica to read as far as the group's last commit."""
IDLE_WAIT_S = 0.1
"""A RECEIVE that waits and finds nothing ready looks again at least this often."""
LOCKED_WAIT_S = 0.02
"""A RECEIVE that waits while every ready group is locked looks again this often: a lock
released by another replica, or expired, makes no record this one reads."""


@dataclass(frozen=True)
class Granted:
    """A RECEIVE's answer: the lease (sealed), its claims and the messages (maybe none)."""

    lease: str
    claims: LeaseClaims
    messages: list[QueueMessage]


@dataclass(frozen=True)
class QueueLook:
    """One look at a queue: what a queue monitor decides on, and what operators watch."""

    ready_messages: int
    ready_groups: int
    runnable_groups: int
    """Ready groups (among the first `STATE_CANDIDATES`) whose lock nobody holds."""
    locked_groups: int
    oldest_ready_ms: int | None
    caught_up: bool


STATE_CANDIDATES = 512
"""Ready groups a look checks the locks of, best first (runnable work beyond is not counted)."""


class Receiving:
    """Locks, leases and RECEIVE over one replica's queues."""

    def __init__(
        self,
        settings: QueueServiceSettings,
        queues: Queues,
        redis_client: redis.Redis,
        seal: LeaseSeal,
        fencing: Fencing,
        *,
        probe: Callable[[], Consumer],
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.names = Names(settings.instance)
        self.queues = queues
        self.seal = seal
        self._fencing = fencing
        self.replica = f"queue-{uuid.uuid4().hex[:10]}"
        """This replica's name: the holder of the locks it takes."""
        self._redis = redis_client
        self._clock = clock
        self._locks: dict[str, GroupLocks] = {}
        self._stalls: dict[str, CommitStalls] = {}
        self.held = HeldLocks(settings.lock_ttl_ms)
        """The locks this replica took and has not let go (under `queues.cond`): the follower
        releases them when their commit outcome is read."""
        self._probe = probe()
        self._probe_lock = threading.Lock()
        self.disabled: frozenset[str] = frozenset()
        """Queues the catalog, or a status record, says are OFF (set on every catalog view):
        RECEIVE refuses them even when Redis lost its flag."""

    # ----------------------------------------------------------------- RECEIVE
    def receive(
        self,
        principal: str,
        queue: str,
        *,
        top: int | None,
        waitfor_ms: int,
        group: str | None,
        handle: str | None,
        lease: str | None,
        received: Sequence[str],
        lock_only: bool,
    ) -> Granted | None:
        """A RECEIVE (or GET CONVERSATION GROUP); None when no group could be locked in time."""
        fold = self.queues.get(queue)
        if lease:
            claims = self.opened(principal, lease, queue)
            if not self.locks(queue).extend(self._lease_of(claims)):
                raise LockLost(f"the lock on group {claims.group} is no longer held")
        else:
            if queue in self.disabled:
                raise QueueDisabled(f"queue {queue!r} is disabled (STATUS = OFF)")
            granted = self._lock(fold, principal, waitfor_ms, group, handle)
            if granted is None:
                return None
            claims, lease = granted
        if lock_only:
            return Granted(lease, claims, [])
        with self.queues.cond:
            refs = fold.index.take(claims.group, top, handle, set(received))
        return Granted(lease, claims, self.queues.records(fold, refs))

    def _lock(
        self,
        fold: QueueFold,
        principal: str,
        waitfor_ms: int,
        group: str | None,
        handle: str | None,
    ) -> tuple[LeaseClaims, str] | None:
        unfiltered = group is None and handle is None
        session: str | None = None
        deadline = time.monotonic() + waitfor_ms / 1000
        try:
            while True:
                tried, granted = self._try_lock(fold, principal, group, handle)
                if granted is not None:
                    return granted
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if unfiltered:
                        self._note_empty(fold.queue)
                    return None
                if unfiltered and session is None:
                    session = f"{self.replica}:{uuid.uuid4().hex[:8]}"
                    until_ms = int((time.time() + remaining) * 1000)
                    self._redis.zadd(self.names.waiting_key(fold.queue), {session: until_ms})
                with self.queues.cond:
                    self.queues.cond.wait(min(remaining, LOCKED_WAIT_S if tried else IDLE_WAIT_S))
        finally:
            if session is not None:
                self._leave_waiting(fold.queue, session)

    def _try_lock(
        self, fold: QueueFold, principal: str, group: str | None, handle: str | None
    ) -> tuple[bool, tuple[LeaseClaims, str] | None]:
        """(whether any group was ready to try, the lock taken)."""
        queue = fold.queue
        with self.queues.cond:
            held = self.held.groups(queue, self._clock.now_ms())
            stalled = self.stalls(queue).stalled(self._clock.now_ms())
            later = (lambda g: partition_for(g, fold.partitions) in stalled) if stalled else None
            targeted = group is not None or handle is not None
            skip = set() if targeted else held  # WHERE names one group: the script decides
            cands = fold.index.lock_candidates(skip, CANDIDATES_PER_TRY, group, handle, later)
            if not targeted:
                # Last, a few groups this replica counts held: a lock can vanish without this
                # replica hearing of it (Redis flushed, a lease run out elsewhere), and the
                # lock script skips those still held for the price of a lookup.
                cands += [g for g in sorted(held) if fold.index.has_group(g)][:HELD_RETRIED]
        if not cands:
            return False, None
        taken = self.locks(queue).acquire_first(cands)
        if taken is None:
            return True, None
        with self.queues.cond:
            self.held.took(queue, taken.group, taken.token, self._clock.now_ms())
        if not taken.first and taken.after is None:
            # The last holder neither committed nor released (its lease ran out, or Redis lost
            # the lock): its commits are stale from here on (`services.queue.fencing`).
            self._fencing.fence(queue, taken.group, taken.token, wait=False)
        self._catch_up(fold, taken)
        with self.queues.cond:
            if fold.index.has_group(taken.group):
                level = fold.index.level_of(taken.group)
                top = next(iter(fold.index.candidates(held | {taken.group})), None)
                ready = fold.index.level_of(top) if top is not None else None
                claims = LeaseClaims(
                    instance=self.settings.instance,
                    queue=queue,
                    group=taken.group,
                    token=taken.token,
                    principal=principal,
                    holder=self.replica,
                    received_ms=self._clock.now_ms(),
                    level=level,
                    ready_level=ready,
                    targeted=group is not None or handle is not None,
                    after=taken.after,
                )
                return True, (claims, self.seal.seal(claims))
        # Its messages were received meanwhile (the catch-up read their receipts): let it go.
        self._give_back(queue, taken, taken.after, committed=False)
        return True, None

    def _catch_up(self, fold: QueueFold, lease: Lease) -> None:
        """Wait until this replica has read what the group's previous holder committed.

        A group with no earlier holder has nothing to wait for. After a Redis flush that is not
        certain, but the dispatcher still refuses a second receipt of any message, so the cost
        of skipping the wait is at worst a refused commit, never a duplicate.
        """
        if lease.first and lease.after is None:
            return
        if lease.after is not None:
            part, target = lease.after[0], lease.after[1] + 1
        else:
            part = partition_for(lease.group, fold.partitions)
            with self._probe_lock:
                _low, target = self._probe.get_watermark_offsets(
                    TopicPartition(self.names.queue(fold.queue), part), timeout=5, cached=False
                )
        deadline = time.monotonic() + CATCH_UP_S
        with self.queues.cond:
            while fold.read_to.get(part, 0) < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning(
                        "%s: not read to %d on partition %d in time (at %d)",
                        fold.queue,
                        target,
                        part,
                        fold.read_to.get(part, 0),
                    )
                    return
                self.queues.cond.wait(remaining)

    def _note_empty(self, queue: str) -> None:
        now_ms = int(time.time() * 1000)
        with best_effort(log, f"{queue}: empty RECEIVE not noted"):
            self._redis.hset(self.names.activity_key(queue), "last_empty_ms", now_ms)

    def _leave_waiting(self, queue: str, session: str) -> None:
        """Unregister a waiting session; if Redis cannot be told, the entry's score (the time
        its wait ends) lets the queue monitor pass over it once that time is gone."""
        with best_effort(log, f"waiting session {session} not unregistered; it lapses"):
            self._redis.zrem(self.names.waiting_key(queue), session)

    def peek(self, queue: str, top: int) -> list[QueueMessage]:
        """The first `top` ready messages in RECEIVE order, without locking anything."""
        fold = self.queues.get(queue)
        with self.queues.cond:
            refs = fold.index.peek(top)
        return self.queues.records(fold, refs)

    def state(self, queue: str) -> QueueLook:
        """How much is ready, and how much of it a new reader could take now."""
        fold = self.queues.get(queue)
        with self.queues.cond:
            index = fold.index
            cands = list(itertools.islice(index.candidates(), STATE_CANDIDATES))
            ready, groups = index.ready_messages, index.ready_groups
            oldest, caught_up = index.oldest_ready_ms(), fold.caught_up
        locked = sum(self.locks(queue).locked(cands)) if cands else 0
        return QueueLook(ready, groups, len(cands) - locked, locked, oldest, caught_up)

    def now_ms(self) -> int:
        return self._clock.now_ms()

    # ----------------------------------------------------------------- leases
    def opened(self, principal: str, lease: str, queue: str | None = None) -> LeaseClaims:
        """The claims of a lease this caller may use: sealed by this instance, issued to this
        principal (for `queue`, when named); `LeaseInvalid` otherwise."""
        claims = self.seal.open(lease)
        if claims.instance != self.settings.instance:
            raise LeaseInvalid(f"the lease is instance {claims.instance!r}'s")
        if claims.principal != principal:
            raise LeaseInvalid(f"the lease was issued to principal {claims.principal!r}")
        if queue is not None and claims.queue != queue:
            raise LeaseInvalid(f"the lease is for queue {claims.queue!r}, not {queue!r}")
        self.queues.get(claims.queue)
        return claims

    def renew(self, principal: str, leases: Sequence[str]) -> list[bool]:
        """Extend the locks of `leases` (all the caller's); one script call per queue."""
        claims = [self.opened(principal, lease) for lease in leases]
        held = [False] * len(claims)
        by_queue: dict[str, list[int]] = {}
        for i, c in enumerate(claims):
            by_queue.setdefault(c.queue, []).append(i)
        for queue, idx in by_queue.items():
            answers = self.locks(queue).extend_all([self._lease_of(claims[i]) for i in idx])
            for i, ok in zip(idx, answers, strict=True):
                held[i] = ok
        now = self._clock.now_ms()
        with self.queues.cond:
            for c, ok in zip(claims, held, strict=True):
                if ok:
                    self.held.renewed(c.queue, c.group, c.token, now)
        return held

    def release(
        self, claims: LeaseClaims, after: tuple[int, int] | None, *, committed: bool
    ) -> None:
        """Give the group back (a rollback, or after its commit's outcome), whichever replica
        took it: the lock's token decides, so a lock a newer holder took is left alone."""
        self._give_back(claims.queue, self._lease_of(claims), after, committed=committed)

    def on_outcomes(self, outcomes: list[Outcome]) -> None:
        """Outcomes the follower read: the locks this replica took for them go back (their
        position kept for the next holder), and their partitions count as answered."""
        mine: list[tuple[str, Lease, tuple[int, int], bool]] = []
        with self.queues.cond:
            for o in outcomes:
                if self.held.let_go(o.queue, o.record.group, o.record.token):
                    lease = Lease(o.record.group, o.record.token, None)
                    mine.append((o.queue, lease, (o.partition, o.offset), o.record.applied))
        by_queue: dict[str, list[tuple[Lease, tuple[int, int] | None, bool]]] = {}
        for queue, lease, at, applied in mine:
            by_queue.setdefault(queue, []).append((lease, at, applied))
        for queue, releases in by_queue.items():
            with best_effort(log, f"{len(releases)} group locks not released; they expire"):
                self.locks(queue).release_all(releases)
        if mine:
            with self.queues.cond:
                self.queues.cond.notify_all()

    def _give_back(
        self, queue: str, lease: Lease, after: tuple[int, int] | None, *, committed: bool
    ) -> None:
        try:
            with best_effort(log, f"the lock on {lease.group} not released; it expires"):
                self.locks(queue).release_all([(lease, after, committed)])
        finally:
            with self.queues.cond:
                self.held.let_go(queue, lease.group, lease.token)
                self.queues.cond.notify_all()

    @staticmethod
    def _lease_of(claims: LeaseClaims) -> Lease:
        return Lease(claims.group, claims.token, claims.after)

    def locks(self, queue: str) -> GroupLocks:
        locks = self._locks.get(queue)
        if locks is None:
            locks = self._locks[queue] = GroupLocks(
                self._redis,
                self.names,
                queue,
                holder=self.replica,
                ttl_ms=self.settings.lock_ttl_ms,
            )
        return locks

    def stalls(self, queue: str) -> CommitStalls:
        """Per queue partition, the commits waiting (`ksb.queue.stalls`; under `queues.cond`)."""
        stalls = self._stalls.get(queue)
        if stalls is None:
            stalls = self._stalls[queue] = CommitStalls(self.settings.stalled_commit_ms)
        return stalls

    def close(self) -> None:
        self._probe.close()
