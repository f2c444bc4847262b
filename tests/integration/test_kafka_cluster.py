"""KSB on a Kafka cluster of three brokers and a Redis Cluster of three primaries with a replica
each, secured as the one-node stack is: every topic KSB makes has a copy on each broker, the broker
coordinating the dispatchers' group, SIGKILLed under load, loses nothing, the group locks, fences
and disabled flags work across Redis nodes, each node knowing every principal, the queue's slot
moved to another primary under load loses nothing, and the Redis primary holding it, SIGKILLed
under load, is replaced by its replica losing nothing.

Where a team outgrows one machine, KSB runs on Kafka's own replication, not on anything of its
own: its topics take the cluster's ``default.replication.factor`` (three here, two in sync before a
write is acknowledged; `devtools.kafka_node.replication_settings`), and its dispatchers, readers
and senders ride out a lost broker the way any Kafka client does, by following the partitions'
new leaders. The test keeps the same invariants as the scale-out tests: every message delivered
once, in its dialog's order, none left to receive. Redis Cluster shards KSB's keys by queue (each
queue's keys carry its instance and name as a hash tag, `ksb.names`), so one lock script runs on
one node.
"""

from __future__ import annotations

import dataclasses
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from bench.e2e import TARGET_QUEUE, Tally, bench_catalog
from devtools.deployment import Deployment, secure_instance, stack_fields
from devtools.dispatchers import DispatcherPool
from devtools.localstack import LocalStack, start_stack
from devtools.processes import signal_group, wait_gone
from devtools.queue_services import QueueReplicas
from devtools.redis_node import SlotMove, move_slot
from ksb.errors import LockStoreUnavailable, NotAuthorized, QueueDisabled
from ksb.names import Names
from ksb.queue.locks import GroupLocks
from ksb.runtime import kafka
from ksb.runtime.catalog_store import apply_catalog
from ksb.runtime.redis_client import redis_client
from ksb.security.principals import ADMIN, Role
from tests.integration.faulted_load import Load, assert_exactly_once_in_order, run_with_fault

pytestmark = pytest.mark.integration

BROKERS = 3
REDIS_NODES = 3
REDIS_REPLICAS = 1
"""Replicas per Redis primary: a primary killed is replaced by its replica."""
SHARDS = 4
LOAD = Load(messages=12_000, dialogs=300, receivers=2, timeout_s=300)
REDIS_LOAD = Load(messages=6_000, dialogs=300, receivers=2, timeout_s=300)
KILL_AT = 0.3
"""The broker (or Redis primary) dies once this share of the messages has been delivered."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    stack = start_stack(
        tmp_path_factory.mktemp("cluster"),
        kafka_nodes=BROKERS,
        redis_nodes=REDIS_NODES,
        redis_replicas=REDIS_REPLICAS,
        timeout_s=240,
    )
    try:
        yield stack
    finally:
        stack.stop()


def _instance(cluster: LocalStack, lock_ttl_ms: int = 30_000) -> Deployment:
    """A new instance on the cluster, secured, the bench's catalog applied; as its owner."""
    base = Deployment.model_validate(
        {
            "instance": f"kc{uuid.uuid4().hex[:8]}",
            "kafka_bootstrap": cluster.kafka_bootstrap,
            "redis_url": cluster.redis_url,
            "redis_cluster": cluster.redis_cluster,
            "request_partitions": SHARDS,
            "lock_ttl_ms": lock_ttl_ms,
            **stack_fields(cluster.security),
        }
    )
    s = secure_instance(base)
    apply_catalog(s, bench_catalog(SHARDS))
    return s


@pytest.fixture
def instance(cluster: LocalStack) -> Deployment:
    return _instance(cluster)


@contextmanager
def _served(settings: Deployment, tmp_path: Path) -> Iterator[Deployment]:
    """The instance's queue service (two replicas, processes of their own, which hold the group
    locks in the Redis cluster): yields the settings its clients RECEIVE with."""
    replicas = QueueReplicas(settings, tmp_path / "queue").start(2)
    try:
        yield replicas.client_settings(settings)
    finally:
        replicas.stop()


def _lock_store(settings: Deployment) -> redis.Redis:
    """The Redis cluster as the queue service logs in to it: the one holder of group locks
    (applications have no Redis login)."""
    return redis_client(settings.as_service(Role.QUEUE))


def _replicas(settings: Deployment) -> dict[str, list[tuple[int, int]]]:
    """(replicas, in sync) of each partition of each of the instance's topics."""
    admin = kafka.admin(settings.as_principal(ADMIN))
    prefix = Names(settings.instance).prefix
    topics = admin.list_topics(timeout=30).topics
    return {
        name: [(len(p.replicas), len(p.isrs)) for p in t.partitions.values()]
        for name, t in topics.items()
        if name.startswith(prefix)
    }


def test_every_topic_has_a_copy_on_each_broker(instance: Deployment) -> None:
    replicas = _replicas(instance)
    assert len(replicas) >= 5, replicas  # requests, endpoints, the queues, errors, ...
    assert all(r == (BROKERS, BROKERS) for parts in replicas.values() for r in parts), replicas


def _coordinator(settings: Deployment) -> int:
    """The node id of the broker coordinating the dispatchers' consumer group."""
    admin = kafka.admin(settings.as_principal(ADMIN))
    group = Names(settings.instance).dispatcher_group
    described = admin.describe_consumer_groups([group])[group].result(30)
    return int(described.coordinator.id)


def test_the_broker_coordinating_the_dispatchers_killed_under_load_loses_nothing(
    cluster: LocalStack, instance: Deployment, tmp_path: Path
) -> None:
    """The hardest broker to lose: besides leading a third of the partitions, it holds the
    dispatchers' group, so the members must find its new coordinator and be given their shards
    again while their transactions to the dead broker time out and are redone."""
    killed: list[tuple[int, int]] = []

    def kill(tally: Tally) -> None:
        node = _coordinator(instance)
        killed.append((node, tally.delivered))
        pid = cluster.kafka_pids[node - 1]
        signal_group(pid, signal.SIGKILL)
        assert wait_gone(pid, time.monotonic() + 30)

    with _served(instance, tmp_path) as served, DispatcherPool(instance, tmp_path).start(2):
        result, failures = run_with_fault(served, LOAD, kill, KILL_AT)
        assert_exactly_once_in_order(result, failures, LOAD)
        assert killed and killed[0][1] < LOAD.messages, killed
        assert _coordinator(instance) != killed[0][0]  # the group lives on another broker
    # Two copies of every partition are left, and in sync: writes go on being acknowledged.
    after = _replicas(instance)
    assert all(isr >= BROKERS - 1 for parts in after.values() for _n, isr in parts), after


def _nodes(settings: Deployment) -> list[redis.Redis]:
    """A client of each Redis node on its own, logged in as ``admin``."""
    admin = settings.as_principal(ADMIN)
    client = redis_client(admin)
    assert isinstance(client, RedisCluster)
    return [client.get_redis_connection(node) for node in client.get_nodes()]


def test_every_redis_node_knows_every_principal(instance: Deployment) -> None:
    """A Redis Cluster keeps ACL users per node: `ksb acl apply` must reach each one."""
    nodes = _nodes(instance)
    assert len(nodes) == REDIS_NODES * (1 + REDIS_REPLICAS)  # replicas too: one may be promoted
    principal = instance.redis_username
    for node in nodes:
        user = node.execute_command("ACL", "GETUSER", principal)  # type: ignore[no-untyped-call]
        assert user is not None, node


def test_group_locks_and_disabled_flags_work_across_redis_nodes(instance: Deployment) -> None:
    """Each queue's keys sit in one slot, so each lock script runs on one node; queues spread
    over the nodes. Logged in as the queue service (its own ACL user on every node)."""
    names = Names(instance.instance)
    r = _lock_store(instance)
    assert isinstance(r, RedisCluster)
    slots = {r.keyslot(names.lock_key(q, "g")) for q in (TARGET_QUEUE, "Q1", "Q2", "Q3", "Q4")}
    assert len(slots) > 1  # different queues, different slots
    locks = GroupLocks(r, names, TARGET_QUEUE, holder="h1", ttl_ms=30_000)
    rival = GroupLocks(r, names, TARGET_QUEUE, holder="h2", ttl_ms=30_000)
    a = locks.acquire_first(["g1", "g2"])
    assert a is not None and a.group == "g1"
    b = rival.acquire_first(["g1", "g2"])  # g1 is held: the first free one
    assert b is not None and b.group == "g2" and b.token != a.token
    assert rival.acquire_first(["g1", "g2"]) is None
    stale = dataclasses.replace(b, token=b.token - 1)  # a lease g2 has since been taken from
    assert locks.extend_all([a, stale, b]) == [True, False, True]
    assert locks.release_all([(a, (0, 7), True)]) == [True]
    again = rival.acquire_first(["g1"])
    assert again is not None and again.after == (0, 7) and again.token > a.token
    admin = redis_client(instance.as_principal(ADMIN))
    admin.set(names.disabled_key(TARGET_QUEUE), 1)
    try:
        with pytest.raises(QueueDisabled):
            locks.acquire_first(["g3"])
    finally:
        admin.delete(names.disabled_key(TARGET_QUEUE))
    assert locks.acquire_first(["g3"]) is not None


def _slot_port(settings: Deployment) -> int:
    """The port of the Redis primary serving the target queue's slot, asked afresh."""
    return _slot_move_ends(settings)[0]


def test_a_queue_slot_half_moved_serves_its_principal_and_keeps_its_fences(
    cluster: LocalStack, instance: Deployment
) -> None:
    """While the queue's slot moves between primaries, the principal's client follows a key's
    ASK redirect to the new node (its ACL user may send ASKING), a lock script, whose keys are
    then split over two nodes, fails (TRYAGAIN, then the RECEIVE's `LockStoreUnavailable`), and
    once the slot has moved the group's fence has moved with it: the next token is larger."""
    names = Names(instance.instance)
    r = _lock_store(instance)
    locks = GroupLocks(r, names, TARGET_QUEUE, holder="h1", ttl_ms=30_000)
    first = locks.acquire_first(["g1"])
    assert first is not None and locks.release_all([(first, (0, 1), True)]) == [True]
    source, target, slot = _slot_move_ends(instance)
    with SlotMove(_url(source), _url(target), slot, cluster.security) as move:
        move.begin()
        r.zadd(names.waiting_key(TARGET_QUEUE), {"s1": 1})  # not on the source: ASK, ASKING
        with pytest.raises(redis.RedisError, match="TTL exhausted"):
            locks.acquire_first(["g1"])  # the disabled flag is on neither node: TRYAGAIN
        assert move.migrate_all() > 0
        move.finish()
    again = locks.acquire_first(["g1"])
    assert again is not None and again.token > first.token
    assert _slot_port(instance) == target


def _slot_move_ends(settings: Deployment) -> tuple[int, int, int]:
    """The port of the primary serving the target queue's slot, of another primary, and the
    slot."""
    admin = redis_client(settings.as_principal(ADMIN))
    assert isinstance(admin, RedisCluster)
    try:
        key = Names(settings.instance).lock_key(TARGET_QUEUE, "g")
        source = admin.get_node_from_key(key)
        target = next(n for n in admin.get_primaries() if n.name != source.name)
        return int(source.port), int(target.port), admin.keyslot(key)
    finally:
        admin.close()


def test_the_queue_slot_moved_to_another_primary_under_load_loses_nothing(
    cluster: LocalStack, tmp_path: Path
) -> None:
    """Resharding: the queue's slot, every lock, fence and flag of it, moves to another primary
    key by key while the load runs (`devtools.redis_node.move_slot`, as ``redis-cli --cluster
    reshard`` does). Meanwhile a lock script over keys on both nodes is answered TRYAGAIN and
    redis-py retries it or the SDK raises `LockStoreUnavailable`; keys already moved are
    followed with ASK, and the moved slot with MOVED. Nothing is lost or received twice, in
    order, and the slot is served by the new primary afterwards."""
    settings = _instance(cluster, lock_ttl_ms=5_000)
    moves: list[tuple[int, int, int, int]] = []

    def reshard(tally: Tally) -> None:
        source, target, slot = _slot_move_ends(settings)
        started = tally.delivered
        keys = move_slot(_url(source), _url(target), slot, cluster.security, batch=5, pause_s=0.01)
        moves.append((source, target, keys, tally.delivered - started))

    with _served(settings, tmp_path) as served, DispatcherPool(settings, tmp_path).start(2):
        result, failures = run_with_fault(served, REDIS_LOAD, reshard, KILL_AT)
    assert not failures, failures
    assert result.problems == ()
    assert result.verified and result.rate.messages == REDIS_LOAD.messages
    # Redis's own answers while the slot moved, never a grant missing for them (ASKING).
    assert NotAuthorized.code not in result.receive_error_codes, result
    [(source, target, keys, delivered_meanwhile)] = moves
    assert keys > 0
    assert delivered_meanwhile < REDIS_LOAD.messages * (1 - KILL_AT)  # moved under load
    assert _slot_port(settings) == target != source


def _url(port: int | str) -> str:
    return f"redis://127.0.0.1:{port}"


def test_the_redis_primary_of_the_queue_killed_under_load_fails_over_losing_nothing(
    cluster: LocalStack, tmp_path: Path
) -> None:
    """Every lock, fence and flag of the queue lives on one primary: SIGKILLed under load, its
    replica takes over (Redis Cluster's own failover, after the nodes' 5 s timeout). Meanwhile
    RECEIVE fails with `LockStoreUnavailable` and a commit that cannot confirm its lock with
    `LockLost` (KsbErrors the bench's readers retry); the messages of such commits come back
    after the short lock TTL. Nothing is lost or received twice, in order, and the queue's slot
    is served by another node afterwards."""
    settings = _instance(cluster, lock_ttl_ms=5_000)
    killed: list[tuple[int, int]] = []

    def kill(tally: Tally) -> None:
        port = _slot_port(settings)
        killed.append((port, tally.delivered))
        pid = cluster.redis_pid_at(port)
        signal_group(pid, signal.SIGKILL)
        assert wait_gone(pid, time.monotonic() + 30)

    with _served(settings, tmp_path) as served, DispatcherPool(settings, tmp_path).start(2):
        result, failures = run_with_fault(served, REDIS_LOAD, kill, KILL_AT)
    assert not failures, failures
    assert result.problems == ()
    assert result.verified and result.rate.messages == REDIS_LOAD.messages
    assert killed and killed[0][1] < REDIS_LOAD.messages, killed
    assert result.receive_errors > 0, "no RECEIVE met the failover: the kill came too late"
    assert LockStoreUnavailable.code in result.receive_error_codes, result
    assert NotAuthorized.code not in result.receive_error_codes, result
    assert _slot_port(settings) != killed[0][0]  # the replica serves the slot now
