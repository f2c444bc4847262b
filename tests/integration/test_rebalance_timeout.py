"""A dispatcher group member that does not give up partitions in time is fenced by Kafka.

The chaos harness found a shard with no owner for minutes: the heartbeat answer that moved it
away from a dispatcher was lost to a request timeout (the broker stalled), librdkafka kept
heartbeating without its owned partitions, and the group coordinator waited for a revocation
the member never heard of, until the rebalance timeout (Kafka's default: 5 minutes). KSB's
dispatchers send ``KSB_REBALANCE_TIMEOUT_MS`` (30 s) instead. The lost answer cannot be made to
happen on demand, so this test holds a member inside its revocation callback, which keeps it
heartbeating without giving anything up, exactly as the stuck member did: the other member must
get the partitions long before the callback returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, TopicPartition

from devtools.deployment import Deployment, secure_instance
from ksb.names import Names
from ksb.runtime import kafka
from ksb.security.principals import Role

pytestmark = pytest.mark.integration

REBALANCE_TIMEOUT_MS = 4_000
HELD_S = 40.0
"""How long the stuck member stays in its revocation callback: ten rebalance timeouts."""


Revoke = Callable[[Consumer, list[TopicPartition]], None]


def _member(settings: Deployment, topic: str, on_revoke: Revoke | None = None) -> Consumer:
    c = kafka.group_consumer(
        settings,
        group=Names(settings.instance).dispatcher_group,
        rebalance_timeout_ms=REBALANCE_TIMEOUT_MS,
    )
    if on_revoke is None:
        c.subscribe([topic])
    else:
        c.subscribe([topic], on_revoke=on_revoke)
    return c


def _poll_until(c: Consumer, done: threading.Event, deadline: float) -> None:
    while not done.is_set() and time.monotonic() < deadline:
        c.poll(0.1)


@pytest.fixture
def two_shards(settings: Deployment) -> Deployment:
    """An instance of its own whose sharded topics have two partitions, as its dispatchers log
    in (none runs)."""
    update = {"instance": f"{settings.instance}r", "request_partitions": 2}
    return secure_instance(settings.model_copy(update=update)).as_service(Role.DISPATCHER)


@pytest.mark.timeout(120)
def test_a_member_stuck_giving_partitions_up_is_fenced_and_the_other_gets_them(
    two_shards: Deployment,
) -> None:
    settings = two_shards
    topic = Names(settings.instance).relay
    released = threading.Event()
    returned_at: list[float] = []

    def hold(_c: Consumer, _parts: list[TopicPartition]) -> None:
        released.wait(HELD_S)
        returned_at.append(time.monotonic())

    stuck = _member(settings, topic, on_revoke=hold)
    deadline = time.monotonic() + 60
    while len(stuck.assignment()) < 2 and time.monotonic() < deadline:
        stuck.poll(0.1)
    assert len(stuck.assignment()) == 2, "the first member never got both partitions"

    stop = threading.Event()
    stuck_loop = threading.Thread(
        target=_poll_until, args=(stuck, stop, time.monotonic() + HELD_S + 20), daemon=True
    )
    stuck_loop.start()
    other = _member(settings, topic)
    try:
        asked = time.monotonic()
        got: list[int] = []
        while time.monotonic() < asked + HELD_S:
            other.poll(0.1)
            got = sorted(tp.partition for tp in other.assignment())
            if got == [0, 1]:
                break
        got_at = time.monotonic()
        assert got == [0, 1], f"the other member holds {got} after {got_at - asked:.1f}s"
        assert not returned_at, "the partitions moved only once the stuck member let them go"
    finally:
        released.set()
        stop.set()
        stuck_loop.join(30)
        other.close()
        stuck.close()
