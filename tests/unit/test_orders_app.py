"""apps/orders.py's bookkeeping: what counts as a duplicate, a reply out of order, a stray, missing."""

from __future__ import annotations

import json

from jsonschema import Draft202012Validator

from apps.orders import Ledger, line_body
from devtools.processes import REPO_ROOT
from ksb.catalog.model import load_catalog_file


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
