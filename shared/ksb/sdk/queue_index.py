"""What is ready to RECEIVE in one queue, ordered the way Service Broker orders it.

A reader (and the activation service) folds the queue topic into this index: message records add,
receipts (tombstones) remove. The index answers RECEIVE's two questions without I/O: which groups to try,
highest priority first, and which messages of a group to return, in order.
"""

from __future__ import annotations

import bisect
from collections.abc import Container, Iterator
from dataclasses import dataclass, field

from ksb.catalog.model import DIALOG_TIMER, ERROR
from ksb.wire.protocol import QueueMessage

__all__ = ["QueueIndex", "order_key"]


def order_key(m: QueueMessage) -> tuple[int, int, int]:
    """Within a conversation: DialogTimer, then Error, then the rest in sequence."""
    if m.message_type_name == DIALOG_TIMER:
        cls = 0
    elif m.message_type_name == ERROR:
        cls = 1
    else:
        cls = 2
    return (cls, m.message_sequence_number, m.queuing_order)


@dataclass
class _Conversation:
    priority: int
    first_order: int
    keys: list[tuple[int, int, int]] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)


@dataclass
class _Group:
    conversations: dict[str, _Conversation] = field(default_factory=dict)
    level: int = 0
    size: int = 0
    since: int = 0
    """Queuing order of the message that made the group ready: FIFO among equal levels, the same
    for every reader whatever order it read the queue's partitions in."""


class QueueIndex:
    """Ready messages of one queue, by group, by conversation, in RECEIVE order."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.messages: dict[str, QueueMessage] = {}
        self._groups: dict[str, _Group] = {}
        self._levels: dict[int, dict[str, None]] = {}
        self.positions: dict[int, int] = {}

    # ----------------------------------------------------------------- folding the topic
    def apply(self, key: str, value: QueueMessage | None, partition: int, offset: int) -> None:
        self.positions[partition] = offset + 1
        if value is None or value.status != 1:
            self.remove(key)
        else:
            self.add(value)

    def add(self, m: QueueMessage) -> None:
        if m.message_id in self.messages:
            return
        self.messages[m.message_id] = m
        g = self._groups.get(m.conversation_group_id)
        if g is None:
            g = self._groups[m.conversation_group_id] = _Group(since=m.queuing_order)
        else:
            g.since = min(g.since, m.queuing_order)
        c = g.conversations.get(m.conversation_handle)
        if c is None:
            c = g.conversations[m.conversation_handle] = _Conversation(m.priority, m.queuing_order)
        k = order_key(m)
        i = bisect.bisect(c.keys, k)
        c.keys.insert(i, k)
        c.ids.insert(i, m.message_id)
        g.size += 1
        self._relevel(m.conversation_group_id, g)

    def remove(self, message_id: str) -> None:
        m = self.messages.pop(message_id, None)
        if m is None:
            return
        g = self._groups[m.conversation_group_id]
        c = g.conversations[m.conversation_handle]
        i = c.ids.index(message_id)
        del c.ids[i]
        del c.keys[i]
        g.size -= 1
        if not c.ids:
            del g.conversations[m.conversation_handle]
        if g.size == 0:
            del self._groups[m.conversation_group_id]
            self._levels[g.level].pop(m.conversation_group_id, None)
            return
        self._relevel(m.conversation_group_id, g)

    def _relevel(self, group_id: str, g: _Group) -> None:
        """A group's priority is the highest among its conversations with ready messages."""
        level = max(c.priority for c in g.conversations.values())
        if level == g.level:
            return
        if g.level:
            self._levels[g.level].pop(group_id, None)
        g.level = level
        self._levels.setdefault(level, {})[group_id] = None

    # ----------------------------------------------------------------- RECEIVE's questions
    def candidates(self, exclude: Container[str] = ()) -> Iterator[str]:
        """Groups with ready messages, highest priority first, then in the order they became ready."""
        for level in sorted(self._levels, reverse=True):
            groups = self._groups
            for group_id in sorted(self._levels[level], key=lambda g: groups[g].since):
                if group_id not in exclude:
                    yield group_id

    def take(
        self, group_id: str, top: int | None = None, handle: str | None = None
    ) -> list[QueueMessage]:
        """A group's ready messages: highest-priority conversation first, each in order."""
        g = self._groups.get(group_id)
        if g is None:
            return []
        convs = sorted(g.conversations.items(), key=lambda kv: (-kv[1].priority, kv[1].first_order))
        out: list[QueueMessage] = []
        for h, c in convs:
            if handle is not None and h != handle:
                continue
            for mid in c.ids:
                out.append(self.messages[mid])
                if top is not None and len(out) >= top:
                    return out
        return out

    def group_of(self, handle: str) -> str | None:
        for group_id, g in self._groups.items():
            if handle in g.conversations:
                return group_id
        return None

    def has_group(self, group_id: str) -> bool:
        return group_id in self._groups

    def level_of(self, group_id: str) -> int:
        g = self._groups.get(group_id)
        return g.level if g else 0

    @property
    def ready_messages(self) -> int:
        return len(self.messages)

    @property
    def ready_groups(self) -> int:
        return len(self._groups)
