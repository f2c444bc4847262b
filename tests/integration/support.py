"""Helpers the integration tests share: draining a queue, reading the error and endpoint topics."""

from __future__ import annotations

import json
import time
from typing import Any

from confluent_kafka import KafkaError, TopicPartition

from ksb import kafka
from ksb.client import KsbClient
from ksb.endpoint import Endpoint, decode_endpoint
from ksb.names import Names
from ksb.protocol import QueueMessage
from ksb.settings import Settings


def receive_all(
    client: KsbClient, queue: str, count: int, *, timeout_s: float = 30, top: int | None = None
) -> list[QueueMessage]:
    """RECEIVE and commit until ``count`` messages have arrived (or time runs out)."""
    got: list[QueueMessage] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        with client.transaction() as tx:
            got.extend(tx.receive(queue, top=top, waitfor_ms=500))
    return got


def read_topic(settings: Settings, topic: str, *, timeout_s: float = 10) -> list[tuple[bytes | None, bytes | None]]:
    """Every record of a topic, from the beginning to its current end."""
    c = kafka.consumer(settings)
    out: list[tuple[bytes | None, bytes | None]] = []
    try:
        kafka.read_to_end(c, topic, lambda m: out.append((m.key(), m.value())), timeout_s=timeout_s)
    finally:
        c.close()
    return out


def errors(settings: Settings, *, at_least: int = 1, timeout_s: float = 15) -> list[dict[str, Any]]:
    """The error topic's records, waiting until at least ``at_least`` are there."""
    deadline = time.monotonic() + timeout_s
    while True:
        recs = [json.loads(v) for _k, v in read_topic(settings, Names(settings.instance).errors) if v]
        if len(recs) >= at_least or time.monotonic() > deadline:
            return recs
        time.sleep(0.1)


def endpoints(settings: Settings) -> dict[str, Endpoint]:
    """The latest state of every endpoint, from the compacted endpoints topic."""
    latest: dict[str, Endpoint] = {}
    for k, v in read_topic(settings, Names(settings.instance).endpoints):
        if k is not None and v is not None:
            latest[k.decode()] = decode_endpoint(v)
    return latest


def wait_endpoint(
    settings: Settings, handle: str, state: str, *, timeout_s: float = 15
) -> Endpoint:
    deadline = time.monotonic() + timeout_s
    while True:
        ep = endpoints(settings).get(handle)
        if ep is not None and ep.state.name == state:
            return ep
        if time.monotonic() > deadline:
            raise AssertionError(f"endpoint {handle} is {ep.state.name if ep else None}, not {state}")
        time.sleep(0.1)


def end_offsets(settings: Settings, topic: str) -> dict[int, int]:
    c = kafka.consumer(settings)
    try:
        md = c.list_topics(topic, timeout=10).topics[topic]
        return {
            p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in md.partitions
        }
    finally:
        c.close()


__all__ = ["KafkaError", "end_offsets", "endpoints", "errors", "read_topic", "receive_all", "wait_endpoint"]
