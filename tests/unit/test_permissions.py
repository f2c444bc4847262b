"""SQL Server's permissions, enforced by the engine for the principal that sent a request: acting
as a service is for its owner (RECEIVE on its queue, or AUTHORIZATION), beginning a dialog needs
SEND on the target service, and a peer instance needs SEND on the target it begins a dialog with.

Each refusal is checked for its code, for naming the principal, the service or queue and the
missing permission, for being reported under the sender's principal (its own errors topic), and
for leaving everything else as it was.
"""

from __future__ import annotations

from typing import Any

import pytest

from ksb.catalog.model import ERROR, Catalog, CatalogView, Grant, parse_catalog
from ksb.dialog.engine import Engine
from ksb.dialog.outputs import Outputs
from ksb.dialog.permissions import Permissions
from ksb.dialog.sources import Source
from ksb.wire.protocol import (
    BeginRequest,
    CommitRequest,
    DeadLetterRequest,
    EndRequest,
    InboundMessage,
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
    "routes": [  # the instances whose messages this one takes
        {"name": "far", "service_name": "//far/Init", "broker_instance": "far"},
        {"name": "else", "service_name": "//elsewhere/Init", "broker_instance": "elsewhere"},
    ],
}
GRANTS = (
    Grant(permission="RECEIVE", target="IQ", principal="alice"),  # she is Init's
    Grant(permission="SEND", target="Tgt", principal="alice"),  # and may begin dialogs with Tgt
    Grant(permission="RECEIVE", target="TQ", principal="tom"),  # Tgt's: replies need no SEND
    Grant(permission="SEND", target="Tgt", principal="mallory"),  # SEND on Tgt, owns nothing
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


def test_a_begin_from_a_service_the_principal_does_not_own_is_refused(engine: Engine) -> None:
    _refused(_begin(engine, "mallory"), "mallory", "as service 'Init'", "RECEIVE ON [IQ]")
    _refused(_begin(engine, "tom"), "tom", "as service 'Init'")
    assert not engine.endpoints
    assert not _begin(engine, "alice").errors  # Init's, with SEND on Tgt


def test_a_begin_to_a_target_without_send_on_it_is_refused(engine: Engine) -> None:
    grants = (GRANTS[0], *GRANTS[2:])  # alice keeps Init, loses SEND on Tgt
    engine.permissions = Permissions.of(_catalog(grants), INSTANCE)
    _refused(_begin(engine, "alice"), "alice", "to service 'Tgt'", "SEND on SERVICE::[Tgt]")
    assert not engine.endpoints


def test_a_services_authorization_owner_acts_as_it_without_receive() -> None:
    data = {**CATALOG, "grants": [Grant(permission="SEND", target="Tgt", principal="olga")]}
    data["services"] = [{**CATALOG["services"][0], "owner": "olga"}, CATALOG["services"][1]]
    catalog = parse_catalog({**data, "grants": [g.model_dump() for g in data["grants"]]})
    eng = Engine(CatalogView(catalog), instance=INSTANCE, max_body_bytes=100)
    eng.permissions = Permissions.of(catalog, INSTANCE)
    assert not _begin(eng, "olga").errors


def test_send_on_a_target_does_not_let_its_grantee_pose_as_the_target(engine: Engine) -> None:
    """The SQL Server way of granting (SEND on the target) read the old way let alice answer
    herself on the target's side of her own dialog: SEND on a service is not owning it."""
    assert not _begin(engine, "alice").errors
    [msg] = _messages(engine.handle(SendRequest(handles=("h",), body="x"), 1, principal="alice"))
    target = msg.conversation_handle
    forged = engine.handle(SendRequest(handles=(target,), body="forged"), 2, principal="alice")
    _refused(forged, "alice", "as service 'Tgt'", "RECEIVE ON [TQ]")
    assert not engine.handle(SendRequest(handles=(target,), body="r"), 3, principal="tom").errors


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
        _refused(
            engine.handle(req, 1, principal="tom"), "tom", "as service 'Init'", req.kind.upper()
        )
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


def test_a_reply_needs_the_receiving_services_queue_not_send(engine: Engine) -> None:
    """RECEIVE on its queue makes a reader its service's: it replies with no SEND grant, and
    loses both with the grant (a revoke)."""
    sent = engine.handle(SendRequest(handles=("h",), body="x"), 1, principal=None)
    assert sent.errors  # no dialog yet: the refusal is the engine's, not a permission's
    assert not _begin(engine, "alice").errors
    [msg] = _messages(engine.handle(SendRequest(handles=("h",), body="x"), 2, principal="alice"))
    target = msg.conversation_handle
    receipt = Receipt(queue="TQ", group=msg.conversation_group_id, message_ids=(msg.message_id,))
    reply = CommitRequest(receipt=receipt, actions=(SendRequest(handles=(target,), body="r"),))
    engine.permissions = Permissions.of(_catalog(GRANTS[:2]), INSTANCE)  # tom's RECEIVE revoked
    refused = engine.handle(reply, 3, principal="tom")
    assert [e.code for e in refused.errors] == ["not_authorized"]
    assert msg.message_id in engine.waiting  # all or nothing: the receipt is not applied
    engine.permissions = Permissions.of(_catalog(), INSTANCE)
    assert not engine.handle(reply, 4, principal="tom").errors


def _first_from(peer: str, conversation: str) -> InboundMessage:
    return InboundMessage(
        message_id="m",
        conversation_id=conversation,
        from_instance=peer,
        to_instance=INSTANCE,
        from_service="//far/Init",
        to_service="Tgt",
        contract="C",
        message_type="DEFAULT",
        from_initiator=True,
        seq=0,
        priority=5,
        enqueued_ms=0,
        body="hello",
    )


def test_a_peer_needs_send_on_the_target_it_begins_a_dialog_with(engine: Engine) -> None:
    """The remote service binding's part: a dialog from another instance is refused (an Error
    back, this side closed) unless the catalog grants that instance SEND on the target."""
    refused = engine.handle(_first_from("far", "c1"), 0, source=Source.PEER)
    [error] = refused.errors
    assert error.code == "dialog_refused" and "[peer-far]" in error.reason, error.reason
    assert not _messages(refused) and [t.message_type for t in refused.transmissions] == [ERROR]
    granted = (*GRANTS, Grant(permission="SEND", target="Tgt", principal="peer-far"))
    engine.permissions = Permissions.of(_catalog(granted), INSTANCE)
    accepted = engine.handle(_first_from("far", "c2"), 1, source=Source.PEER)
    assert not accepted.errors and [m.message_body for m in _messages(accepted)] == [b"hello"]
    other = engine.handle(_first_from("elsewhere", "c3"), 2, source=Source.PEER)
    assert [e.code for e in other.errors] == ["dialog_refused"]  # a grant is one peer's


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
