"""Bad input gets a clear, named error, and nothing else is lost or held up by it.

Each test sends a good message before and after the bad input (one requests partition, so the
dispatcher meets them in that order) and checks that both arrive promptly and nothing else does.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
from confluent_kafka import Producer

from devtools.deployment import Deployment
from ksb.catalog.model import ERROR, Catalog
from ksb.errors import CommitRefused
from ksb.names import Names
from ksb.runtime.catalog_store import load_catalog
from ksb.runtime.kafka import client_security
from ksb.sdk.client import KsbClient
from tests.integration.conftest import ThreadDispatcher
from tests.integration.support import errors, read_topic, receive_all, wait_endpoint, wait_error

pytestmark = pytest.mark.integration


def _login(settings: Deployment) -> dict[str, str]:
    """A plain producer's configuration, logged in as the test's owner (any producer could)."""
    return {
        "bootstrap.servers": settings.kafka_bootstrap,
        **client_security(settings, settings.kafka_bootstrap),
    }


INIT, TGT, CON = "//t/Initiator", "//t/Target", "//t/Contract"
REQ = "//t/Request"
PROMPT_S = 10.0
"""Generous for a loaded 2-core machine; a good message normally arrives in well under a second."""


def _good(client: KsbClient, handle: str, tag: str) -> None:
    client.send(handle, REQ, json.dumps({"good": tag}))


def _assert_delivered(
    client: KsbClient, expected: list[str], *, queue: str = "TargetQueue"
) -> None:
    """Exactly the good messages arrive, in order, promptly; nothing of the bad input is queued."""
    client.flush()
    started = time.monotonic()
    got = receive_all(client, queue, len(expected), timeout_s=PROMPT_S)
    took = time.monotonic() - started
    assert [json.loads(m.message_body)["good"] for m in got] == expected
    assert took < PROMPT_S
    by_conv: dict[str, list[int]] = {}
    for m in got:
        by_conv.setdefault(m.conversation_handle, []).append(m.message_sequence_number)
    for seqs in by_conv.values():  # no sequence number was used up by a refused SEND
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert receive_all(client, queue, 1, timeout_s=0.5) == []


def _by_request(settings: Deployment, request_id: str) -> dict[str, Any]:
    return wait_error(settings, lambda r: r.get("request_id") == request_id)


def _by_handle(settings: Deployment, handle: str) -> dict[str, Any]:
    return wait_error(settings, lambda r: r.get("handle") == handle)


def test_malformed_records_get_a_malformed_record_error(
    settings: Deployment, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    bad: list[tuple[bytes | None, str]] = [
        (b"this is not JSON {", "JSON is malformed"),
        (b'{"v": 1, "kind": "send", "handle": "h1", "body": "x"}', "unknown field `handle`"),
        (b'{"v": 1, "kind": "frobnicate", "handle": "h1"}', "'frobnicate'"),  # unknown kind
        (b'{"v": 2, "kind": "end", "handle": "h1"}', "value 2 - at `$.v`"),  # a future version
        (b"[1, 2, 3]", "Expected `object`"),  # JSON, but not an object
        (None, "tombstone"),
    ]
    good = client.begin_dialog(INIT, TGT, CON)
    _good(client, good, "before")
    client.flush()
    raw = Producer({**_login(settings), "enable.idempotence": True})
    for value, _ in bad:
        raw.produce(Names(settings.instance).requests_for(settings.sender), key=b"raw", value=value)
    assert raw.flush(10) == 0
    _good(client, good, "after")
    _assert_delivered(client, ["before", "after"])
    recs = errors(settings, at_least=len(bad))
    assert [r["code"] for r in recs] == ["malformed_record"] * len(bad)
    assert len({r["source_offset"] for r in recs}) == len(bad)
    for rec, (value, word) in zip(recs, bad, strict=True):
        assert word in rec["reason"], rec
        assert rec["source_topic"] == Names(settings.instance).requests_for(settings.sender)
        assert rec["raw"] == (value or b"").decode()


def test_a_malformed_request_is_refused_under_the_request_id_it_gave(
    settings: Deployment, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    """A client that names its request finds the refusal by that id, keyed by it, even when the
    record is refused before it is a request (here: a misspelt field)."""
    names = Names(settings.instance)
    good = client.begin_dialog(INIT, TGT, CON)
    _good(client, good, "before")
    client.flush()
    request_id = f"misspelt-{uuid.uuid4()}"
    value = json.dumps(
        {"v": 1, "kind": "send", "request_id": request_id, "handles": [good], "bodi": "x"}
    ).encode()
    raw = Producer({**_login(settings), "enable.idempotence": True})
    raw.produce(names.requests_for(settings.sender), key=good.encode(), value=value)
    assert raw.flush(10) == 0
    _good(client, good, "after")
    _assert_delivered(client, ["before", "after"])
    rec = _by_request(settings, request_id)
    assert rec["code"] == "malformed_record" and "bodi" in rec["reason"]
    assert (
        rec["source_topic"] == names.requests_for(settings.sender) and rec["raw"] == value.decode()
    )
    keys = [
        k
        for k, v in read_topic(settings, names.errors_for(settings.sender))
        if v is not None and json.loads(v).get("request_id") == request_id
    ]
    assert keys == [request_id.encode()]


def test_unknown_service_contract_and_message_type_are_named(
    settings: Deployment, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    good = client.begin_dialog(INIT, TGT, CON)
    _good(client, good, "before")
    to_nobody = client.begin_dialog(INIT, "//t/Nobody", CON)
    from_nobody = client.begin_dialog("//t/Ghost", TGT, CON)
    no_contract = client.begin_dialog(INIT, TGT, "//t/NoSuchContract")
    not_accepted = client.begin_dialog(TGT, INIT, CON)  # //t/Initiator accepts no contract
    no_type = client.send(good, "//t/NoSuchType", "{}")
    on_failed_begin = client.send(to_nobody, REQ, "{}")
    _good(client, good, "after")
    _assert_delivered(client, ["before", "after"])
    expect = {
        to_nobody: ("unknown_service", "//t/Nobody"),
        from_nobody: ("unknown_service", "//t/Ghost"),
        no_contract: ("unknown_contract", "//t/NoSuchContract"),
        not_accepted: ("contract_not_accepted", CON),
    }
    for handle, (code, name) in expect.items():
        rec = _by_handle(settings, handle)
        assert (rec["code"], name in rec["reason"]) == (code, True), rec
    rec = _by_request(settings, no_type)
    assert rec["code"] == "unknown_message_type" and "//t/NoSuchType" in rec["reason"]
    rec = _by_request(settings, on_failed_begin)
    assert rec["code"] == "unknown_conversation" and to_nobody in rec["reason"]
    assert len(errors(settings, at_least=6)) == 6


def test_message_type_not_allowed_from_that_side(
    settings: Deployment, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    good = client.begin_dialog(INIT, TGT, CON)
    _good(client, good, "before")
    wrong_side = client.send(good, "//t/Reply", "sent by the initiator")
    not_in_contract = client.send(good, "DEFAULT", "x")
    _good(client, good, "after")
    _assert_delivered(client, ["before", "after"])  # same dialog: sequence numbers 0, 1
    rec = _by_request(settings, wrong_side)
    assert rec["code"] == "message_type_not_allowed"
    assert "//t/Reply" in rec["reason"] and "initiator" in rec["reason"]
    rec = _by_request(settings, not_in_contract)
    assert rec["code"] == "message_type_not_in_contract" and CON in rec["reason"]
    wait_endpoint(settings, good, "CONVERSING")  # a refused SEND does not fail the dialog


@pytest.mark.parametrize(
    ("message_type", "body", "words"),
    [
        ("//t/Order", json.dumps({"qty": 0}), ["qty"]),  # SCHEMA
        (REQ, "{not json", ["JSON"]),  # WELL_FORMED_JSON
        ("//t/Ping", "not empty", ["empty"]),  # EMPTY
    ],
    ids=["schema", "json", "empty"],
)
def test_body_failing_validation_errors_only_its_dialog(
    settings: Deployment,
    client: KsbClient,
    dispatcher: ThreadDispatcher,
    message_type: str,
    body: str,
    words: list[str],
) -> None:
    good = client.begin_dialog(INIT, TGT, CON)
    _good(client, good, "before")
    bad = client.begin_dialog(INIT, TGT, CON)
    client.send(bad, message_type, body)
    _good(client, good, "after")
    _assert_delivered(client, ["before", "after"])
    [err] = receive_all(client, "InitiatorQueue", 1, timeout_s=PROMPT_S)
    assert err.message_type_name == ERROR and err.conversation_handle == bad
    description = json.loads(err.message_body)["description"]
    assert all(w.lower() in description.lower() for w in words), description
    wait_endpoint(settings, bad, "ERROR")
    wait_endpoint(settings, good, "CONVERSING")


def test_body_over_the_size_limit_is_refused(
    settings: Deployment, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    limit = settings.max_body_bytes
    good = client.begin_dialog(INIT, TGT, CON)
    _good(client, good, "before")
    too_big = client.send(good, REQ, json.dumps("x" * (limit - 1)))  # limit + 1 bytes
    _good(client, good, "after")
    _assert_delivered(client, ["before", "after"])
    rec = _by_request(settings, too_big)
    assert rec["code"] == "body_too_large"
    assert str(limit + 1) in rec["reason"] and str(limit) in rec["reason"]
    # Exactly at the limit is fine.
    client.send(good, REQ, json.dumps("y" * (limit - 2)))
    client.flush()
    [m] = receive_all(client, "TargetQueue", 1, timeout_s=PROMPT_S)
    assert len(m.message_body) == limit and m.message_sequence_number == 2


def test_send_on_unknown_or_closed_conversation(
    settings: Deployment, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    good = client.begin_dialog(INIT, TGT, CON)
    _good(client, good, "before")
    unknown = str(uuid.uuid4())
    on_unknown = client.send(unknown, REQ, "{}")
    ended = client.begin_dialog(INIT, TGT, CON)  # sent on, then ended: DISCONNECTED_OUTBOUND
    client.send(ended, REQ, json.dumps({"good": "on ended, before END"}))
    client.end_conversation(ended)
    on_ended = client.send(ended, REQ, "{}")
    closed = client.begin_dialog(INIT, TGT, CON)  # ended before anything was sent: CLOSED at once
    client.end_conversation(closed)
    on_closed = client.send(closed, REQ, "{}")
    _good(client, good, "after")
    client.flush()
    rec = _by_request(settings, on_unknown)
    assert rec["code"] == "unknown_conversation" and unknown in rec["reason"]
    rec = _by_request(settings, on_ended)
    assert rec["code"] == "conversation_closed" and "DISCONNECTED_OUTBOUND" in rec["reason"]
    rec = _by_request(settings, on_closed)
    assert rec["code"] == "unknown_conversation" and closed in rec["reason"]
    wait_endpoint(settings, closed, "CLOSED")
    # The ended dialog's message and its EndDialog still reach the target, in order.
    started = time.monotonic()
    got = receive_all(client, "TargetQueue", 4, timeout_s=PROMPT_S)
    assert time.monotonic() - started < PROMPT_S
    per_conv: dict[str, list[str]] = {}
    for m in got:
        per_conv.setdefault(m.conversation_id, []).append(
            m.message_type_name
            if m.message_type_name != REQ
            else json.loads(m.message_body)["good"]
        )
    assert per_conv[good] == ["before", "after"]
    assert per_conv[ended][0] == "on ended, before END"
    assert per_conv[ended][1].endswith("/EndDialog")
    assert receive_all(client, "TargetQueue", 1, timeout_s=0.5) == []


def test_multi_handle_send_with_one_bad_handle_queues_nothing(
    settings: Deployment, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    good = client.begin_dialog(INIT, TGT, CON)
    other = client.begin_dialog(INIT, TGT, CON)
    _good(client, good, "before")
    ended = client.begin_dialog(INIT, TGT, CON)
    client.end_conversation(ended)
    bad_handle = client.send([good, other, str(uuid.uuid4())], REQ, json.dumps({"good": "BAD"}))
    bad_state = client.send([other, good, ended], REQ, json.dumps({"good": "BAD"}))
    wrong_side = client.send([good, other], "//t/Reply", json.dumps({"good": "BAD"}))
    _good(client, good, "after")
    _assert_delivered(client, ["before", "after"])  # seq 0, 1: the refused SENDs left no trace
    assert _by_request(settings, bad_handle)["code"] == "unknown_conversation"
    assert _by_request(settings, bad_state)["code"] == "unknown_conversation"
    assert _by_request(settings, wrong_side)["code"] == "message_type_not_allowed"
    # `other` got nothing from the multi-handle SENDs: its first message now has sequence number 0.
    client.send(other, REQ, json.dumps({"good": "other"}))
    client.flush()
    [m] = receive_all(client, "TargetQueue", 1, timeout_s=PROMPT_S)
    assert (m.conversation_id, m.message_sequence_number) == (other, 0)
    wait_endpoint(settings, other, "CONVERSING")


def test_commit_with_one_bad_action_is_refused_whole(
    settings: Deployment, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    good = client.begin_dialog(INIT, TGT, CON)
    _good(client, good, "first")
    client.flush()
    tx = client.transaction()
    [m] = tx.receive("TargetQueue", waitfor_ms=10_000)
    tx.send(m.conversation_handle, "//t/Reply", "a reply that must not go out")
    tx.send(str(uuid.uuid4()), REQ, "{}")
    with pytest.raises(CommitRefused, match="unknown_conversation"):
        tx.commit()
    # The receipt was not applied either: the message comes back, and the reply never went out.
    _good(client, good, "second")
    _assert_delivered(client, ["first", "second"])
    assert receive_all(client, "InitiatorQueue", 1, timeout_s=0.5) == []
    assert [r["code"] for r in errors(settings)] == ["unknown_conversation"]


def test_an_invalid_catalog_record_is_skipped_not_fatal(
    settings: Deployment, catalog: Catalog, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    """A catalog record written by hand that is not a valid catalog: every reader keeps the newest
    valid version (with a warning naming the record) and the running dispatcher goes on."""
    good = client.begin_dialog(INIT, TGT, CON)
    _good(client, good, "before")
    client.flush()
    raw = Producer(_login(settings))
    raw.produce(Names(settings.instance).catalog, key=b"catalog", value=b'{"queus": []}')
    raw.produce(Names(settings.instance).catalog, key=b"catalog", value=b"not JSON")
    assert raw.flush(10) == 0
    _good(client, good, "after")
    _assert_delivered(client, ["before", "after"])
    engine = dispatcher.dispatcher.engine
    assert engine is not None and dispatcher.thread.is_alive()
    assert load_catalog(settings).version == engine.catalog.version == catalog.version
