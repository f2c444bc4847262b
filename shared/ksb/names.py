"""Every Kafka topic and Redis key name, in one place, under the instance's namespace."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Names"]


@dataclass(frozen=True)
class Names:
    """Topic and key names for one broker instance."""

    instance: str

    @property
    def prefix(self) -> str:
        return f"ksb.{self.instance}"

    @property
    def requests(self) -> str:
        """The requests topic of clients without a principal (plaintext mode, development)."""
        return f"{self.prefix}.requests"

    def requests_of(self, principal: str) -> str:
        """The requests topic only `principal` may write: how the dispatcher knows who sent a
        request (Kafka does not tell a consumer the producer's principal; its ACLs do)."""
        return f"{self.prefix}.requests.{principal}"

    @property
    def requests_pattern(self) -> str:
        """Every requests topic of the instance, as a consumer subscription regex."""
        return rf"^{re.escape(self.prefix)}\.requests(\..+)?$"

    def requests_for(self, sender: str | None) -> str:
        """The requests topic `sender` writes (`KsbSettings.sender`; None: the shared one)."""
        return self.requests if sender is None else self.requests_of(sender)

    def errors_for(self, sender: str | None) -> str:
        """Where the dispatcher puts the refusals of `sender`'s requests."""
        return self.errors if sender is None else self.errors_of(sender)

    def errors_of(self, principal: str) -> str:
        """The error records of `principal`'s requests, which only it (and operators) may read."""
        return f"{self.prefix}.errors.{principal}"

    @property
    def relay(self) -> str:
        """Work one dispatcher hands to the owner of another shard, inside its transaction."""
        return f"{self.prefix}.relay"

    @property
    def depth(self) -> str:
        """Each queue's unreceived messages per shard, written by the shard's owner
        (`ksb.wire.depth`), read by SDK senders that slow down before a queue outgrows its readers."""
        return f"{self.prefix}.depth"

    @property
    def endpoints(self) -> str:
        return f"{self.prefix}.endpoints"

    @property
    def catalog(self) -> str:
        return f"{self.prefix}.catalog"

    @property
    def errors(self) -> str:
        return f"{self.prefix}.errors"

    @property
    def audit(self) -> str:
        return f"{self.prefix}.audit"

    @property
    def sla(self) -> str:
        """The Spark audit job's output: SLA windows, inversion counts, activation reactions."""
        return f"{self.prefix}.sla"

    @property
    def transmission(self) -> str:
        return f"{self.prefix}.transmission"

    def inbound_from(self, writer: str) -> str:
        """Messages for this instance from other instances, as written by broker instance
        `writer`'s transport (or forwarder): only `writer` may write it, so the topic says which
        instance carried each record (`ksb.dialog.remote`), as a requests topic says who sent a
        request. ``inbound.<this instance>`` holds its own transport's local messages that waited
        in the transmission queue."""
        return f"{self.prefix}.inbound.{writer}"

    @property
    def inbound_prefix(self) -> str:
        return f"{self.prefix}.inbound."

    @property
    def inbound_pattern(self) -> str:
        """Every ``inbound.<writer>`` topic: the dispatchers subscribe to them all."""
        return rf"^{re.escape(self.prefix)}\.inbound\..+$"

    @property
    def acks(self) -> str:
        """Acknowledgements of what this instance transmitted, written by the receiving dispatchers."""
        return f"{self.prefix}.acks"

    @property
    def outbound(self) -> str:
        """Messages the transmitter picked for sending, in order, for the transport to carry."""
        return f"{self.prefix}.outbound"

    @property
    def links(self) -> str:
        """The transport's connection events (connected, failed, disconnected, closed)."""
        return f"{self.prefix}.links"

    @property
    def transport_group(self) -> str:
        """Consumer group whose committed offset is how far the transport has read ``outbound``."""
        return f"{self.prefix}.transport"

    @property
    def activation(self) -> str:
        return f"{self.prefix}.activation"

    @property
    def bcn(self) -> str:
        """Broker configuration notifications: start failures, starts and catalog changes."""
        return f"{self.prefix}.bcn"

    def queue(self, queue_name: str) -> str:
        return f"{self.prefix}.queue.{queue_name}"

    def queue_of(self, topic: str) -> str:
        """The queue whose topic `topic` is (the inverse of `queue`)."""
        return topic.removeprefix(f"{self.prefix}.queue.")

    def dead_letters(self, queue_name: str) -> str:
        return f"{self.prefix}.dlq.{queue_name}"

    def dead_letter_queue_of(self, topic: str) -> str:
        """The queue whose dead-letter topic `topic` is (the inverse of `dead_letters`)."""
        return topic.removeprefix(f"{self.prefix}.dlq.")

    @property
    def external_activator_app(self) -> str:
        """Faust app id (and consumer group) of the external activator that reads `activation`."""
        return f"{self.prefix}.external_activator"

    @property
    def reader_group(self) -> str:
        """The group id of consumers that only assign partitions and never commit: librdkafka
        still looks its coordinator up, which needs DESCRIBE on it, and nothing more."""
        return f"{self.prefix}.unused"

    @property
    def dispatcher_group(self) -> str:
        return f"{self.prefix}.dispatcher"

    @property
    def dispatcher_txn_id(self) -> str:
        return f"{self.prefix}.dispatcher.txn"

    # Redis keys -------------------------------------------------------------------------------
    # Every key of one queue carries a Redis Cluster hash tag naming the queue and its instance
    # (``{<instance>/<queue>}``), so they all hash to one slot: a lock script touches the queue's
    # disabled flag, activity, locks and fences in one call, which a cluster allows only within
    # one slot. Queues, and the same queue of two instances, spread over the slots. On one Redis
    # server the braces are just characters of the name.
    def queue_tag(self, queue_name: str) -> str:
        return f"{{{self.instance}/{queue_name}}}"

    def _queue_key(self, kind: str, queue_name: str) -> str:
        return f"ksb:{self.instance}:{kind}:{self.queue_tag(queue_name)}"

    def lock_key(self, queue_name: str, group_id: str) -> str:
        return f"{self._queue_key('lock', queue_name)}:{group_id}"

    def fence_key(self, queue_name: str, group_id: str) -> str:
        return f"{self._queue_key('fence', queue_name)}:{group_id}"

    def waiting_key(self, queue_name: str) -> str:
        return self._queue_key("waiting", queue_name)

    def tasks_key(self, queue_name: str) -> str:
        return self._queue_key("tasks", queue_name)

    def activity_key(self, queue_name: str) -> str:
        """Hash: last_receive_ms, last_empty_ms of RECEIVEs without WHERE (for queue monitors)."""
        return self._queue_key("activity", queue_name)

    def rollbacks_key(self, queue_name: str) -> str:
        """Rollbacks in a row of transactions that received from the queue (poison detection)."""
        return self._queue_key("rollbacks", queue_name)

    def message_rollbacks_key(self, queue_name: str) -> str:
        """Hash message id -> rollbacks of that message (for dead-letter policies)."""
        return self._queue_key("msgrb", queue_name)

    def disabled_key(self, queue_name: str) -> str:
        """Present while the queue is disabled (STATUS = OFF), mirrored from the catalog so
        RECEIVE can refuse in its lock script. One key per queue, in the queue's slot: the script
        may only touch keys of one slot on a cluster, and a receiver may write only its own
        queues' keys."""
        return self._queue_key("disabled", queue_name)

    @property
    def dead_letter_policy_key(self) -> str:
        """Hash queue -> max_rollbacks, mirrored from the catalog so a rollback can act at once."""
        return f"ksb:{self.instance}:dlpolicy"

    @property
    def monitors_key(self) -> str:
        """Hash queue -> JSON view of its monitor (like sys.dm_broker_queue_monitors)."""
        return f"ksb:{self.instance}:monitors"

    @property
    def suppress_key(self) -> str:
        """Zset destination instance -> suppression deadline (ms): no connection attempt before it."""
        return f"ksb:{self.instance}:suppress"

    @property
    def transmission_view_key(self) -> str:
        """JSON view of the transmission queue (like sys.transmission_queue)."""
        return f"ksb:{self.instance}:transmission"

    @property
    def forwarded_view_key(self) -> str:
        """JSON view of what the forwarder holds (like sys.dm_broker_forwarded_messages)."""
        return f"ksb:{self.instance}:forwarded"

    @property
    def connections_view_key(self) -> str:
        """JSON view of the transport's connections (like sys.dm_broker_connections)."""
        return f"ksb:{self.instance}:connections"
