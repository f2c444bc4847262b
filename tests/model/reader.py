"""What a reader sees of the engine's output: queue topics folded, endpoint records kept.

The engine's `Outputs` are what the dispatcher writes to Kafka, so folding them the way a reader
folds the topics (a message record adds, a tombstone or a ``status`` 0 record removes, commit
outcomes are set aside) gives exactly what an application could RECEIVE, with no look into the
engine. RECEIVE order comes from the SDK's own `QueueIndex`, fed the same records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ksb.dialog.outputs import Outputs
from ksb.queue.index import QueueIndex
from ksb.wire.endpoint import Endpoint
from ksb.wire.protocol import CommitOutcome, QueueMessage

__all__ = ["Topics"]


@dataclass
class Topics:
    """The queue topics and the endpoints topic, as read back from every output so far."""

    queues: tuple[str, ...]
    index: dict[str, QueueIndex] = field(default_factory=dict)
    ready: dict[str, QueueMessage] = field(default_factory=dict)
    """Message id -> the message, for every message ready in any queue."""
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    """Handle -> the endpoint's latest record (a compacted topic's view)."""
    outcomes: dict[str, CommitOutcome] = field(default_factory=dict)
    """Request id -> its commit's outcome (the topic keys them by group; each is kept here)."""
    handles: dict[str, str] = field(default_factory=dict)
    """Message id -> its conversation handle, for every message ever enqueued."""
    partition_of: dict[tuple[str, str], int] = field(default_factory=dict)
    """(queue, group id) -> the queue partition the group's messages are written to."""
    _offsets: dict[tuple[str, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = {q: QueueIndex(q) for q in self.queues}

    def fold(self, out: Outputs) -> list[QueueMessage]:
        """Apply one output's records in order; returns the messages it enqueued."""
        new: list[QueueMessage] = []
        for w in out.queue:
            offset = self._offsets.get((w.queue, w.partition), 0)
            self._offsets[(w.queue, w.partition)] = offset + 1
            if isinstance(w.value, CommitOutcome):
                self.outcomes[w.value.request_id] = w.value
                continue
            if w.key.startswith("commit/"):
                continue  # the outcome's tombstone
            if isinstance(w.value, QueueMessage) and w.value.status == 1:
                if w.key not in self.ready:
                    new.append(w.value)
                self.handles[w.key] = w.value.conversation_handle
                self.partition_of[(w.queue, w.value.conversation_group_id)] = w.partition
                self.ready[w.key] = w.value
            else:
                self.ready.pop(w.key, None)
            self.index[w.queue].apply(w.key, w.value, w.partition, offset)
        for ep in out.endpoints:
            self.endpoints[ep.handle] = ep.copy()
        return new
