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

__all__ = ["WIDTHS", "format_lines", "run_txn_hop", "run_txn_hops"]

WIDTHS = (1, 4)
"""Partitions each hop's transaction writes: the message alone, and as many as a KSB SEND's
one-message transaction writes at most (the queue, the endpoints, the audit and, at most every
`KSB_DEPTH_EVERY_MS`, the depth topics'). librdkafka
sends one produce request per partition, and the broker answers one connection's requests one
after another, so each partition more is a request more on the transaction's path."""

_SIDE_RECORD = b"x" * 100

_WARMUP = 200
"""Unmeasured hops first: the group's join, the first transactions, metadata, and more of the
broker's JIT warm-up for these request paths (about two seconds)."""


def run_txn_hops(
    settings: Deployment,
    *,
    probes: int,
    body_bytes: int,
    timeout_s: float,
    widths: tuple[int, ...] = WIDTHS,
) -> dict[str, Any]:
    """`run_txn_hop` once per transaction width, one after the other."""
    return {
        "probes": probes,
        "widths": {
            str(w): run_txn_hop(
                settings, probes=probes, body_bytes=body_bytes, timeout_s=timeout_s, width=w
            )
            for w in widths
        },
    }


def run_txn_hop(
    settings: Deployment, *, probes: int, body_bytes: int, timeout_s: float, width: int = 1
) -> dict[str, Any]:
    """`probes` single messages through one exactly-once hop whose transaction writes `width`
    partitions (the message, and a 100-byte record to each of the others); the latencies,
    produce to read, as `bench.stats.summarize` gives them."""
    run = uuid.uuid4().hex[:8]
    source, sink = f"bench.hop.{run}.in", f"bench.hop.{run}.out"
    sides = [f"bench.hop.{run}.side{k}" for k in range(1, width)]
    kafka.ensure_topics(
        kafka.admin(settings), [kafka.TopicSpec(t, 1) for t in (source, sink, *sides)]
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
            for side in sides:
                relay.produce(side, value=_SIDE_RECORD)
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
    return summarize(latencies).as_json()


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


def format_lines(hops: dict[str, Any], scaling: dict[str, Any]) -> list[str]:
    """Each width's hop latency, each KSB run's one-at-a-time p50 against two of the narrowest
    hops, and its p50 to RECEIVE (one crossing) against one of the widest."""
    widths = hops["widths"]
    figures = "; ".join(
        f"{w} partition(s) p50 {fmt_ms(_finite(lat['p50_ms']))}, p99 {fmt_ms(_finite(lat['p99_ms']))}"
        for w, lat in widths.items()
    )
    p50 = _finite(widths[min(widths, key=int)]["p50_ms"]) if widths else None
    floor = None if p50 is None else 2 * p50
    against = (
        "n/a"
        if floor is None
        else ", ".join(
            f"{run_label(r)} {r['latency_unloaded']['p50_ms'] / floor:.1f}x"
            for r in scaling["runs"]
        )
    )
    lines = [
        f"one exactly-once hop on raw Kafka (produce -> group member -> transaction with its "
        f"offsets -> read_committed), {hops['probes']} one at a time, by the partitions its "
        f"transaction writes: {figures}",
        f"  a KSB round trip crosses the dispatchers twice, so its one-at-a-time p50 against two "
        f"1-partition hops ({fmt_ms(floor)}): {against}",
    ]
    runs = [r for r in scaling["runs"] if "latency_delivered" in r]
    if runs and widths:
        widest = max(widths, key=int)
        hop = _finite(widths[widest]["p50_ms"])
        delivered = (
            "n/a"
            if hop is None
            else ", ".join(
                f"{run_label(r)} {r['latency_delivered']['p50_ms'] / hop:.1f}x" for r in runs
            )
        )
        lines.append(
            f"  SEND -> RECEIVE crosses them once, in a transaction of up to {widest} "
            f"partitions, so its p50 against one {widest}-partition hop ({fmt_ms(hop)}): "
            f"{delivered}"
        )
    return lines


def _finite(ms: float | None) -> float | None:
    """A figure worth printing: None for one that was not measured (NaN) or is not positive."""
    return ms if ms is not None and math.isfinite(ms) and ms > 0 else None
