"""The transport's connection rules and the transmission queue, on milliseconds handed in."""

from __future__ import annotations

from typing import Any

from ksb.backoff import Backoff
from ksb.catalog.model import CatalogView, parse_catalog
from ksb.transmission.links import (
    ROUTE_EXPIRED,
    Headers,
    Packet,
    Peers,
    route_for,
    route_problem,
)
from ksb.wire.links import LinkEvent, LinkEventKind
from ksb.wire.protocol import AckRecord, InboundMessage
from tests.unit import factories
from tests.unit.factories import transmission_queue

T0 = 1_700_000_000_000


def test_suppression_schedule_15s_after_disconnect_60s_after_failed_connect() -> None:
    links = factories.links()
    assert not links.is_suppressed("B", T0)
    failed = links.on_failed_connect("B", "x:1", "refused", T0)
    assert (failed.kind, failed.suppressed_until_ms, failed.reason) == (
        "failed",
        T0 + 60_000,
        "refused",
    )
    assert links.is_suppressed("B", T0 + 59_999)
    assert not links.is_suppressed("B", T0 + 60_000)
    assert links.on_connected("B", "x:1", T0 + 60_000).kind == "connected"
    assert links.connected() == {"B"}
    gone = links.on_disconnect("B", "broken", T0 + 61_000)
    assert gone is not None and gone.suppressed_until_ms == T0 + 76_000
    assert links.on_disconnect("B", "again", T0 + 61_001) is None  # already down: no event
    assert links.suppressed(T0 + 61_000) == {"B": T0 + 76_000}
    assert links.is_suppressed("B", T0 + 75_999)
    assert not links.is_suppressed("B", T0 + 76_000)


def test_a_failed_attempt_restarts_the_full_back_off_and_a_disconnect_never_shortens_it() -> None:
    links = factories.links(suppress_after_disconnect_ms=15, suppress_after_failed_connect_ms=60)
    links.on_connected("B", "x:1", T0)
    links.on_failed_connect("B", "x:1", "refused", T0)
    links.on_failed_connect("B", "x:1", "refused", T0 + 50)
    assert links.suppressed(T0 + 50) == {"B": T0 + 110}
    assert links.link("B") is not None and links.link("B").failed_attempts == 2  # type: ignore[union-attr]


def test_idle_connections_close_after_90s_and_restore_from_redis() -> None:
    links = factories.links()
    links.on_connected("B", "x:1", T0)
    links.on_activity("B", T0 + 10_000, sent=3)
    assert links.idle(T0 + 99_999) == []
    assert links.idle(T0 + 100_000) == ["B"]
    closed = links.close("B", T0 + 100_000)
    assert closed is not None and (closed.kind, closed.suppressed_until_ms) == ("closed", None)
    assert links.close("B", T0 + 100_001) is None
    other = factories.links()
    other.restore_suppression({"C": T0 + 5_000, "D": T0 - 1}, T0)
    assert other.is_suppressed("C", T0) and not other.is_suppressed("D", T0)
    assert links.rows(T0 + 10_000)[0]["sent"] == 3


def test_packet_headers_round_trip_and_foreign_records_are_refused() -> None:
    packet = Packet("B", "LOCAL", "ksb.B.inbound", T0)
    as_kafka_hands_them: Headers = [
        (k, v.encode() if isinstance(v, str) else v) for k, v in packet.headers()
    ]
    assert Packet.from_headers(as_kafka_hands_them) == packet
    assert Packet.from_headers(None) is None
    assert Packet.from_headers([("ksb-destination", b"B")]) is None
    bad_time: Headers = [*packet.headers()[:3], ("ksb-taken-ms", b"soon")]
    assert Packet.from_headers(bad_time) is None


def _event(
    kind: LinkEventKind, dest: str = "B", until: int | None = None, reason: str | None = None
) -> LinkEvent:
    return LinkEvent(
        destination=dest,
        kind=kind,
        address="x:1",
        event_ms=T0,
        suppressed_until_ms=until,
        reason=reason,
    )


def test_peers_hold_back_suppressed_destinations_and_report_each_return_once() -> None:
    peers = Peers()
    assert peers.sendable({"B", "C"}, T0) == {"B", "C"}
    peers.apply(_event("failed", until=T0 + 1_000, reason="refused"))
    assert peers.sendable({"B", "C"}, T0 + 999) == {"C"}
    assert peers.failures() == {"B": "refused"}
    assert peers.reopened(T0 + 999) == []
    assert peers.reopened(T0 + 1_000) == ["B"]  # the suppression ran out: resend at once
    assert peers.reopened(T0 + 1_001) == []  # only once
    assert peers.sendable({"B"}, T0 + 1_000) == {"B"}
    assert peers.failures() == {"B": "refused"}  # still the last word until it connects
    peers.apply(_event("disconnected", until=T0 + 2_000, reason="broken"))
    peers.apply(_event("connected"))
    assert peers.sendable({"B"}, T0 + 1_500) == {"B"}
    assert peers.failures() == {}
    assert peers.reopened(T0 + 1_500) == ["B"]
    peers.apply(_event("closed"))  # closed on purpose (idle): nothing held back
    assert peers.sendable({"B"}, T0 + 1_500) == {"B"} and peers.reopened(T0 + 1_500) == []


def test_peers_forget_errors_of_destinations_with_nothing_left() -> None:
    peers = Peers()
    peers.apply(_event("failed", "B", T0 + 10, "refused"))
    peers.apply(_event("failed", "C", T0 + 10, "refused"))
    peers.forget({"C"})
    assert peers.failures() == {"C": "refused"}


def _msg(seq: int, conv: str = "c", level: int = 5, dest: str = "B", t: int = T0) -> InboundMessage:
    return InboundMessage(
        message_id=f"{conv}-{seq}",
        conversation_id=conv,
        from_instance="A",
        to_instance=dest,
        from_service="I",
        to_service="T",
        contract="C",
        message_type="M",
        from_initiator=True,
        seq=seq,
        priority=level,
        enqueued_ms=t,
    )


def _ack(seq: int, conv: str = "c") -> AckRecord:
    return AckRecord(
        conversation_id=conv,
        from_initiator=True,
        ack_seq=seq,
        from_instance="B",
        to_instance="A",
    )


def test_priority_order_across_destinations_and_acks_remove() -> None:
    q = transmission_queue()
    q.add(_msg(0, "low", 2, "B"))
    q.add(_msg(0, "high", 9, "C"))
    q.add(_msg(1, "high", 9, "C"))
    sent = q.take(T0, {"B", "C"}, 10)
    assert [m.message_id for m in sent] == ["high-0", "high-1", "low-0"]
    assert q.ack(_ack(1, "high")) == 2 and len(q) == 1
    assert q.ack(_ack(0, "high")) == 0  # an older ack changes nothing


def test_unacked_is_retransmitted_with_backoff_and_on_reconnect() -> None:
    q = transmission_queue(backoff=Backoff(initial_ms=1_000, max_ms=4_000))
    q.add(_msg(0))
    q.add(_msg(1))
    assert len(q.take(T0, {"B"}, 10)) == 2
    assert q.retransmit_due(T0 + 999) == 0
    assert q.retransmit_due(T0 + 1_000) == 2
    assert [m.seq for m in q.take(T0 + 1_000, {"B"}, 10)] == [0, 1]
    q.ack(_ack(0))
    assert q.requeue_destination("B") == 1
    assert [m.seq for m in q.take(T0 + 1_100, {"B"}, 10)] == [1]
    assert not q.add(_msg(0))  # already acknowledged: a replayed record is ignored


def test_no_route_is_held_with_its_reason_until_reclassified() -> None:
    q = transmission_queue()
    q.add(_msg(0), "no route to service 'T'")
    assert q.take(T0, {"B"}, 10) == []
    row = q.rows(T0, {})[0]
    assert row["status"] == "NO_ROUTE" and "no route" in row["last_failure"]
    q.reclassify(lambda _m: None, honor_broker_priority=False)
    assert [m.seq for m in q.take(T0, {"B"}, 10)] == [0]
    assert q.rows(T0, {})[0]["status"] == "SENT"


def _view(
    lifetime_s: int | None, applied_ms: int | None = T0, via: str | None = None
) -> CatalogView:
    route: dict[str, Any] = {
        "name": "r",
        "service_name": "T",
        "broker_instance": "B",
        "lifetime_s": lifetime_s,
    }
    if via is not None:
        route["via"] = via
    return CatalogView(parse_catalog({"routes": [route], "applied_ms": applied_ms}))


def test_route_lifetime_counts_from_the_applied_catalog() -> None:
    view = _view(5)
    assert route_problem(view, "T", "B", T0 + 4_999) is None
    reason = route_problem(view, "T", "B", T0 + 5_000)
    assert reason is not None and reason.startswith(ROUTE_EXPIRED) and "'r'" in reason
    assert route_for(view, "B", T0 + 4_999) is not None
    assert route_for(view, "B", T0 + 5_000) is None
    # a newer version declaring the route again renews it; no LIFETIME never expires
    assert route_problem(_view(5, T0 + 10_000), "T", "B", T0 + 12_000) is None
    assert route_problem(_view(None), "T", "B", T0 + 10**9) is None
    assert route_problem(view, "X", "B", T0) == "no route to service 'X'"
    assert "names broker instance 'B'" in (route_problem(view, "T", "C", T0) or "")


def test_route_via_a_forwarder_names_the_next_hop() -> None:
    assert _view(None, via="F").routes["T"].next_hop == "F"
    assert _view(None).routes["T"].next_hop == "B"


def test_expired_route_holds_messages_until_renewed() -> None:
    q = transmission_queue()
    view = _view(5)
    for seq in range(2):
        m = _msg(seq)
        q.add(m, route_problem(view, m.to_service, m.to_instance, T0))
    assert [m.seq for m in q.take(T0, {"B"}, 10)] == [0, 1]
    q.add(_msg(2), route_problem(view, "T", "B", T0 + 6_000))
    assert q.take(T0 + 6_000, {"B"}, 10) == []
    rows = q.rows(T0 + 6_000, {})
    held = next(r for r in rows if r["seq"] == 2)
    assert held["status"] == "ROUTE_EXPIRED" and held["last_failure"].startswith(ROUTE_EXPIRED)
    assert q.pending_destinations() == set()
    renewed = _view(5, T0 + 7_000)
    q.reclassify(lambda r: route_problem(renewed, r.to_service, r.to_instance, T0 + 7_000), True)
    assert [m.seq for m in q.take(T0 + 7_000, {"B"}, 10)] == [2]


def test_take_reports_effective_level_and_starvation_exceptions() -> None:
    q = transmission_queue(max_wait_ms=1_000)
    q.add(_msg(0, "old", level=1, dest="b", t=0))
    q.add(_msg(0, "new", level=10, dest="b", t=1_500))
    [first] = q.take(2_000, {"b"}, 1)
    assert first.message_id == "old-0" and q.last_take["old-0"] == (1, True)  # waited past 1 s
    [second] = q.take(2_000, {"b"}, 1)
    assert second.message_id == "new-0" and q.last_take == {"new-0": (10, False)}
    off = transmission_queue(honor_broker_priority=False)
    off.add(_msg(0, "x", level=9, dest="b", t=0))
    off.take(0, {"b"}, 1)
    assert off.last_take["x-0"] == (5, False)  # HONOR_BROKER_PRIORITY OFF: sent at 5
