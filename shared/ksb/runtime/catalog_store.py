"""The catalog kept durably in Kafka: one compacted topic, one record per version.

The whole catalog is one record under the key ``catalog`` so that a version is applied atomically
and every service sees either all of it or none; compaction keeps only the newest.
"""

from __future__ import annotations

import json
import logging
import time

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Consumer, KafkaError, Message, TopicPartition

from ksb.catalog.model import Catalog, CatalogView, parse_catalog
from ksb.errors import KsbError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.settings import KsbSettings

__all__ = ["CatalogWatcher", "apply_catalog", "load_catalog"]

_KEY = b"catalog"

log = logging.getLogger("ksb.catalog.model")


def _decode(m: Message) -> Catalog | None:
    """The catalog in `m`, or None for another key or an unreadable record.

    A record that is not a valid catalog (written by hand, not by `apply_catalog`) is skipped
    with a warning naming its offset and the reason: every service keeps the newest valid
    version instead of crashing on it.
    """
    value = m.value()
    if m.key() != _KEY or value is None:
        return None
    try:
        cat = parse_catalog(json.loads(value))
    except (ValueError, KsbError) as exc:
        log.warning("catalog record at offset %s ignored: %s", m.offset(), exc)
        return None
    if cat.applied_ms is None:  # a record written before applied_ms existed: its Kafka timestamp
        kind, ts = m.timestamp()
        if kind != TIMESTAMP_NOT_AVAILABLE:
            cat = cat.model_copy(update={"applied_ms": ts})
    return cat


def load_catalog(settings: KsbSettings) -> Catalog:
    """The newest applied catalog, or an empty one (version 0)."""
    names = Names(settings.instance)
    kafka.ensure_topics(kafka.admin(settings), kafka.core_topics(names, settings))
    c = kafka.consumer(settings)
    latest = Catalog()

    def keep(m: Message) -> None:
        nonlocal latest
        cat = _decode(m)
        if cat is not None:
            latest = cat

    try:
        kafka.read_to_end(c, names.catalog, keep)
    finally:
        c.close()
    return latest


def apply_catalog(settings: KsbSettings, catalog: Catalog) -> Catalog:
    """Store ``catalog`` as the next version and create its queue topics first, and the
    ``inbound.<writer>`` topic of every instance its routes go through.

    Topics come before the record so that no service ever sees a queue whose topic is missing.
    """
    names = Names(settings.instance)
    admin = kafka.admin(settings)
    kafka.ensure_topics(admin, kafka.core_topics(names, settings))
    kafka.ensure_topics(admin, [kafka.queue_topic(names, q) for q in catalog.queues])
    kafka.ensure_topics(admin, [kafka.dead_letter_topic(names, q) for q in catalog.queues])
    carriers = {r.next_hop for r in catalog.routes if r.broker_instance != settings.instance}
    kafka.ensure_topics(admin, kafka.inbound_topics(names, settings, carriers))
    current = load_catalog(settings)
    versioned = catalog.model_copy(
        update={"version": current.version + 1, "applied_ms": int(time.time() * 1000)}
    )
    p = kafka.producer(settings)
    p.produce(names.catalog, key=_KEY, value=versioned.model_dump_json(by_alias=True).encode())
    if p.flush(30) != 0:
        raise TimeoutError("catalog record was not acknowledged")
    return versioned


class CatalogWatcher:
    """Follows the catalog topic so a running service picks up a new version without a restart."""

    def __init__(self, settings: KsbSettings) -> None:
        self._topic = Names(settings.instance).catalog
        self._c: Consumer = kafka.consumer(settings)
        self._c.assign([TopicPartition(self._topic, 0, -2)])
        self.view = CatalogView(Catalog())

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Fold new catalog records; True when the version changed."""
        changed = False
        for m in self._c.consume(100, timeout_s):
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                continue
            cat = _decode(m)
            if cat is not None and cat.version != self.view.version:
                self.view = CatalogView(cat)
                changed = True
        return changed

    def catch_up(self, timeout_s: float = 60.0) -> CatalogView:
        """Read the catalog topic up to its current end: the newest version now."""
        tp = TopicPartition(self._topic, 0)
        _low, end = kafka.watermarks(self._c, tp, timeout_s)
        deadline = time.monotonic() + timeout_s
        while end > 0 and self._c.position([tp])[0].offset < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {self._topic} to its end")
            self.poll(0.1)
        return self.view

    def close(self) -> None:
        self._c.close()
