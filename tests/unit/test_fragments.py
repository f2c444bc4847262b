"""Large inbound records split into fragments and joined again, whatever the arrival order."""

from __future__ import annotations

import pytest

from ksb.wire.fragments import Reassembler, wire_records
from ksb.wire.protocol import FragmentRecord, InboundMessage, dumps, parse_inbound

T0 = 1_700_000_000_000


def _msg(body: str, mid: str = "m") -> InboundMessage:
    return InboundMessage(
        message_id=mid,
        conversation_id="c",
        from_instance="A",
        to_instance="B",
        from_service="I",
        to_service="T",
        contract="C",
        message_type="M",
        from_initiator=True,
        seq=0,
        priority=5,
        enqueued_ms=T0,
        body=body,
    )


def _fragments(msg: InboundMessage, size: int) -> list[FragmentRecord]:
    out = []
    for raw in wire_records(msg, size):
        rec = parse_inbound(raw)
        assert isinstance(rec, FragmentRecord)
        out.append(rec)
    return out


def test_small_records_go_whole() -> None:
    msg = _msg("hello")
    assert wire_records(msg, 4096) == [dumps(msg)]
    assert parse_inbound(dumps(msg)) == msg


def test_split_and_join_in_order() -> None:
    msg = _msg("é" * 5000 + "x" * 3001)
    frags = _fragments(msg, 1024)
    assert len(frags) == -(-len(dumps(msg)) // 1024) and {f.count for f in frags} == {len(frags)}
    assert all(f.to_instance == "B" and f.message_id == "m" for f in frags)
    r = Reassembler()
    got = [r.offer(f, T0) for f in frags]
    assert got[:-1] == [None] * (len(frags) - 1) and got[-1] == msg and len(r) == 0


def test_out_of_order_duplicates_and_interleaved_messages() -> None:
    a, b = _msg("a" * 3000, "ma"), _msg("b" * 3000, "mb")
    fa, fb = _fragments(a, 1024), _fragments(b, 1024)
    assert len(fa) == len(fb) == 4
    r = Reassembler()
    # reversed, repeated and interleaved: nothing is whole until each message's last piece is in
    order = [fa[3], fb[1], fa[0], fa[3], fb[0], fa[0], fb[3], fa[1], fb[2], fa[2]]
    done = [m for f in order if (m := r.offer(f, T0)) is not None]
    assert done == [b, a] and len(r) == 0
    # a retransmission after completion joins again (the receiver's window drops the duplicate)
    assert [r.offer(f, T0) for f in reversed(fa)][-1] == a


def test_partial_messages_go_stale() -> None:
    frags = _fragments(_msg("z" * 4000), 1024)
    r = Reassembler()
    r.offer(frags[0], T0)
    assert r.purge(T0 + 59_999, 60_000) == 0
    assert r.purge(T0 + 60_000, 60_000) == 1
    assert [r.offer(f, T0 + 60_001) for f in frags][-1] is not None  # the origin resends all


def test_a_fragment_index_outside_its_count_is_malformed() -> None:
    from ksb.errors import ProtocolError

    bad = b'{"kind":"fragment","message_id":"m","conversation_id":"c","from_instance":"A",'
    bad += b'"to_instance":"B","index":3,"count":3,"data_b64":""}'
    with pytest.raises(ProtocolError, match="index"):
        parse_inbound(bad)
