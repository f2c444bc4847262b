"""The floor of one exactly-once hop on raw Kafka, one message at a time.

KSB's one-at-a-time round trip crosses the dispatchers twice: the SEND is applied in one
transaction, which makes the message visible to RECEIVE, and the RECEIVE's commit in another,
whose outcome the reader waits for. Each crossing is Kafka's consume -> transform -> produce
pattern under exactly-once: a group member reads a record, and in one transaction writes its
result and its consumer offsets, and a read_committed consumer sees the result once the
transaction's markers are written. This section measures one such hop with nothing of KSB in it,
with the dispatcher's own client settings (the SDK's request producer, a KIP-848 group member,
the dispatcher's transactional producer, a read_committed reader), so the one-at-a-time ratio to
raw Kafka can be read against what Kafka's transactions alone cost on the same broker: a round
trip cannot be faster than two of these hops.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

import ksb.runtime.kafka as kafka
from bench.scaling import run_label
from bench.stats import fmt_ms, make_body, now_ns, parse_body, summarize
from devtools.deployment import Deployment
from services.dispatcher.journal import TXN_PRODUCER

__all__ = ["format_lines", "run_txn_hop"]

_WARMUP = 200
"""Unmeasured hops first: the group's join, the first transactions, metadata, and more of the
broker's JIT warm-up for these request paths (about two seconds)."""


def run_txn_hop(
    settings: Deployment, *, probes: int, body_bytes: int, timeout_s: float
) -> dict[str, Any]:
    """`probes` single messages through one exactly-once hop; their latencies, produce to read."""
    run = uuid.uuid4().hex[:8]
    source, sink = f"bench.hop.{run}.in", f"bench.hop.{run}.out"
    kafka.ensure_topics(
        kafka.admin(settings), [kafka.TopicSpec(source, 1), kafka.TopicSpec(sink, 1)]
    )
    sender = kafka.request_producer(settings)
    member = kafka.group_consumer(
        settings, group=f"bench.hop.{run}", rebalance_timeout_ms=30_000, assignor="range"
    )
    member.subscribe([source])
    relay = kafka.producer(settings, transactional_id=f"bench.hop.{run}", extra=TXN_PRODUCER)
    relay.init_transactions(timeout_s)
    reader = kafka.consumer(settings, group=f"bench.hop.{run}.reader")
    reader.assign([TopicPartition(sink, 0, -2)])  # -2: from the beginning
    deadline = time.monotonic() + timeout_s
    latencies: list[int] = []
    try:
        for i in range(_WARMUP + probes):
            sender.produce(source, value=make_body(body_bytes, now_ns(), f"h{i}").encode())
            sender.poll(0)
            request = _next(member, deadline)
            relay.begin_transaction()
            relay.produce(sink, value=request.value())
            relay.send_offsets_to_transaction(
                member.position(member.assignment()), member.consumer_group_metadata(), timeout_s
            )
            relay.commit_transaction(timeout_s)
            sent, tag = parse_body(_next(reader, deadline).value() or b"")
            if tag != f"h{i}":  # one at a time: each hop returns the record just sent
                raise RuntimeError(f"hop {i} delivered {tag!r}")
            if i >= _WARMUP:
                latencies.append(now_ns() - sent)
    finally:
        sender.flush(5)
        member.close()
        reader.close()
    return {"probes": probes, "latency": summarize(latencies).as_json()}


def _next(consumer: Consumer, deadline: float) -> Message:
    """The consumer's next record, waiting no longer than `deadline` (monotonic seconds)."""
    while time.monotonic() < deadline:
        m = consumer.poll(0.05)
        if m is None:
            continue
        err = m.error()
        if err is None:
            return m
        if err.code() != KafkaError._PARTITION_EOF:
            raise KafkaException(err)
    raise TimeoutError("the exactly-once hop did not deliver in time")


def format_lines(hop: dict[str, Any], scaling: dict[str, Any]) -> list[str]:
    """The hop's latency, and each KSB run's one-at-a-time p50 against two hops."""
    lat = hop["latency"]
    p50 = lat["p50_ms"] if math.isfinite(lat["p50_ms"]) and lat["p50_ms"] > 0 else None
    floor = None if p50 is None else 2 * p50
    against = (
        "n/a"
        if floor is None
        else ", ".join(
            f"{run_label(r)} {r['latency_unloaded']['p50_ms'] / floor:.1f}x"
            for r in scaling["runs"]
        )
    )
    return [
        f"one exactly-once hop on raw Kafka (produce -> group member -> transaction with its "
        f"offsets -> read_committed), {hop['probes']} one at a time: p50 {fmt_ms(p50)}, "
        f"p99 {fmt_ms(lat['p99_ms'])}; a KSB round trip crosses the dispatchers twice, so "
        f"its one-at-a-time p50 against two hops ({fmt_ms(floor)}): {against}",
    ]
