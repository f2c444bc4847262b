"""The catalog kept durably in Kafka: one compacted topic, one record per version.

The whole catalog is one record under the key ``catalog`` so that a version is applied atomically
and every service sees either all of it or none; compaction keeps only the newest. Each version
names the principal that wrote it (``written_by``); Kafka's ACLs let only the catalog's writers
write the topic (`ksb.security.governance`).

The queues that poison-message handling disabled are not in the catalog but in the queue-status
topic (`ksb.wire.queue_status`), which the watcher reads beside it: the view a service gets has
those queues OFF (`ksb.catalog.queue_status`), so every service that honours a disabled queue
honours them without knowing where the status came from.
"""

from __future__ import annotations

import json
import logging
import time

from confluent_kafka import (
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from ksb.catalog.model import Catalog, CatalogView, parse_catalog
from ksb.catalog.queue_status import disabled_by_status, effective
from ksb.errors import KsbError, NotAuthorized
from ksb.names import Names
from ksb.runtime import kafka
from ksb.settings import KsbSettings
from ksb.wire.queue_status import QueueStatus, encode_queue_status, parse_queue_status

__all__ = [
    "CatalogWatcher",
    "apply_catalog",
    "load_catalog",
    "load_statuses",
    "load_view",
    "write_queue_status",
]

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


def load_statuses(settings: KsbSettings) -> dict[str, QueueStatus]:
    """The newest status record of each queue that has one (empty where the topic is missing:
    an instance whose ACLs were applied before the topic existed)."""
    names = Names(settings.instance)
    c = kafka.consumer(settings)
    latest: dict[str, QueueStatus] = {}

    def keep(m: Message) -> None:
        status = _decode_status(m)
        if status is not None:
            latest[status.queue] = status

    try:
        if _exists(c, names.queue_status):
            kafka.read_to_end(c, names.queue_status, keep)
    finally:
        c.close()
    return latest


def load_view(settings: KsbSettings) -> CatalogView:
    """The newest catalog as the services see it: with the queues status records disable."""
    catalog = load_catalog(settings)
    disabled = _disabled(load_statuses(settings))
    return CatalogView(effective(catalog, disabled), disabled_by_status(catalog, disabled))


def write_queue_status(settings: KsbSettings, status: QueueStatus) -> None:
    """Store `status` as its queue's newest status record (acknowledged before it returns)."""
    names = Names(settings.instance)
    _write(settings, names.queue_status, status.queue.encode(), encode_queue_status(status))


def apply_catalog(settings: KsbSettings, catalog: Catalog) -> Catalog:
    """Store ``catalog`` as the next version, written by this login, its queue topics first,
    and the ``inbound.<writer>`` topic of every instance its routes go through.

    Topics come before the record so that no service ever sees a queue whose topic is missing.
    """
    names = Names(settings.instance)
    admin = kafka.admin(settings)
    kafka.ensure_topics(admin, kafka.core_topics(names, settings))
    try:
        kafka.ensure_topics(admin, [kafka.queue_topic(names, q) for q in catalog.queues])
        kafka.ensure_topics(admin, [kafka.dead_letter_topic(names, q) for q in catalog.queues])
        carriers = {r.next_hop for r in catalog.routes if r.broker_instance != settings.instance}
        kafka.ensure_topics(admin, kafka.inbound_topics(names, settings, carriers))
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.TOPIC_AUTHORIZATION_FAILED:
            raise
        raise _not_a_writer(settings, names.catalog) from None
    current = load_catalog(settings)
    versioned = catalog.model_copy(
        update={
            "version": current.version + 1,
            "applied_ms": int(time.time() * 1000),
            "written_by": settings.acting_principal or None,
        }
    )
    _write(settings, names.catalog, _KEY, versioned.model_dump_json(by_alias=True).encode())
    return versioned


def _write(settings: KsbSettings, topic: str, key: bytes, value: bytes) -> None:
    """Produce one record and wait for its acknowledgement; a refusal is an error naming who
    may write `topic` (only the catalog's writers, `ksb.security.governance`)."""
    refused: list[KafkaError] = []

    def delivered(err: KafkaError | None, _m: Message) -> None:
        if err is not None:
            refused.append(err)

    p = kafka.producer(settings)
    p.produce(topic, key=key, value=value, on_delivery=delivered)
    if p.flush(30) != 0:
        raise TimeoutError(f"the {topic} record was not acknowledged")
    if refused:
        err = refused[0]
        if err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            raise _not_a_writer(settings, topic)
        raise KafkaException(err)


def _not_a_writer(settings: KsbSettings, topic: str) -> NotAuthorized:
    who = settings.acting_principal or "this login"
    return NotAuthorized(
        f"{who} may not write {topic}: the catalog and the queues' status are changed by admin "
        "and the instance's owners only (docs/security.md, 'Who may change the catalog')"
    )


class CatalogWatcher:
    """Follows the catalog and queue-status topics, so a running service picks up a new version,
    or a queue disabled by poison-message handling, without a restart."""

    def __init__(self, settings: KsbSettings) -> None:
        names = Names(settings.instance)
        self._topic = names.catalog
        self._status_topic = names.queue_status
        self._c: Consumer = kafka.consumer(settings)
        self._follows_status = _exists(self._c, self._status_topic)
        if not self._follows_status:
            log.warning(
                "%s does not exist or may not be read: queues disabled by poison-message "
                "handling are not seen (run `ksb acl apply` as admin)",
                self._status_topic,
            )
        parts = [TopicPartition(self._topic, 0, -2)]
        if self._follows_status:
            parts.append(TopicPartition(self._status_topic, 0, -2))
        self._c.assign(parts)
        self._catalog = Catalog()
        self._statuses: dict[str, QueueStatus] = {}
        self.view = CatalogView(Catalog())

    @property
    def view(self) -> CatalogView:
        return self._view

    @view.setter
    def view(self, view: CatalogView) -> None:
        """Start from `view` (the shell's newest); the next records fold onto the stored
        catalog as read, so a version seen again is taken again, harmlessly."""
        self._view = view

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Fold new catalog and status records; True when the view changed (a new version, or a
        queue's status)."""
        catalog_changed = status_changed = False
        for m in self._c.consume(100, timeout_s):
            if m.error() is not None:
                continue
            if m.topic() == self._status_topic:
                status = _decode_status(m)
                if status is not None and self._statuses.get(status.queue) != status:
                    self._statuses[status.queue] = status
                    status_changed = True
                continue
            cat = _decode(m)
            if cat is not None and cat.version != self._catalog.version:
                self._catalog = cat
                catalog_changed = True
        if not (catalog_changed or status_changed):
            return False
        disabled = _disabled(self._statuses)
        held = disabled_by_status(self._catalog, disabled)
        if not catalog_changed and held == self._view.held_off:
            return False
        self._view = CatalogView(effective(self._catalog, disabled), held)
        return True

    def catch_up(self, timeout_s: float = 60.0) -> CatalogView:
        """Read the catalog and status topics up to their current end: the newest view now."""
        parts = [TopicPartition(self._topic, 0)]
        if self._follows_status:
            parts.append(TopicPartition(self._status_topic, 0))
        ends = {}
        for tp in parts:
            try:
                ends[tp.topic] = kafka.watermarks(self._c, tp, timeout_s)[1]
            except KafkaException as exc:
                if tp.topic != self._status_topic:
                    raise
                log.warning("%s not read: %s", tp.topic, exc)
        deadline = time.monotonic() + timeout_s
        while any(
            end > 0 and self._c.position([TopicPartition(topic, 0)])[0].offset < end
            for topic, end in ends.items()
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {self._topic} to its end")
            self.poll(0.1)
        return self.view

    def close(self) -> None:
        self._c.close()


def _decode_status(m: Message) -> QueueStatus | None:
    """The status in `m`, or None for a tombstone or an unreadable record (skipped with a
    warning, as an unreadable catalog record is)."""
    if m.value() is None:
        return None
    try:
        return parse_queue_status(m.value())
    except KsbError as exc:
        log.warning("queue status record at offset %s ignored: %s", m.offset(), exc)
        return None


def _disabled(statuses: dict[str, QueueStatus]) -> dict[str, str]:
    return {q: s.reason for q, s in statuses.items() if s.disabled}


def _exists(c: Consumer, topic: str) -> bool:
    """Whether `topic` exists and this login may see it (its metadata carries no error)."""
    try:
        meta = c.list_topics(topic, timeout=10).topics.get(topic)
    except KafkaException:
        return False
    return meta is not None and meta.error is None
