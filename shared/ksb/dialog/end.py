"""END CONVERSATION: this side is done; the far side is told with an EndDialog or an Error.

A side that ends first waits (DISCONNECTED_OUTBOUND) until the far side has received its EndDialog;
a side that ends after the far side did closes at once. Either way its unreceived messages leave
its queue and its timer is cancelled: an ended side receives nothing more. WITH CLEANUP closes
this side at once and drops its queued messages without telling the far side. A local END behind messages held in the
transmission queue (a disabled target queue) waits in line with them, so it never overtakes them.
"""

from __future__ import annotations

from ksb.catalog.model import END_DIALOG, ERROR
from ksb.dialog import endpoint as ep_rules
from ksb.dialog.delivery import drop_queued, enqueue, transmit
from ksb.dialog.send import must_park
from ksb.dialog.stage import Stage
from ksb.dialog.state import DialogState
from ksb.dialog.system_messages import error_body
from ksb.wire.endpoint import Endpoint, State
from ksb.wire.protocol import EndRequest

__all__ = ["end"]


def end(state: DialogState, stage: Stage, req: EndRequest, now: int) -> None:
    ep = stage.endpoint(req.handle)
    ep.updated_ms = now
    if req.cleanup:
        ep.state = State.CLOSED
        drop_queued(state, stage, ep)
        return
    if ep.far_instance is not None:
        _end_remote(state, stage, ep, req, now)
    else:
        _end_local(state, stage, ep, req, now)
    # Ending a conversation removes its messages from this side's queue, and its timer fires no
    # more: an ended side receives nothing (Service Broker's END CONVERSATION).
    ep.timer_deadline_ms = None
    drop_queued(state, stage, ep)


def _end_local(state: DialogState, stage: Stage, ep: Endpoint, req: EndRequest, now: int) -> None:
    peer = _local_peer(stage, ep)
    new_state = ep_rules.after_end(ep)
    told = ep.state not in (State.DISCONNECTED_INBOUND, State.ERROR)
    if peer is not None and peer.state is not State.CLOSED and told:
        if must_park(state, ep, peer):
            _park_end(state, stage, ep, req, now)
            ep.state = new_state
            return
        peer.recv_seq = ep.send_seq + 1
        if req.error_code is not None:
            desc = req.error_description or ""
            body = error_body(req.error_code, desc)
            enqueue(state, stage, peer, ERROR, "X", body, ep.send_seq, now)
            peer.state = ep_rules.after_peer_error(peer)
            peer.error_code, peer.error_description = req.error_code, desc
        else:
            enqueue(state, stage, peer, END_DIALOG, "E", b"", ep.send_seq, now)
            peer.state = ep_rules.after_peer_ended(peer)
        ep.send_seq += 1
    elif peer is None:
        # Nothing was ever sent, or the far side is gone (it ended WITH CLEANUP): there is no far
        # side to tell, and none would ever acknowledge this END, so waiting for it would leak.
        new_state = State.CLOSED
    elif peer is not None and peer.state is State.DISCONNECTED_OUTBOUND:
        # The far side ended first and waits for its END to be acknowledged; this END is that,
        # whether or not its EndDialog was received: both sides have ended, so both close.
        peer.state = ep_rules.after_peer_received_end(peer)
        peer.updated_ms = now
    ep.state = new_state


def _local_peer(stage: Stage, ep: Endpoint) -> Endpoint | None:
    """The far endpoint of a local dialog; an initiator's target may not exist yet."""
    if ep.is_initiator and not stage.knows(ep.far_handle):
        return None
    return stage.maybe_endpoint(ep.far_handle)


def _park_end(state: DialogState, stage: Stage, ep: Endpoint, req: EndRequest, now: int) -> None:
    """A local END behind parked messages: its EndDialog or Error waits in line with them,
    and the peer's state changes when it is accepted (`ksb.dialog.remote`), as for a remote peer."""
    if req.error_code is not None:
        body = error_body(req.error_code, req.error_description or "")
        transmit(state, stage, ep, ERROR, body, now, to_instance=state.instance)
    else:
        transmit(state, stage, ep, END_DIALOG, b"", now, to_instance=state.instance)


def _end_remote(state: DialogState, stage: Stage, ep: Endpoint, req: EndRequest, now: int) -> None:
    """END toward another instance: the EndDialog (or Error) travels like any message.

    Unlike a local dialog, the far side cannot see our receipt of its EndDialog, so a side that
    ends second (DISCONNECTED_INBOUND) also sends an EndDialog: that is what closes the first.
    """
    new_state = ep_rules.after_end(ep)
    if ep.state is State.STARTED_OUTBOUND and ep.send_seq == 0:
        new_state = State.CLOSED  # nothing was ever sent: there is no far side to tell
    elif ep.state is not State.ERROR:
        if req.error_code is not None:
            body = error_body(req.error_code, req.error_description or "")
            transmit(state, stage, ep, ERROR, body, now)
            new_state = State.CLOSED  # nothing more can come that this side would accept
        else:
            transmit(state, stage, ep, END_DIALOG, b"", now)
    ep.state = new_state
