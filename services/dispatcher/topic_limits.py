"""The record size each queue topic takes, so that a message past it is refused, not poison.

Kafka refuses a record longer than its topic's ``max.message.bytes``, and the refusal fails the
whole transaction. KSB creates its topics with a limit above any body it accepts
(`ksb.runtime.kafka.MAX_RECORD_BYTES`), but an operator may lower a topic's limit, or a topic
may come from elsewhere. The dispatcher reads each queue topic's limit at start, on a new
catalog and after a failed transaction (the limit may have changed meanwhile), and the engine
refuses a SEND whose message would not fit (``request_too_large``, `ksb.dialog.engine`) before
its transaction, as SQL Server refuses a message past its limits at SEND. Poison isolation
(`services.dispatcher.isolation`) stays for what no check foresees.

I/O at the edge: one ``describe_configs`` call for every queue topic.
"""

from __future__ import annotations

import logging

from confluent_kafka import KafkaException

# confluent_kafka.admin re-exports these from a private module, with no __all__ to say so.
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

from ksb.catalog.model import Catalog
from ksb.names import Names

__all__ = ["queue_limits"]

log = logging.getLogger("ksb.dispatcher")


def queue_limits(
    admin: AdminClient, names: Names, catalog: Catalog, *, headroom: int, timeout_s: float
) -> dict[str, int]:
    """Queue name -> the longest body its topic takes (its ``max.message.bytes`` less
    `headroom` for the record around the body). A queue whose limit cannot be read is left
    out: its messages are checked by Kafka alone, and poison isolation handles a refusal."""
    topics = {names.queue(q.name): q.name for q in catalog.queues}
    if not topics:
        return {}
    resources = [ConfigResource(ConfigResource.Type.TOPIC, t) for t in topics]
    limits: dict[str, int] = {}
    try:
        futures = admin.describe_configs(resources, request_timeout=timeout_s)
    except KafkaException as exc:
        log.warning("queue topics' size limits not read (%s)", exc)
        return limits
    for resource, future in futures.items():
        try:
            entry = future.result(timeout_s).get("max.message.bytes")
        except KafkaException as exc:
            log.warning("size limit of %s not read (%s)", resource.name, exc)
            continue
        if entry is not None and entry.value is not None:
            limits[topics[resource.name]] = max(int(entry.value) - headroom, 0)
    return limits
