"""The group locks one queue service replica took and has not let go.

A replica passes over its own locked groups when it picks candidates for a RECEIVE (the lock
script would skip them anyway, but a busy queue's first candidates are mostly the groups its own
readers work on, and a RECEIVE tries a bounded number), and it releases a lock when it reads the
outcome of the commit made under it. A lock it took can also end without either: its client dies
and the lease runs out, or another replica releases it for a client that moved there. So each
entry lasts only as long as the lease would without renewal through this replica; after that the
group is a candidate again, and the lock script decides.

Each entry also remembers when the lock was taken, renewals aside: how long the oldest lock a
replica took has been held is what an operator looks at when readers seem stuck
(`services.queue.gauges`).
"""

from __future__ import annotations

__all__ = ["HeldLocks"]


class HeldLocks:
    """(queue, group) -> (token, until when this replica counts it held, when it was taken)."""

    def __init__(self, ttl_ms: int) -> None:
        self._ttl_ms = ttl_ms
        self._held: dict[tuple[str, str], tuple[int, int, int]] = {}

    def took(self, queue: str, group: str, token: int, now_ms: int) -> None:
        entry = self._held.get((queue, group))
        since = entry[2] if entry is not None and entry[0] == token else now_ms
        self._held[(queue, group)] = (token, now_ms + self._ttl_ms, since)

    def renewed(self, queue: str, group: str, token: int, now_ms: int) -> None:
        """A renewal through this replica: counted held for another lease."""
        if self.token(queue, group) == token:
            self.took(queue, group, token, now_ms)

    def token(self, queue: str, group: str) -> int | None:
        entry = self._held.get((queue, group))
        return None if entry is None else entry[0]

    def groups(self, queue: str, now_ms: int) -> set[str]:
        """The groups of `queue` this replica counts held now (the lapsed ones are forgotten)."""
        for key in [k for k, (_t, until, _s) in self._held.items() if until <= now_ms]:
            del self._held[key]
        return {g for (q, g) in self._held if q == queue}

    def taken_since(self, now_ms: int) -> dict[str, dict[str, int]]:
        """Queue -> group -> when its lock was taken, for the locks counted held now (the
        lapsed ones are left for `groups` to forget: this is read by the metrics' scrape)."""
        out: dict[str, dict[str, int]] = {}
        for (queue, group), (_t, until, since) in self._held.items():
            if until > now_ms:
                out.setdefault(queue, {})[group] = since
        return out

    def let_go(self, queue: str, group: str, token: int) -> bool:
        """Forget the lock if it is the one under `token`; whether it was."""
        if token and self.token(queue, group) == token:
            del self._held[(queue, group)]
            return True
        return False

    def __len__(self) -> int:
        return len(self._held)
