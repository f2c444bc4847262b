"""Redis loses its state: FLUSHALL mid-run, expired and stolen locks, stale fencing tokens.

Redis holds only locks (ARCHITECTURE.md); the dispatcher is the authority that a message is received
at most once. These tests take Redis's state away and check that nothing is lost or received twice.
"""

from __future__ import annotations

import json
import time

import pytest

# confluent_kafka.admin re-exports these from a private module, with no __all__ to say so.
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
)

from devtools.deployment import Deployment
from ksb.errors import CommitRefused, LockLost
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.redis_client import redis_client
from ksb.sdk.client import KsbClient, Transaction
from ksb.security.principals import ADMIN
from ksb.wire.protocol import CommitRequest, QueueMessage, Receipt, SendRequest, dumps
from tests.integration.conftest import ThreadDispatcher
from tests.integration.support import (
    Flow,
    queue_receipts,
    read_topic,
    receive_all,
    wait_error,
    wait_for,
)

pytestmark = pytest.mark.integration

INIT, TGT, CON = "//t/Initiator", "//t/Target", "//t/Contract"
Q = "TargetQueue"


@pytest.fixture
def settings(settings: Deployment) -> Deployment:
    """The instance's settings with every commit confirming its lock first
    (``lock_confirm_age_ms`` 0): these tests take a lock from under its holder within moments of
    its grant (a flush, an expiry forced in Redis), which the SDK's default, committing a lock
    granted less than 2.5 s ago on its lease alone, would not notice. Then the holder's commit is
    applied and the new holder's refused: exactly once still, the other way round. A holder
    that really stalls has its lock expire only after ``lock_ttl_ms`` without renewal, long past
    that age, and confirms before it commits."""
    return settings.model_copy(update={"lock_confirm_age_ms": 0})


def _flushall(settings: Deployment) -> None:
    r = redis_client(settings.as_principal(ADMIN))  # FLUSHALL is the admin's alone
    try:
        r.flushall()
    finally:
        r.close()


def _token(settings: Deployment, group: str) -> int:
    r = redis_client(settings)
    try:
        raw = r.hget(Names(settings.instance).lock_key(Q, group), "token")
    finally:
        r.close()
    assert raw is not None, f"group {group} is not locked"
    return int(raw)


def _waiting(settings: Deployment) -> list[str]:
    """The ids of the target queue's messages that have no receipt yet, in queue order."""
    return [k for k, (m, r) in queue_receipts(settings, Q).items() if m and not r]


def _queued(settings: Deployment, count: int, timeout_s: float = 15) -> None:
    """Wait until ``count`` messages wait in the target queue."""
    deadline = time.monotonic() + timeout_s
    while len(_waiting(settings)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} messages queued in time"
        time.sleep(0.1)


def _dialog_with(client: KsbClient, settings: Deployment, count: int) -> str:
    h = client.begin_dialog(INIT, TGT, CON)
    for n in range(count):
        client.send(h, "//t/Request", json.dumps({"n": n}))
    client.flush()
    _queued(settings, count)
    return h


def _receive(tx: Transaction, count: int) -> list[QueueMessage]:
    got = tx.receive(Q, waitfor_ms=10_000)
    assert len(got) == count
    return got


def test_flushall_mid_run_keeps_exactly_once_in_order(
    settings: Deployment, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    """Redis is flushed twice while 1,800 messages flow; every one arrives once, in order.

    Each flush happens while the reader holds a group between RECEIVE and commit (so that commit
    must fail with LockLost and its messages come back) and while other commits are in flight.
    """
    flushed_at: list[int] = []

    def flush_midway(flow: Flow) -> None:
        if len(flushed_at) < 2 and len(flow.received) >= (400, 1_200)[len(flushed_at)]:
            _flushall(settings)
            flushed_at.append(len(flow.received))

    flow = Flow(
        settings,
        client,
        dialogs=30,
        per_dialog=60,
        round_pause_s=0.02,
        top=20,
        before_commit=flush_midway,
    ).start()
    try:
        flow.wait_received(flow.total, timeout_s=90)
    finally:
        flow.close()
    assert len(flushed_at) == 2 and flushed_at[1] < flow.total
    assert flow.lock_lost >= 2, "the flushes did not take a lock from under a commit"
    flow.check_exactly_once_in_order()
    receipts = queue_receipts(settings, Q)
    assert len(receipts) == flow.total and set(receipts.values()) == {(1, 1)}


def test_commit_after_lock_expired_and_taken_is_refused_and_redelivered(
    settings: Deployment, dispatcher: ThreadDispatcher
) -> None:
    """A's lease runs out (a stalled holder); B takes the group; A's commit is refused."""
    with KsbClient(settings) as a, KsbClient(settings) as b:
        _dialog_with(a, settings, 3)
        tx_a = a.transaction()
        first = _receive(tx_a, 3)
        # A live reader renews its leases, so the stall is simulated by letting the lock key's TTL
        # run out now in Redis: exactly what happens when the holder stops renewing. (Only the
        # queue service may touch a lock; the test does it as the admin.)
        r = redis_client(settings.as_principal(ADMIN))
        try:
            key = Names(settings.instance).lock_key(Q, first[0].conversation_group_id)
            assert r.pexpire(key, 1)
            time.sleep(0.05)
        finally:
            r.close()
        tx_b = b.transaction()
        second = _receive(tx_b, 3)
        assert [m.message_id for m in second] == [m.message_id for m in first]
        assert _token(settings, second[0].conversation_group_id) > 0
        with pytest.raises((LockLost, CommitRefused)):
            tx_a.commit()
        tx_b.commit()
        # Nothing is left for anyone, A included.
        for c in (a, b):
            tx = c.transaction()
            assert tx.receive(Q, waitfor_ms=300) == []
            tx.rollback()
    receipts = queue_receipts(settings, Q)
    assert {m.message_id: receipts[m.message_id] for m in first} == {
        m.message_id: (1, 1) for m in first
    }


def test_commit_after_flush_and_taken_is_refused_and_redelivered(
    settings: Deployment, dispatcher: ThreadDispatcher
) -> None:
    with KsbClient(settings) as a, KsbClient(settings) as b:
        _dialog_with(a, settings, 2)
        tx_a = a.transaction()
        first = _receive(tx_a, 2)
        group = first[0].conversation_group_id
        token_a = _token(settings, group)
        _flushall(settings)
        tx_b = b.transaction()
        second = _receive(tx_b, 2)
        assert [m.message_id for m in second] == [m.message_id for m in first]
        # The fencing counter restarted from Redis TIME: the new holder's token is still newer.
        assert _token(settings, group) > token_a
        with pytest.raises((LockLost, CommitRefused)):
            tx_a.commit()
        tx_b.commit()
        tx = a.transaction()
        assert tx.receive(Q, waitfor_ms=300) == []
        tx.rollback()


def test_commit_after_flush_with_no_new_holder_is_refused_and_messages_come_back(
    settings: Deployment, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    _dialog_with(client, settings, 2)
    tx = client.transaction()
    first = _receive(tx, 2)
    _flushall(settings)
    with pytest.raises(LockLost):
        tx.commit()
    again = client.transaction()
    second = _receive(again, 2)
    assert [m.message_id for m in second] == [m.message_id for m in first]
    again.commit()
    assert receive_all(client, Q, 1, timeout_s=0.5) == []


def _superseded(client: KsbClient, settings: Deployment) -> tuple[QueueMessage, int, str]:
    """Lock the first message's group and roll back, then let a newer holder receive it and
    commit: the first holder's token is now stale. Returns that message, the stale token and
    the stale lease (a real one, sealed for this principal and group: only its age is wrong)."""
    old = client.transaction()
    [m1] = old.receive(Q, top=1, waitfor_ms=10_000)
    group = m1.conversation_group_id
    stale_token, stale_lease = old.token, old.lease
    assert stale_token == _token(settings, group)
    old.rollback()
    newer = client.transaction()
    assert [
        m.message_id for m in newer.receive(Q, top=1, waitfor_ms=5000, conversation_group_id=group)
    ] == [m1.message_id]
    assert _token(settings, group) > stale_token
    newer.commit()
    return m1, stale_token, stale_lease


def _send_commit(
    settings: Deployment,
    group: str,
    token: int,
    lease: str,
    message_id: str,
    actions: tuple[SendRequest, ...] = (),
) -> CommitRequest:
    """Produce, as any Kafka client could, a commit under `lease` (and its `token`) that
    receives `message_id`."""
    receipt = Receipt(queue=Q, group=group, token=token, message_ids=(message_id,), lease=lease)
    commit = CommitRequest(reader="stale-holder", receipt=receipt, actions=actions)
    p = kafka.producer(settings)
    p.produce(
        Names(settings.instance).requests_for(settings.sender),
        key=group.encode(),
        value=dumps(commit),
    )
    assert p.flush(10) == 0
    return commit


def test_stale_fencing_token_is_refused_by_the_dispatcher(
    settings: Deployment, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    """A commit carrying an older token than one already applied for the group is refused whole."""
    h = _dialog_with(client, settings, 2)
    m1, stale_token, stale_lease = _superseded(client, settings)
    group = m1.conversation_group_id
    # m2 is still waiting; the old holder's commit names it and carries a SEND.
    [m2_id] = _waiting(settings)
    send = SendRequest(handles=(h,), message_type="//t/Request", body='{"stale":1}')
    stale = _send_commit(settings, group, stale_token, stale_lease, m2_id, (send,))
    err = wait_error(settings, lambda r: r.get("request_id") == stale.request_id)
    assert err["code"] == "stale_token"
    assert str(stale_token) in err["reason"]
    outcomes = [
        o
        for k, v in read_topic(settings, Names(settings.instance).queue(Q))
        if k == f"commit/{group}".encode() and v is not None
        if (o := json.loads(v))["request_id"] == stale.request_id
    ]
    assert [(o["applied"], o["reason"].split(":")[0]) for o in outcomes] == [(False, "stale_token")]
    # Nothing of the stale commit happened: m2 is delivered to a proper holder, the SEND was dropped
    # (the next message on the dialog still gets sequence number 2).
    client.send(h, "//t/Request", json.dumps({"n": 2}))
    client.flush()
    got = receive_all(client, Q, 2, timeout_s=15)
    assert [m.message_id for m in got][:1] == [m2_id]
    assert [json.loads(m.message_body) for m in got] == [{"n": 1}, {"n": 2}]
    assert [m.message_sequence_number for m in got] == [1, 2]
    assert receive_all(client, Q, 1, timeout_s=0.5) == []


# A queue topic's segments roll and are cleaned as soon as Kafka's log cleaner comes by.
_COMPACT_NOW = {
    "segment.ms": "100",
    "min.cleanable.dirty.ratio": "0.01",
    "delete.retention.ms": "0",
}


def _compact_soon(settings: Deployment, topic: str) -> None:
    admin = kafka.admin(settings.as_principal(ADMIN))
    resource = ConfigResource(
        ConfigResource.Type.TOPIC,
        topic,
        incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET)
            for k, v in _COMPACT_NOW.items()
        ],
    )
    for fut in admin.incremental_alter_configs([resource]).values():
        fut.result(30)


def test_a_stale_token_is_refused_after_compaction_and_a_restart(
    settings: Deployment, client: KsbClient, dispatcher: ThreadDispatcher
) -> None:
    """The group's fence outlives Kafka's compaction of the queue topic and a dispatcher restart:
    the newest commit outcome of a group is never tombstoned while the group lives, and it carries
    the fence the rebuild takes back (issue 12: fences were once rebuilt only from outcomes that
    were tombstoned at once, so after compaction and a restart a stale token was accepted)."""
    topic = Names(settings.instance).queue(Q)
    h = _dialog_with(client, settings, 2)
    m1, stale_token, stale_lease = _superseded(client, settings)
    group = m1.conversation_group_id
    _compact_soon(settings, topic)
    time.sleep(0.3)  # past segment.ms: the next record of the partition rolls a new segment
    client.send(h, "//t/Request", json.dumps({"n": 2}))
    client.flush()
    # m2 and the new one wait; m1's record, its receipt and the outcome are in an older segment
    _queued(settings, 2)

    def m1_compacted() -> bool:
        return all(k != m1.message_id.encode() or v is None for k, v in read_topic(settings, topic))

    wait_for("Kafka's log cleaner to compact m1 away", m1_compacted, timeout_s=90, poll_s=1)
    outcomes = [v for k, v in read_topic(settings, topic) if k == f"commit/{group}".encode()]
    assert len(outcomes) == 1 and outcomes[0] is not None  # the newest outcome, kept whole
    dispatcher.stop()
    restarted = ThreadDispatcher(settings)
    try:
        restarted.wait_owning_every_shard()
        stale = _send_commit(settings, group, stale_token, stale_lease, _waiting(settings)[0])
        err = wait_error(settings, lambda r: r.get("request_id") == stale.request_id)
        assert err["code"] == "stale_token"
        got = receive_all(client, Q, 2, timeout_s=15)
        assert [json.loads(m.message_body) for m in got] == [{"n": 1}, {"n": 2}]
    finally:
        restarted.stop()
