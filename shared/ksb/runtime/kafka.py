"""Kafka client configuration and topic layout, tuned for low latency on a small cluster.

Consumers wait at most ``fetch_wait_max_ms`` for data (librdkafka's 500 ms default would dominate
end-to-end latency), at most `FETCH_QUEUE_BACKOFF_MS` to fetch again after their read-ahead
filled (librdkafka's 1 s default stalled readers of a backlog), and use short sessions so a
restarted service rejoins in about a second.

Every client made here logs in through `client_security`, the one place that turns a process's
settings into its Kafka login, so no client can be made without the process's credentials; and
hands its log lines and errors to Python's logging (`ksb.runtime.kafka_logs`, logger
``ksb.kafka.<role>``) instead of librdkafka's stderr.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from ksb.names import Names
from ksb.runtime.credentials import kafka_login
from ksb.runtime.kafka_logs import client_log
from ksb.settings import STICKY_SHARDS, ClientSettings, KsbSettings

if TYPE_CHECKING:  # only the type: a client's import of this module needs no catalog validators
    from ksb.catalog.model import Queue

__all__ = [
    "TopicSpec",
    "admin",
    "client_security",
    "consume_batch",
    "consumer",
    "core_topics",
    "dead_letter_topic",
    "ensure_topics",
    "group_consumer",
    "log_consumer_error",
    "producer",
    "producer_conf",
    "queue_topic",
    "read_to_end",
    "remote_producer",
    "request_producer",
    "watermarks",
]


def producer(
    settings: KsbSettings,
    *,
    transactional_id: str | None = None,
    txn_timeout_ms: int = 10_000,
    extra: dict[str, Any] | None = None,
) -> Producer:
    return Producer(
        producer_conf(
            settings, transactional_id=transactional_id, txn_timeout_ms=txn_timeout_ms, extra=extra
        )
    )


def request_producer(settings: ClientSettings) -> Producer:
    """The SDK's request producer (`ksb.sdk.client.KsbClient`), which the benchmarks' raw
    baseline uses too, so that it never waits where KSB's client does not.

    One produce request in flight: a request leaves at once when none is (no linger), and what
    queues up meanwhile goes in the next one. With librdkafka's five, a client sending a few
    thousand requests a second sent most of them alone, and the broker, paying per request,
    handled a fifth more produce requests (JMX, `make bench`'s load: 1,192 -> 934 a second)."""
    extra = {"linger.ms": settings.request_linger_ms, "max.in.flight.requests.per.connection": 1}
    return producer(settings, extra=extra)


def producer_conf(
    settings: KsbSettings,
    *,
    transactional_id: str | None = None,
    txn_timeout_ms: int = 10_000,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every KSB producer's configuration (for a `Producer` subclass, say)."""
    conf: dict[str, Any] = {
        "bootstrap.servers": settings.kafka_bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": settings.batch_linger_ms,
        "message.max.bytes": MAX_RECORD_BYTES,
        "compression.type": settings.kafka_compression,
        **client_log("producer"),
    }
    if transactional_id is not None:
        conf["transactional.id"] = transactional_id
        conf["transaction.timeout.ms"] = txn_timeout_ms
    conf.update(extra or {})
    conf.update(client_security(settings, conf["bootstrap.servers"]))
    return conf


def remote_producer(
    settings: KsbSettings,
    address: str,
    *,
    delivery_timeout_ms: int,
    connect_timeout_s: float | None = None,
) -> Producer:
    """A producer to the cluster at `address` (bootstrap list): a failed delivery is reported
    within `delivery_timeout_ms`, which is how a broken link to another instance shows."""
    extra: dict[str, Any] = {
        "bootstrap.servers": address,
        "message.timeout.ms": delivery_timeout_ms,
    }
    if connect_timeout_s is not None:
        extra["socket.connection.setup.timeout.ms"] = int(connect_timeout_s * 1000)
    return producer(settings, extra=extra)


FETCH_QUEUE_BACKOFF_MS = 5
"""How long librdkafka postpones a partition's next fetch once the consumer's read-ahead is full.
Its default, 1 s, outlives what the read-ahead holds here: the SDK's read-back consumers
(`ksb.sdk.fetch`) stalled a whole second every few RECEIVEs of a backlog longer than the body cache,
and a reader behind by that much fell further behind, down to ~250 messages a second
(a read-back took p90 1,007 ms, 100,000 records in; 11 ms with this)."""


def consumer(
    settings: KsbSettings, *, group: str | None = None, read_committed: bool = True, **extra: Any
) -> Consumer:
    conf: dict[str, Any] = {
        "bootstrap.servers": settings.kafka_bootstrap,
        "group.id": group or Names(settings.instance).reader_group,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed" if read_committed else "read_uncommitted",
        "fetch.wait.max.ms": settings.fetch_wait_max_ms,
        "fetch.error.backoff.ms": 50,
        "session.timeout.ms": settings.session_timeout_ms,
        "heartbeat.interval.ms": max(100, settings.session_timeout_ms // 5),
        "enable.partition.eof": True,
        "topic.metadata.refresh.interval.ms": 5000,
        "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
        **client_log("consumer"),
    }
    conf.update(extra)
    conf.update(client_security(settings, conf["bootstrap.servers"]))
    return Consumer(conf)


def group_consumer(
    settings: KsbSettings,
    *,
    group: str,
    rebalance_timeout_ms: int,
    assignor: str = STICKY_SHARDS,
    **extra: Any,
) -> Consumer:
    """A member of a consumer group under Kafka's consumer protocol (KIP-848) with a
    co-partitioning server-side assignor: every member gets the same partition numbers of every
    topic it subscribes to, which is what lets the partition number be a shard. KSB's own
    (`STICKY_SHARDS`, a broker plugin) also keeps each member's shards while others come and go;
    Kafka's ``range`` splits alike but moves survivors' shards. Its session and heartbeat are the
    broker's (``group.consumer.*``); a client may not set them. A member that has not given up
    partitions the coordinator moved away ``rebalance_timeout_ms`` after being told (or has not
    polled for that long) is fenced and joins afresh."""
    conf: dict[str, Any] = {
        "bootstrap.servers": settings.kafka_bootstrap,
        "group.id": group,
        "group.protocol": "consumer",
        "group.remote.assignor": assignor,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "fetch.wait.max.ms": settings.fetch_wait_max_ms,
        "fetch.error.backoff.ms": 50,
        "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
        "enable.partition.eof": False,
        "max.poll.interval.ms": rebalance_timeout_ms,  # sent as the member's rebalance timeout
        **client_log("group", debug=bool(settings.kafka_debug)),
    }
    if settings.kafka_debug:
        conf["debug"] = settings.kafka_debug
    conf.update(extra)
    conf.update(client_security(settings, conf["bootstrap.servers"]))
    return Consumer(conf)


def admin(settings: KsbSettings) -> AdminClient:
    """An admin client. Its log lines reach ``ksb.kafka.admin`` only when its ``poll`` is
    called (`ensure_topics` does); a failed request raises from the call that made it."""
    conf = {"bootstrap.servers": settings.kafka_bootstrap, **client_log("admin")}
    return AdminClient({**conf, **client_security(settings, settings.kafka_bootstrap)})


def client_security(settings: KsbSettings, bootstrap: str) -> dict[str, str]:
    """How a client of this process authenticates to the cluster at `bootstrap`: the process's
    own login on its own cluster, the remote credentials file's entry on a far one.

    Raises `ksb.errors.SecurityError` naming the missing setting when security is on and the
    process has no credentials, instead of letting librdkafka time out on a closed connection.
    """
    return kafka_login(settings, bootstrap).librdkafka()


@dataclass(frozen=True)
class TopicSpec:
    """A topic KSB makes; `ensure_topics` adds ``max.message.bytes`` = `MAX_RECORD_BYTES`."""

    name: str
    partitions: int
    config: tuple[tuple[str, str], ...] = ()


MAX_RECORD_BYTES = 8_000_000
"""The largest record (or batch of records) a KSB producer makes, and the limit every topic KSB
makes is created with: a cluster's default (1 MB on Kafka) would refuse a batch of small records
or a message near KSB's body limit, and a transaction holding one used to fail over and over
(now the record is set aside as poison: `services.dispatcher.isolation`). The local brokers take
8 MiB (`devtools.kafka_node`)."""

_COMPACT = (
    ("cleanup.policy", "compact"),
    ("min.cleanable.dirty.ratio", "0.1"),
    ("segment.ms", "3600000"),
    ("delete.retention.ms", "3600000"),
)


def core_topics(names: Names, settings: KsbSettings) -> list[TopicSpec]:
    return [
        TopicSpec(names.requests, settings.request_partitions),
        TopicSpec(names.relay, settings.request_partitions),
        TopicSpec(names.endpoints, settings.request_partitions, _COMPACT),
        TopicSpec(names.depth, 1, _COMPACT),
        TopicSpec(names.catalog, 1, _COMPACT),
        TopicSpec(names.errors, 1),
        TopicSpec(names.audit, 1),
        TopicSpec(names.transmission, 1),
        TopicSpec(names.inbound_from(names.instance), settings.request_partitions),
        TopicSpec(names.acks, 1),
        TopicSpec(names.outbound, 1),
        TopicSpec(names.links, 1),
        TopicSpec(names.activation, 1),
        TopicSpec(names.bcn, 1),
    ]


def queue_topic(names: Names, queue: Queue) -> TopicSpec:
    return TopicSpec(names.queue(queue.name), queue.partitions, _COMPACT)


def dead_letter_topic(names: Names, queue: Queue) -> TopicSpec:
    return TopicSpec(names.dead_letters(queue.name), 1)


def inbound_topics(names: Names, settings: KsbSettings, carriers: Iterable[str]) -> list[TopicSpec]:
    """One ``inbound.<writer>`` topic per instance that carries messages here (the catalog's
    routes say which: `CatalogView.carriers`), with the shard count, as the dispatchers
    co-partition them with the requests topics."""
    return [TopicSpec(names.inbound_from(w), settings.request_partitions) for w in sorted(carriers)]


def log_consumer_error(m: Message, logger: logging.Logger) -> None:
    """Warn about a consumer error record; end-of-partition markers are not errors."""
    err = m.error()
    if err is not None and err.code() != KafkaError._PARTITION_EOF:
        logger.warning("consumer error: %s", err)


def consume_batch(c: Consumer, max_n: int, timeout_s: float) -> list[Message]:
    """Up to ``max_n`` messages, returning as soon as ANY is available.

    librdkafka's ``consume(n, timeout)`` waits until ``n`` messages or the timeout, which would add
    the whole timeout to every hop's latency under light load; instead wait for the first message,
    then take whatever else is already fetched.
    """
    first = c.poll(timeout_s)
    if first is None:
        return []
    rest = c.consume(max_n - 1, 0) if max_n > 1 else []
    return [first, *rest]


def ensure_topics(client: AdminClient, specs: Iterable[TopicSpec], timeout_s: float = 30) -> None:
    """Create missing topics with their explicit partition counts; existing ones are left alone.

    Each gets as many copies as the cluster's ``default.replication.factor`` (and so its
    ``min.insync.replicas``) says: one on the one-node local stack, three on a cluster of three
    (tests/integration/test_kafka_cluster.py), where KSB's records, committed with ``acks=all``,
    outlive a broker. A fixed factor of 1 would have left every KSB topic on a single broker of
    a cluster, unreadable while it is down and gone with its disk."""
    wanted = list(specs)
    existing = set(client.list_topics(timeout=timeout_s).topics)
    limit = {"max.message.bytes": str(MAX_RECORD_BYTES)}
    new = [
        NewTopic(
            s.name,
            num_partitions=s.partitions,
            replication_factor=-1,
            config={**limit, **dict(s.config)},
        )
        for s in wanted
        if s.name not in existing
    ]
    if not new:
        client.poll(0)  # hands over its queued log lines
        return
    for _name, fut in client.create_topics(new, operation_timeout=timeout_s).items():
        try:
            fut.result()
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    _wait_for_metadata(client, [t.topic for t in new], timeout_s)


def _wait_for_metadata(client: AdminClient, topics: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        md = client.list_topics(timeout=timeout_s).topics
        client.poll(0)
        if all(t in md and not md[t].error and md[t].partitions for t in topics):
            return
        time.sleep(0.05)
    raise TimeoutError(f"topics not visible in metadata: {topics}")


def read_to_end(
    c: Consumer,
    topic: str,
    handle: Callable[[Message], None],
    *,
    timeout_s: float = 60,
) -> dict[int, int]:
    """Fold a whole topic (from the beginning to its current end) into ``handle``.

    Returns the next offset per partition. Used to rebuild in-memory state from compacted topics.
    """
    md = c.list_topics(topic, timeout=timeout_s).topics[topic]
    parts = sorted(md.partitions)
    c.assign([TopicPartition(topic, p, -2) for p in parts])  # -2: OFFSET_BEGINNING
    positions: dict[int, int] = {}
    pending = set(parts)
    for p in parts:
        low, high = watermarks(c, TopicPartition(topic, p), timeout_s)
        if high <= low:
            pending.discard(p)
            positions[p] = high
    deadline = time.monotonic() + timeout_s
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"could not read {topic} to its end")
        for m in c.consume(1000, 0.2):
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(m.partition() or 0)
                    positions[m.partition() or 0] = m.offset() or 0
                    continue
                raise KafkaException(err)
            positions[m.partition() or 0] = (m.offset() or 0) + 1
            handle(m)
    c.unassign()
    return positions


_NOT_READY = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_PARTITION,
        KafkaError._UNKNOWN_TOPIC,
    }
)


def watermarks(c: Consumer, tp: TopicPartition, timeout_s: float) -> tuple[int, int]:
    """A partition's offsets, waiting out a just-created topic whose leader is not up yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            low, high = c.get_watermark_offsets(tp, timeout=timeout_s)
            return low, high
        except KafkaException as exc:
            if exc.args[0].code() not in _NOT_READY or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
