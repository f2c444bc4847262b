"""The records of ``ksb.<instance>.activation``: what external activators are told about a queue.

Service Broker's event notifications for external activation: QUEUE_ACTIVATION when a new reader
would have useful work on a queue (`ksb.activation.monitor`), BROKER_QUEUE_DISABLED when poison
message handling turned a queue off. The activation service writes them, keyed by the queue so
one queue's events keep their order; external activators (`ksb.activation.external`) read them.
"""

from __future__ import annotations

from ksb.wire.protocol import Name, Wire, dumps, parse_record

__all__ = [
    "ActivationEvent",
    "BrokerQueueDisabled",
    "QueueActivation",
    "encode_activation_event",
    "parse_activation_event",
]


class QueueActivation(Wire, tag="QUEUE_ACTIVATION"):
    """A new reader on `queue` would have useful work now (`reason`: which rule decided)."""

    instance: str
    queue: Name
    reason: str
    event_ms: int


class BrokerQueueDisabled(Wire, tag="BROKER_QUEUE_DISABLED"):
    """`queue` was disabled (STATUS = OFF) by poison message handling: start no readers."""

    instance: str
    queue: Name
    reason: str
    event_ms: int


ActivationEvent = QueueActivation | BrokerQueueDisabled


def encode_activation_event(event: ActivationEvent) -> bytes:
    return dumps(event)


def parse_activation_event(raw: bytes | None) -> ActivationEvent:
    """Decode a record, or raise `ProtocolError` naming what is wrong with it."""
    return parse_record(ActivationEvent, raw, "activation event")  # type: ignore[arg-type]
