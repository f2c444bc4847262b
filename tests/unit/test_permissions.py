"""GRANT SEND and GRANT RECEIVE, enforced by the engine for the principal that sent a request.

Each refusal is checked for its code, for naming the principal, the service or queue and the
missing permission, for being reported under the sender's principal (its own errors topic), and
for leaving everything else as it was.
"""

from __future__ import annotations

from typing import Any

import pytest

from ksb.catalog.model import Catalog, CatalogView, Grant, parse_catalog
from ksb.dialog.engine import Engine
from ksb.dialog.outputs import Outputs
from ksb.dialog.permissions import Permissions
from ksb.wire.protocol import (
    BeginRequest,
    CommitRequest,
    DeadLetterRequest,
    EndRequest,
    QueueMessage,
    Receipt,
    SendRequest,
    TimerRequest,
)
from ksb.wire.relay import RelayAction

INSTANCE = "u"
CATALOG: dict[str, Any] = {
    "contracts": [{"name": "C", "messages": [{"type": "DEFAULT", "sent_by": "ANY"}]}],
    "queues": [{"name": "IQ"}, {"name": "TQ"}],
    "services": [
        {"name": "Init", "queue": "IQ"},
        {"name": "Tgt", "queue": "TQ", "contracts": ["C"]},
    ],
}
GRANTS = (
    Grant(permission="SEND", target="Init", principal="alice"),
    Grant(permission="RECEIVE", target="IQ", principal="alice"),
    Grant(permission="SEND", target="Tgt", principal="tom"),
    Grant(permission="RECEIVE", target="TQ", principal="tom"),
)


def _catalog(grants: tuple[Grant, ...] = GRANTS) -> Catalog:
    return parse_catalog({**CATALOG, "grants": [g.model_dump() for g in grants]})


@pytest.fixture
def engine() -> Engine:
    catalog = _catalog()
    eng = Engine(CatalogView(catalog), instance=INSTANCE, max_body_bytes=100)
    eng.permissions = Permissions.of(catalog, INSTANCE, owners=("boss",))
    return eng


def _begin(engine: Engine, who: str | None, handle: str = "h") -> Outputs:
    req = BeginRequest(handle=handle, from_service="Init", to_service="Tgt", contract="C")
    return engine.handle(req, 0, principal=who)


def _messages(out: Outputs) -> list[QueueMessage]:
    return [w.value for w in out.queue if isinstance(w.value, QueueMessage)]


def _refused(out: Outputs, who: str, *words: str) -> None:
    [error] = out.errors
    assert error.code == "not_authorized"
    for w in (repr(who), *words):
        assert w in error.reason, error.reason
    assert out.principal == who
    assert not out.queue and not out.endpoints and not out.relays


def test_a_begin_from_a_service_not_granted_is_refused(engine: Engine) -> None:
    _refused(_begin(engine, "tom"), "tom", "'Init'", "SEND on SERVICE::[Init]")
    assert not engine.endpoints
    assert not _begin(engine, "alice").errors  # granted


@pytest.mark.parametrize("who", [None, "boss", f"ksb-{INSTANCE}-activation"])
def test_no_principal_an_owner_and_the_activation_service_need_no_grant(
    engine: Engine, who: str | None
) -> None:
    out = _begin(engine, who)
    assert not out.errors and out.principal == who


def test_send_end_and_timer_on_another_services_endpoint_are_refused(engine: Engine) -> None:
    assert not _begin(engine, "alice").errors
    before = dict(engine.endpoints)
    for req in (
        SendRequest(handles=("h",), body="x"),
        EndRequest(handle="h"),
        TimerRequest(handle="h", timeout_s=5),
    ):
        _refused(engine.handle(req, 1, principal="tom"), "tom", "'Init'", req.kind.upper())
    assert engine.endpoints == before
    sent = engine.handle(SendRequest(handles=("h",), body="x"), 2, principal="alice")
    assert not sent.errors and len(_messages(sent)) == 1


def test_a_receipt_on_a_queue_without_receive_is_refused_with_its_outcome(engine: Engine) -> None:
    assert not _begin(engine, "alice").errors
    [msg] = _messages(engine.handle(SendRequest(handles=("h",), body="x"), 1, principal="alice"))
    receipt = Receipt(queue="TQ", group=msg.conversation_group_id, message_ids=(msg.message_id,))
    out = engine.handle(CommitRequest(receipt=receipt), 2, principal="alice")
    [error] = out.errors
    assert error.code == "not_authorized" and "RECEIVE" in error.reason and "'TQ'" in error.reason
    assert msg.message_id in engine.waiting  # still waiting for a reader that may take it
    applied = engine.handle(CommitRequest(receipt=receipt), 3, principal="tom")
    assert not applied.errors and msg.message_id not in engine.waiting


def test_a_reply_needs_send_on_the_receiving_service(engine: Engine) -> None:
    """RECEIVE alone lets a reader take messages; replying acts for its service."""
    sent = engine.handle(SendRequest(handles=("h",), body="x"), 1, principal=None)
    assert sent.errors  # no dialog yet: the refusal is the engine's, not a permission's
    assert not _begin(engine, "alice").errors
    [msg] = _messages(engine.handle(SendRequest(handles=("h",), body="x"), 2, principal="alice"))
    target = msg.conversation_handle
    catalog = _catalog((*GRANTS[:2], GRANTS[3]))  # tom keeps RECEIVE, loses SEND (a revoke)
    engine.permissions = Permissions.of(catalog, INSTANCE)
    receipt = Receipt(queue="TQ", group=msg.conversation_group_id, message_ids=(msg.message_id,))
    reply = CommitRequest(receipt=receipt, actions=(SendRequest(handles=(target,), body="r"),))
    refused = engine.handle(reply, 3, principal="tom")
    assert [e.code for e in refused.errors] == ["not_authorized"]
    assert msg.message_id in engine.waiting  # all or nothing: the receipt is not applied
    assert not engine.handle(CommitRequest(receipt=receipt), 4, principal="tom").errors


def test_a_dead_letter_needs_receive_on_the_queue(engine: Engine) -> None:
    assert not _begin(engine, "alice").errors
    [msg] = _messages(engine.handle(SendRequest(handles=("h",), body="x"), 1, principal="alice"))
    out = engine.handle(DeadLetterRequest(message=msg, reason="bad"), 2, principal="alice")
    assert [e.code for e in out.errors] == ["not_authorized"] and not out.dead_letters
    done = engine.handle(DeadLetterRequest(message=msg, reason="bad"), 3, principal="tom")
    assert not done.errors and len(done.dead_letters) == 1


def test_a_relayed_action_is_checked_for_the_principal_that_committed_it(engine: Engine) -> None:
    assert not _begin(engine, "alice").errors
    relay = RelayAction(
        action=SendRequest(handles=("h",), body="x"), group="h", request_id="c1", principal="tom"
    )
    out = engine.handle_relayed(relay, 1)
    assert [e.code for e in out.errors] == ["not_authorized"] and out.principal == "tom"
    assert out.errors[0].request_id == "c1"
