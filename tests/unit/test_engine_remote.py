"""Cross-instance dialogs in the pure engine: two engines, the transport played by the test."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ksb.catalog.model import END_DIALOG, ERROR, CatalogView, parse_catalog
from ksb.dialog.engine import Engine
from ksb.dialog.outputs import Outputs
from ksb.wire.endpoint import Endpoint, State, decode_endpoint, encode_endpoint
from ksb.wire.partitioning import target_handle
from ksb.wire.protocol import (
    BeginRequest,
    CommitRequest,
    EndRequest,
    InboundMessage,
    QueueMessage,
    Receipt,
    SendRequest,
    dumps,
    parse_request,
)

TYPES = [{"name": "Req", "validation": "WELL_FORMED_JSON"}, {"name": "Rep"}]
CONTRACT = {
    "name": "C",
    "messages": [{"type": "Req", "sent_by": "INITIATOR"}, {"type": "Rep", "sent_by": "TARGET"}],
}
A_CATALOG: dict[str, Any] = {
    "message_types": TYPES,
    "contracts": [CONTRACT],
    "queues": [{"name": "IQ"}],
    "services": [{"name": "Init", "queue": "IQ"}],
    "routes": [{"name": "to-b", "service_name": "Tgt", "broker_instance": "b"}],
    "priorities": [{"name": "p", "contract": "C", "local_service": "Init", "level": 3}],
}
B_CATALOG: dict[str, Any] = {
    "message_types": TYPES,
    "contracts": [CONTRACT],
    "queues": [{"name": "TQ", "partitions": 2}],
    "services": [{"name": "Tgt", "queue": "TQ", "contracts": ["C"]}],
    "routes": [{"name": "to-a", "service_name": "Init", "broker_instance": "a"}],
    "priorities": [{"name": "p", "contract": "C", "remote_service": "Init", "level": 8}],
}
NOW = 1_700_000_000_000


def engine(catalog: dict[str, Any], instance: str) -> Engine:
    return Engine(CatalogView(parse_catalog(catalog)), instance=instance, max_body_bytes=1000)


@pytest.fixture
def a() -> Engine:
    return engine(A_CATALOG, "a")


@pytest.fixture
def b() -> Engine:
    return engine(B_CATALOG, "b")


def begin(e: Engine, handle: str = "c1", to: str = "Tgt") -> Outputs:
    return e.handle(
        BeginRequest(handle=handle, from_service="Init", to_service=to, contract="C"),
        NOW,
    )


def send(e: Engine, handle: str, mtype: str, body: str) -> Outputs:
    return e.handle(SendRequest(handles=(handle,), message_type=mtype, body=body), NOW)


def bodies(out: Outputs) -> list[str]:
    return [w.value.body or "" for w in out.queue if isinstance(w.value, QueueMessage)]


def test_remote_begin_and_send_produce_transmission_records(a: Engine) -> None:
    out = begin(a)
    assert not out.errors
    ep = out.endpoints[0]
    assert ep.far_instance == "b" and ep.far_handle == target_handle("c1") and ep.priority == 3
    out = send(a, "c1", "Req", '{"n": 0}')
    out2 = send(a, "c1", "Req", '{"n": 1}')
    assert not out.queue and not out2.queue
    t0, t1 = out.transmissions[0], out2.transmissions[0]
    assert (t0.seq, t1.seq) == (0, 1)
    assert (t0.from_instance, t0.to_instance, t0.to_service, t0.from_service) == (
        "a",
        "b",
        "Tgt",
        "Init",
    )
    assert (
        t0.priority == 3 and t0.from_initiator and t0.contract == "C" and t0.message_type == "Req"
    )
    assert t0.message_id != t1.message_id and t0.enqueued_ms == NOW
    # the record is a valid request for the receiving dispatcher (round trip through JSON)
    assert parse_request(dumps(t0)) == t0


def test_unknown_route_is_a_clear_error(a: Engine) -> None:
    out = begin(a, to="Nowhere")
    assert [e.code for e in out.errors] == ["unknown_service"]
    assert "no route" in out.errors[0].reason
    out = a.handle(
        BeginRequest(
            handle="x",
            from_service="Init",
            to_service="Tgt",
            contract="C",
            to_broker_instance="zz",
        ),
        NOW,
    )
    assert out.errors and "zz" in out.errors[0].reason


def test_inbound_creates_target_with_local_priority_and_acks(a: Engine, b: Engine) -> None:
    begin(a)
    t = send(a, "c1", "Req", '{"n": 0}').transmissions[0]
    out = b.handle(t, NOW + 5)
    assert not out.errors
    target = next(e for e in out.endpoints if e.handle == target_handle("c1"))
    assert target.state is State.STARTED_INBOUND and target.priority == 8  # B's rule, not A's 3
    assert target.far_instance == "a" and target.recv_seq == 1
    assert bodies(out) == ['{"n": 0}']
    assert [(k.ack_seq, k.to_instance, k.from_initiator) for k in out.acks] == [(0, "a", True)]


def test_out_of_order_and_duplicates(a: Engine, b: Engine) -> None:
    begin(a)
    ts = [send(a, "c1", "Req", json.dumps({"n": i})).transmissions[0] for i in range(4)]
    got: list[str] = []
    acks: list[int] = []
    for t in (ts[2], ts[0], ts[0], ts[3], ts[1], ts[2], ts[1]):
        out = b.handle(t, NOW)
        got += bodies(out)
        acks += [k.ack_seq for k in out.acks]
    assert [json.loads(x)["n"] for x in got] == [0, 1, 2, 3]
    assert acks == [-1, 0, 0, 0, 3, 3, 3]


def test_window_survives_restart_from_endpoint_records(a: Engine, b: Engine) -> None:
    begin(a)
    ts = [send(a, "c1", "Req", json.dumps({"n": i})).transmissions[0] for i in range(3)]
    records: dict[str, bytes] = {}
    for t in ts[:2]:
        for ep in b.handle(t, NOW).endpoints:
            records[ep.handle] = encode_endpoint(ep)
    fresh = engine(B_CATALOG, "b")
    for raw in records.values():
        fresh.load_endpoint(decode_endpoint(raw))
    dup = fresh.handle(ts[1], NOW)
    assert bodies(dup) == [] and dup.acks[0].ack_seq == 1
    nxt = fresh.handle(ts[2], NOW)
    assert bodies(nxt) == ['{"n": 2}'] and nxt.acks[0].ack_seq == 2


def _receive_all(e: Engine, out: Outputs) -> None:
    """Commit a receipt for every message `out` put in a queue (the application's RECEIVE)."""
    for w in out.queue:
        if isinstance(w.value, QueueMessage):
            m = w.value
            e.handle(
                CommitRequest(
                    receipt=Receipt(
                        queue=m.queue, group=m.conversation_group_id, message_ids=(m.message_id,)
                    ),
                ),
                NOW,
            )


def test_request_reply_and_end_both_sides(a: Engine, b: Engine) -> None:
    begin(a)
    req = send(a, "c1", "Req", "{}").transmissions[0]
    out = b.handle(req, NOW)
    _receive_all(b, out)
    th = target_handle("c1")
    reply = b.handle(SendRequest(handles=(th,), message_type="Rep", body="ok"), NOW)
    assert not reply.queue
    rep = reply.transmissions[0]
    assert (rep.seq, rep.from_initiator, rep.to_instance, rep.to_service, rep.priority) == (
        0,
        False,
        "a",
        "Init",
        8,
    )
    end_b = b.handle(EndRequest(handle=th), NOW).transmissions[0]
    assert end_b.message_type == END_DIALOG and end_b.seq == 1
    assert b.endpoints[th].state is State.DISCONNECTED_OUTBOUND
    got = a.handle(rep, NOW)
    got2 = a.handle(end_b, NOW)
    assert bodies(got) == ["ok"] and got.acks[0].ack_seq == 0 and not got.acks[0].from_initiator
    assert a.endpoints["c1"].state is State.DISCONNECTED_INBOUND
    _receive_all(a, got)
    _receive_all(a, got2)
    fin = a.handle(EndRequest(handle="c1"), NOW)
    assert "c1" not in a.endpoints
    last = fin.transmissions[0]
    assert last.message_type == END_DIALOG and last.seq == 1
    closed = b.handle(last, NOW)
    assert th not in b.endpoints and closed.acks[0].ack_seq == 1
    # a late retransmission of the first request does not begin the dialog again
    again = b.handle(req, NOW)
    assert not again.endpoints and not again.queue and again.acks


def test_inbound_to_unknown_service_refuses_the_dialog(a: Engine) -> None:
    other = engine({**B_CATALOG, "services": [], "queues": []}, "b")
    begin(a)
    t = send(a, "c1", "Req", "{}").transmissions[0]
    out = other.handle(t, NOW)
    assert [e.code for e in out.errors] == ["dialog_refused"]
    err = out.transmissions[0]
    assert err.message_type == ERROR and err.to_instance == "a" and out.acks[0].ack_seq == 0
    back = a.handle(err, NOW)
    assert a.endpoints["c1"].state is State.ERROR and back.queue


def test_remote_validation_failure_fails_both_sides(a: Engine, b: Engine) -> None:
    begin(a)
    out = send(a, "c1", "Req", "not json")
    assert a.endpoints["c1"].state is State.ERROR
    assert [w.value.message_type_name for w in out.queue if w.value is not None] == [ERROR]  # type: ignore[union-attr]
    err = out.transmissions[0]
    got = b.handle(err, NOW)
    ep: Endpoint = next(e for e in got.endpoints if e.handle == target_handle("c1"))
    assert ep.state is State.ERROR


def test_purge_windows_drops_old_early_arrivals(a: Engine, b: Engine) -> None:
    begin(a)
    ts = [send(a, "c1", "Req", "{}").transmissions[0] for _ in range(3)]
    b.handle(ts[0], NOW)
    b.handle(ts[2], NOW)
    assert b.purge_windows(NOW + 5_000, 10_000) == 0
    assert b.purge_windows(NOW + 10_000, 10_000) == 1
    out = b.handle(ts[1], NOW + 10_001)
    assert len(bodies(out)) == 1 and out.acks[0].ack_seq == 1  # seq 2 must come again


def test_inbound_for_another_instance_is_left_to_the_forwarder(b: Engine) -> None:
    msg = InboundMessage(
        message_id="m",
        conversation_id="c",
        from_instance="a",
        to_instance="zz",
        from_service="Init",
        to_service="Tgt",
        contract="C",
        message_type="Req",
        from_initiator=True,
        seq=0,
        priority=5,
        enqueued_ms=NOW,
    )
    out = b.handle(msg, NOW)
    assert out.errors == [] and out.acks == [] and out.transmissions == [] and not bodies(out)


def test_records_between_instances_are_keyed_by_the_receiving_group(a: Engine, b: Engine) -> None:
    """An initiator in a named group: the target's replies are keyed by that group, so with
    several dispatchers at the initiator's end they reach the one that owns it."""
    out = a.handle(
        BeginRequest(
            handle="c9",
            from_service="Init",
            to_service="Tgt",
            contract="C",
            conversation_group_id="orders-7",
        ),
        NOW,
    )
    assert not out.errors
    [first] = send(a, "c9", "Req", "{}").transmissions
    assert (first.from_group, first.key) == ("orders-7", target_handle("c9"))
    got = b.handle(first, NOW)
    [m] = [w.value for w in got.queue if isinstance(w.value, QueueMessage)]
    assert m.conversation_group_id == target_handle("c9")  # a new group: the target's handle
    assert b.endpoints[target_handle("c9")].far_group == "orders-7"
    [reply] = send(b, target_handle("c9"), "Rep", "r").transmissions
    assert (reply.to_group, reply.key, reply.from_group) == ("orders-7", "orders-7", None)


def test_an_end_applied_in_an_aborted_transaction_closes_again_when_redelivered(
    a: Engine, b: Engine
) -> None:
    """Found by the chaos harness: B's transaction that closed its ended endpoints was aborted
    (the consumer group had moved on), B rebuilt the shard from Kafka and read A's EndDialog
    again, but still remembered the endpoint as closed and only acknowledged it: its
    DISCONNECTED_OUTBOUND record stayed for ever."""
    begin(a)
    out = b.handle(send(a, "c1", "Req", "{}").transmissions[0], NOW)
    _receive_all(b, out)
    th = target_handle("c1")
    end_b = b.handle(EndRequest(handle=th), NOW)
    committed = encode_endpoint(next(e for e in end_b.endpoints if e.handle == th))
    a.handle(end_b.transmissions[0], NOW)
    last = a.handle(EndRequest(handle="c1"), NOW).transmissions[0]
    first = b.handle(last, NOW)
    assert [e.state for e in first.endpoints if e.handle == th] == [State.CLOSED]
    assert th not in b.endpoints
    # the transaction is aborted: B gives the shard up and rebuilds it from what was committed
    shard = b.ownership.shard(th)
    b.drop_shard(shard)
    b.ownership.owned.add(shard)
    b.load_endpoint(decode_endpoint(committed))
    b.finish_load()
    assert b.endpoints[th].state is State.DISCONNECTED_OUTBOUND
    again = b.handle(last, NOW)
    assert [e.state for e in again.endpoints if e.handle == th] == [State.CLOSED]
    assert th not in b.endpoints and again.acks[0].ack_seq == 1


# ----------------------------------------------------------------- what a peer sends is checked
def _from_a(
    seq: int, mtype: str, body: str, *, conversation: str = "x1", **over: Any
) -> InboundMessage:
    fields: dict[str, Any] = {
        "message_id": f"m{seq}",
        "conversation_id": conversation,
        "from_instance": "a",
        "to_instance": "b",
        "from_service": "Init",
        "to_service": "Tgt",
        "contract": "C",
        "message_type": mtype,
        "from_initiator": True,
        "seq": seq,
        "priority": 5,
        "enqueued_ms": NOW,
        "body": body,
    }
    return InboundMessage(**{**fields, **over})


def test_a_message_from_an_instance_no_route_names_is_refused_and_not_acknowledged(
    b: Engine,
) -> None:
    """Not even the instance to acknowledge to is believed: an ack to a topic the dispatcher
    may not write failed its transaction forever."""
    out = b.handle(_from_a(0, "Req", "{}", from_instance="nowhere"), NOW)
    [error] = out.errors
    assert error.code == "unknown_peer" and "'nowhere'" in error.reason
    assert not out.acks and not out.queue and not b.endpoints


@pytest.mark.parametrize(
    ("mtype", "body", "why"),
    [
        ("Req", "x" * 1001, "over the limit of 1000"),
        ("Req", "not json", "not well-formed JSON"),
        ("Rep", "{}", "may not be sent by the initiator"),
        ("Other", "{}", "not in contract 'C'"),
    ],
)
def test_a_peers_message_its_target_would_refuse_fails_the_dialog(
    b: Engine, mtype: str, body: str, why: str
) -> None:
    """As a local target refuses a SEND: nothing enqueued, an Error back to the far side in the
    conversation's order, this side closed, its queued messages gone."""
    first = b.handle(_from_a(0, "Req", '{"n": 0}'), NOW)
    assert bodies(first) == ['{"n": 0}']
    out = b.handle(_from_a(1, mtype, body), NOW)
    [error] = out.transmissions
    assert error.message_type == ERROR and why in json.loads(error.body_bytes())["description"]
    assert error.to_instance == "a" and not bodies(out)
    assert [a.ack_seq for a in out.acks] == [1]  # taken, in order: not sent again
    target = target_handle("x1")
    assert [e.state for e in out.endpoints if e.handle == target] == [State.CLOSED]
    assert [w.value for w in out.queue] == [None]  # the first message left its queue
