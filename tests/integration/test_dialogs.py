"""Dialog semantics end to end on real Kafka and Redis."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from devtools.deployment import Deployment
from ksb.catalog.model import END_DIALOG, ERROR
from ksb.sdk.client import KsbClient
from tests.integration.conftest import ThreadDispatcher, serving
from tests.integration.support import errors, receive_all, wait_endpoint

pytestmark = pytest.mark.integration

I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741


def test_request_reply_end_in_order(
    client: KsbClient, settings: Deployment, dispatcher: ThreadDispatcher
) -> None:
    handles = [client.begin_dialog(I, T, C) for _ in range(3)]
    for h in handles:
        for i in range(4):
            client.send(h, "//t/Request", json.dumps({"i": i}))
    client.flush()
    got = receive_all(client, "TargetQueue", 12)
    by_conv: dict[str, list[int]] = {}
    for m in got:
        by_conv.setdefault(m.conversation_id, []).append(json.loads(m.message_body)["i"])
        assert m.service_name == T and m.service_contract_name == C
    assert sorted(by_conv) == sorted(handles)
    assert all(seq == [0, 1, 2, 3] for seq in by_conv.values())
    target = got[0].conversation_handle
    wait_endpoint(settings, target, "CONVERSING")
    # reply and end from the target inside one transaction
    with client.transaction() as tx:
        tx.send(target, "//t/Reply", "done")
        tx.end_conversation(target)
    replies = receive_all(client, "InitiatorQueue", 2)
    assert [m.message_type_name for m in replies] == ["//t/Reply", END_DIALOG]
    initiator = replies[0].conversation_handle
    assert initiator in handles
    wait_endpoint(settings, initiator, "DISCONNECTED_INBOUND")
    client.end_conversation(initiator)
    client.flush()
    wait_endpoint(settings, initiator, "CLOSED")
    wait_endpoint(settings, target, "CLOSED")


def test_receive_returns_one_group_and_rollback_puts_back(
    client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    a = client.begin_dialog(I, T, C)
    b = client.begin_dialog(I, T, C)
    for h in (a, b):
        client.send(h, "//t/Request", "{}")
        client.send(h, "//t/Request", "{}")
    client.flush()
    tx = client.transaction()
    first = tx.receive("TargetQueue", waitfor_ms=5000)
    assert len(first) == 2 and len({m.conversation_group_id for m in first}) == 1
    tx.rollback()
    again = client.transaction()
    second = again.receive(
        "TargetQueue", conversation_group_id=first[0].conversation_group_id, waitfor_ms=5000
    )
    assert [m.message_id for m in second] == [m.message_id for m in first]
    again.commit()
    rest = receive_all(client, "TargetQueue", 2)
    assert {m.conversation_group_id for m in rest} != {first[0].conversation_group_id}
    assert len(rest) == 2


def test_locked_group_is_skipped_by_another_reader(
    client: KsbClient, settings: Deployment, dispatcher: ThreadDispatcher
) -> None:
    a = client.begin_dialog(I, T, C)
    client.send(a, "//t/Request", "{}")
    client.flush()
    holder = client.transaction()
    assert holder.receive("TargetQueue", waitfor_ms=5000)
    with KsbClient(settings) as other:
        tx = other.transaction()
        assert tx.receive("TargetQueue", waitfor_ms=300) == []
        tx.rollback()
    holder.commit()


def test_body_failing_validation_errors_the_dialog(
    client: KsbClient, settings: Deployment, dispatcher: ThreadDispatcher
) -> None:
    h = client.begin_dialog(I, T, C)
    client.send(h, "//t/Order", json.dumps({"qty": 0}))
    client.flush()
    [err] = receive_all(client, "InitiatorQueue", 1)
    assert err.message_type_name == ERROR
    body = json.loads(err.message_body)
    assert "qty" in body["description"]
    wait_endpoint(settings, h, "ERROR")


def test_unknown_service_goes_to_error_topic(
    client: KsbClient, settings: Deployment, dispatcher: ThreadDispatcher
) -> None:
    client.begin_dialog(I, "//t/Nobody", C)
    client.flush()
    [rec] = errors(settings)
    assert rec["code"] == "unknown_service"
    assert "//t/Nobody" in rec["reason"]


def test_a_lock_outlives_its_ttl_while_the_transaction_runs(
    settings: Deployment, dispatcher: ThreadDispatcher, tmp_path: Path
) -> None:
    with (
        serving(settings, tmp_path / "q", lock_ttl_ms=600, lock_renew_ms=150) as short,
        KsbClient(short) as client,
        KsbClient(short) as other,
    ):
        client.send(client.begin_dialog(I, T, C), "//t/Request", "{}")
        client.flush()
        tx = client.transaction()
        assert tx.receive("TargetQueue", waitfor_ms=5000)
        time.sleep(2)  # several TTLs: the reader keeps renewing its lease
        probe = other.transaction()
        assert probe.receive("TargetQueue", waitfor_ms=200) == []
        probe.rollback()
        tx.commit()
