"""Regression tests for what the reference model (tests/model) found the engine doing differently.

Each test drives the engine through its public API only (requests in, `Outputs` and endpoint
states out) and names the rule it holds the engine to.
"""

from __future__ import annotations

from typing import Any

import pytest

from ksb.catalog.model import CatalogView, parse_catalog
from ksb.dialog.engine import Engine
from ksb.dialog.outputs import Outputs
from ksb.wire.protocol import (
    Action,
    BeginRequest,
    CommitRequest,
    EndRequest,
    QueueMessage,
    Receipt,
    SendRequest,
    TimerRequest,
)

CATALOG: dict[str, Any] = {
    "contracts": [{"name": "C", "messages": [{"type": "DEFAULT", "sent_by": "ANY"}]}],
    "queues": [{"name": "IQ"}, {"name": "TQ"}],
    "services": [
        {"name": "Init", "queue": "IQ"},
        {"name": "Tgt", "queue": "TQ", "contracts": ["C"]},
    ],
}


@pytest.fixture
def engine() -> Engine:
    return Engine(CatalogView(parse_catalog(CATALOG)), instance="u", max_body_bytes=100)


def _begin(engine: Engine, handle: str) -> None:
    out = engine.handle(
        BeginRequest(handle=handle, from_service="Init", to_service="Tgt", contract="C"),
        0,
    )
    assert not out.errors


def _commit(engine: Engine, *actions: Action) -> Outputs:
    return engine.handle(CommitRequest(actions=actions), 1)


def _messages(out: Outputs) -> list[QueueMessage]:
    return [w.value for w in out.queue if isinstance(w.value, QueueMessage)]


@pytest.mark.parametrize(
    "then",
    [
        SendRequest(handles=("h",), body="x"),
        EndRequest(handle="h", cleanup=True),
        EndRequest(handle="h"),
    ],
    ids=["send", "end-with-cleanup", "end"],
)
def test_an_action_on_an_endpoint_an_earlier_action_of_the_same_commit_closed_is_refused(
    engine: Engine, then: Action
) -> None:
    """An initiator that never sent closes at its END; within the same commit it is then as
    unknown as any CLOSED endpoint, and the whole commit is refused."""
    _begin(engine, "h")
    out = _commit(engine, EndRequest(handle="h"), then)
    assert [e.code for e in out.errors] == ["unknown_conversation"]
    assert engine.endpoints["h"].state.name == "STARTED_OUTBOUND"  # nothing of it happened
    assert not out.endpoints and not _messages(out)


def _conversing(engine: Engine, handle: str = "h") -> tuple[str, QueueMessage]:
    """A dialog whose target has received the first message and replied; returns the target's
    handle and the reply waiting in the initiator's queue."""
    _begin(engine, handle)
    [first] = _messages(engine.handle(SendRequest(handles=(handle,), body="q"), 0))
    target = first.conversation_handle
    out = engine.handle(
        CommitRequest(
            receipt=Receipt(
                queue="TQ", group=first.conversation_group_id, message_ids=(first.message_id,)
            ),
            actions=(SendRequest(handles=(target,), body="r"),),
        ),
        1,
    )
    [reply] = _messages(out)
    return target, reply


def test_ending_a_conversation_removes_its_unreceived_messages_from_this_sides_queue(
    engine: Engine,
) -> None:
    """Service Broker: when a conversation ends, its messages leave the service queue. The
    initiator ends without receiving the reply: the reply is gone, not left for a reader."""
    _target, reply = _conversing(engine)
    out = engine.handle(EndRequest(handle="h"), 2)
    assert (reply.message_id, None) in [(w.key, w.value) for w in out.queue]
    late = engine.handle(
        CommitRequest(
            receipt=Receipt(
                queue="IQ", group=reply.conversation_group_id, message_ids=(reply.message_id,)
            ),
        ),
        3,
    )
    assert [e.code for e in late.errors] == ["already_received"]


def test_no_dialog_timer_fires_for_a_side_that_has_ended(engine: Engine) -> None:
    _conversing(engine)
    engine.handle(TimerRequest(handle="h", timeout_s=1), 2)
    assert not engine.handle(EndRequest(handle="h"), 3).errors
    assert engine.endpoints["h"].state.name == "DISCONNECTED_OUTBOUND"
    assert not _messages(engine.tick(10_000))


def test_ending_a_conversation_twice_is_refused_and_tells_the_far_side_once(engine: Engine) -> None:
    target, _reply = _conversing(engine)
    first = engine.handle(EndRequest(handle="h"), 2)
    assert [m.message_type_name.rsplit("/", 1)[-1] for m in _messages(first)] == ["EndDialog"]
    again = engine.handle(EndRequest(handle="h"), 3)
    assert [e.code for e in again.errors] == ["conversation_closed"]
    assert "DISCONNECTED_OUTBOUND" in again.errors[0].reason
    assert not _messages(again) and engine.endpoints[target].state.name == "DISCONNECTED_INBOUND"


@pytest.mark.parametrize("error", [None, 42], ids=["end", "end-with-error"])
def test_when_the_second_side_ends_without_receiving_the_end_both_sides_close(
    engine: Engine, error: int | None
) -> None:
    """Both sides have called END, so the conversation is complete: the side that ended first
    must not wait forever for a receipt of its EndDialog that the second side dropped."""
    target, _reply = _conversing(engine)
    engine.handle(EndRequest(handle="h", error_code=error), 2)
    assert engine.endpoints["h"].state.name == "DISCONNECTED_OUTBOUND"
    out = engine.handle(EndRequest(handle=target), 3)
    assert {ep.handle: ep.state.name for ep in out.endpoints} == {"h": "CLOSED", target: "CLOSED"}
    assert "h" not in engine.endpoints and target not in engine.endpoints


@pytest.mark.parametrize("cleaned", ["target", "initiator"])
def test_after_the_far_side_ends_with_cleanup_sends_go_nowhere_and_end_closes_at_once(
    engine: Engine, cleaned: str
) -> None:
    """WITH CLEANUP tells the far side nothing, so it may still SEND (as in Service Broker):
    the message has nowhere to go, and no new endpoint may bring the removed side back. Its END
    closes it at once: nobody is left to acknowledge it."""
    target, _reply = _conversing(engine)
    gone, other = (target, "h") if cleaned == "target" else ("h", target)
    assert not engine.handle(EndRequest(handle=gone, cleanup=True), 2).errors
    out = engine.handle(SendRequest(handles=(other,), body="late"), 3)
    assert not out.errors and not _messages(out)
    assert gone not in engine.endpoints and gone not in {ep.handle for ep in out.endpoints}
    out = engine.handle(EndRequest(handle=other), 4)
    assert not out.errors and {ep.handle: ep.state.name for ep in out.endpoints} == {
        other: "CLOSED"
    }


def test_a_lifetime_that_passes_closes_a_side_that_has_ended_instead_of_sending_it_an_error(
    engine: Engine,
) -> None:
    engine.handle(
        BeginRequest(
            handle="h",
            from_service="Init",
            to_service="Tgt",
            contract="C",
            lifetime_s=60,
        ),
        0,
    )
    [first] = _messages(engine.handle(SendRequest(handles=("h",), body="q"), 0))
    target = first.conversation_handle
    engine.handle(EndRequest(handle="h"), 1)
    out = engine.tick(60_000)
    assert [
        (m.conversation_handle, m.message_type_name.rsplit("/", 1)[-1]) for m in _messages(out)
    ] == [(target, "Error")]
    assert "h" not in engine.endpoints and engine.endpoints[target].state.name == "ERROR"
