"""Conversation-group locks: Redis Lua scripts with fencing tokens.

A RECEIVE sends the candidate groups, best first, to one script that locks the first free one, so a
RECEIVE costs one round trip whatever the number of groups. Each acquisition draws a token from a
per-group counter; the token travels with the commit and the dispatcher refuses an older one. When a
counter is new (first use, or Redis was flushed) it restarts from Redis TIME in microseconds, so tokens
keep growing across a flush.

Every key a script touches belongs to one queue and carries the queue's hash tag
(`ksb.names.Names`), so on a Redis Cluster each call runs on the one node that holds the queue's
slot. Batches (extend, release) are one script call over all their keys rather than a pipeline of
calls: one round trip either way, and a cluster pipeline cannot carry EVALSHA.

A clean release leaves ``after`` (the queue position of the holder's commit outcome) so that the next
holder waits until its own index has read that far; when the hash is gone the next holder cannot know,
and catches up with the partition's end instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis

from ksb.errors import QueueDisabled
from ksb.names import Names

__all__ = ["GroupLocks", "Lease"]

_ACQUIRE_FIRST = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {-1}
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
for i = 3, #KEYS, 2 do
  local lk = KEYS[i]
  local fk = KEYS[i + 1]
  local holder = redis.call('HGET', lk, 'holder')
  if (not holder) or holder == '' then
    local after = redis.call('HGET', lk, 'after')
    local t = redis.call('INCR', fk)
    local fresh = 0
    if t == 1 then
      t = tonumber(now[1]) * 1000000 + tonumber(now[2])
      redis.call('SET', fk, t)
      fresh = 1
    end
    redis.call('PEXPIRE', fk, 86400000)
    redis.call('HSET', lk, 'holder', ARGV[1], 'token', t)
    redis.call('HDEL', lk, 'after')
    redis.call('PEXPIRE', lk, ARGV[2])
    redis.call('HSET', KEYS[2], 'last_receive_ms', now_ms)
    return {(i - 1) / 2, t, after or '', fresh}
  end
end
return false
"""

_EXTEND = """
local out = {}
for i = 1, #KEYS do
  out[i] = 0
  if redis.call('HGET', KEYS[i], 'token') == ARGV[i + 1] and redis.call('HGET', KEYS[i], 'holder') ~= '' then
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
    out[i] = 1
  end
end
return out
"""
"""KEYS: lock keys; ARGV: the TTL, then each lease's token. Returns 1 per lease still held."""

_RELEASE = """
local out = {}
local committed = false
for i = 2, #KEYS do
  local a = (i - 2) * 3 + 2
  out[i - 1] = 0
  if redis.call('HGET', KEYS[i], 'token') == ARGV[a] then
    redis.call('HSET', KEYS[i], 'holder', '', 'after', ARGV[a + 1])
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
    if ARGV[a + 2] == '1' then
      committed = true
    end
    out[i - 1] = 1
  end
end
if committed then
  redis.call('SET', KEYS[1], 0)
end
return out
"""
"""KEYS: the queue's rollback counter, then lock keys; ARGV: how long ``after`` is kept, then
per lease its token, ``after`` and whether it committed. Returns 1 per lease released."""


@dataclass(frozen=True)
class Lease:
    group: str
    token: int
    after: tuple[int, int] | None
    """(partition, offset) the previous holder's outcome sits at; None when unknown."""
    first: bool = False
    """No earlier holder is known (first use of the group, or Redis lost its counter)."""


class GroupLocks:
    """The locks of one queue's conversation groups, for one holder (a reader)."""

    def __init__(
        self,
        client: redis.Redis,
        names: Names,
        queue: str,
        *,
        holder: str,
        ttl_ms: int,
        keep_after_ms: int = 600_000,
    ) -> None:
        self._r = client
        self._names = names
        self._queue = queue
        self.holder = holder
        self.ttl_ms = ttl_ms
        self._keep_after_ms = keep_after_ms
        self._acquire = client.register_script(_ACQUIRE_FIRST)
        self._extend = client.register_script(_EXTEND)
        self._release = client.register_script(_RELEASE)

    def acquire_first(self, groups: Sequence[str]) -> Lease | None:
        """Lock the first free group of ``groups`` (best first); None when all are held."""
        if not groups:
            return None
        keys: list[str] = [
            self._names.disabled_key(self._queue),
            self._names.activity_key(self._queue),
        ]
        for g in groups:
            keys.append(self._names.lock_key(self._queue, g))
            keys.append(self._names.fence_key(self._queue, g))
        res = cast(Any, self._acquire(keys=keys, args=[self.holder, self.ttl_ms]))
        if not res:
            return None
        if int(res[0]) < 0:
            raise QueueDisabled(f"queue {self._queue!r} is disabled (STATUS = OFF)")
        index, token, after, fresh = int(res[0]), int(res[1]), res[2], int(res[3])
        return Lease(groups[index - 1], token, _parse_after(after), first=bool(fresh))

    def extend(self, lease: Lease) -> bool:
        """Renew the lease; False means another holder may have it (commit must not go ahead)."""
        return self.extend_all([lease])[0]

    def extend_all(self, leases: Sequence[Lease]) -> list[bool]:
        """Renew many leases in one script call."""
        if not leases:
            return []
        keys = [self._names.lock_key(self._queue, lease.group) for lease in leases]
        args: list[Any] = [self.ttl_ms, *(lease.token for lease in leases)]
        return [bool(v) for v in cast(list[Any], self._extend(keys=keys, args=args))]

    def release(
        self, lease: Lease, after: tuple[int, int] | None, *, committed: bool = False
    ) -> bool:
        """Give the group back; a commit also ends the queue's run of rollbacks."""
        return self.release_all([(lease, after, committed)])[0]

    def release_all(
        self, releases: Sequence[tuple[Lease, tuple[int, int] | None, bool]]
    ) -> list[bool]:
        """`release` for many (lease, after, committed), in one script call."""
        if not releases:
            return []
        keys = [self._names.rollbacks_key(self._queue)]
        args: list[Any] = [self._keep_after_ms]
        for lease, after, committed in releases:
            keys.append(self._names.lock_key(self._queue, lease.group))
            mark = f"{after[0]}:{after[1]}" if after else ""
            args += [lease.token, mark, "1" if committed else "0"]
        return [bool(v) for v in cast(list[Any], self._release(keys=keys, args=args))]

    def holder_of(self, group: str) -> str | None:
        raw = self._r.hget(self._names.lock_key(self._queue, group), "holder")
        if not raw:
            return None
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def locked(self, groups: Sequence[str]) -> list[bool]:
        """Which of ``groups`` are held right now (one pipelined round trip)."""
        pipe = self._r.pipeline(transaction=False)
        for g in groups:
            pipe.hget(self._names.lock_key(self._queue, g), "holder")
        return [bool(v) for v in pipe.execute()]


def _parse_after(raw: Any) -> tuple[int, int] | None:
    if isinstance(raw, bytes):
        raw = raw.decode()
    if not raw:
        return None
    part, _, off = str(raw).partition(":")
    return int(part), int(off)
