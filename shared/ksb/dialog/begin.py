"""BEGIN DIALOG CONVERSATION: the initiator endpoint now, the target with its first message.

The client chooses the initiator's handle, which makes BEGIN retry-safe (the same handle and target
again is recognised and ignored) and is also the conversation id. The target's handle is derived
from the conversation id (`ksb.wire.partitioning.target_handle`), so either side can be found
without a round trip. Each endpoint's priority level comes from its own broker's priority table
when it is created and never changes.
"""

from __future__ import annotations

from ksb.dialog.shards import colocated_group
from ksb.dialog.stage import Stage
from ksb.dialog.state import DialogState
from ksb.errors import CatalogError, ConversationError
from ksb.wire.endpoint import Endpoint, State
from ksb.wire.partitioning import target_handle
from ksb.wire.protocol import BeginRequest

__all__ = ["begin", "ensure_target"]


def begin(state: DialogState, stage: Stage, req: BeginRequest, now: int) -> None:
    if req.handle in state.endpoints or req.handle in stage.endpoints:
        existing = stage.endpoints.get(req.handle) or state.endpoints[req.handle]
        if existing.is_initiator and existing.remote_service == req.to_service:
            return  # a retried BEGIN: the dialog already exists
        raise ConversationError(f"handle {req.handle!r} is already in use", code="duplicate_handle")
    cat = state.catalog
    cat.service(req.from_service)  # an unknown sender is refused before anything else
    contract = cat.contract(req.contract)
    target = cat.services.get(req.to_service)
    if target is None:
        _begin_remote(state, stage, req, now)
        return
    if contract.name not in target.contracts:
        raise CatalogError(
            f"service {target.name!r} does not accept contract {contract.name!r}",
            code="contract_not_accepted",
        )
    _put_initiator(state, stage, req, now, remote_service=target.name, far_instance=None)
    initiator = stage.endpoints[req.handle]
    if state.ownership.shards > 1:
        shard = state.ownership.shard(initiator.group)
        far_group = colocated_group(req.handle, shard, state.ownership.shards)
        initiator.far_group = None if far_group == initiator.far_handle else far_group


def _begin_remote(state: DialogState, stage: Stage, req: BeginRequest, now: int) -> None:
    """A target on another instance: the route names it; the far endpoint is not ours to make.

    The target's acceptance of the contract is checked by the target's dispatcher when the
    first message arrives (it answers with an Error message if it refuses).
    """
    route = state.catalog.routes.get(req.to_service)
    if route is None:
        raise CatalogError(
            f"unknown target service {req.to_service!r} (no local service, no route)",
            code="unknown_service",
        )
    if req.to_broker_instance is not None and req.to_broker_instance != route.broker_instance:
        raise CatalogError(
            f"no route to service {req.to_service!r} on broker instance "
            f"{req.to_broker_instance!r} (the route names {route.broker_instance!r})",
            code="unknown_service",
        )
    if route.broker_instance == state.instance:
        raise CatalogError(
            f"route {route.name!r} points service {req.to_service!r} at this instance, "
            "which does not host it",
            code="unknown_service",
        )
    _put_initiator(
        state, stage, req, now, remote_service=req.to_service, far_instance=route.broker_instance
    )


def _put_initiator(
    state: DialogState,
    stage: Stage,
    req: BeginRequest,
    now: int,
    *,
    remote_service: str,
    far_instance: str | None,
) -> None:
    """The initiator endpoint, in the related conversation's group (or the named one, or a new
    group whose id is the handle), with the level its own catalog assigns; the conversation id is
    the initiator's handle."""
    cat = state.catalog
    local = cat.service(req.from_service)
    contract = cat.contract(req.contract)
    group = req.conversation_group_id or req.handle
    if req.related_conversation is not None:
        group = stage.endpoint(req.related_conversation).group
    stage.put(
        Endpoint(
            handle=req.handle,
            conversation_id=req.handle,
            is_initiator=True,
            state=State.STARTED_OUTBOUND,
            local_service=local.name,
            remote_service=remote_service,
            contract=contract.name,
            queue=local.queue,
            group=group,
            priority=cat.priorities.level(contract.name, local.name, remote_service),
            far_handle=target_handle(req.handle),
            created_ms=now,
            updated_ms=now,
            lifetime_deadline_ms=now + req.lifetime_s * 1000 if req.lifetime_s else None,
            far_instance=far_instance,
        )
    )


def ensure_target(state: DialogState, stage: Stage, initiator: Endpoint, now: int) -> Endpoint:
    """The target endpoint comes into being with the first message sent to it, in a new group
    (as Service Broker gives a new target a new group): its handle, or with several shards the
    initiator's choice of an id in its own shard (`ksb.dialog.shards.colocated_group`)."""
    assert initiator.far_handle is not None
    existing = stage.endpoints.get(initiator.far_handle) or state.endpoints.get(
        initiator.far_handle
    )
    if existing is not None:
        return stage.endpoint(existing.handle)
    service = state.catalog.service(initiator.remote_service)
    level = state.catalog.priorities.level(
        initiator.contract, service.name, initiator.local_service
    )
    ep = Endpoint(
        handle=initiator.far_handle,
        conversation_id=initiator.conversation_id,
        is_initiator=False,
        state=State.STARTED_INBOUND,
        local_service=service.name,
        remote_service=initiator.local_service,
        contract=initiator.contract,
        queue=service.queue,
        group=initiator.far_group or initiator.far_handle,
        priority=level,
        far_handle=initiator.handle,
        far_group=initiator.group if initiator.group != initiator.handle else None,
        created_ms=now,
        updated_ms=now,
        lifetime_deadline_ms=initiator.lifetime_deadline_ms,
    )
    stage.put(ep)
    return ep
