"""The Kafka ACLs of one instance: least privilege per principal, from the services' own use.

Each role gets the topics it reads and writes, the consumer groups it commits or joins, and the
transactional ids it uses, read off the services (`ksb.names` has every name):

| role | reads | writes | groups, transactional ids |
|---|---|---|---|
| dispatcher | requests (all), relay, inbound (all), endpoints, catalog, queues | queues, endpoints, errors (all), dead letters, transmission, relay, audit, bcn, acks (own; far peers' mailboxes) | group and txn id ``ksb.<i>.dispatcher*`` |
| transmitter | transmission, acks, links, catalog | outbound, audit | — |
| transport | outbound, catalog | links, audit, acks (relayed), ``inbound.<i>`` (its own, and, granted by their plans, ``inbound.<i>`` of its next hops) | group ``ksb.<i>.transport`` |
| forwarder | inbound (all), catalog | ``inbound.<i>`` of its next hops and peers' acks (granted by their plans) | — |
| queue service | queues, catalog | requests (dead letters), audit | — |
| activation | catalog | catalog (poison), activation, audit, requests | — |
| external activator | activation | audit, requests; its faust topic | group ``ksb.<i>.external_activator*`` |
| spark | audit, catalog | sla | group ``ksb.<i>.spark*`` |
| operator | everything of the instance | catalog, requests; creates queue and dead-letter topics | — |
| application | its errors topic, depth | its requests topic | DESCRIBE group ``ksb.<i>.dispatcher`` (back-pressure reads its offsets) |

Applications read no queue topic: they RECEIVE through the queue service (`services.queue`),
which checks their grants. They write no audit record either: what they do is recorded by the
services that carry it out.

Every principal of the instance may DESCRIBE the group ``ksb.<i>.unused`` (librdkafka looks up
the coordinator of a consumer that only assigns partitions); services and the operator may
DESCRIBE every topic of the instance (they check the topics they need exist). No principal may
create core topics, users or ACLs: `ksb acl apply` does, as ``admin``. Kafka 4.2 needs no
IDEMPOTENT_WRITE for idempotent or transactional producers that may WRITE some topic; the forwarder,
which may have none before its routes, has IDEMPOTENT_WRITE on the cluster (no topic right).

Nobody may write the instance's unsuffixed ``requests`` topic on a secured stack (only a stack
without security uses it): a request there would carry no principal, and the dispatcher trusts a
request without one (`ksb.dialog.permissions`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum

from ksb.names import Names
from ksb.security.access import Access, Peer
from ksb.security.principals import Role, service_principal

__all__ = ["KafkaAcl", "Operation", "Pattern", "Resource", "instance_acls"]


class Resource(str, Enum):
    TOPIC = "topic"
    GROUP = "group"
    TRANSACTIONAL_ID = "transactional_id"
    CLUSTER = "cluster"


CLUSTER_NAME = "kafka-cluster"
"""The one name of the cluster resource."""


class Pattern(str, Enum):
    LITERAL = "literal"
    PREFIXED = "prefixed"


class Operation(str, Enum):
    READ = "READ"
    WRITE = "WRITE"
    DESCRIBE = "DESCRIBE"
    CREATE = "CREATE"
    IDEMPOTENT_WRITE = "IDEMPOTENT_WRITE"


@dataclass(frozen=True, order=True)
class KafkaAcl:
    """One ALLOW binding (KSB never writes DENY ones: nothing is allowed unless a rule says so)."""

    principal: str
    resource: Resource
    name: str
    pattern: Pattern
    operation: Operation

    def __str__(self) -> str:
        star = "*" if self.pattern is Pattern.PREFIXED else ""
        return (
            f"User:{self.principal} {self.operation.value} {self.resource.value}:{self.name}{star}"
        )


def _acl(
    principal: str,
    op: Operation,
    name: str,
    *,
    prefixed: bool = False,
    kind: Resource = Resource.TOPIC,
) -> KafkaAcl:
    return KafkaAcl(principal, kind, name, Pattern.PREFIXED if prefixed else Pattern.LITERAL, op)


R, W, D, C = Operation.READ, Operation.WRITE, Operation.DESCRIBE, Operation.CREATE


def instance_acls(
    names: Names, accesses: Iterable[Access], peers: Iterable[Peer]
) -> list[KafkaAcl]:
    """Every binding of the instance, sorted and without duplicates."""
    acls: set[KafkaAcl] = set()
    for a in accesses:
        acls.update(_principal_acls(names, a))
    for peer in peers:
        acls.update(_peer_acls(names, peer))
    return sorted(acls)


def _principal_acls(names: Names, a: Access) -> Iterator[KafkaAcl]:
    p = a.principal
    yield _acl(p, D, names.reader_group, kind=Resource.GROUP)
    if a.role is not None or a.owner:
        yield _acl(p, D, f"{names.prefix}.", prefixed=True)
    if a.sends:
        yield _acl(p, W, names.requests_of(p))
        # Back-pressure (`ksb.sdk.backpressure`) reads how far the dispatchers have committed.
        yield _acl(p, D, names.dispatcher_group, kind=Resource.GROUP)
        yield _acl(p, R, names.errors_of(p))
        # Queue-depth back-pressure (`ksb.sdk.depth`) reads how deep its targets' queues are.
        yield _acl(p, R, names.depth)
    if a.owner:
        yield from _role_acls(names, p, Role.OPERATOR)
    if a.role is not None:
        yield from _role_acls(names, p, a.role)


def _role_acls(names: Names, p: str, role: Role) -> Iterator[KafkaAcl]:
    n = names
    if role is Role.DISPATCHER:
        yield from (_acl(p, R, t) for t in (n.relay, n.endpoints, n.catalog))
        yield _acl(p, R, n.inbound_prefix, prefixed=True)
        # The unsuffixed topic too (one regex subscription, secured or not); no one writes it.
        yield from (_acl(p, R, f"{n.prefix}.requests.", prefixed=True), _acl(p, R, n.requests))
        yield from (
            _acl(p, R, f"{n.prefix}.queue.", prefixed=True),
            _acl(p, W, f"{n.prefix}.queue.", prefixed=True),
        )
        yield _acl(p, W, f"{n.prefix}.dlq.", prefixed=True)
        yield _acl(p, W, f"{n.prefix}.errors.", prefixed=True)
        for t in (n.endpoints, n.depth, n.errors, n.transmission, n.relay, n.audit, n.bcn, n.acks):
            yield _acl(p, W, t)
        yield _acl(p, R, n.dispatcher_group, prefixed=True, kind=Resource.GROUP)
        yield _acl(p, W, n.dispatcher_group, prefixed=True, kind=Resource.TRANSACTIONAL_ID)
    elif role is Role.TRANSMITTER:
        yield from (_acl(p, R, t) for t in (n.transmission, n.acks, n.links, n.catalog))
        yield from (_acl(p, W, t) for t in (n.outbound, n.audit))
    elif role is Role.TRANSPORT:
        yield from (_acl(p, R, t) for t in (n.outbound, n.catalog))
        yield from (_acl(p, W, t) for t in (n.links, n.audit, n.acks, n.inbound_from(n.instance)))
        yield _acl(p, R, n.transport_group, kind=Resource.GROUP)
    elif role is Role.FORWARDER:
        yield from (_acl(p, R, n.inbound_prefix, prefixed=True), _acl(p, R, n.catalog))
        # Its idempotent producer starts before it has a route to write to, and Kafka then asks
        # for IDEMPOTENT_WRITE (WRITE on any topic would do instead): the right to obtain a
        # producer id, no right to write anything.
        yield _acl(p, Operation.IDEMPOTENT_WRITE, CLUSTER_NAME, kind=Resource.CLUSTER)
    elif role is Role.QUEUE:
        yield from (_acl(p, R, f"{n.prefix}.queue.", prefixed=True), _acl(p, R, n.catalog))
        # It counts each queue's dead letters for operators (`services.queue.dead_letters`).
        yield _acl(p, R, f"{n.prefix}.dlq.", prefixed=True)
        yield _acl(p, W, n.audit)
    elif role is Role.ACTIVATION:
        yield from (_acl(p, W, t) for t in (n.catalog, n.activation, n.audit))
        yield _acl(p, R, n.catalog)
    elif role is Role.EXTERNAL_ACTIVATOR:
        yield from (_acl(p, R, n.activation), _acl(p, W, n.audit))
        app = n.external_activator_app
        for op in (R, W, C):  # faust's own topic (`<app>-__assignor-__leader`) and group
            yield _acl(p, op, app, prefixed=True)
        yield _acl(p, R, app, prefixed=True, kind=Resource.GROUP)
    elif role is Role.SPARK:
        yield from (_acl(p, R, t) for t in (n.audit, n.catalog))
        yield _acl(p, W, n.sla)
        yield _acl(p, R, f"{n.prefix}.spark", prefixed=True, kind=Resource.GROUP)
    elif role is Role.OPERATOR:
        yield _acl(p, R, f"{n.prefix}.", prefixed=True)
        yield _acl(p, W, n.catalog)
        yield _acl(p, C, f"{n.prefix}.queue.", prefixed=True)
        yield _acl(p, C, f"{n.prefix}.dlq.", prefixed=True)


def _peer_acls(names: Names, peer: Peer) -> Iterator[KafkaAcl]:
    """Who crosses between us and `peer`, on our topics (routes are declared on both sides, so
    its plan binds what it consents to on its own topics, ours on ours).

    Its dispatcher acknowledges what we send (our ``acks``); its transport writes its own
    ``inbound.<peer>`` here, and a forwarder between us writes ``inbound.<forwarder>`` and our
    acks for the messages it carries. On another cluster, our dispatcher and forwarder write
    the mailbox of its acks here, which its transport reads and relays home.
    """
    them = Names(peer.instance)
    yield _acl(service_principal(peer.instance, Role.DISPATCHER), W, names.acks)
    if peer.direct:
        transport = service_principal(peer.instance, Role.TRANSPORT)
        yield _acl(transport, W, names.inbound_from(peer.instance))
        if peer.far:
            yield _acl(transport, R, them.acks)
            yield _acl(transport, D, them.reader_group, kind=Resource.GROUP)
    for f in sorted(peer.via):
        forwarder = service_principal(f, Role.FORWARDER)
        yield _acl(forwarder, W, names.inbound_from(f))
        yield _acl(forwarder, W, names.acks)
        if peer.far:
            yield _acl(forwarder, R, them.acks)
            yield _acl(forwarder, D, Names(f).reader_group, kind=Resource.GROUP)
    if peer.far:
        own = {role: service_principal(names.instance, role) for role in Role}
        yield _acl(own[Role.DISPATCHER], W, them.acks)
        yield _acl(own[Role.FORWARDER], W, them.acks)
