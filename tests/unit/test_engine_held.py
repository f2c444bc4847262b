"""Local messages held in the transmission queue while their target queue is disabled.

Local delivery normally skips the transmission queue. With the target queue at STATUS = OFF the
dispatcher hands the message to the transmitter addressed to its own instance; it comes back as an
inbound record once the queue is enabled, and every later message of that direction waits behind
it, so the conversation's order holds across the switch.
"""

from __future__ import annotations

from typing import Any

from ksb.catalog.model import END_DIALOG, CatalogView, parse_catalog
from ksb.dialog.engine import Engine
from ksb.dialog.outputs import Outputs
from ksb.transmission.links import QUEUE_DISABLED, delivery_problem, route_for
from ksb.wire.endpoint import State
from ksb.wire.partitioning import target_handle
from ksb.wire.protocol import EndRequest, InboundMessage, QueueMessage
from tests.unit.factories import transmission_queue
from tests.unit.test_engine import CATALOG, begin, messages, send


def _catalog(tq_status: str) -> CatalogView:
    data: dict[str, Any] = {
        **CATALOG,
        "queues": [
            {"name": "IQ"},
            {"name": "TQ", "partitions": 3, "status": tq_status},
            {"name": "KQ", "retention": "ON"},
        ],
    }
    return CatalogView(parse_catalog(data))


def _engine(tq_status: str) -> Engine:
    return Engine(_catalog(tq_status), instance="u", max_body_bytes=100)


def _bounce(engine: Engine, records: list[InboundMessage], now: int) -> Outputs:
    """What the transmitter does with held records: hand them back through ``inbound``."""
    total = Outputs()
    for r in records:
        total.extend(engine.handle(r, now))
    return total


def test_send_to_a_disabled_queue_goes_to_the_transmission_queue_at_the_sender_level() -> None:
    e = _engine("OFF")
    begin(e, 0)
    out = send(e, 1, "h1", body='{"n": 0}')
    assert messages(out) == []
    [t] = out.transmissions
    assert (t.to_instance, t.from_instance, t.to_service, t.seq) == ("u", "u", "Tgt", 0)
    assert t.priority == e.endpoints["h1"].priority == 5  # the sender's level orders transmission
    assert e.endpoints["h1"].state is State.CONVERSING


def test_held_messages_keep_their_order_after_the_queue_is_enabled() -> None:
    e = _engine("OFF")
    begin(e, 0)
    held = send(e, 1, "h1", body='{"n": 0}').transmissions
    e.catalog = _catalog("ON")
    # Enabled now, but seq 0 still waits in the transmission queue: seq 1 must wait behind it.
    held += send(e, 2, "h1", body='{"n": 1}').transmissions
    assert [t.seq for t in held] == [0, 1]
    back = _bounce(e, held, 3)
    assert [(m.message_sequence_number, m.message_body) for m in messages(back)] == [
        (0, b'{"n": 0}'),
        (1, b'{"n": 1}'),
    ]
    assert [a.ack_seq for a in back.acks] == [0, 1] and back.acks[0].to_instance == "u"
    # Caught up: the next message goes straight to the queue again.
    direct = send(e, 4, "h1", body='{"n": 2}')
    assert direct.transmissions == []
    assert [m.message_sequence_number for m in messages(direct)] == [2]


def test_inbound_for_a_still_disabled_queue_is_neither_queued_nor_acknowledged() -> None:
    e = _engine("OFF")
    begin(e, 0)
    held = send(e, 1, "h1").transmissions
    out = _bounce(e, held, 2)
    assert messages(out) == [] and out.acks == []
    e.catalog = _catalog("ON")
    again = _bounce(e, held, 3)  # the transmitter's retry after the queue was enabled
    assert len(messages(again)) == 1 and [a.ack_seq for a in again.acks] == [0]
    assert _bounce(e, held, 4).queue == []  # a duplicate retry is dropped, acknowledged again


def test_end_behind_held_messages_waits_in_line_and_changes_the_peer_on_arrival() -> None:
    e = _engine("OFF")
    begin(e, 0)
    held = send(e, 1, "h1").transmissions
    out = e.handle(EndRequest(handle="h1"), 2)
    assert messages(out) == []
    held += out.transmissions
    assert [t.message_type for t in held] == ["Req", END_DIALOG]
    assert e.endpoints["h1"].state is State.DISCONNECTED_OUTBOUND
    target = e.endpoints[target_handle("h1")]
    assert target.state is State.STARTED_INBOUND  # it has heard nothing yet
    e.catalog = _catalog("ON")
    arrived: list[QueueMessage] = messages(_bounce(e, held, 3))
    assert [m.message_type_name for m in arrived] == ["Req", END_DIALOG]
    assert e.endpoints[target_handle("h1")].state is State.DISCONNECTED_INBOUND


def test_reply_direction_is_not_held_by_the_other_direction() -> None:
    e = _engine("OFF")  # only the target's queue is disabled; the initiator's queue is not
    begin(e, 0)
    send(e, 1, "h1")
    reply = send(e, 2, target_handle("h1"), mtype="Rep", body="ok")
    assert reply.transmissions == [] and [m.queue for m in messages(reply)] == ["IQ"]


def test_transmitter_holds_local_records_while_the_queue_is_disabled() -> None:
    off, on = _catalog("OFF"), _catalog("ON")
    e = _engine("OFF")
    begin(e, 0)
    [rec] = send(e, 1, "h1").transmissions
    reason = delivery_problem(off, rec.to_service, rec.to_instance, "u", 5)
    assert reason is not None and reason.startswith(QUEUE_DISABLED) and "'TQ'" in reason
    q = transmission_queue()
    q.add(rec, reason)
    [row] = q.rows(10, {})
    assert row["status"] == "QUEUE_DISABLED" and row["last_failure"] == reason
    assert q.take(10, {"u"}, 10) == []
    q.reclassify(lambda r: delivery_problem(on, r.to_service, r.to_instance, "u", 20), True)
    assert [r.message_id for r in q.take(20, {"u"}, 10)] == [rec.message_id]
    # No catalog route is needed to reach ourselves; other instances still need one.
    local = route_for(on, "u", 20, instance="u")
    assert local is not None and local.address == "LOCAL" and local.next_hop == "u"
    assert route_for(on, "elsewhere", 20, instance="u") is None
