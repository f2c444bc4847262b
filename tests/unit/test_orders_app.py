"""apps/orders.py's bookkeeping: what counts as a duplicate, a reply out of order, a stray, missing."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest
from jsonschema import Draft202012Validator

from apps.orders import (
    CLIENT_QUEUE,
    CLIENT_SERVICE,
    LINE_ACCEPTED,
    ORDER_SERVICE,
    Ledger,
    OrderClient,
    line_body,
)
from devtools.processes import REPO_ROOT
from ksb.catalog.model import load_catalog_file
from ksb.dialog.permissions import Permissions
from ksb.errors import CommitRefused, KsbError, NotAuthorized
from ksb.sdk.client import KsbClient
from ksb.wire.protocol import QueueMessage


def test_each_line_once_in_order_completes_a_dialog() -> None:
    ledger = Ledger()
    ledger.open("h1", 3)
    for line in (0, 1):
        ledger.record("h1", line)
    assert not ledger.complete("h1") and ledger.missing(["h1"]) == 1
    ledger.record("h1", 2)
    assert ledger.complete("h1") and ledger.missing(["h1"]) == 0
    assert ledger.problems == []


def test_a_line_twice_is_a_duplicate_and_does_not_count_twice() -> None:
    ledger = Ledger()
    ledger.open("h1", 2)
    ledger.record("h1", 0)
    ledger.record("h1", 0)
    assert ledger.duplicates == 1 and not ledger.complete("h1")
    assert "replied to twice" in ledger.problems[0]


def test_a_line_before_one_already_seen_is_out_of_order() -> None:
    ledger = Ledger()
    ledger.open("h1", 3)
    ledger.record("h1", 1)
    ledger.record("h1", 0)
    assert ledger.out_of_order == 1 and ledger.duplicates == 0


def test_a_reply_on_a_dialog_never_opened_is_a_stray() -> None:
    ledger = Ledger()
    ledger.record("nobody", 0)
    assert ledger.strays == 1 and ledger.problems


def test_an_order_line_matches_the_catalog_schema() -> None:
    catalog = load_catalog_file(REPO_ROOT / "infra" / "compose" / "catalog.yaml")
    schema = next(t.json_schema for t in catalog.message_types if t.name.endswith("/OrderLine"))
    assert schema is not None
    Draft202012Validator(schema).validate(json.loads(line_body("round-0-order-1", 7)))


def test_the_compose_catalog_grants_the_order_client_what_it_does_and_no_more() -> None:
    """SQL Server's permission model: the client (principal `orders` in docker-compose.yml) acts
    as its own service through RECEIVE on its queue and begins dialogs with the order service
    through SEND on that target; it cannot act as the order service, whose side the external
    activator's readers run."""
    catalog = load_catalog_file(REPO_ROOT / "infra" / "compose" / "catalog.yaml")
    perms = Permissions.of(catalog, "local")
    perms.check_acts_as("orders", CLIENT_SERVICE, CLIENT_QUEUE, "BEGIN")
    perms.check_send("orders", ORDER_SERVICE, "BEGIN")
    perms.check_receive("orders", CLIENT_QUEUE, "RECEIVE")
    with pytest.raises(NotAuthorized):
        perms.check_acts_as("orders", ORDER_SERVICE, "OrderServiceQueue", "SEND")
    with pytest.raises(NotAuthorized):
        perms.check_receive("orders", "OrderServiceQueue", "RECEIVE")


def _reply(handle: str, body: str) -> QueueMessage:
    return QueueMessage(
        message_id=f"m-{handle}", queue=CLIENT_QUEUE, status=1, priority=5, queuing_order=0,
        conversation_group_id="g", conversation_handle=handle, conversation_id="c",
        message_sequence_number=0, service_name="s", service_contract_name="k",
        message_type_name=LINE_ACCEPTED, validation="N", enqueued_ms=0, body=body,
    )  # fmt: skip


class _Tx:
    """A transaction of the SDK's shape that records how it ended."""

    def __init__(self, msgs: list[QueueMessage], commit: Exception | None = None) -> None:
        self.msgs, self.commit_fails, self.done = msgs, commit, False
        self.ended: list[str] = []

    def receive(self, queue: str, *, waitfor_ms: int = 0) -> list[QueueMessage]:
        return self.msgs

    def end_conversation(self, handle: str) -> None:
        pass

    def commit(self) -> None:
        self.done = True
        self.ended.append("commit")
        if self.commit_fails is not None:
            raise self.commit_fails

    def rollback(self) -> None:
        self.done = True
        self.ended.append("rollback")


class _Client:
    def __init__(self, tx: _Tx) -> None:
        self.tx = tx

    def transaction(self) -> _Tx:
        return self.tx


def _client_of(tx: _Tx) -> OrderClient:
    app = OrderClient(cast(KsbClient, cast(Any, _Client(tx))), 1, 2, 60.0)
    app.ledger.open("h1", 2)
    return app


def test_a_receive_that_fails_before_its_commit_gives_the_group_back() -> None:
    """A reply it cannot read ends the transaction in a rollback, not a lock held (and renewed)
    until the process ends; the failure still reaches the caller."""
    tx = _Tx([_reply("h1", "not json")])
    with pytest.raises(ValueError):
        _client_of(tx)._receive_once()
    assert tx.ended == ["rollback"]


def test_only_a_committed_receive_counts_its_replies() -> None:
    body = json.dumps({"order_id": "o", "line": 0, "status": "accepted"})
    refused = _Tx([_reply("h1", body)], commit=CommitRefused("fenced"))
    app = _client_of(refused)
    with pytest.raises(KsbError):
        app._receive_once()
    assert refused.ended == ["commit"] and app.ledger.got["h1"] == []  # no rollback after it
    committed = _Tx([_reply("h1", body)])
    app.client = cast(KsbClient, cast(Any, _Client(committed)))
    app._receive_once()
    assert committed.ended == ["commit"] and app.ledger.got["h1"] == [0]
