"""Endpoint records leave counters to the queue records; a rebuild still gets them exactly.

A script of dialogs runs on one engine while every record it would write is kept, in order. A
second engine is rebuilt from those records alone (endpoints first, then the queue records, as the
dispatcher reads them), once as written and once as log compaction leaves them (the last record
per key, tombstones gone), and must agree with the first on every endpoint's counters and state.
"""

from __future__ import annotations

from typing import Any

import pytest

from ksb.catalog.model import CatalogView, parse_catalog
from ksb.dialog.engine import Engine
from ksb.dialog.outputs import Outputs, QueueWrite
from ksb.wire.endpoint import Endpoint, decode_endpoint, encode_endpoint
from ksb.wire.partitioning import target_handle
from ksb.wire.protocol import (
    AnyRequest,
    BeginRequest,
    CommitRequest,
    EndRequest,
    QueueMessage,
    Receipt,
    SendRequest,
)

CATALOG: dict[str, Any] = {
    "message_types": [{"name": "Req"}, {"name": "Rep"}],
    "contracts": [
        {
            "name": "C",
            "messages": [
                {"type": "Req", "sent_by": "INITIATOR"},
                {"type": "Rep", "sent_by": "TARGET"},
            ],
        }
    ],
    "queues": [{"name": "IQ"}, {"name": "TQ", "partitions": 2}],
    "services": [
        {"name": "Init", "queue": "IQ"},
        {"name": "Tgt", "queue": "TQ", "contracts": ["C"]},
    ],
}


def engine() -> Engine:
    return Engine(CatalogView(parse_catalog(CATALOG)), instance="u", max_body_bytes=1000)


class Recorder:
    """An engine and the records it wrote: endpoints and queue records, in order."""

    def __init__(self) -> None:
        self.engine = engine()
        self.endpoints: list[tuple[str, bytes]] = []
        self.queue: list[QueueWrite] = []
        self.token = 0

    def apply(self, req: AnyRequest) -> Outputs:
        out = self.engine.handle(req, 0)
        assert not out.errors, out.errors
        self.endpoints += [(ep.handle, encode_endpoint(ep)) for ep in out.endpoints]
        self.queue += out.queue
        return out

    def receive(self, handle: str, *, take: int | None = None) -> None:
        """Commit the oldest `take` (all) waiting messages of `handle`'s group."""
        ep = self.engine.endpoints[handle]
        mids = sorted(
            (mid for mid, i in self.engine.waiting.items() if i.handle == handle),
            key=lambda m: int(m.rsplit(":", 1)[1]),
        )[:take]
        self.token += 1
        receipt = Receipt(queue=ep.queue, group=ep.group, token=self.token, message_ids=tuple(mids))
        self.apply(CommitRequest(receipt=receipt))


def script(r: Recorder) -> list[str]:
    """Dialogs in every stage: sent to and unread, partly read, replied to, ended."""
    handles = [f"h{n}" for n in range(4)]
    for h in handles:
        r.apply(BeginRequest(handle=h, from_service="Init", to_service="Tgt", contract="C"))
        for i in range(5):
            r.apply(SendRequest(handles=(h,), message_type="Req", body=str(i)))
    r.receive(target_handle("h1"), take=2)
    r.receive(target_handle("h2"))
    r.apply(SendRequest(handles=(target_handle("h2"),), message_type="Rep", body="r"))
    r.apply(SendRequest(handles=("h2",), message_type="Req", body="after"))
    r.receive(target_handle("h3"))
    r.apply(EndRequest(handle=target_handle("h3")))
    r.receive("h3")
    r.receive(target_handle("h0"))  # all read, more sent, all read again: nothing but the
    for i in range(3):  # counters changes at the second receipt, and compaction keeps no message
        r.apply(SendRequest(handles=("h0",), message_type="Req", body=f"more{i}"))
    r.receive(target_handle("h0"))
    return handles


def rebuilt(endpoints: list[tuple[str, bytes]], queue: list[QueueWrite]) -> Engine:
    fresh = engine()
    for _handle, raw in endpoints:
        fresh.load_endpoint(decode_endpoint(raw))
    for w in queue:
        if not w.key.startswith("commit/"):
            value = w.value if isinstance(w.value, QueueMessage) else None
            fresh.load_queue_record(w.key, value, w.partition)
    fresh.finish_load()
    return fresh


def compacted(r: Recorder) -> tuple[list[tuple[str, bytes]], list[QueueWrite]]:
    """What compaction leaves: the last record per key, and no tombstones."""
    endpoints = dict(r.endpoints)
    queue = {w.key: w for w in r.queue}
    return list(endpoints.items()), [w for w in queue.values() if w.value is not None]


def counters(ep: Endpoint) -> tuple[object, ...]:
    return (ep.state, ep.send_seq, ep.enqueued, ep.recv_seq, ep.outstanding)


@pytest.mark.parametrize("compact", [False, True])
def test_a_rebuild_restores_what_endpoint_records_left_out(compact: bool) -> None:
    r = Recorder()
    script(r)
    live = r.engine.endpoints
    fresh = rebuilt(*compacted(r)) if compact else rebuilt(r.endpoints, r.queue)
    assert {h: counters(ep) for h, ep in fresh.endpoints.items()} == {
        h: counters(ep) for h, ep in live.items()
    }
    assert set(fresh.waiting) == set(r.engine.waiting)
    # And the rebuilt engine goes on where the live one would: the next message has the next
    # number and sequence, in either.
    nxt = SendRequest(handles=("h1",), message_type="Req", body="next")
    live_out, fresh_out = r.engine.handle(nxt, 1), fresh.handle(nxt, 1)
    [a] = [w.value for w in live_out.queue if isinstance(w.value, QueueMessage)]
    [b] = [w.value for w in fresh_out.queue if isinstance(w.value, QueueMessage)]
    assert (a.message_id, a.message_sequence_number) == (b.message_id, b.message_sequence_number)


def test_a_send_writes_no_endpoint_record_once_the_dialog_is_conversing() -> None:
    r = Recorder()
    r.apply(BeginRequest(handle="h", from_service="Init", to_service="Tgt", contract="C"))
    first = r.apply(SendRequest(handles=("h",), message_type="Req", body="0"))
    assert {ep.handle for ep in first.endpoints} == {"h", target_handle("h")}  # new, and a state
    later = r.apply(SendRequest(handles=("h",), message_type="Req", body="1"))
    assert later.endpoints == []
    r.receive(target_handle("h"))  # a receipt writes both ends, with their counters
    [*_, last_t] = [raw for h, raw in r.endpoints if h == target_handle("h")]
    [*_, last_i] = [raw for h, raw in r.endpoints if h == "h"]
    assert decode_endpoint(last_t).enqueued == 2 and decode_endpoint(last_i).send_seq == 2
