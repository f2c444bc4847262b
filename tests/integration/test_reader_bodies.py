"""RECEIVE with bodies read back from Kafka: the reader's index holds no bodies, its record cache
is bounded, and whatever it must read back, RECEIVE keeps its order and exactly-once."""

from __future__ import annotations

import json
import time

import pytest

from devtools.deployment import Deployment
from ksb.catalog.model import DIALOG_TIMER
from ksb.sdk.client import KsbClient
from ksb.sdk.reader import QueueReader
from tests.integration.conftest import ThreadDispatcher

pytestmark = pytest.mark.integration

I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741
Q = "TargetQueue"


def _send_round_robin(client: KsbClient, dialogs: int, per_dialog: int, pad: int = 0) -> list[str]:
    handles = [client.begin_dialog(I, T, C) for _ in range(dialogs)]
    for n in range(per_dialog):
        for d, h in enumerate(handles):
            client.send(h, "//t/Request", json.dumps({"d": d, "n": n, "pad": "x" * pad}))
    client.flush()
    return handles


def _wait_indexed(reader: QueueReader, count: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while reader.index.ready_messages < count:
        assert time.monotonic() < deadline, f"{reader.index.ready_messages} of {count} indexed"
        time.sleep(0.05)


def _drain(client: KsbClient, count: int, top: int | None) -> dict[int, list[int]]:
    """RECEIVE and commit until `count` messages came; per dialog, the numbers in order received."""
    got: dict[int, list[int]] = {}
    deadline = time.monotonic() + 30
    received = 0
    while received < count:
        assert time.monotonic() < deadline, f"only {received} of {count} received"
        with client.transaction() as tx:
            for m in tx.receive(Q, top=top, waitfor_ms=500):
                if m.message_type_name == DIALOG_TIMER:
                    continue
                body = json.loads(m.message_body)
                got.setdefault(body["d"], []).append(body["n"])
                received += 1
    return got


def test_bodies_read_back_from_kafka_keep_receive_order_and_rollback(
    settings: Deployment, dispatcher: ThreadDispatcher
) -> None:
    uncached = settings.model_copy(update={"reader_cache_bytes": 0})
    with KsbClient(uncached) as client:
        handles = _send_round_robin(client, dialogs=3, per_dialog=12)
        client.begin_conversation_timer(handles[0], 0.2)
        client.flush()
        reader = client.reader(Q)
        _wait_indexed(reader, 36)
        tx = client.transaction()
        first = tx.receive(Q, top=5, waitfor_ms=5000)
        more = tx.receive(Q, top=5)  # the same group, after what this transaction already has
        assert len(first) == 5 and len(more) == 5
        assert not {m.message_id for m in first} & {m.message_id for m in more}
        tx.rollback()
        again = client.transaction()
        second = again.receive(Q, top=10, conversation_group_id=first[0].conversation_group_id)
        assert [m.message_id for m in second] == [m.message_id for m in first + more]
        assert [m.message_body for m in second] == [m.message_body for m in first + more]
        again.rollback()
        got = _drain(client, 36, top=4)
        assert got == {d: list(range(12)) for d in range(3)}
        assert reader.bodies.bytes == 0
        assert sum(f.records_read for f in reader.fetchers) >= 36


def test_a_small_cache_serves_what_a_read_back_passed_over(
    settings: Deployment, dispatcher: ThreadDispatcher
) -> None:
    small = settings.model_copy(update={"reader_cache_bytes": 40_000})
    with KsbClient(small) as sender:
        _send_round_robin(sender, dialogs=8, per_dialog=25, pad=900)
        with KsbClient(small) as client:  # a reader started on a backlog ~5 times its cache
            reader = client.reader(Q)
            _wait_indexed(reader, 200)
            assert 0 < reader.bodies.bytes <= 40_000
            got = _drain(client, 200, top=5)
            assert got == {d: list(range(25)) for d in range(8)}
            # 40 RECEIVEs at least; reading on and the records kept on the way spare most seeks
            assert 0 < sum(f.seeks for f in reader.fetchers) < 20
            assert reader.bodies.bytes <= 40_000
