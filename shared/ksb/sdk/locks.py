"""Conversation-group locks: Redis Lua scripts with fencing tokens.

A RECEIVE sends the candidate groups, best first, to one script that locks the first free one, so a
RECEIVE costs one round trip whatever the number of groups. Each acquisition draws a token from a
per-group counter; the token travels with the commit and the dispatcher refuses an older one. When a
counter is new (first use, or Redis was flushed) it restarts from Redis TIME in microseconds, so tokens
keep growing across a flush.

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
if redis.call('SISMEMBER', KEYS[1], ARGV[3]) == 1 then
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
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] and redis.call('HGET', KEYS[1], 'holder') ~= '' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

_RELEASE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'holder', '', 'after', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  if ARGV[4] == '1' then
    redis.call('SET', KEYS[2], 0)
  end
  return 1
end
return 0
"""


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
        keys: list[str] = [self._names.disabled_key, self._names.activity_key(self._queue)]
        for g in groups:
            keys.append(self._names.lock_key(self._queue, g))
            keys.append(self._names.fence_key(self._queue, g))
        res = cast(Any, self._acquire(keys=keys, args=[self.holder, self.ttl_ms, self._queue]))
        if not res:
            return None
        if int(res[0]) < 0:
            raise QueueDisabled(f"queue {self._queue!r} is disabled (STATUS = OFF)")
        index, token, after, fresh = int(res[0]), int(res[1]), res[2], int(res[3])
        return Lease(groups[index - 1], token, _parse_after(after), first=bool(fresh))

    def extend(self, lease: Lease) -> bool:
        """Renew the lease; False means another holder may have it (commit must not go ahead)."""
        key = self._names.lock_key(self._queue, lease.group)
        return bool(self._extend(keys=[key], args=[lease.token, self.ttl_ms]))

    def extend_all(self, leases: Sequence[Lease]) -> list[bool]:
        """Renew many leases in one pipelined round trip."""
        pipe = self._r.pipeline(transaction=False)
        for lease in leases:
            key = self._names.lock_key(self._queue, lease.group)
            self._extend(keys=[key], args=[lease.token, self.ttl_ms], client=pipe)
        return [bool(v) for v in pipe.execute()]

    def release(
        self, lease: Lease, after: tuple[int, int] | None, *, committed: bool = False
    ) -> bool:
        """Give the group back; a commit also ends the queue's run of rollbacks."""
        return self.release_all([(lease, after, committed)])[0]

    def release_all(
        self, releases: Sequence[tuple[Lease, tuple[int, int] | None, bool]]
    ) -> list[bool]:
        """`release` for many (lease, after, committed), in one pipelined round trip."""
        pipe = self._r.pipeline(transaction=False)
        rollbacks = self._names.rollbacks_key(self._queue)
        for lease, after, committed in releases:
            mark = f"{after[0]}:{after[1]}" if after else ""
            self._release(
                keys=[self._names.lock_key(self._queue, lease.group), rollbacks],
                args=[lease.token, mark, self._keep_after_ms, "1" if committed else "0"],
                client=pipe,
            )
        return [bool(v) for v in pipe.execute()]

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
