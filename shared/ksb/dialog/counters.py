"""Endpoint counters that the queue topics already record, so an endpoint record need not.

A SEND moves two counters of a local dialog: the sender's ``send_seq`` and the receiver's
``enqueued`` (and ``recv_seq``, ``outstanding``, ``updated_ms``). Writing both endpoints' records
for every message would be most of what the dispatcher writes. It need not: every message record
in a queue topic names its receiving endpoint, its number (the key, ``<handle>:<n>``) and its
sequence number, so when a shard is rebuilt the counters are the larger of what the endpoint
record says and what the queue records show. What the queue no longer shows is covered by the
rule that an endpoint's record is written whenever something else about it changes, and at
every receipt (which is what tombstones messages) for the receiver and its local far side.

Remote dialogs are not covered (their messages cross in the transmission topic, and the receive
window must survive a restart exactly): their endpoints are written at every change.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping

from ksb.wire.endpoint import Endpoint
from ksb.wire.protocol import QueueMessage

__all__ = ["CounterScan", "durable_change"]

COUNTERS = frozenset({"send_seq", "enqueued", "recv_seq", "outstanding", "updated_ms"})
_durable = operator.attrgetter(*(f for f in Endpoint.__struct_fields__ if f not in COUNTERS))
"""An endpoint's fields other than the counters, as a tuple (built in C: this runs for every
endpoint a request touches)."""


def durable_change(before: Endpoint, after: Endpoint) -> bool:
    """Whether `after` differs from `before` in anything the queue records cannot restore."""
    return after.far_instance is not None or _durable(before) != _durable(after)


class CounterScan:
    """While a shard's queue records are read back: the highest message number per receiving
    endpoint (from every key, tombstones included) and the highest sequence number per
    receiving endpoint (from the messages still there)."""

    def __init__(self) -> None:
        self.numbers: dict[str, int] = {}
        self.sequences: dict[str, int] = {}

    def note(self, key: str, value: QueueMessage | None) -> None:
        handle, sep, n = key.rpartition(":")
        if sep and n.isdigit() and int(n) > self.numbers.get(handle, -1):
            self.numbers[handle] = int(n)
        if value is not None and value.message_sequence_number >= 0:
            h, seq = value.conversation_handle, value.message_sequence_number
            if seq > self.sequences.get(h, -1):
                self.sequences[h] = seq

    def restore(self, endpoints: Mapping[str, Endpoint], waiting: Callable[[str], int]) -> None:
        """Raise the counters of `endpoints` to what the records showed; ``outstanding`` is what
        `waiting` says (messages still in the endpoint's queue). Then forget."""
        for handle, n in self.numbers.items():
            ep = endpoints.get(handle)
            if ep is not None and ep.enqueued <= n:
                ep.enqueued = n + 1
        for handle, seq in self.sequences.items():
            ep = endpoints.get(handle)
            if ep is None or ep.far_instance is not None:
                continue
            ep.recv_seq = max(ep.recv_seq, seq + 1)
            sender = endpoints.get(ep.far_handle or "")
            if sender is not None:
                sender.send_seq = max(sender.send_seq, seq + 1)
        for ep in endpoints.values():
            ep.outstanding = waiting(ep.handle)
        self.numbers.clear()
        self.sequences.clear()
