"""The dispatcher engine's rules, without Kafka: states, sequencing, atomicity, timers, receipts."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ksb.catalog.model import DIALOG_TIMER, END_DIALOG, ERROR, CatalogView, parse_catalog
from ksb.clock import ManualClock
from ksb.dialog.engine import Engine
from ksb.dialog.outputs import Outputs
from ksb.wire.endpoint import State
from ksb.wire.partitioning import target_handle
from ksb.wire.protocol import (
    BeginRequest,
    CommitOutcome,
    CommitRequest,
    EndRequest,
    QueueMessage,
    Receipt,
    SendRequest,
    TimerRequest,
)

CATALOG: dict[str, Any] = {
    "message_types": [
        {"name": "Req", "validation": "WELL_FORMED_JSON"},
        {"name": "Rep"},
    ],
    "contracts": [
        {
            "name": "C",
            "messages": [
                {"type": "Req", "sent_by": "INITIATOR"},
                {"type": "Rep", "sent_by": "TARGET"},
            ],
        }
    ],
    "queues": [{"name": "IQ"}, {"name": "TQ", "partitions": 3}, {"name": "KQ", "retention": "ON"}],
    "services": [
        {"name": "Init", "queue": "IQ"},
        {"name": "Tgt", "queue": "TQ", "contracts": ["C"]},
        {"name": "Keeper", "queue": "KQ", "contracts": ["C"]},
    ],
    "priorities": [
        {"name": "hi", "contract": "C", "local_service": "Tgt", "level": 9},
    ],
}


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def engine() -> Engine:
    return Engine(CatalogView(parse_catalog(CATALOG)), instance="u", max_body_bytes=100)


def begin(engine: Engine, now: int, handle: str = "h1", **kw: Any) -> Outputs:
    return engine.handle(
        BeginRequest(handle=handle, from_service="Init", to_service="Tgt", contract="C", **kw),
        now,
    )


def send(engine: Engine, now: int, *handles: str, mtype: str = "Req", body: str = "{}") -> Outputs:
    return engine.handle(SendRequest(handles=handles, message_type=mtype, body=body), now)


def messages(out: Outputs) -> list[QueueMessage]:
    return [w.value for w in out.queue if isinstance(w.value, QueueMessage)]


def receive(engine: Engine, now: int, msgs: list[QueueMessage], token: int = 1) -> Outputs:
    g = msgs[0].conversation_group_id
    return engine.handle(
        CommitRequest(
            receipt=Receipt(
                queue=msgs[0].queue,
                group=g,
                token=token,
                message_ids=tuple(m.message_id for m in msgs),
            ),
        ),
        now,
    )


def test_begin_then_send_creates_target_with_its_own_priority(
    engine: Engine, clock: ManualClock
) -> None:
    assert not begin(engine, clock.now_ms()).errors
    assert engine.endpoints["h1"].state is State.STARTED_OUTBOUND
    assert engine.endpoints["h1"].priority == 5  # the rule covers the target side only
    out = send(engine, clock.now_ms(), "h1")
    [m] = messages(out)
    t = engine.endpoints[target_handle("h1")]
    assert t.state is State.STARTED_INBOUND and t.priority == 9 and m.priority == 9
    assert m.queue == "TQ" and m.conversation_handle == t.handle and m.message_sequence_number == 0
    assert engine.endpoints["h1"].state.name == "CONVERSING"  # mypy narrowed it to SO above
    assert [m.message_sequence_number for m in messages(send(engine, 0, "h1"))] == [1]


def test_first_receive_makes_target_conversing_and_twice_is_refused(engine: Engine) -> None:
    begin(engine, 0)
    msgs = messages(send(engine, 0, "h1"))
    out = receive(engine, 1, msgs)
    assert not out.errors
    assert engine.endpoints[target_handle("h1")].state is State.CONVERSING
    again = receive(engine, 2, msgs, token=2)
    assert [e.code for e in again.errors] == ["already_received"]
    assert [w.value.applied for w in again.queue if isinstance(w.value, CommitOutcome)] == [False]


def test_stale_token_is_refused(engine: Engine) -> None:
    begin(engine, 0)
    first = messages(send(engine, 0, "h1"))
    second = messages(send(engine, 0, "h1"))
    assert not receive(engine, 1, first, token=7).errors
    out = receive(engine, 2, second, token=6)
    assert [e.code for e in out.errors] == ["stale_token"]
    assert second[0].message_id in engine.waiting


def test_multi_handle_send_is_atomic(engine: Engine) -> None:
    begin(engine, 0, "a")
    begin(engine, 0, "b")
    out = send(engine, 0, "a", "nope")
    assert [e.code for e in out.errors] == ["unknown_conversation"]
    assert not messages(out) and not out.endpoints
    assert target_handle("a") not in engine.endpoints
    ok = send(engine, 0, "a", "b")
    assert len(messages(ok)) == 2


def test_commit_with_a_bad_action_leaves_the_receipt_unapplied(engine: Engine) -> None:
    begin(engine, 0)
    msgs = messages(send(engine, 0, "h1"))
    t = target_handle("h1")
    bad = CommitRequest(
        receipt=Receipt(
            queue="TQ",
            group=msgs[0].conversation_group_id,
            token=1,
            message_ids=(msgs[0].message_id,),
        ),
        actions=(SendRequest(handles=(t,), message_type="Req", body="{}"),),
    )
    out = engine.handle(bad, 1)
    assert [e.code for e in out.errors] == ["message_type_not_allowed"]
    assert msgs[0].message_id in engine.waiting  # not received: it will be delivered again


@pytest.mark.parametrize(
    ("mtype", "body", "code"),
    [
        ("Nope", "{}", "unknown_message_type"),
        ("Rep", "x", "message_type_not_allowed"),
        ("Req", "x" * 101, "body_too_large"),
    ],
)
def test_send_refusals(engine: Engine, mtype: str, body: str, code: str) -> None:
    begin(engine, 0)
    out = send(engine, 0, "h1", mtype=mtype, body=body)
    assert [e.code for e in out.errors] == [code]
    assert not messages(out)


def test_a_message_past_its_queue_topics_limit_is_refused_before_its_transaction(
    engine: Engine,
) -> None:
    """Kafka would refuse the record and fail the whole transaction (`topic_limits`): the SEND
    is refused instead, nothing staged, and the dialog goes on."""
    begin(engine, 0)
    engine.queue_limits = {"TQ": 40}
    out = send(engine, 0, "h1", body=json.dumps({"x": "y" * 40}))
    assert [(e.code, "queue 'TQ'" in e.reason) for e in out.errors] == [("request_too_large", True)]
    assert not messages(out)
    assert len(messages(send(engine, 0, "h1", body=json.dumps({"x": "y" * 30})))) == 1
    engine.queue_limits = {"IQ": 0}  # other queues' limits do not matter
    assert len(messages(send(engine, 0, "h1", body="{}"))) == 1


def test_validation_failure_errors_the_dialog(engine: Engine) -> None:
    begin(engine, 0)
    out = send(engine, 0, "h1", body="not json")
    [m] = messages(out)
    assert m.queue == "IQ" and m.message_type_name == ERROR
    assert "not well-formed JSON" in json.loads(m.message_body)["description"]
    assert engine.endpoints["h1"].state is State.ERROR
    assert target_handle("h1") not in engine.endpoints
    assert [e.code for e in send(engine, 0, "h1").errors] == ["conversation_closed"]


def test_end_dialog_states_through_to_closed(engine: Engine) -> None:
    begin(engine, 0)
    receive(engine, 0, messages(send(engine, 0, "h1")))
    t = target_handle("h1")
    out = engine.handle(EndRequest(handle=t), 1)
    [end] = messages(out)
    assert end.message_type_name == END_DIALOG and end.queue == "IQ"
    assert engine.endpoints[t].state is State.DISCONNECTED_OUTBOUND
    assert engine.endpoints["h1"].state is State.DISCONNECTED_INBOUND
    receive(engine, 2, [end])  # the initiator received the EndDialog: the target is acknowledged
    assert t not in engine.endpoints  # CLOSED endpoints leave memory
    out = engine.handle(EndRequest(handle="h1"), 3)
    assert [ep.state for ep in out.endpoints] == [State.CLOSED]
    assert "h1" not in engine.endpoints


def test_end_with_error_sends_error_to_peer(engine: Engine) -> None:
    begin(engine, 0)
    send(engine, 0, "h1")
    out = engine.handle(EndRequest(handle="h1", error_code=42, error_description="boom"), 1)
    [err] = messages(out)
    assert err.message_type_name == ERROR and json.loads(err.message_body) == {
        "code": 42,
        "description": "boom",
    }
    assert engine.endpoints[target_handle("h1")].state is State.ERROR


def test_end_with_cleanup_removes_queued_messages_silently(engine: Engine) -> None:
    begin(engine, 0)
    msgs = messages(send(engine, 0, "h1"))
    out = engine.handle(EndRequest(handle=target_handle("h1"), cleanup=True), 1)
    assert [(w.key, w.value) for w in out.queue] == [(msgs[0].message_id, None)]
    assert msgs[0].message_id not in engine.waiting
    assert engine.endpoints["h1"].state is State.CONVERSING  # the far side is not told


def test_conversation_timer_fires_dialog_timer(engine: Engine, clock: ManualClock) -> None:
    begin(engine, clock.now_ms())
    engine.handle(TimerRequest(handle="h1", timeout_s=10), clock.now_ms())
    clock.advance(9.999)
    assert not engine.tick(clock.now_ms()).queue
    clock.advance(0.001)
    [m] = messages(engine.tick(clock.now_ms()))
    assert m.message_type_name == DIALOG_TIMER and m.queue == "IQ" and m.conversation_handle == "h1"
    assert not engine.tick(clock.now_ms() + 60_000).queue  # fires once


def test_lifetime_expiry_errors_both_sides_and_refuses_sends(
    engine: Engine, clock: ManualClock
) -> None:
    begin(engine, clock.now_ms(), lifetime_s=60)
    send(engine, clock.now_ms(), "h1")
    clock.advance(60)
    out = engine.tick(clock.now_ms())
    assert sorted(m.queue for m in messages(out)) == ["IQ", "TQ"]
    assert all(m.message_type_name == ERROR for m in messages(out))
    assert engine.endpoints["h1"].state is State.ERROR
    assert engine.endpoints[target_handle("h1")].state is State.ERROR
    assert [e.code for e in send(engine, clock.now_ms(), "h1").errors] == ["conversation_closed"]


def test_related_conversation_shares_the_group(engine: Engine) -> None:
    begin(engine, 0, "a")
    begin(engine, 0, "b", related_conversation="a")
    assert engine.endpoints["a"].group == engine.endpoints["b"].group
    begin(engine, 0, "c")
    assert engine.endpoints["c"].group != engine.endpoints["a"].group


def test_retried_begin_is_idempotent(engine: Engine) -> None:
    begin(engine, 0)
    out = begin(engine, 1)
    assert not out.errors and not out.endpoints


def test_begin_refusals(engine: Engine) -> None:
    bad = [
        BeginRequest(handle="x", from_service="Nobody", to_service="Tgt", contract="C"),
        BeginRequest(handle="x", from_service="Init", to_service="Tgt", contract="Nope"),
        BeginRequest(handle="x", from_service="Init", to_service="tgt", contract="C"),
        BeginRequest(handle="x", from_service="Init", to_service="Init", contract="C"),
    ]
    codes = [engine.handle(r, 0).errors[0].code for r in bad]
    assert codes == [
        "unknown_service",
        "unknown_contract",
        "unknown_service",
        "contract_not_accepted",
    ]
    assert "x" not in engine.endpoints


def test_rebuild_from_records_restores_inflight(engine: Engine) -> None:
    begin(engine, 0)
    msgs = messages(send(engine, 0, "h1"))
    fresh = Engine(engine.catalog, instance="u", max_body_bytes=100)
    for ep in list(engine.endpoints.values()):
        fresh.load_endpoint(ep.copy())
    for m in msgs:
        fresh.load_queue_record(m.message_id, m, 0)
    assert not receive(fresh, 1, msgs).errors


def test_retention_keeps_received_messages_until_the_conversation_ends(engine: Engine) -> None:
    engine.handle(
        BeginRequest(handle="k", from_service="Init", to_service="Keeper", contract="C"),
        0,
    )
    msgs = messages(send(engine, 0, "k"))
    out = receive(engine, 1, msgs)
    [kept] = [w.value for w in out.queue if isinstance(w.value, QueueMessage)]
    assert kept.message_id == msgs[0].message_id and kept.status == 0
    assert [e.code for e in receive(engine, 2, msgs, token=2).errors] == ["already_received"]
    t = target_handle("k")
    engine.handle(EndRequest(handle="k"), 3)
    out = engine.handle(EndRequest(handle=t), 4)
    assert (msgs[0].message_id, None) in [(w.key, w.value) for w in out.queue]


def _recount(engine: Engine) -> dict[str, int]:
    counts: dict[str, int] = {}
    for info in engine.waiting.values():
        counts[info.queue] = counts.get(info.queue, 0) + 1
    return {q: n for q, n in counts.items() if n}


def _depth(engine: Engine) -> dict[str, int]:
    return {q: n for q, n in engine.depth.items() if n}


def test_depth_follows_inflight_through_send_receive_cleanup_and_rebuild(engine: Engine) -> None:
    begin(engine, 0)
    begin(engine, 0, handle="h2")
    first = messages(send(engine, 0, "h1"))
    messages(send(engine, 0, "h1", "h2"))
    assert _depth(engine) == _recount(engine) == {"TQ": 3}
    receive(engine, 1, first)
    assert _depth(engine) == _recount(engine) == {"TQ": 2}
    receive(engine, 2, first, token=2)  # refused: nothing changes
    assert _depth(engine) == {"TQ": 2}
    engine.handle(EndRequest(handle=target_handle("h2"), cleanup=True), 3)
    assert _depth(engine) == _recount(engine) == {"TQ": 1}
    fresh = Engine(engine.catalog, instance="u", max_body_bytes=100)
    msgs = messages(send(engine, 4, "h1"))
    for m in msgs:
        fresh.load_queue_record(m.message_id, m, 0)
        fresh.load_queue_record(m.message_id, m, 0)  # a record read twice counts once
    assert _depth(fresh) == {"TQ": 1}
    fresh.load_queue_record(msgs[0].message_id, None, 0)
    assert _depth(fresh) == {}


def test_receipt_reports_priority_and_enqueue_time_of_received_messages(engine: Engine) -> None:
    begin(engine, 0)
    msgs = messages(send(engine, 1000, "h1"))
    out = receive(engine, 1500, msgs)
    assert [(i.queue, i.priority, i.enqueued_ms) for i in out.received] == [("TQ", 9, 1000)]
    assert not out.purged
    assert receive(engine, 1600, msgs, token=2).received == []  # a refused commit received nothing


def test_cleanup_reports_unreceived_messages_as_purged(engine: Engine) -> None:
    begin(engine, 0)
    msgs = messages(send(engine, 0, "h1"))
    messages(send(engine, 0, "h1"))
    receive(engine, 1, msgs)
    out = engine.handle(EndRequest(handle=target_handle("h1"), cleanup=True), 2)
    assert [(i.queue, i.priority) for i in out.purged] == [("TQ", 9)]


def test_retained_received_messages_are_not_purged_when_the_conversation_ends(
    engine: Engine,
) -> None:
    engine.handle(
        BeginRequest(handle="k", from_service="Init", to_service="Keeper", contract="C"),
        0,
    )
    msgs = messages(send(engine, 0, "k"))
    receive(engine, 1, msgs)
    assert _depth(engine) == {}
    engine.handle(EndRequest(handle="k"), 3)
    out = engine.handle(EndRequest(handle=target_handle("k"), cleanup=True), 4)
    # The received (retained) message leaves too, but only the unreceived EndDialog is a purge.
    assert (msgs[0].message_id, None) in [(w.key, w.value) for w in out.queue]
    assert [i.message_type for i in out.purged] == [END_DIALOG]
    assert _depth(engine) == _recount(engine) == {}
