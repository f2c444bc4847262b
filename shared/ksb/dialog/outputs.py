"""What applying a request produces: records for Kafka, and facts for metrics and the audit.

The engine never writes anything itself; the dispatcher writes an `Outputs` in one Kafka
transaction with the offsets it consumed, which is what makes a request's effects all-or-nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ksb.security.leases import LeaseClaims
from ksb.wire.endpoint import Endpoint
from ksb.wire.protocol import (
    AckRecord,
    CommitOutcome,
    DeadLetterRecord,
    ErrorRecord,
    InboundMessage,
    QueueMessage,
)
from ksb.wire.relay import RelayRecord

__all__ = ["Inflight", "Outputs", "QueueWrite", "Received"]


class QueueWrite(NamedTuple):
    """One record for a queue topic: a message, a receipt (value None), or a commit outcome.

    (A named tuple, as `Inflight`: several are made per message, and a frozen dataclass costs
    several times more to make.)"""

    queue: str
    partition: int
    key: str
    value: QueueMessage | CommitOutcome | None


class Inflight(NamedTuple):
    """A message still in a queue: enough to apply its receipt without reading it back."""

    queue: str
    partition: int
    group: str
    handle: str
    message_type: str
    retained: QueueMessage | None = None
    """The message itself, kept only for RETENTION queues, which rewrite it as received."""
    priority: int = 5
    enqueued_ms: int = 0
    """Level and enqueue time, for the time-in-queue figures the dispatcher exports at receipt."""
    message_id: str = ""
    service: str = ""
    sent_ms: int | None = None
    """For the audit events (ksb.audit): which message, which service, and when it was sent."""


class Received(NamedTuple):
    """A receipt applied under a lease: what the RECEIVE saw, for its audit event."""

    claims: LeaseClaims
    message_ids: tuple[str, ...]


@dataclass(slots=True)
class Outputs:
    queue: list[QueueWrite] = field(default_factory=list)
    endpoints: list[Endpoint] = field(default_factory=list)
    errors: list[ErrorRecord] = field(default_factory=list)
    dead_letters: list[DeadLetterRecord] = field(default_factory=list)
    received: list[Inflight] = field(default_factory=list)
    """Messages a commit received (for metrics; nothing is written for them beyond `queue`)."""
    purged: list[Inflight] = field(default_factory=list)
    """Unreceived messages that left their queue because their conversation closed."""
    transmissions: list[InboundMessage] = field(default_factory=list)
    """Messages for another broker instance: written to this instance's transmission topic."""
    acks: list[AckRecord] = field(default_factory=list)
    """Acknowledgements of inbound messages: written to ``ksb.<to_instance>.acks``."""
    relays: list[RelayRecord] = field(default_factory=list)
    """Work for the owners of other shards: written to the relay topic, keyed by group."""
    receipts: list[Received] = field(default_factory=list)
    """Receipts applied under a lease (the receive events the dispatcher writes for them)."""
    principal: str | None = None
    """Who sent the request: its `errors` go to that principal's errors topic."""

    def extend(self, other: Outputs) -> None:
        self.queue.extend(other.queue)
        self.endpoints.extend(other.endpoints)
        self.errors.extend(other.errors)
        self.dead_letters.extend(other.dead_letters)
        self.received.extend(other.received)
        self.purged.extend(other.purged)
        self.transmissions.extend(other.transmissions)
        self.acks.extend(other.acks)
        self.relays.extend(other.relays)
        self.receipts.extend(other.receipts)
