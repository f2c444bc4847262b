"""Conversation timers and dialog lifetimes: deadlines in the endpoint state, fired in order.

BEGIN CONVERSATION TIMER puts a DialogTimer message into the endpoint's own queue when it fires
(a new timer replaces the old one); a dialog lifetime that passes fails both sides with an Error
message (-8489), but closes a side that has already ended. Deadlines live in the endpoint
records, so the heap is rebuilt from them; stale heap entries (a replaced timer, an ended dialog)
are skipped when they come up. Time is whatever
the caller passes in, so the rules are tested in milliseconds.
"""

from __future__ import annotations

import heapq

from ksb.catalog.model import DIALOG_TIMER, ERROR
from ksb.dialog.delivery import drop_queued, enqueue
from ksb.dialog.stage import Stage
from ksb.dialog.state import DialogState
from ksb.dialog.system_messages import LIFETIME_EXPIRED, error_body
from ksb.errors import ConversationError
from ksb.wire.endpoint import Endpoint, State
from ksb.wire.protocol import TimerRequest

__all__ = ["Timers", "fire", "set_timer"]


class Timers:
    """A heap of (deadline, handle, kind) for every armed timer and lifetime."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, str, str]] = []

    def arm(self, ep: Endpoint) -> None:
        if ep.timer_deadline_ms is not None:
            heapq.heappush(self._heap, (ep.timer_deadline_ms, ep.handle, "timer"))
        if ep.lifetime_deadline_ms is not None and ep.state is not State.ERROR:
            heapq.heappush(self._heap, (ep.lifetime_deadline_ms, ep.handle, "lifetime"))

    def next_deadline_ms(self) -> int | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now_ms: int) -> tuple[int, str, str] | None:
        if self._heap and self._heap[0][0] <= now_ms:
            return heapq.heappop(self._heap)
        return None


def set_timer(stage: Stage, req: TimerRequest, now: int) -> None:
    """BEGIN CONVERSATION TIMER: a new deadline replaces the old one."""
    ep = stage.endpoint(req.handle)
    if ep.state in (State.CLOSED, State.DISCONNECTED_OUTBOUND):
        raise ConversationError(
            f"cannot set a timer on conversation {ep.handle}: it is {ep.state.name}",
            code="conversation_closed",
        )
    ep.timer_deadline_ms = now + round(req.timeout_s * 1000)
    ep.updated_ms = now


def fire(state: DialogState, stage: Stage, due: tuple[int, str, str], now_ms: int) -> bool:
    """Fire one due timer or lifetime (from `Timers.pop_due`) on `stage`; False when the entry
    is stale (a replaced timer, an ended dialog) and nothing happened."""
    deadline, handle, kind = due
    ep = stage.maybe_endpoint(handle)
    if ep is None:
        return False
    if kind == "timer" and ep.timer_deadline_ms == deadline:
        ep.timer_deadline_ms = None
        enqueue(state, stage, ep, DIALOG_TIMER, "E", b"", -1, now_ms)
        return True
    if kind == "lifetime" and ep.lifetime_deadline_ms == deadline:
        _expire(state, stage, ep, now_ms)
        return True
    return False


def _expire(state: DialogState, stage: Stage, ep: Endpoint, now: int) -> None:
    reason = "The conversation's lifetime has expired."
    sides = [ep]
    peer = stage.maybe_endpoint(ep.far_handle)
    if peer is not None and peer.lifetime_deadline_ms == ep.lifetime_deadline_ms:
        sides.append(peer)
    for side in sides:
        side.lifetime_deadline_ms = None
        if side.state is State.DISCONNECTED_OUTBOUND:
            # This side has ended and receives nothing more; with the dialog's time up, the far
            # side's acknowledgement it waits for will never come: it closes.
            side.state = State.CLOSED
            side.updated_ms = now
            drop_queued(state, stage, side)
            continue
        if side.state in (State.ERROR, State.CLOSED):
            continue
        enqueue(state, stage, side, ERROR, "X", error_body(LIFETIME_EXPIRED, reason), -1, now)
        side.state = State.ERROR
        side.error_code, side.error_description = LIFETIME_EXPIRED, reason
