"""The transmission-queue scheduler: which waiting message goes out next, across all destinations.

Ordering rules, strongest first:

1. **Conversation order is never broken.** Only the head of a conversation (its lowest pending
   `seq`) is eligible; the next message becomes eligible once the head was taken or removed.
2. **Hard maximum wait.** If the oldest eligible message has waited more than `max_wait_ms`, it is
   sent next whatever its level, and the send is flagged `starvation_exception=True`. This is the
   starvation prevention the priority rules promise: a low-priority message may overtake higher
   ones once it has waited long enough.
3. **Weighted shares per level.** Otherwise the level is picked by stride scheduling (weighted fair
   queuing with integer strides): level L has weight w(L), default 2**(L-1), and stride
   `lcm(weights) // w(L)`. Each level keeps a pass value; the level with the smallest `pass +
   stride` is served (ties go to the higher level) and its pass advances by its stride. Under
   saturation level L gets the share w(L) / sum(w of present levels): with all ten levels present
   10, 9 and 8 get 50 %, 25 % and 12.5 %, so most capacity goes to the top two or three levels
   while every level still progresses. A level that was idle, or skipped by a destination filter,
   is credited at most one stride of lag (its pass is raised to `virtual_time - stride`), so it
   cannot burst on return. Weights that grow by more than the backlog per level (e.g. 1000**L) make
   the order strictly by level.
4. **Within a level**, conversation heads go in enqueue order (`enqueued_ms`, then order of `add`).

HONOR_BROKER_PRIORITY off schedules every message at level 5; forwarded messages are always at 5.
The `waiting` view still reports the assigned level, as sys.transmission_queue does.

**Bound on the wait.** Assume enqueue times are non-decreasing within a conversation (they are: a
conversation's messages are enqueued in send order), one send decision every `S` ms while anything
waits, and at most one arrival per `S` ms (the sender is not overloaded). Then no message waits
more than `max_wait_ms + S`. Proof: take message m enqueued at a, taken at t. Let t0 be the last
decision before t that was idle or took a message enqueued after a. Every decision in (t0, t) took
a message enqueued at or before a. If t0 took a younger message then nothing was overdue at t0
(rule 2 would have taken the oldest head, which is m or an older predecessor of m), so every
message taken in (t0, t], m included, was enqueued in [t0 - max_wait_ms, a]; at most (a - t0 +
max_wait_ms) / S + 1 of them exist, so t <= t0 + S * ((a - t0 + max_wait_ms) / S + 1) = a +
max_wait_ms + S. If t0 was idle the same count over (t0, a] gives t <= a + S. When arrivals outrun
the sender no scheduler can keep any bound; oldest-first among overdue messages then minimises the
largest wait.

**Cost.** Each eligible head sits in three heaps (per level, per level and destination, and global
by age) with lazy deletion, so `add`, `remove` and `next` cost O(log n + levels); `next` with a
destination filter adds O(destinations holding heads) per level.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass, field

from ksb.errors import ConversationError

__all__ = [
    "DEFAULT_LEVEL",
    "DEFAULT_WEIGHTS",
    "LEVELS",
    "Pending",
    "Scheduled",
    "TransmissionScheduler",
    "WaitingRow",
]

LEVELS: tuple[int, ...] = tuple(range(10, 0, -1))
"""Priority levels, highest first."""
DEFAULT_LEVEL = 5
DEFAULT_WEIGHTS: Mapping[int, int] = {level: 2 ** (level - 1) for level in LEVELS}


@dataclass(frozen=True)
class Pending:
    """A message waiting in a transmission queue."""

    message_id: str
    conversation_id: str
    seq: int
    level: int
    destination: str
    enqueued_ms: int
    forwarded: bool = False

    def __post_init__(self) -> None:
        if self.level not in DEFAULT_WEIGHTS:
            raise ConversationError(
                f"message {self.message_id}: priority level {self.level} is outside 1..10",
                code="invalid_priority_level",
            )


@dataclass(frozen=True)
class Scheduled:
    """A message handed to the transport, with why it was picked."""

    pending: Pending
    effective_level: int
    starvation_exception: bool
    waited_ms: int


@dataclass(frozen=True)
class WaitingRow:
    """One row of the transmission-queue view."""

    message_id: str
    destination: str
    level: int
    effective_level: int
    waited_ms: int


# Heap entry: (enqueued_ms, add order, head token). The token tells a live entry from a stale one.
_HeapEntry = tuple[int, int, int]


@dataclass
class _Entry:
    pending: Pending
    order: int
    effective_level: int
    head_token: int = 0  # 0: not the head of its conversation


@dataclass
class _Conversation:
    # (seq, add order); removed messages are skipped lazily.
    heap: list[tuple[int, int]] = field(default_factory=list)
    head: int | None = None  # add order of the current head


class TransmissionScheduler:
    """Orders waiting messages by max wait, level shares and conversation order (see module)."""

    def __init__(
        self,
        honor_broker_priority: bool = True,
        *,
        max_wait_ms: int,
        weights: Mapping[int, int] | None = None,
    ) -> None:
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        self._honor = honor_broker_priority
        self._max_wait_ms = max_wait_ms
        self._stride = _strides(DEFAULT_WEIGHTS if weights is None else weights)
        self._pass = dict.fromkeys(LEVELS, 0)
        self._virtual = 0
        self._entries: dict[int, _Entry] = {}
        self._by_id: dict[str, int] = {}
        self._convs: dict[str, _Conversation] = {}
        self._next_order = 0
        self._next_token = 0
        self._level_heap: dict[int, list[_HeapEntry]] = {level: [] for level in LEVELS}
        self._level_heads: dict[int, int] = dict.fromkeys(LEVELS, 0)
        self._dest_heap: dict[tuple[int, str], list[_HeapEntry]] = {}
        self._dest_heads: dict[int, dict[str, int]] = {level: {} for level in LEVELS}
        self._age_heap: list[_HeapEntry] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, message_id: object) -> bool:
        return message_id in self._by_id

    def effective_level(self, pending: Pending) -> int:
        if pending.forwarded or not self._honor:
            return DEFAULT_LEVEL
        return pending.level

    def add(self, pending: Pending) -> None:
        if pending.message_id in self._by_id:
            raise ValueError(f"message {pending.message_id} is already waiting")
        order = self._next_order
        self._next_order += 1
        self._entries[order] = _Entry(pending, order, self.effective_level(pending))
        self._by_id[pending.message_id] = order
        conv = self._convs.setdefault(pending.conversation_id, _Conversation())
        heapq.heappush(conv.heap, (pending.seq, order))
        self._refresh_head(conv)

    def remove(self, message_id: str) -> bool:
        """Forget a message that was acknowledged or purged; False if it was not waiting."""
        order = self._by_id.get(message_id)
        if order is None:
            return False
        self._discard(order)
        return True

    def next(self, now_ms: int, destinations: Container[str] | None = None) -> Scheduled | None:
        """Take the message to send now, or None if nothing (for these destinations) waits."""
        return self._take(now_ms, _Filter(many=destinations))

    def take_batch(self, now_ms: int, n: int, destination: str | None = None) -> list[Scheduled]:
        """Take up to n messages in schedule order, e.g. to fill one transport block."""
        only = _Filter(one=destination)
        batch: list[Scheduled] = []
        while len(batch) < n:
            taken = self._take(now_ms, only)
            if taken is None:
                break
            batch.append(taken)
        return batch

    def waiting(self, now_ms: int) -> list[WaitingRow]:
        """Every waiting message, highest effective level first, then by enqueue order."""
        entries = sorted(
            self._entries.values(),
            key=lambda e: (-e.effective_level, e.pending.enqueued_ms, e.order),
        )
        return [
            WaitingRow(
                message_id=e.pending.message_id,
                destination=e.pending.destination,
                level=e.pending.level,
                effective_level=e.effective_level,
                waited_ms=now_ms - e.pending.enqueued_ms,
            )
            for e in entries
        ]

    # -- selection ---------------------------------------------------------------------------

    def _take(self, now_ms: int, only: _Filter) -> Scheduled | None:
        oldest = self._oldest(only)
        if oldest is None:
            return None
        overdue = now_ms - oldest.pending.enqueued_ms > self._max_wait_ms
        chosen = oldest if overdue else self._weighted_pick(only)
        assert chosen is not None  # an oldest head exists, so some level has a head
        self._charge(chosen.effective_level)
        self._discard(chosen.order)
        return Scheduled(
            pending=chosen.pending,
            effective_level=chosen.effective_level,
            starvation_exception=overdue,
            waited_ms=now_ms - chosen.pending.enqueued_ms,
        )

    def _oldest(self, only: _Filter) -> _Entry | None:
        if only.unfiltered:
            return self._top(self._age_heap)
        best: _Entry | None = None
        for level in LEVELS:
            candidate = self._best_at(level, only)
            if candidate is not None and (best is None or _age(candidate) < _age(best)):
                best = candidate
        return best

    def _weighted_pick(self, only: _Filter) -> _Entry | None:
        best: _Entry | None = None
        best_finish = 0
        for level in LEVELS:  # highest first, so ties go to the higher level
            candidate = self._best_at(level, only)
            if candidate is None:
                continue
            finish = self._start(level) + self._stride[level]
            if best is None or finish < best_finish:
                best, best_finish = candidate, finish
        return best

    def _start(self, level: int) -> int:
        # Credit at most one stride of lag, so an idle or filtered-out level cannot burst.
        return max(self._pass[level], self._virtual - self._stride[level])

    def _charge(self, level: int) -> None:
        start = self._start(level)
        self._pass[level] = start + self._stride[level]
        self._virtual = max(self._virtual, start)

    def _best_at(self, level: int, only: _Filter) -> _Entry | None:
        if not self._level_heads[level]:
            return None
        if only.unfiltered:
            return self._top(self._level_heap[level])
        best: _Entry | None = None
        for dest in self._dest_candidates(level, only):
            candidate = self._top(self._dest_heap[(level, dest)])
            if candidate is not None and (best is None or _age(candidate) < _age(best)):
                best = candidate
        return best

    def _dest_candidates(self, level: int, only: _Filter) -> Iterator[str]:
        holding = self._dest_heads[level]
        if only.one is not None:
            if holding.get(only.one):
                yield only.one
            return
        for dest, count in holding.items():
            if count and only.many is not None and dest in only.many:
                yield dest

    def _top(self, heap: list[_HeapEntry]) -> _Entry | None:
        while heap:
            if self._is_live(heap[0]):
                return self._entries[heap[0][1]]
            heapq.heappop(heap)
        return None

    # -- bookkeeping -------------------------------------------------------------------------

    def _discard(self, order: int) -> None:
        entry = self._entries.pop(order)
        del self._by_id[entry.pending.message_id]
        conv = self._convs[entry.pending.conversation_id]
        if conv.head == order:
            self._demote(entry)
            conv.head = None
        self._refresh_head(conv)
        if conv.head is None:
            del self._convs[entry.pending.conversation_id]

    def _refresh_head(self, conv: _Conversation) -> None:
        """Make the lowest pending seq the head; a late lower seq takes over from the old head."""
        while conv.heap and conv.heap[0][1] not in self._entries:
            heapq.heappop(conv.heap)
        if not conv.heap:
            return
        order = conv.heap[0][1]
        if conv.head == order:
            return
        if conv.head is not None:
            self._demote(self._entries[conv.head])
        conv.head = order
        self._promote(self._entries[order])

    def _promote(self, entry: _Entry) -> None:
        self._next_token += 1
        entry.head_token = self._next_token
        item = (entry.pending.enqueued_ms, entry.order, entry.head_token)
        level, dest = entry.effective_level, entry.pending.destination
        self._level_heads[level] += 1
        self._dest_heads[level][dest] = self._dest_heads[level].get(dest, 0) + 1
        self._push(self._level_heap[level], item, self._level_heads[level])
        self._push(
            self._dest_heap.setdefault((level, dest), []), item, self._dest_heads[level][dest]
        )
        self._push(self._age_heap, item, len(self._convs))

    def _push(self, heap: list[_HeapEntry], item: _HeapEntry, live: int) -> None:
        """Push, and drop stale entries once they outnumber live ones, so memory tracks the backlog.

        A heap that is only ever peeked through a destination filter would otherwise keep every
        stale entry; rebuilding at twice the live size keeps the cost amortised O(1) per push.
        """
        heapq.heappush(heap, item)
        if len(heap) > 2 * live + 64:
            heap[:] = [e for e in heap if self._is_live(e)]
            heapq.heapify(heap)

    def _is_live(self, item: _HeapEntry) -> bool:
        entry = self._entries.get(item[1])
        return entry is not None and entry.head_token == item[2]

    def _demote(self, entry: _Entry) -> None:
        entry.head_token = 0
        level, dest = entry.effective_level, entry.pending.destination
        self._level_heads[level] -= 1
        if not self._level_heads[level]:
            self._level_heap[level].clear()
        remaining = self._dest_heads[level][dest] - 1
        if remaining:
            self._dest_heads[level][dest] = remaining
        else:
            del self._dest_heads[level][dest]
            del self._dest_heap[(level, dest)]


@dataclass(frozen=True)
class _Filter:
    one: str | None = None
    many: Container[str] | None = None

    @property
    def unfiltered(self) -> bool:
        return self.one is None and self.many is None


def _age(entry: _Entry) -> tuple[int, int]:
    return (entry.pending.enqueued_ms, entry.order)


def _strides(weights: Mapping[int, int]) -> dict[int, int]:
    """Integer strides inversely proportional to the weights, so shares are exact over time."""
    missing = [level for level in LEVELS if level not in weights]
    if missing:
        raise ValueError(f"weights must cover every level 1..10; missing {missing[0]}")
    extra = sorted(set(weights) - set(LEVELS))
    if extra:
        raise ValueError(f"weights name level {extra[0]}, outside 1..10")
    bad = [level for level in LEVELS if weights[level] <= 0]
    if bad:
        raise ValueError(f"weight of level {bad[0]} must be positive, got {weights[bad[0]]}")
    scale = math.lcm(*(weights[level] for level in LEVELS))
    return {level: scale // weights[level] for level in LEVELS}
