"""The waiting-message ledger (`ksb.dialog.membership`): compact entries, whole ones, the counts."""

from __future__ import annotations

from ksb.dialog.membership import Membership, message_id
from ksb.dialog.outputs import Inflight
from ksb.wire.endpoint import Endpoint
from tests.unit.endpoints import make_endpoint


def _endpoint(handle: str) -> Endpoint:
    return make_endpoint(
        handle=handle, is_initiator=False, queue="Q", group="g-" + handle, far_handle=None
    )


def _info(mid: str, handle: str, enqueued_ms: int = 10) -> Inflight:
    return Inflight(
        "Q", 0, "g-" + handle, handle, "M", None, enqueued_ms=enqueued_ms, message_id=mid
    )


def _ledger(*handles: str) -> Membership:
    endpoints = {h: _endpoint(h) for h in handles}
    return Membership(endpoints, lambda _queue: 1, lambda _group: 0)


def test_a_record_read_back_again_is_one_waiting_message() -> None:
    ledger = _ledger("h")
    mid = message_id("h", 0)
    ledger.add(mid, _info(mid, "h"))
    ledger.add(mid, _info(mid, "h", enqueued_ms=20))  # the same record, read back again
    assert len(ledger) == 1 and ledger.shard_depth == {("Q", 0): 1}
    got = ledger.get(mid)
    assert got is not None and got.enqueued_ms == 20 and got.group == "g-h"
    assert ledger.remove(mid) and not ledger.remove(mid)
    assert len(ledger) == 0 and ledger.shard_depth == {("Q", 0): 0}
    assert ledger.get(mid) is None


def test_messages_added_out_of_order_leave_in_any_order_and_counts_stay_true() -> None:
    ledger = _ledger("h")
    for n in (3, 1, 2):
        ledger.add(message_id("h", n), _info(message_id("h", n), "h"))
    assert sorted(ledger) == [message_id("h", n) for n in (1, 2, 3)]
    assert ledger.remove(message_id("h", 2)) and not ledger.remove(message_id("h", 2))
    assert ledger.waiting_of("h") == 2 and ledger.shard_depth[("Q", 0)] == 2


def test_a_message_kept_whole_is_replaced_by_its_compact_entry_once() -> None:
    ledger = _ledger("h")
    mid = message_id("h", 0)
    retained_ledger = _ledger()  # its endpoint unknown: the message is kept whole
    retained_ledger.add(mid, _info(mid, "h"))
    ledger.adopt(retained_ledger)
    assert ledger.shard_depth == {("Q", 0): 1}
    ledger.add(mid, _info(mid, "h"))  # now its endpoint is known
    assert len(ledger) == 1 and ledger.shard_depth == {("Q", 0): 1}
    assert ledger.remove(mid) and len(ledger) == 0 and ledger.shard_depth == {("Q", 0): 0}


def test_an_id_not_of_the_handle_form_is_kept_whole() -> None:
    ledger = _ledger("h")
    ledger.add("legacy-id", _info("legacy-id", "h"))
    assert ledger.get("legacy-id") == _info("legacy-id", "h")
    assert ledger.remove("legacy-id") and ledger.shard_depth == {("Q", 0): 0}
