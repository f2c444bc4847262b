"""Operator views over conversation endpoints: rows to show and conversations that leak.

Service Broker's classic leak is a conversation ended on one side only: the application that got the
EndDialog never ends its own side, or one side was cleaned up while the other still talks. Those
endpoints live forever (here: in the compacted endpoints topic and the dispatcher's memory). The
rules are pure functions of the endpoints' latest states and a clock so that they are unit-tested
without Kafka; `ksb endpoints --leaked` only feeds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from ksb.wire.endpoint import Endpoint, State

__all__ = [
    "ONE_SIDED_GRACE_MS",
    "LeakRow",
    "endpoint_row",
    "leaked",
]

ONE_SIDED_GRACE_MS: Final = 5_000
"""How long an end may stay one-sided before it counts as a leak.

A target normally receives the EndDialog and ends its side within one transaction; a few seconds
cover a reader that is busy, without hiding an application that never calls END CONVERSATION.
"""

_OPEN: Final = frozenset({State.STARTED_OUTBOUND, State.STARTED_INBOUND, State.CONVERSING})
_ENDED: Final = frozenset({State.CLOSED, State.DISCONNECTED_OUTBOUND})
_WAITING_FOR_END: Final = frozenset({State.DISCONNECTED_INBOUND, State.ERROR})


@dataclass(frozen=True)
class LeakRow:
    """One endpoint that will not go away by itself, with the reason an operator can act on."""

    endpoint: Endpoint
    far: Endpoint | None
    reason: str
    since_ms: int
    """When the endpoint got into the leaking situation (the start of the age shown)."""


def leaked(
    endpoints: Mapping[str, Endpoint],
    now_ms: int,
    idle_ms: int,
    *,
    grace_ms: int = ONE_SIDED_GRACE_MS,
) -> list[LeakRow]:
    """Endpoints that need an END CONVERSATION nobody is going to send, oldest first.

    `endpoints` maps handle to the latest state of every endpoint (CLOSED ones included: they are
    how the far side's end is known). The endpoint reported is always the one still alive, since
    that is the one whose application must act. Rules, first match wins:

    * the far side ended (CLOSED or DISCONNECTED_OUTBOUND) and this side, told so
      (DISCONNECTED_INBOUND or ERROR), has not ended for longer than `grace_ms`;
    * the far side is CLOSED or DISCONNECTED_OUTBOUND while this side is still open, which only an
      END ... WITH CLEANUP (or a lost peer) leaves behind, so no grace applies;
    * nothing happened on the endpoint for longer than `idle_ms`.
    """
    rows: list[LeakRow] = []
    for ep in endpoints.values():
        if ep.state is State.CLOSED:
            continue
        far = endpoints.get(ep.far_handle) if ep.far_handle is not None else None
        row = _one_sided(ep, far, now_ms, grace_ms) or _idle(ep, far, now_ms, idle_ms)
        if row is not None:
            rows.append(row)
    rows.sort(key=lambda r: (r.since_ms, r.endpoint.handle))
    return rows


def _one_sided(ep: Endpoint, far: Endpoint | None, now_ms: int, grace_ms: int) -> LeakRow | None:
    if far is None or far.state not in _ENDED:
        return None
    since = max(ep.updated_ms, far.updated_ms)
    if ep.state in _WAITING_FOR_END:
        if now_ms - since <= grace_ms:
            return None
        return LeakRow(
            ep,
            far,
            f"far side is {far.state.name}; this side is {ep.state.name} and never ended "
            f"(END CONVERSATION missing for {_seconds(now_ms - since)})",
            since,
        )
    if ep.state in _OPEN:
        return LeakRow(
            ep,
            far,
            f"far side is {far.state.name} but this side is still {ep.state.name} "
            "(ended WITH CLEANUP on one side?)",
            since,
        )
    return None


def _idle(ep: Endpoint, far: Endpoint | None, now_ms: int, idle_ms: int) -> LeakRow | None:
    if now_ms - ep.updated_ms <= idle_ms:
        return None
    return LeakRow(
        ep,
        far,
        f"{ep.state.name} and idle for {_seconds(now_ms - ep.updated_ms)}",
        ep.updated_ms,
    )


def _seconds(ms: int) -> str:
    return f"{max(ms, 0) / 1000:.0f}s"


def endpoint_row(ep: Endpoint, now_ms: int) -> dict[str, str | int | None]:
    """One endpoint as an operator reads it, the same fields for the table and for --json.

    `lifetime_s` is what is left of the dialog lifetime (None without one); `age_s` counts from
    BEGIN.
    """
    lifetime_s = (
        None
        if ep.lifetime_deadline_ms is None
        else max(0, (ep.lifetime_deadline_ms - now_ms) // 1000)
    )
    return {
        "handle": ep.handle,
        "conversation_id": ep.conversation_id,
        "role": "initiator" if ep.is_initiator else "target",
        "state": ep.state.name,
        "local_service": ep.local_service,
        "remote_service": ep.remote_service,
        "contract": ep.contract,
        "group": ep.group,
        "priority": ep.priority,
        "outstanding": ep.outstanding,
        "lifetime_s": lifetime_s,
        "age_s": max(0, (now_ms - ep.created_ms) // 1000),
        "idle_s": max(0, (now_ms - ep.updated_ms) // 1000),
    }
