"""The fencing-token rule: a commit under an older lock than one already applied is refused.

A reader RECEIVEs under a conversation-group lock (`ksb.queue.locks`), and every acquisition draws a
token from a per-group counter in Redis that only grows. The token travels with the reader's commit.
A lock can expire while its holder is paused (a GC pause, SIGSTOP); the next holder then gets a
higher token and may commit first. When the paused holder wakes up and commits, its token is older
than the one already applied for that group, and the dispatcher refuses the whole commit
(`stale_token`): the sink, not the lock, is the authority.

Here: the check, and the highest token applied per (queue, group) (the engine's; a commit records
its own on its stage, merged with it).
Token 0 means "no KSB lock" (a reader in another language that takes none) and is never fenced.
"""

from __future__ import annotations

from collections.abc import Callable

from ksb.errors import ConversationError

__all__ = ["Fences", "check_token"]


def check_token(fence: int, group: str, token: int) -> None:
    """Refuse a commit whose token is older than `fence`, the newest one applied for its group."""
    if token and token < fence:
        raise ConversationError(
            f"stale lock token {token} for group {group} (a newer holder committed {fence})",
            code="stale_token",
        )


class Fences:
    """The newest applied token per (queue, group): the dispatcher's half of the fencing rule."""

    def __init__(self) -> None:
        self._applied: dict[tuple[str, str], int] = {}

    def applied(self, queue: str, group: str, token: int) -> None:
        """A commit with `token` was applied (its outcome written): older tokens are stale from
        now on. A group is remembered even at token 0, so its outcome is cleaned up at its end."""
        key = (queue, group)
        self._applied[key] = max(self._applied.get(key, 0), token)

    def forget(self, queue: str, group: str) -> bool:
        """The group has no conversation left: nothing it could still receive is fenced. True
        when the group had a commit outcome (whose record can now go)."""
        return self._applied.pop((queue, group), None) is not None

    def adopt(self, other: Fences) -> None:
        """Take over `other`'s fences, of groups this one holds none of (`Engine.adopt`)."""
        self._applied.update(other._applied)

    def drop(self, in_shard: Callable[[str], bool]) -> None:
        """Forget the fences of the groups `in_shard` says (a shard another dispatcher owns now)."""
        for key in [k for k in self._applied if in_shard(k[1])]:
            del self._applied[key]

    def get(self, queue: str, group: str) -> int:
        """The newest applied token for the group (0: none)."""
        return self._applied.get((queue, group), 0)

    def __len__(self) -> int:
        return len(self._applied)
