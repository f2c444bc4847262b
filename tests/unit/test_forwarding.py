"""The forwarder's rules: next hop, arrival order at one level, retry, dropping stale messages."""

from __future__ import annotations

from ksb.catalog.model import CatalogView, parse_catalog
from ksb.transmission.forwarding import FORWARDING_PRIORITY, ForwardQueue, next_hop
from ksb.transmission.links import ROUTE_EXPIRED
from ksb.wire.protocol import InboundMessage

T0 = 1_700_000_000_000


def _msg(seq: int, level: int = 5, conv: str = "c", to: str = "C") -> InboundMessage:
    return InboundMessage(
        message_id=f"{conv}-{seq}",
        conversation_id=conv,
        from_instance="A",
        to_instance=to,
        from_service="I",
        to_service="T",
        contract="C",
        message_type="M",
        from_initiator=True,
        seq=seq,
        priority=level,
        enqueued_ms=T0,
    )


def _view(**route: object) -> CatalogView:
    base = {"name": "to-c", "service_name": "T", "broker_instance": "C", **route}
    return CatalogView(parse_catalog({"routes": [base], "applied_ms": T0}))


def test_next_hop_follows_our_route_and_refuses_loops_and_expired_routes() -> None:
    hop = next_hop(_view(), _msg(0), "B", T0)
    assert not isinstance(hop, str) and hop.next_hop == "C" and hop.address == "LOCAL"
    assert next_hop(_view(via="D"), _msg(0), "B", T0).next_hop == "D"  # type: ignore[union-attr]
    assert "loop" in str(next_hop(_view(via="B"), _msg(0), "B", T0))
    assert str(next_hop(_view(lifetime_s=1), _msg(0), "B", T0 + 1_000)).startswith(ROUTE_EXPIRED)
    assert "names broker instance 'C'" in str(next_hop(_view(), _msg(0, to="E"), "B", T0))


def test_arrival_order_whatever_the_level_and_duplicates_held_once() -> None:
    q = ForwardQueue()
    assert q.add(_msg(0, level=1), T0)
    assert q.add(_msg(0, level=9, conv="hi"), T0)
    assert not q.add(_msg(0, level=1), T0 + 10)  # the origin retransmitted it: held once
    assert [m.message_id for m in q.take(10)] == ["c-0", "hi-0"]
    assert q.take(10) == []  # in flight
    assert {r["priority"] for r in q.rows(T0)} == {FORWARDING_PRIORITY}


def test_failed_forward_retries_until_stale_then_drops() -> None:
    q = ForwardQueue()
    q.add(_msg(0), T0)
    q.add(_msg(1), T0 + 30_000)
    q.take(10)
    q.delivered("c-1")
    q.failed("c-0", "no route to service 'T'")
    assert q.rows(T0)[0]["last_failure"] == "no route to service 'T'"
    assert [m.seq for m in q.take(10)] == [0]
    assert q.drop_stale(T0 + 60_000, 60_000) == 0  # in flight: its outcome decides
    q.failed("c-0", "delivery failed")
    assert q.drop_stale(T0 + 59_999, 60_000) == 0
    assert q.drop_stale(T0 + 60_000, 60_000) == 1
    assert len(q) == 0 and q.forwarded == 1 and q.dropped == 1
