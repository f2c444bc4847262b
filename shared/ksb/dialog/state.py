"""What a dialog rule may read of the dispatcher's state: a narrow, read-only interface.

The rules (`begin`, `send`, `end`, `receipts`, `dead_letters`, `timers`, `remote`, `delivery`) are
functions of this state and a `ksb.dialog.stage.Stage`: they read here and write only to the
stage, which the engine merges when the whole request succeeded. As a Kafka Streams processor
gets a `ProcessorContext` and never its task, a rule never sees the `Engine`: it cannot apply
another request, merge, or change state behind the stage's back, so every change is
all-or-nothing by construction. `ksb.dialog.engine.Engine` is the one implementation; tests may
give a rule any object of this shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from ksb.catalog.model import CatalogView
from ksb.dialog.outputs import Inflight
from ksb.dialog.permissions import Permissions
from ksb.dialog.sequencing import ReceiveWindow
from ksb.dialog.shards import Ownership
from ksb.security.leases import LeaseSeal
from ksb.wire.endpoint import Endpoint
from ksb.wire.protocol import DeadLetterRecord, InboundMessage

__all__ = ["DialogState", "WaitingMessages"]


class WaitingMessages(Protocol):
    """The messages still in a queue, by id: what a receipt, a drop or a replay needs."""

    def get(self, mid: str, /) -> Inflight | None:
        """The waiting message `mid` (None: not waiting: received, never there)."""
        ...

    def __contains__(self, mid: object, /) -> bool: ...

    def queued_for(self, handle: str) -> list[str]:
        """Ids of the messages (waiting or retained) queued for the endpoint `handle`."""
        ...

    @property
    def retained(self) -> Mapping[str, Inflight]:
        """Received messages RETENTION queues keep until their conversation ends."""
        ...


class DialogState(Protocol):
    """The engine's state as the rules see it: read only."""

    @property
    def catalog(self) -> CatalogView: ...

    @property
    def instance(self) -> str:
        """This broker instance's name (other instances' messages name theirs)."""
        ...

    @property
    def max_body_bytes(self) -> int: ...

    @property
    def permissions(self) -> Permissions:
        """Who may act for which service and queue (`ksb.dialog.permissions`)."""
        ...

    @property
    def leases(self) -> LeaseSeal:
        """Opens the lock leases receipts carry (`ksb.dialog.leases`)."""
        ...

    @property
    def ownership(self) -> Ownership:
        """The shards this engine owns: work for another's groups is relayed."""
        ...

    @property
    def endpoints(self) -> Mapping[str, Endpoint]:
        """Open endpoints by handle, as the last merged request left them."""
        ...

    @property
    def waiting(self) -> WaitingMessages: ...

    def fence(self, queue: str, group: str) -> int:
        """The newest lock token applied for the group (0: none; `ksb.dialog.fences`)."""
        ...

    def receive_window(self, receiver: Endpoint) -> ReceiveWindow[InboundMessage]:
        """A private copy of `receiver`'s window over another instance's messages, at its
        durable next number; the stage keeps the copy and the engine takes it at merge."""
        ...

    def closed_remote(self, handle: str) -> bool:
        """Whether `handle` is a remote dialog's endpoint that closed here (a late
        retransmission must not begin it again)."""
        ...

    def queue_disabled(self, name: str) -> bool: ...

    def group_open(self, queue: str, group: str) -> bool:
        """Whether the group has an open endpoint on `queue` here (its fence still matters)."""
        ...

    def last_order(self) -> int:
        """The newest enqueue order handed out (the stage counts on from it)."""
        ...

    def dead_letter_at(self, queue: str, offset: int) -> DeadLetterRecord | None:
        """The record stored at `offset` of `queue`'s dead-letter topic (None: none there, or
        it could not be read): what a replay puts back."""
        ...
