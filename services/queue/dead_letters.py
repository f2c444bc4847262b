"""How many messages each queue's dead-letter policy has moved aside, as the queue service counts.

The dispatcher writes a dead letter to ``ksb.<i>.dlq.<queue>`` (in the transaction that takes it
out of the queue) and nothing removes it: `ksb dlq replay` puts a copy back in the queue, and
`ksb dlq list` still shows the record. So the depth an operator watches is what `ksb dlq list`
shows, the distinct messages in that topic. Each replica reads the dead-letter topics of the
queues that have a policy from their beginning (read_committed, no group), a little on every
tick, and remembers the message ids it saw: dead letters are few, and an id is all a count needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from ksb.catalog.model import Queue
from ksb.names import Names

__all__ = ["DeadLetters"]

log = logging.getLogger("ksb.queue")

BATCHES_PER_TICK = 20
"""Batches of dead letters read on one tick at most (the rest wait for the next)."""
BATCH = 1000
METADATA_TIMEOUT_S = 2.0


class DeadLetters:
    """The dead-letter topics of one instance's queues, counted by distinct message id."""

    def __init__(self, names: Names, make_consumer: Callable[[], Consumer]) -> None:
        self._names = names
        self._make_consumer = make_consumer
        self._consumer: Consumer | None = None
        self._ids: dict[str, set[str]] = {}
        """Queue (with a dead-letter policy) -> the ids in its dead-letter topic read so far."""
        self._missing: set[str] = set()
        """Queues whose dead-letter topic did not exist yet when last looked for."""

    def watch(self, queues: Iterable[Queue]) -> None:
        """Count the dead letters of every queue of `queues` that has a policy (a new catalog)."""
        for q in queues:
            if q.dead_letter is not None and q.name not in self._ids:
                self._ids[q.name] = set()
                self._missing.add(q.name)

    def poll(self, _tick: int = 0) -> None:
        """Read what the dead-letter topics gained since the last poll (a tick task)."""
        if not self._ids:
            return
        consumer = self._assigned()
        for _ in range(BATCHES_PER_TICK):
            msgs = consumer.consume(BATCH, 0)
            for m in msgs:
                err = m.error()
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        log.warning("dead letters not read: %s", err)
                    continue
                queue = self._names.dead_letter_queue_of(m.topic() or "")
                key = m.key()
                if queue in self._ids and key is not None:
                    self._ids[queue].add(key.decode(errors="replace"))
            if len(msgs) < BATCH:
                return

    def _assigned(self) -> Consumer:
        if self._consumer is None:
            self._consumer = self._make_consumer()
        if self._missing:
            try:
                topics = self._consumer.list_topics(timeout=METADATA_TIMEOUT_S).topics
            except KafkaException as exc:
                log.warning("dead-letter topics not looked up: %s", exc)
                return self._consumer
            found = {q for q in self._missing if self._names.dead_letters(q) in topics}
            if found:
                self._consumer.incremental_assign(
                    [
                        TopicPartition(topic, p, -2)  # -2: from the beginning
                        for topic in map(self._names.dead_letters, sorted(found))
                        for p in topics[topic].partitions
                    ]
                )
                self._missing -= found
        return self._consumer

    def counts(self) -> dict[str, int]:
        """Queue -> dead letters in its topic (queues without a policy are not named)."""
        return {queue: len(ids) for queue, ids in list(self._ids.items())}

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
