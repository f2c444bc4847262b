"""Acknowledgements written on another Kafka cluster, copied onto our own.

A receiving dispatcher writes its acks to ``ksb.<sender>.acks`` on *its* cluster. A transmitter
reads only its own cluster, so whoever crosses the cluster boundary carries the acks back: the
transport for its direct connections, and a forwarder for the origins whose messages it passed
on (each hop relays onto the cluster the previous hop reached it on, so a chain of forwarders
between clusters that cannot reach each other still gets every ack home).

Copies are safe to repeat: acks are cumulative and the transmission queue ignores one it has
already applied. A relay starts at the far topic's end as of `watch`, which is before anything
it carries was sent; on a restart, anything missed in between is retransmitted and acked again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)

from ksb.clock import Clock, SystemClock
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.kafka import TopicSpec
from ksb.settings import KsbSettings
from ksb.transmission.links import bootstrap_of

__all__ = ["AckRelay"]

log = logging.getLogger("ksb.transmission.ack_relay")


@dataclass
class AckRelay:
    """Relays ``ksb.<instance>.acks`` from far clusters to ours; `pump` copies what arrived."""

    settings: KsbSettings
    batch: int = 500
    clock: Clock = field(default_factory=SystemClock)
    retry_after_ms: int = 5_000
    """A cluster that could not be reached is not tried again before this (each try blocks)."""
    _consumers: dict[tuple[str, str], Consumer] = field(default_factory=dict)
    _unreachable: dict[str, tuple[int, str]] = field(default_factory=dict)
    _ensured_here: set[str] = field(default_factory=set)
    relayed: int = 0

    def is_local(self, address: str) -> bool:
        own = self.settings.kafka_bootstrap
        return bootstrap_of(address, own) == own

    def watch(self, address: str, instance: str, timeout_s: float = 5.0) -> None:
        """Carry `instance`'s acks from the cluster at `address` (nothing to do for our own).

        Creates the acks topic on both clusters when missing: brokers here do not auto-create
        topics, and a far dispatcher's transaction would fail on a missing one.
        """
        if self.is_local(address) or (address, instance) in self._consumers:
            return
        now = self.clock.now_ms()
        until, why = self._unreachable.get(address, (0, ""))
        if now < until:
            raise TimeoutError(f"{address} was unreachable moments ago: {why}")
        topic = Names(instance).acks
        far = self.settings.model_copy(update={"kafka_bootstrap": address})
        try:
            kafka.ensure_topics(kafka.admin(far), [TopicSpec(topic, 1)], timeout_s=timeout_s)
        except (KafkaException, TimeoutError) as exc:
            self._unreachable[address] = (self.clock.now_ms() + self.retry_after_ms, str(exc))
            raise
        self._unreachable.pop(address, None)
        if instance not in self._ensured_here:
            kafka.ensure_topics(kafka.admin(self.settings), [TopicSpec(topic, 1)])
            self._ensured_here.add(instance)
        c = kafka.consumer(far)
        c.assign([TopicPartition(topic, 0, _end(c, topic, timeout_s))])
        self._consumers[(address, instance)] = c
        log.info("relaying %s from %s", topic, address)

    def unwatch(self, address: str) -> None:
        """The connection to `address` closed: stop reading there (a reopen watches again)."""
        for key in [k for k in self._consumers if k[0] == address]:
            self._consumers.pop(key).close()

    def pump(self, producer: Producer) -> int:
        """Copy whatever acks have arrived; returns how many."""
        n = 0
        for (_address, instance), c in list(self._consumers.items()):
            topic = Names(instance).acks
            for m in c.consume(self.batch, 0):
                err = m.error()
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        log.warning("ack relay from %s: %s", _address, err)
                    continue
                producer.produce(topic, key=m.key(), value=m.value())
                n += 1
        self.relayed += n
        return n

    def close(self) -> None:
        for c in self._consumers.values():
            c.close()
        self._consumers.clear()


def _end(c: Consumer, topic: str, timeout_s: float) -> int:
    """The far topic's current end: acks written after this moment are all carried."""
    try:
        return int(c.get_watermark_offsets(TopicPartition(topic, 0), timeout=timeout_s)[1])
    except KafkaException:
        return OFFSET_BEGINNING
