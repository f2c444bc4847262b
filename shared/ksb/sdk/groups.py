"""Which conversation group a handle belongs to, as far as this client has seen.

With several dispatchers, a request must reach the owner of its conversation's group: it is keyed by
the group (docs/protocol.md, "Keys"). A conversation's group is its own handle unless it was begun in
a named or related group, and then only its begin and the messages received on it say which. The
client remembers what it has seen, so application code passes handles as Service Broker's does.
"""

from __future__ import annotations

from ksb.wire.protocol import BeginRequest, QueueMessage

__all__ = ["GroupDirectory"]

REMEMBERED = 100_000
"""Handles remembered at most (the oldest are forgotten first); a forgotten handle whose group is
not itself gets the dispatcher's clear unknown_conversation error, never a wrong apply."""


class GroupDirectory:
    """handle -> group, for the handles whose group is not the handle itself."""

    def __init__(self, capacity: int = REMEMBERED) -> None:
        self._capacity = capacity
        self._groups: dict[str, str] = {}

    def learn(self, handle: str, group: str) -> None:
        if group == handle:
            return
        self._groups.pop(handle, None)
        self._groups[handle] = group
        if len(self._groups) > self._capacity:
            del self._groups[next(iter(self._groups))]

    def learn_received(self, messages: list[QueueMessage]) -> None:
        for m in messages:
            self.learn(m.conversation_handle, m.conversation_group_id)

    def of(self, handle: str) -> str:
        """The group of `handle` (the handle itself unless this client learnt otherwise)."""
        return self._groups.get(handle, handle)

    def hint(self, handle: str) -> str | None:
        """The group to name in a commit's action on `handle`, when it is not the handle."""
        return self._groups.get(handle)

    def begun(self, req: BeginRequest) -> str:
        """The group a BEGIN puts its new conversation in (remembered); also the BEGIN's key."""
        if req.related_conversation is not None:  # the related conversation's group wins
            group = self.of(req.related_conversation)
        else:
            group = req.conversation_group_id or req.handle
        self.learn(req.handle, group)
        return group
