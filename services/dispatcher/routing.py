"""What a consumed record is, who sent it, and whether it belongs to this dispatcher's shard.

Three kinds of topic feed a dispatcher, all with the instance's shard count of partitions and
co-partitioned by the consumer group: the requests topics (``requests`` for clients without a
principal, ``requests.<principal>`` for each principal, whose ACL lets only that principal write
it: the topic names the sender), the relay (work other dispatchers handed over), and the
``inbound.<writer>`` topics (messages from other instances, each written only by the instance
that carried them here: the topic names the carrier, as a requests topic names the sender). A client request or an inbound record is keyed by the group it
acts on; one that sits in a partition that is not its key's shard (a client whose partitioner is
not librdkafka's CRC-32) is relayed, unchanged and in order, to the owner of that shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Message

from ksb.dialog.outputs import Outputs
from ksb.names import Names
from ksb.wire.partitioning import shard_of
from ksb.wire.protocol import (
    AnyRequest,
    FragmentRecord,
    InboundMessage,
    parse_inbound,
    parse_request,
)
from ksb.wire.relay import RelayAction, RelayRecord, RelayRequest, parse_relay

__all__ = ["Incoming", "Router", "handed_over"]


@dataclass(frozen=True)
class Incoming:
    """One consumed record, read: a request, an inbound record, relayed work, or a record for
    another shard's owner (`elsewhere`)."""

    request: AnyRequest | FragmentRecord | None = None
    relayed: RelayAction | None = None
    elsewhere: RelayRequest | None = None
    principal: str | None = None
    sent_ms: int | None = None
    peer: str | None = None
    """Read from ``inbound.<peer>`` (directly or relayed): written by that broker instance's
    transport or forwarder, whatever its kind says (`ksb.dialog.sources`)."""


class Router:
    """Reads consumed records for one instance with `shards` shards."""

    def __init__(self, names: Names, shards: int) -> None:
        self.names = names
        self.shards = shards
        self._prefix = f"{names.requests}."

    def principal_of(self, topic: str) -> str | None:
        """The principal a requests topic belongs to (None: the topic of clients without one)."""
        return topic[len(self._prefix) :] if topic.startswith(self._prefix) else None

    def read(self, m: Message) -> Incoming:
        """Decode `m` (raising ProtocolError for a record that is not one) and say where it goes."""
        topic, raw = m.topic() or "", m.value()
        if topic == self.names.relay:
            return self._relayed(parse_relay(raw))
        sent = _sent_ms(m)
        partition = m.partition() or 0
        if topic.startswith(self.names.inbound_prefix):
            writer = topic[len(self.names.inbound_prefix) :]
            inbound = parse_inbound(raw)
            if isinstance(inbound, InboundMessage) and self._elsewhere(inbound.key, partition):
                relay = self.to_owner(inbound.key, raw, "inbound", writer, sent)
                return Incoming(elsewhere=relay)
            return Incoming(request=inbound, sent_ms=sent, peer=writer)
        principal = self.principal_of(topic)
        key = m.key()
        if (
            key is not None
            and raw is not None
            and self._elsewhere(key.decode(errors="replace"), partition)
        ):
            relay = self.to_owner(key.decode(errors="replace"), raw, "requests", principal, sent)
            return Incoming(elsewhere=relay)
        return Incoming(request=parse_request(raw), principal=principal, sent_ms=sent)

    def to_owner(
        self,
        key: str,
        raw: bytes | None,
        source: Literal["requests", "inbound"],
        principal: str | None,
        sent_ms: int | None,
    ) -> RelayRequest:
        """A record for the owner of `key`'s shard, relayed unchanged (`principal`: its
        requests topic's, or, for an inbound record, the instance that carried it)."""
        return RelayRequest(
            key=key, raw=raw or b"", source=source, principal=principal, sent_ms=sent_ms
        )

    def elsewhere(self, key: str, partition: int) -> bool:
        """Whether a record keyed `key` read from `partition` belongs to another shard."""
        return self._elsewhere(key, partition)

    def _relayed(self, record: RelayRecord) -> Incoming:
        if not isinstance(record, RelayRequest):
            return Incoming(relayed=record)
        if record.source == "inbound":
            inbound = parse_inbound(record.raw)
            return Incoming(request=inbound, sent_ms=record.sent_ms, peer=record.principal)
        return Incoming(
            request=parse_request(record.raw), principal=record.principal, sent_ms=record.sent_ms
        )

    def _elsewhere(self, key: str, partition: int) -> bool:
        return self.shards > 1 and shard_of(key, self.shards) != partition


def _sent_ms(m: Message) -> int | None:
    """The record's timestamp (the producer's create time): when the client sent it."""
    kind, ts = m.timestamp()
    return ts if kind != TIMESTAMP_NOT_AVAILABLE and ts > 0 else None


def handed_over(relay: RelayRequest) -> Outputs:
    """The outputs of a record that belongs to another shard: only its relay to the owner."""
    out = Outputs()
    out.relays.append(relay)
    return out
