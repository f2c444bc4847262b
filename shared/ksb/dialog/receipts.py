"""A reader's commit: its receipt and its actions, applied all or nothing, at most once.

The dispatcher is the single authority that a message is received at most once: a receipt naming a
message that is not waiting (received before, never there) or that belongs to another group is
refused whole, and so is one under a stale lock token (`ksb.dialog.fences`). Refused or applied,
every commit with a receipt gets an outcome record in its group's partition of the queue topic,
which is how the committing reader learns the result and releases its lock; keyed by the group,
the newest one also keeps the group's fence through compaction and restarts.
"""

from __future__ import annotations

from ksb.catalog.model import END_DIALOG, ERROR
from ksb.dialog import endpoint as ep_rules
from ksb.dialog.fences import check_token
from ksb.dialog.leases import leased
from ksb.dialog.outputs import Outputs, QueueWrite, Received
from ksb.dialog.stage import Stage
from ksb.dialog.state import DialogState
from ksb.errors import ConversationError, KsbError
from ksb.wire.endpoint import Endpoint
from ksb.wire.partitioning import partition_for
from ksb.wire.protocol import (
    Action,
    BeginRequest,
    CommitOutcome,
    CommitRequest,
    FenceRequest,
    Receipt,
    SendRequest,
    replace,
)
from ksb.wire.relay import RelayAction

__all__ = [
    "applied",
    "fence",
    "local_actions",
    "outcome_key",
    "receive",
    "refused_outcome",
]


def receive(state: DialogState, stage: Stage, req: CommitRequest, now: int) -> None:
    """A commit's first step: its receipt, if it has one, under its lease (the engine then
    applies the actions `local_actions` leaves it, and ends with `applied`)."""
    r = req.receipt
    if r is None:
        return
    state.permissions.check_receive(stage.principal, r.queue, "commit a receipt")
    token, claims = leased(state.leases, state.instance, stage.principal, r)
    stage.receipt = replace(r, token=token)
    if claims is not None:
        stage.out.receipts.append(Received(claims, r.message_ids))
    apply_receipt(state, stage, stage.receipt, now)


def local_actions(state: DialogState, stage: Stage, req: CommitRequest) -> list[Action]:
    """The commit's actions on groups this engine owns, in order, for the engine to apply; the
    others are relayed to their groups' owners."""
    begun: dict[str, str] = {}
    local: list[Action] = []
    for action in req.actions:
        group = _group_of(stage, action, begun)
        if group is None or state.ownership.owns(group):
            local.append(action)
        else:
            # A conversation of a group another dispatcher owns: carried out there, after this
            # commit, exactly once; a refusal is reported under this commit's request id.
            stage.out.relays.append(
                RelayAction(
                    action=action,
                    group=group,
                    request_id=req.request_id,
                    principal=stage.principal,
                )
            )
    return local


def applied(state: DialogState, stage: Stage, req: CommitRequest) -> None:
    """The whole commit applied: its token fences older holders out, and its outcome tells the
    committing reader."""
    r = stage.receipt
    if r is None:
        return
    stage.apply_fence(r.queue, r.group, r.token)
    fence = stage.fence(r.queue, r.group)
    stage.out.queue.append(_outcome(state, req, r, fence, applied=True, reason=""))


def apply_receipt(state: DialogState, stage: Stage, r: Receipt, now: int) -> None:
    check_token(stage.fence(r.queue, r.group), r.group, r.token)
    state.catalog.queue(r.queue)  # an unknown queue is refused before anything is applied
    for mid in dict.fromkeys(r.message_ids):
        info = state.waiting.get(mid)
        if info is None or mid in stage.gone_inflight:
            raise ConversationError(
                f"message {mid} is not waiting in queue {r.queue!r} (already received?)",
                code="already_received",
            )
        if info.queue != r.queue or info.group != r.group:
            raise ConversationError(
                f"message {mid} is not in group {r.group} of queue {r.queue!r}",
                code="wrong_group",
            )
        stage.gone_inflight.add(mid)
        stage.out.received.append(info)
        if info.retained is not None:
            # RETENTION ON: the message stays, marked received, until its conversation ends.
            kept = replace(info.retained, status=0)
            stage.out.queue.append(QueueWrite(r.queue, info.partition, mid, kept))
            stage.new_retained[mid] = info
        else:
            stage.out.queue.append(QueueWrite(r.queue, info.partition, mid, None))
        receiver = stage.maybe_endpoint(info.handle)
        if receiver is None:
            continue
        receiver.outstanding = max(0, receiver.outstanding - 1)
        receiver.state = ep_rules.after_receive(receiver)
        receiver.updated_ms = now
        _persist_counters(stage, receiver)
        if info.message_type in (END_DIALOG, ERROR):
            _far_received_end(state, stage, receiver, now)


def _persist_counters(stage: Stage, receiver: Endpoint) -> None:
    """A receipt tombstones messages, and with them what the queue showed of the dialog's
    counters: both ends' records are written now (`ksb.dialog.counters`)."""
    if receiver.handle in stage.persist:
        return
    stage.persist.add(receiver.handle)
    if receiver.far_instance is None and receiver.far_handle is not None:
        sender = stage.maybe_endpoint(receiver.far_handle)
        if sender is not None:
            stage.persist.add(sender.handle)


def _group_of(stage: Stage, action: Action, begun: dict[str, str]) -> str | None:
    """The group an action changes, None when it is an endpoint this engine has. A BEGIN's is
    its related conversation's, the group it names, or its own handle; another handle's is the
    group a BEGIN earlier in the commit gave it, else the group the action names, else (as for
    any conversation not begun in a named or related group) its own handle."""
    if isinstance(action, BeginRequest):
        group = action.conversation_group_id or action.handle
        related = action.related_conversation
        if related is not None:
            if stage.knows(related):
                return None
            # A related conversation of another shard: the group the BEGIN also names (the SDK
            # names it when it knows it) finds its owner when it is not the related handle.
            group = begun.get(related) or action.conversation_group_id or related
        begun[action.handle] = group
        return group
    handle = action.handles[0] if isinstance(action, SendRequest) else action.handle
    if stage.knows(handle):
        return None
    return begun.get(handle) or action.group or handle


def _far_received_end(state: DialogState, stage: Stage, receiver: Endpoint, now: int) -> None:
    """Our application received the far side's EndDialog or Error: the far side, if it ended
    first, is closed by that (a local dialog's two ends always have the same owner)."""
    if receiver.far_instance is not None:
        return  # another instance learns it from our own EndDialog (`ksb.dialog.end`)
    peer = stage.maybe_endpoint(receiver.far_handle)
    if peer is not None:
        peer.state = ep_rules.after_peer_received_end(peer)
        peer.updated_ms = now


def fence(state: DialogState, stage: Stage, req: FenceRequest) -> None:
    """The queue service let a group's lock go without a commit: a commit under an older token
    is stale from now on, the rolled-back lease's own included (else a client could roll back,
    let the next holder take the group, and still commit under its old lease). The outcome
    record answers the queue service, which waits for it before it frees the lock, and keeps
    the fence through compaction and restarts; a group with nothing open here has nothing left
    to fence, and its outcome goes at once."""
    partitions = state.catalog.queue(req.queue).partitions
    at, key = partition_for(req.group, partitions), outcome_key(req.group)
    open_ = state.group_open(req.queue, req.group)
    if open_:
        stage.apply_fence(req.queue, req.group, req.below)
    record = CommitOutcome(
        request_id=req.request_id,
        group=req.group,
        token=0,
        applied=True,
        reason="fenced",
        fence=stage.fence(req.queue, req.group),
    )
    stage.out.queue.append(QueueWrite(req.queue, at, key, record))
    if not open_:
        stage.out.queue.append(QueueWrite(req.queue, at, key, None))


def refused_outcome(
    state: DialogState, req: CommitRequest, exc: KsbError, principal: str | None, out: Outputs
) -> None:
    """A refused commit still gets its outcome record, so its reader learns and lets go. Its
    token is the one its lease grants, or 0 when the lease grants nothing: the queue service
    frees a lock on an outcome under the lock's own token, and a refused commit must not free
    a lock it never held by naming that lock's token (tokens are not secrets)."""
    r = req.receipt
    if r is None:
        return
    try:
        token, _claims = leased(state.leases, state.instance, principal, r)
    except KsbError:
        token = 0
    reason = f"{exc.code}: {exc.reason}"
    fence = state.fence(r.queue, r.group)
    out.queue.append(
        _outcome(state, req, replace(r, token=token), fence, applied=False, reason=reason)
    )


def outcome_key(group: str) -> str:
    """The queue-topic key of a group's commit outcomes: compaction keeps the newest."""
    return f"commit/{group}"


def _outcome(
    state: DialogState, req: CommitRequest, r: Receipt, fence: int, *, applied: bool, reason: str
) -> QueueWrite:
    queue = state.catalog.queues.get(r.queue)
    partitions = queue.partitions if queue else 1
    record = CommitOutcome(
        request_id=req.request_id,
        group=r.group,
        token=r.token,
        applied=applied,
        reason=reason,
        fence=fence,
    )
    return QueueWrite(r.queue, partition_for(r.group, partitions), outcome_key(r.group), record)
