"""Endpoint records read back: a damaged one is refused with a named error, a good one reads as written.

Regression tests for what the decoder fuzzers (tests/fuzz) found in `decode_endpoint`.
"""

from __future__ import annotations

import json

import pytest

from ksb.errors import ProtocolError
from ksb.wire.endpoint import decode_endpoint, encode_endpoint
from tests.unit.endpoints import make_endpoint


def _record(**changes: object) -> bytes:
    d = json.loads(encode_endpoint(make_endpoint()))
    d.update(changes)
    return json.dumps({k: v for k, v in d.items() if v is not ...}).encode()


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"", "truncated"),
        (b"\x80", "JSON is malformed"),
        (b"[" * 100_000, "malformed endpoint record"),
        (b"[]", "Expected `object`"),
        (b"null", "Expected `object`"),
        (_record(state=...), "missing required field `state`"),
        (_record(handle=...), "missing required field `handle`"),
        (_record(state="SO"), "Invalid enum value 'SO'"),
        (_record(state=["CLOSED"]), "state"),
        (_record(send_seq="1"), "send_seq"),
        (_record(priority=None), "priority"),
        (_record(is_initiator=1), "is_initiator"),
        (_record(outstanding=True), "outstanding"),
        (_record(handle=7), "handle"),
    ],
    ids=[
        "empty",
        "not-utf8",
        "nested-too-deep",
        "array",
        "null",
        "no-state",
        "no-handle",
        "state-code-not-name",
        "state-not-text",
        "number-as-text",
        "null-level",
        "number-as-flag",
        "flag-as-number",
        "number-as-handle",
    ],
)
def test_a_damaged_endpoint_record_is_refused_with_the_reason(raw: bytes, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        decode_endpoint(raw)


def test_an_endpoint_without_a_far_handle_reads_back_as_written() -> None:
    """Null fields are left out of the record, so a missing nullable field must read as null."""
    ep = make_endpoint(far_handle=None, error_code=-8489, error_description="lifetime")
    assert decode_endpoint(encode_endpoint(ep)) == ep


def test_fields_a_newer_writer_added_are_ignored() -> None:
    assert decode_endpoint(_record(shiny_new_field=[1, 2])) == make_endpoint()
