"""Several dispatcher processes share one instance: exactly once, in order, through membership
changes (a member SIGKILLed, one SIGSTOPped until its shards moved, one added), and timers that
fire once when their shard moves while they come due.

Each test runs 100,000 messages over 1,000 dialogs through three dispatcher processes (six shards)
with the SDK's readers committing what they receive, changes the group part way through, and
checks the same invariants: every message delivered once, in its dialog's order, no commit
refused, nothing left to receive.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.e2e import (
    CONTRACT,
    INITIATOR,
    INITIATOR_QUEUE,
    MESSAGE_TYPE,
    TARGET,
    TARGET_QUEUE,
    Tally,
    bench_catalog,
)
from devtools.deployment import Deployment, secure_instance
from devtools.dispatchers import DispatcherPool
from devtools.queue_services import QueueReplicas
from ksb.runtime.catalog_store import apply_catalog
from ksb.sdk.client import KsbClient
from ksb.wire.partitioning import shard_of
from tests.integration.faulted_load import Load, assert_exactly_once_in_order, run_with_fault
from tests.integration.support import endpoints, queue_receipts

pytestmark = pytest.mark.integration

SHARDS = 6
LOAD = Load(messages=100_000, dialogs=1_000)
FAULT_AT = 0.3
"""The fault comes once this share of the messages has been delivered."""


@pytest.fixture
def scaled(settings: Deployment, tmp_path: Path) -> Iterator[Deployment]:
    # An instance of its own: its topics are made with the shard count when it is secured. Its
    # queue service runs as processes of their own, as the dispatchers do: the test's own
    # process is busy sending and receiving.
    s = secure_instance(
        settings.model_copy(
            update={"instance": f"{settings.instance}s", "request_partitions": SHARDS}
        )
    )
    apply_catalog(s, bench_catalog(SHARDS))
    replicas = QueueReplicas(s, tmp_path / "queue").start(2)
    try:
        yield replicas.client_settings(s)
    finally:
        replicas.stop()


@pytest.fixture
def pool(scaled: Deployment, tmp_path: Path) -> Iterator[DispatcherPool]:
    with DispatcherPool(scaled, tmp_path).start(3) as p:
        yield p


def test_a_killed_dispatchers_shards_move_to_the_others(
    scaled: Deployment, pool: DispatcherPool
) -> None:
    def kill(_tally: Tally) -> None:
        before = pool.owned()
        pool.kill("d2")
        pool.wait_settled(60)
        after = pool.owned()
        assert "d2" not in after and before["d2"] <= after["d1"] | after["d3"]
        # KSB's assignor: the survivors keep what they had (Kafka's range moved their shards).
        assert before["d1"] <= after["d1"] and before["d3"] <= after["d3"], (before, after)

    result, failures = run_with_fault(scaled, LOAD, kill, FAULT_AT)
    assert_exactly_once_in_order(result, failures, LOAD)


def test_a_paused_dispatcher_commits_nothing_once_its_shards_moved(
    scaled: Deployment, pool: DispatcherPool
) -> None:
    def pause(_tally: Tally) -> None:
        pool.pause("d2")
        pool.wait_settled(60)  # d1 and d3 own every shard: d2's session has expired
        assert set(pool.owned()) == {"d1", "d3"}
        pool.resume("d2")  # a zombie: its transaction, if one was open, must not commit

    result, failures = run_with_fault(scaled, LOAD, pause, FAULT_AT)
    assert_exactly_once_in_order(result, failures, LOAD)
    log = pool.members["d2"].log_text()
    # It learnt it was out of the group (its shards lost, or its transaction refused) before it
    # took part again.
    assert "lost (this member was fenced)" in log or "transaction failed" in log, log[-3000:]


def test_a_fourth_dispatcher_joins_mid_stream_and_takes_a_share(
    scaled: Deployment, pool: DispatcherPool
) -> None:
    def add(tally: Tally) -> None:
        before = pool.owned()
        name = pool.add()
        after = pool.owned()
        assert after[name]
        # The others only give shards up, to the newcomer: none moves between them.
        assert all(after[m] <= before[m] for m in before), (before, after)
        # It is in while work is left to do (a process takes seconds to start and join, so it
        # is started early).
        assert tally.delivered < LOAD.messages, tally.delivered

    result, failures = run_with_fault(scaled, LOAD, add, at=0.02)
    assert_exactly_once_in_order(result, failures, LOAD)
    owned = pool.owned()
    assert len(owned) == 4 and all(owned.values())
    pool.stop()
    counts = {name: a.records for name, a in pool.applied().items()}
    assert set(counts) == {"d1", "d2", "d3", "d4"} and counts["d4"] > 0, counts


TIMED = 30
TIMER_S = 12.0


def test_a_timer_fires_once_when_its_dispatcher_is_paused_past_it(
    scaled: Deployment, tmp_path: Path
) -> None:
    """d2 is paused while its shards' timers come due; d1 takes the shards and fires them. When
    d2 wakes, its heap still holds them, due: its transaction must be refused, not committed
    (found by the chaos harness as a DialogTimer delivered twice)."""
    with DispatcherPool(scaled, tmp_path).start(2) as pool:
        with KsbClient(scaled) as client:
            handles = [client.begin_dialog(INITIATOR, TARGET, CONTRACT) for _ in range(TIMED)]
            for h in handles:
                client.begin_conversation_timer(h, TIMER_S)
            client.flush()
        due = time.monotonic() + TIMER_S
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            eps = endpoints(scaled)
            if all(h in eps and eps[h].timer_deadline_ms for h in handles):
                break
            time.sleep(0.2)
        assert pool.owned()["d2"], pool.owned()
        pool.pause("d2")
        pool.wait_settled(60)
        assert set(pool.owned()) == {"d1"}
        time.sleep(max(0.0, due - time.monotonic()) + 3)  # d1 fires every timer
        pool.resume("d2")
        pool.wait_settled(60)  # d2 is back in the group: it tried whatever it had due first
        assert set(pool.owned()) == {"d1", "d2"}
        deadline = time.monotonic() + 30  # on a busy machine an owner may still be firing them
        while True:
            timers = queue_receipts(scaled, INITIATOR_QUEUE)
            fired = sorted(mid.rsplit(":", 1)[0] for mid in timers)
            if fired == sorted(handles) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert fired == sorted(handles)
        assert set(timers.values()) == {(1, 0)}, {m: c for m, c in timers.items() if c != (1, 0)}


def test_receive_passes_over_a_paused_dispatchers_groups_while_others_wait(
    scaled: Deployment, tmp_path: Path
) -> None:
    """A reader whose commit on one shard goes unanswered while another shard answers a later one
    takes that other shard's group next, though the first shard's group became ready before it
    (`ksb.queue.stalls`); the unanswered commit applies once its dispatcher is back."""
    with DispatcherPool(scaled, tmp_path).start(2) as pool, KsbClient(scaled) as client:
        owned = pool.owned()
        paused = min(owned["d2"])  # a1 and a2 on one shard of d2, b1 and b2 on d1's
        on_d2: list[str] = []
        on_d1: list[str] = []
        for _ in range(400):  # dialogs until two on each (handles hash to shards at random)
            h = client.begin_dialog(INITIATOR, TARGET, CONTRACT)
            shard = shard_of(h, SHARDS)
            if shard == paused:
                on_d2.append(h)
            elif shard in owned["d1"]:
                on_d1.append(h)
            if len(on_d2) >= 2 and len(on_d1) >= 2:
                break
        # Ready in this order: a1, b1, a2, b2 (each indexed before the next is sent).
        order = zip(["a1", "b1", "a2", "b2"], [on_d2[0], on_d1[0], on_d2[1], on_d1[1]], strict=True)
        for n, (name, h) in enumerate(order):
            client.send(h, MESSAGE_TYPE, name.encode())
            client.flush()
            deadline = time.monotonic() + 30
            while client.queue_state(TARGET_QUEUE).ready_messages < n + 1:
                assert time.monotonic() < deadline, f"{name} not indexed"
                time.sleep(0.02)

        def receive() -> tuple[str, Any]:
            tx = client.transaction()
            got = tx.receive(TARGET_QUEUE, waitfor_ms=5000)
            assert len(got) == 1
            return got[0].message_body.decode(), tx

        pool.pause("d2")
        try:
            first, tx = receive()
            stuck = tx.commit_async()  # d2's: no answer while it is paused
            time.sleep(0.3)
            second, tx = receive()
            tx.commit(30)  # d1's, sent 300 ms after the one d2 has not answered
            third, tx = receive()
            tx.commit(30)
        finally:
            pool.resume("d2")
        assert (first, second) == ("a1", "b1")
        assert third == "b2"  # not a2, though a2 became ready first
        stuck.result(30)  # applied once d2 is back
        last, tx = receive()
        tx.commit(30)
        assert last == "a2"
