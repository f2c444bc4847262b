"""The records of the smaller topics (activation, links, sla): what a writer encodes, a reader
decodes to the same thing; what no writer makes is refused with a ProtocolError."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from ksb.errors import ProtocolError
from ksb.wire.activation import (
    BrokerQueueDisabled,
    QueueActivation,
    encode_activation_event,
    parse_activation_event,
)
from ksb.wire.links import encode_link_event, parse_link_event
from ksb.wire.sla import encode_sla_row, parse_sla_row


def test_activation_events_round_trip_and_say_their_kind_first() -> None:
    for event in (
        QueueActivation(instance="i", queue="Q", reason="first_message", event_ms=5),
        BrokerQueueDisabled(instance="i", queue="Q", reason="5 rollbacks", event_ms=6),
    ):
        raw = encode_activation_event(event)
        assert raw.startswith(b'{"v":1,"kind":"')
        assert parse_activation_event(raw) == event


def test_a_link_record_keeps_the_json_the_transport_wrote_before() -> None:
    """The transmitter reads ``links`` from the beginning: a record written by the pydantic
    model these records used to be is still read."""
    old = {
        "destination": "B",
        "kind": "failed",
        "address": "x:1",
        "event_ms": 7,
        "suppressed_until_ms": 60_007,
        "reason": "refused",
    }
    event = parse_link_event(json.dumps(old).encode())
    assert (event.kind, event.suppressed_until_ms) == ("failed", 60_007)
    assert parse_link_event(encode_link_event(event)) == event
    with pytest.raises(ProtocolError, match="link event"):
        parse_link_event(json.dumps({**old, "kind": "exploded"}).encode())


class _Odd:
    """A value JSON has no type for (as numpy's integers are, in Spark's pandas rows)."""

    def __str__(self) -> str:
        return "odd"


def test_an_sla_row_travels_with_its_type_and_batch_and_odd_values_as_text() -> None:
    at = dt.datetime(2026, 11, 28, tzinfo=dt.UTC)
    raw = encode_sla_row("sla", 3, {"queue": "Q", "p99_ms": 12.5, "at": at, "n": _Odd()})
    row = parse_sla_row(raw)
    assert row == {
        "type": "sla",
        "batch_id": 3,
        "queue": "Q",
        "p99_ms": 12.5,
        "at": "2026-11-28T00:00:00Z",
        "n": "odd",
    }
    with pytest.raises(ProtocolError):
        parse_sla_row(b'{"queue": "Q"}')
