"""Reads one dead letter where a replay says it is, so that a replay puts back what is stored.

A replay names a queue, a message id and the offset of its dead-letter record; the message
itself is read here, from the queue's dead-letter topic (one partition), and the engine puts
back that and nothing the client sent (`ksb.dialog.dead_letters.replay`). Replays are an
operator's rare act: one read a replay, on a consumer kept for them, is cheap enough inside the
dispatcher's loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaException, TopicPartition

from ksb.errors import ProtocolError
from ksb.names import Names
from ksb.wire.protocol import DeadLetterRecord, parse_record

__all__ = ["DeadLetterReader"]

log = logging.getLogger("ksb.dispatcher")


class DeadLetterReader:
    """`read(queue, offset)`: the dead-letter record at `offset`, or None."""

    def __init__(self, names: Names, consumer: Callable[[], Consumer], timeout_s: float) -> None:
        self._names = names
        self._make = consumer
        self._consumer: Consumer | None = None
        self._timeout_s = timeout_s

    def read(self, queue: str, offset: int) -> DeadLetterRecord | None:
        if self._consumer is None:
            self._consumer = self._make()
        c = self._consumer
        tp = TopicPartition(self._names.dead_letters(queue), 0, offset)
        try:
            low, high = c.get_watermark_offsets(tp, timeout=self._timeout_s)
        except KafkaException as exc:
            log.warning("dead-letter topic of %s not read (%s)", queue, exc)
            return None
        if not low <= offset < high:
            return None
        c.assign([tp])
        deadline = time.monotonic() + self._timeout_s
        try:
            while (left := deadline - time.monotonic()) > 0:
                m = c.poll(min(left, 0.5))
                if m is None or m.error() is not None:
                    continue
                if m.offset() != offset or m.value() is None:
                    return None  # compacted away, or a tombstone: nothing stored there
                return parse_record(DeadLetterRecord, m.value(), "dead-letter record")
        except (KafkaException, ProtocolError) as exc:
            log.warning("dead letter at %s@%d not read (%s)", queue, offset, exc)
        finally:
            c.unassign()
        return None

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
