"""Broker instances on two Kafka clusters: direct, and through a forwarder on the first cluster.

Each transmitter reads acks only on its own cluster, so every ack written on the far cluster must
be carried back: by the transport for a direct connection, by the forwarder for what it passed
on. A drained transmission queue on both sides is the proof that every ack came home.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from devtools.deployment import Deployment, connect_clusters, secure_instance
from devtools.localstack import start_stack
from ksb.catalog.model import parse_catalog
from ksb.names import Names
from ksb.runtime.catalog_store import apply_catalog
from ksb.security.principals import ADMIN, Role
from tests.conftest import Stack
from tests.integration.conftest import BASIC_CATALOG
from tests.integration.support import check_exactly_once_in_order, read_topic, receive_all
from tests.integration.test_two_instances import (
    C,
    I,
    Instance,
    T,
    ThreadForwarder,
    _catalogs,
    _wait_view_empty,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def far(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A second Kafka (and Redis) of its own: the far cluster."""
    running = start_stack(tmp_path_factory.mktemp("far"))
    try:
        yield Stack(running.kafka_bootstrap, running.redis_url, running.security)
    finally:
        running.stop()


def _settings(stack: Stack, name: str) -> Deployment:
    return stack.deployment(instance=name, lock_ttl_ms=15_000)


def _exchange(a: Instance, b: Instance, dialogs: int, per_dialog: int) -> None:
    """A sends, B receives everything exactly once in order and replies; A gets the replies."""
    handles = [a.client.begin_dialog(I, T, C) for _ in range(dialogs)]
    for k in range(per_dialog):
        for i, h in enumerate(handles):
            a.client.send(h, "//t/Request", json.dumps({"conv": i, "n": k}))
    a.client.flush()
    got = receive_all(b.client, "TargetQueue", dialogs * per_dialog, timeout_s=90)
    check_exactly_once_in_order([json.loads(m.message_body) for m in got], dialogs, per_dialog)
    firsts = {m.conversation_handle: m for m in got}
    with b.client.transaction() as tx:
        for handle in firsts:
            tx.send(handle, "//t/Reply", "back")
    replies = receive_all(a.client, "InitiatorQueue", dialogs, timeout_s=60)
    assert [m.message_body for m in replies] == [b"back"] * dialogs


def test_direct_route_to_another_cluster_gets_its_acks_relayed_home(
    stack: Stack, far: Stack, unique: str
) -> None:
    sa, sb = _settings(stack, f"t{unique}A"), _settings(far, f"t{unique}B")
    ca, cb = _catalogs(far.kafka_bootstrap)
    ca["routes"][0]["broker_instance"] = sb.instance
    cb["routes"][0].update(broker_instance=sa.instance, address=stack.kafka_bootstrap)
    # Each cluster's plan makes the other's transport a user there; each side gets its login.
    sa, sb = secure_instance(sa, parse_catalog(ca)), secure_instance(sb, parse_catalog(cb))
    connect_clusters(sa, Role.TRANSPORT, sb)
    connect_clusters(sb, Role.TRANSPORT, sa)
    b, a = Instance(sb, cb), Instance(sa, ca)
    try:
        _exchange(a, b, dialogs=5, per_dialog=20)
        _wait_view_empty(a.settings, timeout_s=60)
        _wait_view_empty(b.settings, timeout_s=60)
        # A's acks were written on the far cluster and copied to A's own by A's transport
        assert read_topic(sb.as_principal(ADMIN), Names(sa.instance).acks, timeout_s=5)
        assert read_topic(sa, Names(sa.instance).acks, timeout_s=5)
    finally:
        a.close()
        b.close()


def test_forwarder_between_clusters_carries_acks_back_one_cluster(
    stack: Stack, far: Stack, unique: str
) -> None:
    """A -> F -> B: A and the forwarder F on the first cluster, B on the far one. A's route names
    only F (LOCAL); B reaches A through F on the first cluster."""
    sa, sf = _settings(stack, f"t{unique}A"), _settings(stack, f"t{unique}F")
    sb = _settings(far, f"t{unique}B")
    ca, cb = _catalogs()
    ca["routes"] = [route(T, sb.instance, "LOCAL", via=sf.instance)]
    cb["routes"] = [route(I, sa.instance, stack.kafka_bootstrap, via=sf.instance)]
    cf: dict[str, Any] = {
        **BASIC_CATALOG,
        "routes": [route(T, sb.instance, far.kafka_bootstrap), route(I, sa.instance, "LOCAL")],
    }
    sb = secure_instance(sb, parse_catalog(cb))
    sf = secure_instance(sf, parse_catalog(cf))
    connect_clusters(sf, Role.FORWARDER, sb)  # F carries to B and relays A's acks from there
    connect_clusters(sb, Role.TRANSPORT, sf)  # B's transport sends to F's inbound
    apply_catalog(sf, parse_catalog(cf))
    forwarder = ThreadForwarder(sf)
    b, a = Instance(sb, cb), Instance(sa, ca)
    try:
        _exchange(a, b, dialogs=4, per_dialog=15)
        big = json.dumps({"blob": "x" * 600_000})  # fragments, joined and split again at F
        h = a.client.begin_dialog(I, T, C)
        a.client.send(h, "//t/Request", big)
        a.client.flush()
        assert [m.message_body for m in receive_all(b.client, "TargetQueue", 1)] == [big.encode()]
        _wait_view_empty(a.settings, timeout_s=60)
        _wait_view_empty(b.settings, timeout_s=60)
        assert forwarder.forwarder.relay.relayed > 0
    finally:
        a.close()
        b.close()
        forwarder.stop()


def route(service: str, instance: str, address: str, via: str | None = None) -> dict[str, Any]:
    r: dict[str, Any] = {
        "name": f"to-{service}",
        "service_name": service,
        "broker_instance": instance,
        "address": address,
    }
    if via is not None:
        r["via"] = via
    return r
