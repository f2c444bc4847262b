"""Leak classification and endpoint rows, from endpoint states alone."""

from __future__ import annotations

from ksb.dialog.views import ONE_SIDED_GRACE_MS, endpoint_row, leaked
from ksb.wire.endpoint import Endpoint, State
from tests.unit.endpoints import make_endpoint

NOW = 1_700_000_000_000
IDLE_MS = 3_600_000


def _pair(
    initiator: State, target: State, *, updated_ms: int = NOW, conv: str = "c1"
) -> dict[str, Endpoint]:
    i = make_endpoint(
        handle=f"{conv}-i",
        conversation_id=conv,
        state=initiator,
        local_service="I",
        remote_service="T",
        group=f"{conv}-gi",
        far_handle=f"{conv}-t",
        created_ms=updated_ms,
        updated_ms=updated_ms,
    )
    t = make_endpoint(
        handle=f"{conv}-t",
        conversation_id=conv,
        is_initiator=False,
        state=target,
        local_service="T",
        remote_service="I",
        queue="TQ",
        group=f"{conv}-gt",
        far_handle=f"{conv}-i",
        created_ms=updated_ms,
        updated_ms=updated_ms,
    )
    return {i.handle: i, t.handle: t}


def _handles(eps: dict[str, Endpoint], now_ms: int = NOW) -> list[str]:
    return [row.endpoint.handle for row in leaked(eps, now_ms, IDLE_MS)]


def test_healthy_conversations_are_not_leaks() -> None:
    eps = _pair(State.CONVERSING, State.CONVERSING)
    eps |= _pair(State.CLOSED, State.CLOSED, conv="c2")
    eps |= _pair(State.STARTED_OUTBOUND, State.STARTED_INBOUND, conv="c3")
    assert _handles(eps, NOW + 60_000) == []


def test_target_that_never_ends_after_end_dialog_leaks_once_grace_is_over() -> None:
    eps = _pair(State.CLOSED, State.DISCONNECTED_INBOUND)
    assert _handles(eps, NOW + ONE_SIDED_GRACE_MS) == []
    [row] = leaked(eps, NOW + ONE_SIDED_GRACE_MS + 1, IDLE_MS)
    assert row.endpoint.handle == "c1-t"
    assert row.far is not None and row.far.state is State.CLOSED
    assert "never ended" in row.reason and "CLOSED" in row.reason
    assert row.since_ms == NOW


def test_end_dialog_not_yet_received_is_a_leak_only_after_grace() -> None:
    eps = _pair(State.DISCONNECTED_OUTBOUND, State.DISCONNECTED_INBOUND)
    assert _handles(eps, NOW + 1_000) == []
    assert _handles(eps, NOW + ONE_SIDED_GRACE_MS + 1) == ["c1-t"]


def test_error_side_that_never_ends_leaks() -> None:
    eps = _pair(State.ERROR, State.CLOSED)
    assert _handles(eps, NOW + ONE_SIDED_GRACE_MS + 1) == ["c1-i"]


def test_open_side_of_a_cleaned_up_conversation_leaks_at_once() -> None:
    eps = _pair(State.CONVERSING, State.CLOSED)
    [row] = leaked(eps, NOW, IDLE_MS)
    assert row.endpoint.handle == "c1-i"
    assert "still CONVERSING" in row.reason


def test_idle_endpoint_leaks_past_threshold() -> None:
    eps = _pair(State.CONVERSING, State.CONVERSING)
    assert _handles(eps, NOW + IDLE_MS) == []
    rows = leaked(eps, NOW + IDLE_MS + 1, IDLE_MS)
    assert sorted(r.endpoint.handle for r in rows) == ["c1-i", "c1-t"]
    assert all("idle" in r.reason for r in rows)


def test_initiator_without_target_is_judged_by_idleness_only() -> None:
    eps = _pair(State.STARTED_OUTBOUND, State.CLOSED)
    del eps["c1-t"]
    assert _handles(eps, NOW + 10_000) == []
    assert _handles(eps, NOW + IDLE_MS + 1) == ["c1-i"]


def test_rows_are_oldest_first() -> None:
    eps = _pair(State.CONVERSING, State.CLOSED, updated_ms=NOW)
    eps |= _pair(State.CONVERSING, State.CLOSED, updated_ms=NOW - 10_000, conv="c0")
    assert _handles(eps) == ["c0-i", "c1-i"]


def test_endpoint_row_names_state_and_counts_seconds() -> None:
    ep = _pair(State.DISCONNECTED_INBOUND, State.CLOSED)["c1-i"]
    ep.lifetime_deadline_ms = NOW + 90_500
    row = endpoint_row(ep, NOW + 30_000)
    assert row["state"] == "DISCONNECTED_INBOUND"
    assert row["role"] == "initiator"
    assert row["lifetime_s"] == 60
    assert row["age_s"] == 30
    no_lifetime = endpoint_row(_pair(State.CONVERSING, State.CONVERSING)["c1-t"], NOW)
    assert no_lifetime["lifetime_s"] is None and no_lifetime["role"] == "target"
