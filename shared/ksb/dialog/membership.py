"""Which messages wait in which queue: the dispatcher's at-most-once ledger, kept compact.

The dispatcher is the single authority that a message is received at most once, so it must know
every message still waiting. It knows that per endpoint: each message an endpoint's queue gets is
numbered by the endpoint (``Endpoint.enqueued``) and its id is ``<handle>:<n>``, so the ledger
needs, per waiting message, only that number and a packed integer (when it was enqueued, when its
sender sent it, whether it is an EndDialog, an Error or a DialogTimer): 16 bytes in two arrays,
whatever the body. Everything else a receipt needs (queue, partition, group, level, service) is
the endpoint's. A backlog of a million messages therefore costs the dispatcher tens of megabytes,
not the messages themselves.

It also counts the waiting messages of each queue per shard, and which counts changed since the
dispatcher last wrote them to the ``depth`` topic (`ksb.wire.depth`, `Engine.changed_depths`),
which SDK senders read to slow down before a queue outgrows its readers.

Messages whose id does not name a live endpoint (a replayed dead letter whose conversation ended,
a record written before ids had this form) are kept whole, as are received messages of RETENTION
queues, which a receipt rewrites and the end of the conversation removes.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Iterator, Mapping

from ksb.catalog.model import DIALOG_TIMER, END_DIALOG, ERROR
from ksb.dialog.outputs import Inflight
from ksb.wire.endpoint import Endpoint
from ksb.wire.partitioning import partition_for
from ksb.wire.protocol import QueueMessage

__all__ = ["DepthKey", "Membership", "Waiting", "message_id"]

DepthKey = tuple[str, int]
"""(queue, shard): what one ``depth`` record counts."""

_SYSTEM = {END_DIALOG: 1, ERROR: 2, DIALOG_TIMER: 3}
_TYPES = {1: END_DIALOG, 2: ERROR, 3: DIALOG_TIMER}
_MS_BITS = 42
_MS_MASK = (1 << _MS_BITS) - 1
_CLASS_SHIFT = _MS_BITS
_SENT_SHIFT = _MS_BITS + 2
_SENT_UNKNOWN = (1 << 19) - 1
"""A sender's time more than ~8.7 minutes before the enqueue is not kept (it only feeds the
end-to-end latency of the audit events)."""


def message_id(handle: str, n: int) -> str:
    """The id of the `n`-th message an endpoint's queue got."""
    return f"{handle}:{n}"


def _split(mid: str) -> tuple[str, int] | None:
    handle, sep, n = mid.rpartition(":")
    if not sep or not n.isdigit():
        return None
    return handle, int(n)


def _pack(info: Inflight) -> int:
    cls = _SYSTEM.get(info.message_type, 0)
    sent = _SENT_UNKNOWN
    if info.sent_ms is not None and 0 <= info.enqueued_ms - info.sent_ms < _SENT_UNKNOWN:
        sent = info.enqueued_ms - info.sent_ms
    return (info.enqueued_ms & _MS_MASK) | (cls << _CLASS_SHIFT) | (sent << _SENT_SHIFT)


class Waiting:
    """The waiting messages of one endpoint: their numbers, ascending, and packed facts.

    Receipts nearly always take the oldest messages (RECEIVE returns a conversation in order), so
    removal from the front only moves a start index; the arrays are compacted now and then.
    """

    __slots__ = ("_meta", "_ns", "_start")

    def __init__(self) -> None:
        self._ns = array("q")
        self._meta = array("q")
        self._start = 0

    def __len__(self) -> int:
        return len(self._ns) - self._start

    def add(self, n: int, meta: int) -> None:
        if len(self._ns) == self._start or n > self._ns[-1]:
            self._ns.append(n)
            self._meta.append(meta)
            return
        i = bisect.bisect_left(self._ns, n, self._start)
        if i < len(self._ns) and self._ns[i] == n:
            self._meta[i] = meta
            return
        self._ns.insert(i, n)
        self._meta.insert(i, meta)

    def newest(self, n: int) -> bool:
        """Whether `n` is above every number waiting (a new message, nothing to replace)."""
        return len(self._ns) == self._start or n > self._ns[-1]

    def get(self, n: int) -> int | None:
        i = self._index(n)
        return None if i is None else self._meta[i]

    def remove(self, n: int) -> int | None:
        i = self._index(n)
        if i is None:
            return None
        meta = self._meta[i]
        if i == self._start:
            self._start += 1
            if self._start > 64 and self._start * 2 > len(self._ns):
                del self._ns[: self._start]
                del self._meta[: self._start]
                self._start = 0
        else:
            del self._ns[i]
            del self._meta[i]
        return meta

    def items(self) -> Iterator[tuple[int, int]]:
        for i in range(self._start, len(self._ns)):
            yield self._ns[i], self._meta[i]

    def _index(self, n: int) -> int | None:
        i = bisect.bisect_left(self._ns, n, self._start)
        return i if i < len(self._ns) and self._ns[i] == n else None


class Membership(Mapping[str, Inflight]):
    """Every message waiting in a queue of the engine's endpoints, by id (a read-only mapping to
    what a receipt needs), plus the received messages RETENTION queues keep."""

    def __init__(
        self,
        endpoints: Mapping[str, Endpoint],
        partitions: Callable[[str], int],
        shard: Callable[[str], int],
    ) -> None:
        """`partitions` gives a queue's partition count, `shard` a group's shard."""
        self._endpoints = endpoints
        self._partitions = partitions
        self._shard = shard
        self._waiting: dict[str, Waiting] = {}
        self._orphans: dict[str, Inflight] = {}
        self.retained: dict[str, Inflight] = {}
        self.shard_depth: dict[DepthKey, int] = {}
        """Unreceived messages per queue and shard."""
        self._changed: set[DepthKey] = set()
        """The counts changed since `take_changed` last handed them out."""

    @property
    def depth(self) -> dict[str, int]:
        """Unreceived messages per queue (over the shards this ledger holds)."""
        depth: dict[str, int] = {}
        for (queue, _shard), n in self.shard_depth.items():
            depth[queue] = depth.get(queue, 0) + n
        return depth

    @property
    def depths_changed(self) -> bool:
        """Whether a count changed since `take_changed` last handed them out."""
        return bool(self._changed)

    def take_changed(self) -> dict[DepthKey, int]:
        """The counts that changed since the last call, with their values now."""
        changed = {key: self.shard_depth.get(key, 0) for key in self._changed}
        self._changed.clear()
        return changed

    def _count_one(self, queue: str, group: str, step: int) -> None:
        key = (queue, self._shard(group))
        self.shard_depth[key] = self.shard_depth.get(key, 0) + step
        self._changed.add(key)

    # ----------------------------------------------------------------- the mapping
    def __getitem__(self, mid: str) -> Inflight:
        info = self.get(mid)
        if info is None:
            raise KeyError(mid)
        return info

    def get(self, mid: str, default: Inflight | None = None) -> Inflight | None:  # type: ignore[override]
        orphan = self._orphans.get(mid)
        if orphan is not None:
            return orphan
        parts = _split(mid)
        if parts is None:
            return default
        handle, n = parts
        waiting = self._waiting.get(handle)
        meta = None if waiting is None else waiting.get(n)
        if meta is None:
            return default
        return self._info(mid, handle, meta)

    def __contains__(self, mid: object) -> bool:
        return isinstance(mid, str) and self.get(mid) is not None

    def __iter__(self) -> Iterator[str]:
        yield from self._orphans
        for handle, waiting in self._waiting.items():
            for n, _meta in waiting.items():
                yield message_id(handle, n)

    def __len__(self) -> int:
        return len(self._orphans) + sum(len(w) for w in self._waiting.values())

    # ----------------------------------------------------------------- changes
    def add(self, mid: str, info: Inflight) -> None:
        """A message now waiting in `info.queue` (a newer record with the same id replaces it)."""
        parts = _split(mid)
        compact = info.retained is None and info.handle in self._endpoints
        if compact and parts is not None and parts[0] == info.handle:
            waiting = self._waiting.get(info.handle)
            if waiting is None or not waiting.newest(parts[1]) or mid in self._orphans:
                self.remove(mid)  # a record read back again, or one kept whole before
                waiting = self._waiting.get(info.handle)
            if waiting is None:
                waiting = self._waiting[info.handle] = Waiting()
            waiting.add(parts[1], _pack(info))
        else:
            self.remove(mid)
            self._orphans[mid] = info
        self._count_one(info.queue, info.group, 1)

    def remove(self, mid: str) -> bool:
        """The message left its queue (received, dead-lettered, dropped): whether it was waiting.
        (Every receipt's messages leave through here: what they were is not built again.)"""
        info = self._orphans.pop(mid, None)
        if info is not None:
            self._count_one(info.queue, info.group, -1)
            return True
        parts = _split(mid)
        waiting = None if parts is None else self._waiting.get(parts[0])
        if parts is None or waiting is None or waiting.remove(parts[1]) is None:
            return False
        if not waiting:
            del self._waiting[parts[0]]
        ep = self._endpoints[parts[0]]
        self._count_one(ep.queue, ep.group, -1)
        return True

    def retain(self, mid: str, info: Inflight) -> None:
        """A RETENTION queue's message was received: it stays, as received, until its dialog ends."""
        self.retained[mid] = info

    def queued_for(self, handle: str) -> list[str]:
        """Ids of the messages (waiting or retained) queued for the endpoint `handle`."""
        waiting = self._waiting.get(handle)
        mids = [] if waiting is None else [message_id(handle, n) for n, _m in waiting.items()]
        mids += [mid for mid, info in self._orphans.items() if info.handle == handle]
        mids += [mid for mid, info in self.retained.items() if info.handle == handle]
        return mids

    def waiting_of(self, handle: str) -> int:
        """How many messages wait in `handle`'s queue."""
        waiting = self._waiting.get(handle)
        return 0 if waiting is None else len(waiting)

    def adopt(self, other: Membership) -> None:
        """Take over `other`'s messages, none of which this one holds (`Engine.adopt`)."""
        self._waiting.update(other._waiting)
        self._orphans.update(other._orphans)
        self.retained.update(other.retained)
        for key, n in other.shard_depth.items():
            self.shard_depth[key] = self.shard_depth.get(key, 0) + n
        self._changed.update(other.shard_depth)  # the new owner writes its shards' counts again

    def drop(self, shard: int) -> None:
        """Forget the messages of `shard` (another dispatcher owns it now), and its counts: its
        next owner writes them. Called once the shard's endpoints are forgotten: a compact entry
        whose endpoint is gone goes with it."""
        for handle in [h for h, _w in self._waiting.items() if h not in self._endpoints]:
            del self._waiting[handle]
        for store in (self._orphans, self.retained):
            for mid in [m for m, i in store.items() if self._shard(i.group) == shard]:
                del store[mid]
        for key in [k for k in self.shard_depth if k[1] == shard]:
            del self.shard_depth[key]
            self._changed.discard(key)

    # ----------------------------------------------------------------- rebuild
    def load(self, key: str, value: QueueMessage | None, partition: int, retains: bool) -> None:
        """Fold one queue record read back from Kafka (records come in offset order)."""
        if value is None:
            if not self.remove(key):
                self.retained.pop(key, None)
            return
        info = _from_record(key, value, partition, retains)
        if value.status != 1:
            self.remove(key)
            self.retained[key] = info
            return
        self.add(key, info)

    def _info(self, mid: str, handle: str, meta: int) -> Inflight:
        ep = self._endpoints[handle]
        enqueued = meta & _MS_MASK
        sent = (meta >> _SENT_SHIFT) & _SENT_UNKNOWN
        return Inflight(
            ep.queue,
            partition_for(ep.group, self._partitions(ep.queue)),
            ep.group,
            handle,
            _TYPES.get((meta >> _CLASS_SHIFT) & 3, ""),
            None,
            priority=ep.priority,
            enqueued_ms=enqueued,
            message_id=mid,
            service=ep.local_service,
            sent_ms=None if sent == _SENT_UNKNOWN else enqueued - sent,
        )


def _from_record(key: str, value: QueueMessage, partition: int, retains: bool) -> Inflight:
    return Inflight(
        value.queue,
        partition,
        value.conversation_group_id,
        value.conversation_handle,
        value.message_type_name,
        value if retains else None,
        priority=value.priority,
        enqueued_ms=value.enqueued_ms,
        message_id=key,
        service=value.service_name,
        sent_ms=value.sent_ms,
    )
