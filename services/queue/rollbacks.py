"""ROLLBACK in the queue service: count it, and move aside what a dead-letter policy says.

Every rollback is counted here, and only here: per queue (rollbacks in a row, which a commit
resets in the lock's release script; poison message handling reads it, `ksb.activation.poison`)
and per message. A queue with a dead-letter policy moves a message rolled back ``max_rollbacks``
times to its dead-letter topic while the rollback still holds the group's lock, so nobody
receives it again in between: the record is the one this replica stored, sent to the dispatcher
as a ``dead_letter`` request on the queue service's own requests topic, which the dispatcher
accepts from the queue service only. Redis failing means the rollback is not counted (the
counts live there, as after a flush), never that it fails: a rollback always gives the messages
back.
"""

from __future__ import annotations

import logging
import time

import redis
from confluent_kafka import Producer

from ksb.activation.poison import to_dead_letter
from ksb.names import Names
from ksb.security.leases import LeaseClaims
from ksb.settings import QueueServiceSettings
from ksb.wire.protocol import DeadLetterRequest, dumps
from services.queue.queues import Queues

__all__ = ["Rollbacks"]

log = logging.getLogger("ksb.queue")

DEAD_LETTER_WAIT_S = 10.0
"""How long a rollback waits for its dead-lettered messages to leave the queue (the dispatcher
applies the request) before it lets the group go anyway."""


class Rollbacks:
    """Counts rollbacks and dead-letters what a policy says."""

    def __init__(
        self,
        settings: QueueServiceSettings,
        queues: Queues,
        redis_client: redis.Redis,
        producer: Producer,
    ) -> None:
        self.names = Names(settings.instance)
        self._queues = queues
        self._redis = redis_client
        self._producer = producer
        self._topic = self.names.requests_for(settings.sender)

    def rolled_back(self, claims: LeaseClaims, message_ids: list[str]) -> list[str]:
        """Count one rollback of `message_ids`; the ones moved to the dead letters."""
        if not message_ids:
            return []
        due = self._count(claims.queue, message_ids)
        if due:
            self._dead_letter(claims, due)
        return due

    def _count(self, queue: str, message_ids: list[str]) -> list[str]:
        pipe = self._redis.pipeline(transaction=False)
        pipe.hget(self.names.dead_letter_policy_key, queue)
        pipe.incr(self.names.rollbacks_key(queue))
        for mid in message_ids:
            pipe.hincrby(self.names.message_rollbacks_key(queue), mid, 1)
        try:
            limit, _in_a_row, *counts = pipe.execute()
        except redis.RedisError as exc:
            log.warning("rollback of %d messages not counted (%s)", len(message_ids), exc)
            return []
        if not limit:
            return []
        return to_dead_letter(dict(zip(message_ids, map(int, counts), strict=True)), int(limit))

    def _dead_letter(self, claims: LeaseClaims, due: list[str]) -> None:
        fold = self._queues.get(claims.queue)
        with self._queues.cond:
            refs = [r for mid in due if (r := fold.index.find(mid)) is not None]
        for m in self._queues.records(fold, refs):
            req = DeadLetterRequest(
                message=m,
                reason=f"rolled back {claims.queue} message the maximum number of times",
            )
            self._producer.produce(
                self._topic, key=m.conversation_group_id.encode(), value=dumps(req)
            )
            log.warning(
                "dead-lettering %s from %s",
                m.message_id,
                claims.queue,
                extra={"conversation": m.conversation_handle, "group": m.conversation_group_id},
            )
        self._producer.flush(DEAD_LETTER_WAIT_S)
        deadline = time.monotonic() + DEAD_LETTER_WAIT_S
        with self._queues.cond:
            while any(mid in fold.index for mid in due):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning("%s: dead letters %s still in the queue", claims.queue, due)
                    break
                self._queues.cond.wait(remaining)
        try:
            self._redis.hdel(self.names.message_rollbacks_key(claims.queue), *due)
        except redis.RedisError as exc:
            log.warning("rollback counts of %s not cleared (%s)", due, exc)
