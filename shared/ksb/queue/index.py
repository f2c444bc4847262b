"""What is ready to RECEIVE in one queue, ordered the way Service Broker orders it, in a few bytes
a message.

The queue service folds each queue topic into this index: message records add,
receipts (tombstones) remove. The index answers RECEIVE's two questions without I/O: which groups
to try, highest priority first, and which messages of a group to return, in order.

It keeps no message, only what ordering and finding one need, because a reader must survive a
backlog of millions: per conversation one array of 64-bit rows (order class and sequence packed in
one, queuing order, partition and offset packed in one, and the message's number), 32 bytes a
message whatever its body. The message id is not stored: the dispatcher names the ``n``-th message
an endpoint's queue gets ``<conversation handle>:<n>`` (`ksb.dialog.membership.message_id`), so
the row keeps ``n`` and the id is rebuilt. An id of another form (a record written before ids had
this form, or by another producer) is kept as a string beside the rows. The bodies are in the
queue service's store on disk, by partition and offset (`ksb.queue.bodies`).
"""

from __future__ import annotations

import bisect
import itertools
from array import array
from collections.abc import Callable, Container, Iterator
from typing import NamedTuple

from ksb.catalog.model import DIALOG_TIMER, ERROR
from ksb.wire.protocol import QueueMessage

__all__ = ["QueueIndex", "Ready", "order_key", "pack_position", "unpack_position"]

_STRIDE = 4
_KEY, _ORDER, _POS, _N = range(_STRIDE)
_CLASS_SHIFT = 60
_SEQ_LIMIT = (1 << 59) - 1
"""Sequence numbers are packed under the order class; beyond ±2^59 they are clamped (no dialog
sends that many messages)."""
_OFFSET_BITS = 48
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
_COMPACT_AFTER = 64
"""Received rows at the front of a conversation are only skipped; the array is compacted once
they are more than this many and more than half of it."""


def order_key(m: QueueMessage) -> tuple[int, int, int]:
    """Within a conversation: DialogTimer, then Error, then the rest in sequence."""
    return (_order_class(m.message_type_name), m.message_sequence_number, m.queuing_order)


def _order_class(message_type: str) -> int:
    if message_type == DIALOG_TIMER:
        return 0
    if message_type == ERROR:
        return 1
    return 2


def _pack_key(order_class: int, seq: int) -> int:
    return (order_class << _CLASS_SHIFT) + max(-_SEQ_LIMIT, min(_SEQ_LIMIT, seq))


def pack_position(partition: int, offset: int) -> int:
    """A record's place in the topic as one integer (-1: not known)."""
    return -1 if offset < 0 else (partition << _OFFSET_BITS) | offset


def unpack_position(pos: int) -> tuple[int, int]:
    return (-1, -1) if pos < 0 else (pos >> _OFFSET_BITS, pos & _OFFSET_MASK)


def _derived_n(message_id: str, handle: str) -> int | None:
    """``n`` when the id is exactly ``<handle>:<n>``, so it can be rebuilt from the two."""
    head, sep, tail = message_id.rpartition(":")
    if sep and head == handle and tail.isdigit() and (tail == "0" or tail[0] != "0"):
        return int(tail)
    return None


class Ready(NamedTuple):
    """A ready message as the index knows it: enough to order it, find its record and name it."""

    message_id: str
    conversation_group_id: str
    conversation_handle: str
    priority: int
    order_class: int
    """0 DialogTimer, 1 Error, 2 any other message type."""
    message_sequence_number: int
    queuing_order: int
    partition: int
    offset: int

    @property
    def position(self) -> int:
        return pack_position(self.partition, self.offset)


class _Conversation:
    """One conversation's ready messages: rows of `_STRIDE` int64s, sorted by (key, order)."""

    __slots__ = ("first_order", "group", "handle", "last_n", "priority", "rows", "start")

    def __init__(self, group: str, handle: str, priority: int, first_order: int) -> None:
        self.group = group
        self.handle = handle
        self.priority = priority
        self.first_order = first_order
        self.rows = array("q")
        self.start = 0
        self.last_n = -1
        """The highest derived message number seen: a higher one cannot be a duplicate."""

    def __len__(self) -> int:
        return len(self.rows) // _STRIDE - self.start

    def insert(self, key: int, order: int, pos: int, n: int) -> None:
        rows = self.rows
        if len(rows) // _STRIDE == self.start or (rows[-_STRIDE], rows[1 - _STRIDE]) < (key, order):
            rows.extend((key, order, pos, n))  # in order: nearly always
            return
        i = self._bisect(key, order) * _STRIDE  # a timer or an error jumps the queue
        rows[i:i] = array("q", (key, order, pos, n))

    def _bisect(self, key: int, order: int) -> int:
        rows = self.rows
        lo, hi = self.start, len(rows) // _STRIDE
        while lo < hi:
            mid = (lo + hi) // 2
            if (rows[mid * _STRIDE], rows[mid * _STRIDE + 1]) <= (key, order):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def find(self, n: int) -> int | None:
        """The row of message number ``n``; receipts nearly always name the first one."""
        rows = self.rows
        for i in range(self.start, len(rows) // _STRIDE):
            if rows[i * _STRIDE + _N] == n:
                return i
        return None

    def row(self, i: int) -> tuple[int, int, int, int]:
        b = i * _STRIDE
        r = self.rows
        return r[b + _KEY], r[b + _ORDER], r[b + _POS], r[b + _N]

    def delete(self, i: int) -> None:
        if i == self.start:
            self.start += 1
            if self.start > _COMPACT_AFTER and self.start * 2 > len(self.rows) // _STRIDE:
                del self.rows[: self.start * _STRIDE]
                self.start = 0
        else:
            del self.rows[i * _STRIDE : (i + 1) * _STRIDE]

    def live(self) -> range:
        return range(self.start, len(self.rows) // _STRIDE)


def _age_key(m: QueueMessage) -> int:
    """A message's place in first-in first-out order: when it was enqueued (ms), ties broken by
    its queuing order. The time comes first because queuing orders are counted by each shard's
    owner: two dispatchers' counters are not comparable, and by them a reader draining a backlog
    served one dispatcher's groups before any of the other's, whatever their age (the failover
    bench: the survivors' shards stood still for seconds while a moved shard's backlog drained)."""
    return (m.enqueued_ms << 24) | (m.queuing_order & 0xFFFFFF)


class _Group:
    __slots__ = ("conversations", "entered", "level", "partition", "since", "size")

    def __init__(self, since: int, partition: int) -> None:
        self.conversations: dict[str, _Conversation] = {}
        self.level = 0
        self.size = 0
        self.since = since
        """Age (`_age_key`) of the oldest message that made the group ready: FIFO among equal
        levels within a partition, whatever order the reader read the queue's partitions in."""
        self.partition = partition
        """The queue partition the group lives in (a group's records are keyed to one)."""
        self.entered = 0
        """When it took its level (a serial): equal ages keep the order groups came in."""


_Lane = list[tuple[int, int, str]]
"""One level's groups of one partition, oldest first: (since, entered, group id), sorted."""


class QueueIndex:
    """Ready messages of one queue, by group, by conversation, in RECEIVE order."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self._groups: dict[str, _Group] = {}
        self._conversations: dict[str, _Conversation] = {}
        self._lanes: dict[int, dict[int, _Lane]] = {}
        """level -> partition -> its groups oldest first: RECEIVE walks them without sorting."""
        self._entered = 0
        self._odd_ids: dict[str, tuple[str, int]] = {}
        """Ids that are not ``<handle>:<n>``: id -> (handle, the negative number standing for it)."""
        self._odd_names: dict[int, str] = {}
        self._next_odd = -1
        self._count = 0
        self.positions: dict[int, int] = {}
        self._served: dict[int, int] = {}
        """Partition -> when `take` last returned one of its groups (a serial): partitions take
        turns within a level, the one served longest ago first."""
        self._serial = 0

    # ----------------------------------------------------------------- folding the topic
    def apply(
        self, key: str, value: QueueMessage | None, partition: int, offset: int
    ) -> Ready | None:
        """Fold one queue record; returns the message it took out of the queue, if any."""
        self.positions[partition] = offset + 1
        if value is None or value.status != 1:
            return self.remove(key)
        self.add(value, partition, offset)
        return None

    def add(self, m: QueueMessage, partition: int = 0, offset: int = -1) -> bool:
        """Index a ready message (its record at ``partition``/``offset``); False if already in."""
        handle = m.conversation_handle
        conv = self._conversations.get(handle)
        n = _derived_n(m.message_id, handle)
        if conv is not None and self._holds(conv, m.message_id, n):
            return False
        g = self._groups.get(m.conversation_group_id)
        if g is None:
            g = self._groups[m.conversation_group_id] = _Group(_age_key(m), partition)
        elif _age_key(m) < g.since:  # an older message made ready late: the group moves up
            self._unlane(m.conversation_group_id, g)
            g.since = _age_key(m)
            self._lane(m.conversation_group_id, g)
        if conv is None:
            conv = _Conversation(m.conversation_group_id, handle, m.priority, m.queuing_order)
            self._conversations[handle] = g.conversations[handle] = conv
        if n is None:
            n = self._name_odd(m.message_id, handle)
        else:
            conv.last_n = max(conv.last_n, n)
        key = _pack_key(_order_class(m.message_type_name), m.message_sequence_number)
        conv.insert(key, m.queuing_order, pack_position(partition, offset), n)
        g.size += 1
        self._count += 1
        self._relevel(m.conversation_group_id, g)
        return True

    def _holds(self, conv: _Conversation, message_id: str, n: int | None) -> bool:
        if n is None:
            return message_id in self._odd_ids
        return n <= conv.last_n and conv.find(n) is not None

    def _name_odd(self, message_id: str, handle: str) -> int:
        n = self._next_odd
        self._next_odd -= 1
        self._odd_ids[message_id] = (handle, n)
        self._odd_names[n] = message_id
        return n

    def remove(self, message_id: str) -> Ready | None:
        """A receipt: the message is no longer ready. Returns what it was, if it was ready."""
        found = self._locate(message_id)
        if found is None:
            return None
        conv, i = found
        ready = self._ready(conv, i)
        conv.delete(i)
        if ready.message_id in self._odd_ids:
            del self._odd_names[self._odd_ids.pop(ready.message_id)[1]]
        g = self._groups[conv.group]
        g.size -= 1
        self._count -= 1
        if not conv:
            del g.conversations[conv.handle]
            del self._conversations[conv.handle]
        if g.size == 0:
            del self._groups[conv.group]
            self._unlane(conv.group, g)
        else:
            self._relevel(conv.group, g)
        return ready

    def _locate(self, message_id: str) -> tuple[_Conversation, int] | None:
        odd = self._odd_ids.get(message_id)
        if odd is not None:
            handle, n = odd
        else:
            handle, sep, tail = message_id.rpartition(":")
            if not sep or not tail.isdigit():
                return None
            n = int(tail)
        conv = self._conversations.get(handle)
        if conv is None:
            return None
        i = conv.find(n)
        return None if i is None else (conv, i)

    def _relevel(self, group_id: str, g: _Group) -> None:
        """A group's priority is the highest among its conversations with ready messages."""
        level = max(c.priority for c in g.conversations.values())
        if level == g.level:
            return
        self._unlane(group_id, g)
        g.level = level
        self._entered += 1
        g.entered = self._entered
        self._lane(group_id, g)

    def _lane(self, group_id: str, g: _Group) -> None:
        lanes = self._lanes.setdefault(g.level, {})
        bisect.insort(lanes.setdefault(g.partition, []), (g.since, g.entered, group_id))

    def _unlane(self, group_id: str, g: _Group) -> None:
        lanes = self._lanes.get(g.level)
        lane = None if lanes is None else lanes.get(g.partition)
        if lanes is None or lane is None:
            return
        entry = (g.since, g.entered, group_id)
        i = bisect.bisect_left(lane, entry)
        if i < len(lane) and lane[i] == entry:
            del lane[i]
        if not lane:
            del lanes[g.partition]
            if not lanes:
                del self._lanes[g.level]

    def _ready(self, conv: _Conversation, i: int) -> Ready:
        key, order, pos, n = conv.row(i)
        order_class = (key + _SEQ_LIMIT + 1) >> _CLASS_SHIFT
        mid = self._odd_names[n] if n < 0 else f"{conv.handle}:{n}"
        partition, offset = unpack_position(pos)
        return Ready(
            mid,
            conv.group,
            conv.handle,
            conv.priority,
            order_class,
            key - (order_class << _CLASS_SHIFT),
            order,
            partition,
            offset,
        )

    # ----------------------------------------------------------------- RECEIVE's questions
    def candidates(
        self, exclude: Container[str] = (), later: Callable[[str], bool] | None = None
    ) -> Iterator[str]:
        """Groups with ready messages, highest priority first. Within a level the queue's
        partitions take turns (`_take_turns`), each partition's groups oldest first; the groups
        `later` names come after the level's others (`ksb.queue.stalls`), taking turns alike.

        Turns, not one first-in first-out order over the whole queue, because a partition is a
        shard with an owner of its own: when a shard's owner fails, its messages wait for the
        group to move it and then come back all at once, older than everything else. By age alone
        a reader at capacity drained that backlog first and every other shard's deliveries stood
        still for seconds (the failover bench); with turns they go on at their share, and the
        backlog drains at its own. Kafka gives no order across partitions either; within a
        conversation and a group the order is kept, and levels always come first.
        """
        for level in sorted(self._lanes, reverse=True):
            lanes = self._lanes[level]
            if later is None:
                yield from self._take_turns(lanes, lambda g: g not in exclude)
                continue
            yield from self._take_turns(lanes, lambda g: g not in exclude and not later(g))
            yield from self._take_turns(lanes, lambda g: g not in exclude and later(g))

    def _take_turns(
        self, lanes: dict[int, _Lane], eligible: Callable[[str], bool]
    ) -> Iterator[str]:
        """Round robin over the partitions' eligible groups, the partition served longest ago
        first; among partitions never served (or served alike), the one whose oldest eligible
        group is oldest first. Lazy: a RECEIVE that takes the first few groups walks only as far
        as those, not every ready group (it sorted them all twice per RECEIVE before, a third of
        a busy reader's CPU)."""
        heads: list[tuple[int, tuple[int, int, str], Iterator[str]]] = []
        for p, lane in lanes.items():
            walk = (e for e in lane if eligible(e[2]))
            first = next(walk, None)
            if first is not None:
                rest = (e[2] for e in walk)
                heads.append((self._served.get(p, 0), first, itertools.chain((first[2],), rest)))
        heads.sort(key=lambda h: (h[0], h[1]))
        for row in itertools.zip_longest(*(h[2] for h in heads)):
            yield from (g for g in row if g is not None)

    def lock_candidates(
        self,
        held: Container[str],
        limit: int,
        group: str | None = None,
        handle: str | None = None,
        later: Callable[[str], bool] | None = None,
    ) -> list[str]:
        """The groups a RECEIVE may try to lock now, best first (`later`: as in `candidates`).

        A RECEIVE naming a group or a conversation waits for that one alone: a conversation the
        index has not read yet has no candidate, never the best other group (locking another
        group would answer a WHERE conversation_handle RECEIVE with nothing while its message
        is still on its way).
        """
        target = group
        if target is None and handle is not None:
            target = self.group_of(handle)
            if target is None:
                return []
        if target is not None:
            return [target] if self.has_group(target) and target not in held else []
        return list(itertools.islice(self.candidates(held, later), limit))

    def take(
        self,
        group_id: str,
        top: int | None = None,
        handle: str | None = None,
        skip: Container[str] = (),
    ) -> list[Ready]:
        """A group's ready messages: highest-priority conversation first, each in order; those in
        `skip` (already received in this transaction) left out before `top` counts. Returning
        any counts as serving the group's partition (its turn in `candidates`)."""
        g = self._groups.get(group_id)
        if g is None:
            return []
        out = list(itertools.islice(self._in_order(g, handle, skip), top))
        if out:
            self._serial += 1
            self._served[g.partition] = self._serial
        return out

    def peek(self, top: int) -> list[Ready]:
        """The first `top` ready messages in RECEIVE order, locks aside; nothing is served."""
        out: list[Ready] = []
        for group_id in self.candidates():
            for ready in self._in_order(self._groups[group_id], None, ()):
                out.append(ready)
                if len(out) >= top:
                    return out
        return out

    def _in_order(self, g: _Group, handle: str | None, skip: Container[str]) -> Iterator[Ready]:
        convs = sorted(g.conversations.values(), key=lambda c: (-c.priority, c.first_order))
        for c in convs:
            if handle is not None and c.handle != handle:
                continue
            for i in c.live():
                ready = self._ready(c, i)
                if ready.message_id not in skip:
                    yield ready

    def find(self, message_id: str) -> Ready | None:
        """The message if it is ready."""
        found = self._locate(message_id)
        return None if found is None else self._ready(*found)

    def __contains__(self, message_id: object) -> bool:
        return isinstance(message_id, str) and self._locate(message_id) is not None

    def holds_at(self, message_id: str, partition: int, offset: int) -> bool:
        """Is this record (by its key and place) a ready message? What a read-ahead may keep."""
        found = self._locate(message_id)
        if found is None:
            return False
        conv, i = found
        return conv.rows[i * _STRIDE + _POS] == pack_position(partition, offset)

    def group_of(self, handle: str) -> str | None:
        conv = self._conversations.get(handle)
        return None if conv is None else conv.group

    def has_group(self, group_id: str) -> bool:
        return group_id in self._groups

    def group_size(self, group_id: str) -> int:
        """The group's unreceived messages (0 for a group with none)."""
        g = self._groups.get(group_id)
        return g.size if g else 0

    def level_of(self, group_id: str) -> int:
        g = self._groups.get(group_id)
        return g.level if g else 0

    @property
    def ready_messages(self) -> int:
        return self._count

    @property
    def ready_groups(self) -> int:
        return len(self._groups)

    def oldest_ready_ms(self) -> int | None:
        """When the oldest ready message was enqueued (None: nothing ready): the age of a queue
        that stays true while its readers are stalled. Each lane's first group is its oldest."""
        firsts = [lane[0][0] for lanes in self._lanes.values() for lane in lanes.values() if lane]
        return min(firsts) >> 24 if firsts else None

    def oldest_ready_by_level(self) -> dict[int, int]:
        """Priority level -> when its oldest ready message was enqueued (levels with any): what
        the catalog's SLA targets, which are per level, are checked against."""
        out: dict[int, int] = {}
        for level, lanes in self._lanes.items():
            firsts = [lane[0][0] for lane in lanes.values() if lane]
            if firsts:
                out[level] = min(firsts) >> 24
        return out
