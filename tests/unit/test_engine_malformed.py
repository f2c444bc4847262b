"""The error record of a malformed request keeps the request_id the client gave, when it gave one.

A client that sends a request with its own `request_id` waits for the outcome by that id (the
error topic is keyed by it), so a refusal of a record that is JSON but not a valid request must
carry it; a record with no readable id keeps null and is found by its source position.
"""

from __future__ import annotations

import pytest

from ksb.dialog.engine import Engine
from ksb.errors import ProtocolError
from ksb.wire.protocol import ErrorRecord, parse_request


def _refusal(raw: bytes | None) -> ErrorRecord:
    with pytest.raises(ProtocolError) as refused:
        parse_request(raw)
    out = Engine.malformed(refused.value, topic="ksb.u.requests", partition=0, offset=41, raw=raw)
    [error] = out.errors
    assert (error.code, error.source_topic, error.source_offset) == (
        "malformed_record",
        "ksb.u.requests",
        41,
    )
    return error


@pytest.mark.parametrize(
    "raw",
    [
        b'{"v": 1, "kind": "send", "request_id": "r-7", "handle": "h1", "body": "x"}',
        b'{"v": 2, "kind": "end", "request_id": "r-7", "handle": "h1"}',
        b'{"v": 1, "kind": "frobnicate", "request_id": "r-7"}',
        b'{"v": 1, "kind": "end", "request_id": "r-7", "handle": "h1", "cleanup": "maybe"}',
        b'{"request_id": "r-7"}',
    ],
    ids=["missing-field", "future-version", "unknown-kind", "mistyped-field", "nothing-else"],
)
def test_a_json_request_refused_as_malformed_keeps_its_request_id(raw: bytes) -> None:
    error = _refusal(raw)
    assert error.request_id == "r-7"
    assert error.raw == raw.decode()


@pytest.mark.parametrize(
    "raw",
    [
        b'this is not JSON {"request_id": "r-7"}',
        b'[{"request_id": "r-7"}]',
        b'{"v": 1, "kind": "end", "request_id": 7, "handle": "h1", "cleanup": "maybe"}',
        b'{"v": 1, "kind": "end", "handle": "h1", "cleanup": "maybe"}',
        b'{"v": 1, "kind": "end", "request_id": {"id": "r-7"}}',
        None,
    ],
    ids=["not-json", "not-an-object", "numeric-id", "no-id", "object-id", "tombstone"],
)
def test_a_record_without_a_string_request_id_gets_a_null_one(raw: bytes | None) -> None:
    assert _refusal(raw).request_id is None
