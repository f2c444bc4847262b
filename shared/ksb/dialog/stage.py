"""A request's private, copy-on-write view of the engine's state, and the only place rules write.

Every request is applied to a `Stage` first: endpoints are copied on first touch, queue membership
changes, fences, receive windows and enqueue orders are recorded beside the engine's, and records
go to the stage's own `Outputs`. Only when the whole request succeeded does the engine merge the
stage; a request that raises leaves no trace, which is what makes a multi-conversation SEND or a
reader's commit all-or-nothing. The rules read the engine through `ksb.dialog.state.DialogState`
and never touch it.
"""

from __future__ import annotations

from ksb.dialog.outputs import Inflight, Outputs
from ksb.dialog.sequencing import ReceiveWindow
from ksb.dialog.state import DialogState
from ksb.errors import ConversationError
from ksb.wire.endpoint import Endpoint, State
from ksb.wire.protocol import InboundMessage, Receipt

__all__ = ["Stage"]


class Stage:
    """Copy-on-write view of the engine's state for one request."""

    def __init__(
        self, state: DialogState, sent_ms: int | None = None, principal: str | None = None
    ) -> None:
        self.state = state
        self.principal = principal
        """Who sent the request (its requests topic's principal): what it may do is checked."""
        self.endpoints: dict[str, Endpoint] = {}
        self.new_inflight: dict[str, Inflight] = {}
        self.gone_inflight: set[str] = set()
        self.new_retained: dict[str, Inflight] = {}
        self.fences: dict[tuple[str, str], int] = {}
        """(queue, group) -> the lock token of a commit this request applied."""
        self.windows: dict[str, ReceiveWindow[InboundMessage]] = {}
        """Receive windows this request moved (copies of the engine's), by endpoint handle."""
        self.order = 0
        """The newest enqueue order this request handed out (0: none)."""
        self.receipt: Receipt | None = None
        """A commit's receipt as its lease grants it (`ksb.dialog.leases`)."""
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
        base = self.state.endpoints.get(handle) if staged is None else None
        if base is None or base.state is State.CLOSED:
            hint = ""
            ownership = self.state.ownership
            if len(ownership.owned) < ownership.shards:
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
        return handle is not None and (handle in self.endpoints or handle in self.state.endpoints)

    def put(self, ep: Endpoint) -> None:
        self.endpoints[ep.handle] = ep

    def next_order(self) -> int:
        """The next enqueue order: RECEIVE's tie-break among equal levels in one millisecond."""
        self.order = (self.order or self.state.last_order()) + 1
        return self.order

    def apply_fence(self, queue: str, group: str, token: int) -> None:
        """A commit under `token` applies: older tokens of the group are stale from the merge on."""
        key = (queue, group)
        self.fences[key] = max(self.fences.get(key, 0), token)

    def fence(self, queue: str, group: str) -> int:
        """The group's newest applied token, this request's included."""
        return max(self.fences.get((queue, group), 0), self.state.fence(queue, group))

    def window(self, receiver: Endpoint) -> ReceiveWindow[InboundMessage]:
        """`receiver`'s receive window as this request moves it (the engine keeps it at merge)."""
        window = self.windows.get(receiver.handle)
        if window is None or window.next_seq != receiver.recv_seq:
            window = self.windows[receiver.handle] = self.state.receive_window(receiver)
        return window
