"""A request's private, copy-on-write view of the engine's state.

Every request is applied to a `Stage` first: endpoints are copied on first touch, queue membership
changes are recorded beside the engine's, and records go to the stage's own `Outputs`. Only when
the whole request succeeded does the engine merge the stage; a request that raises leaves no trace,
which is what makes a multi-conversation SEND or a reader's commit all-or-nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ksb.dialog.endpoint import Endpoint, State
from ksb.dialog.outputs import Inflight, Outputs
from ksb.errors import ConversationError

if TYPE_CHECKING:
    from ksb.dialog.engine import Engine

__all__ = ["Stage"]


class Stage:
    """Copy-on-write view of the engine's state for one request."""

    def __init__(
        self, engine: Engine, sent_ms: int | None = None, principal: str | None = None
    ) -> None:
        self.engine = engine
        self.principal = principal
        """Who sent the request (its requests topic's principal): what it may do is checked."""
        self.endpoints: dict[str, Endpoint] = {}
        self.new_inflight: dict[str, Inflight] = {}
        self.gone_inflight: set[str] = set()
        self.new_retained: dict[str, Inflight] = {}
        self.out = Outputs()
        self.persist: set[str] = set()
        """Endpoints whose record is written even if only their counters changed."""
        self.sent_ms = sent_ms
        """The request record's timestamp, stamped on what it enqueues (end-to-end latency)."""

    def endpoint(self, handle: str) -> Endpoint:
        """The open endpoint `handle`, as this request has left it so far: one that an earlier
        action of the same request closed is as unknown as one closed long ago."""
        staged = self.endpoints.get(handle)
        if staged is not None and staged.state is not State.CLOSED:
            return staged
        base = self.engine.endpoints.get(handle) if staged is None else None
        if base is None or base.state is State.CLOSED:
            hint = ""
            if len(self.engine.ownership.owned) < self.engine.ownership.shards:
                hint = (
                    " on this dispatcher (a conversation's requests are keyed by its conversation"
                    " group: its handle, unless it was begun in a related group)"
                )
            raise ConversationError(
                f"unknown or closed conversation handle {handle!r}{hint}",
                code="unknown_conversation",
            )
        ep = base.copy()
        self.endpoints[handle] = ep
        return ep

    def maybe_endpoint(self, handle: str | None) -> Endpoint | None:
        if handle is None:
            return None
        try:
            return self.endpoint(handle)
        except ConversationError:
            return None

    def knows(self, handle: str | None) -> bool:
        """Whether `handle` is an endpoint of this request or of the engine (closed ones aside)."""
        return handle is not None and (handle in self.endpoints or handle in self.engine.endpoints)

    def put(self, ep: Endpoint) -> None:
        self.endpoints[ep.handle] = ep
