"""The security plan of one instance: principals, topics, Kafka ACLs and Redis rules, generated.

ACLs are never written by hand: `plan_instance` derives them from the catalog (grants, routes,
event notifications) and the deployment (the instance, its shard count, its owners), and
``ksb acl apply`` makes Kafka and Redis match the plan (`ksb.security.apply`). Pure.

The plan also names the topics to create before any service starts, so no service needs to
create one: the core topics, the relay between dispatchers, each sender's requests and errors
topics (``ksb.<i>.requests.<principal>``, ``ksb.<i>.errors.<principal>``), the peers' ``acks``
topics and the catalog's queue and dead-letter topics. The requests topics, ``relay`` and
``inbound`` all get the instance's shard count (`KsbSettings.request_partitions`): the
dispatcher co-partitions them.

A plan *owns* the bindings whose resource is in its instance's namespace (``ksb.<i>.``), and no
other: one instance's routes grant nothing on another instance's topics, whose own plan grants
what it consents to (routes are declared on both sides). The one exception is a peer on another
cluster, whose plan cannot reach ours: the mailbox of its acks here (``ksb.<peer>.acks``, written
by our dispatcher, read and relayed home by its transport) is ours to make and bind. Applying a
plan removes the owned bindings it no longer has, so a revoked grant stops working without a
restart, and leaves every other binding alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ksb.catalog.model import Catalog
from ksb.names import Names
from ksb.runtime.kafka import (
    TopicSpec,
    core_topics,
    dead_letter_topic,
    inbound_topics,
    queue_topic,
)
from ksb.security.access import Access, Peer, access_of, peers_of
from ksb.security.kafka_acls import KafkaAcl, Operation, Resource, instance_acls
from ksb.security.principals import Role, service_principal, service_principals
from ksb.security.redis_acls import RedisRules, instance_rules
from ksb.settings import KsbSettings

__all__ = ["SecurityPlan", "plan_instance"]


@dataclass(frozen=True)
class SecurityPlan:
    instance: str
    accesses: tuple[Access, ...]
    peers: tuple[Peer, ...]
    principals: tuple[str, ...]
    """Every SCRAM user the plan needs on this cluster: ours, and the peers' that cross here."""
    topics: tuple[TopicSpec, ...]
    kafka_acls: tuple[KafkaAcl, ...]
    redis: dict[str, RedisRules]

    @property
    def names(self) -> Names:
        return Names(self.instance)

    def accesses_of(self, principal: str) -> Access:
        """`principal`'s reach in this plan."""
        return next(a for a in self.accesses if a.principal == principal)

    def owns(self, acl: KafkaAcl) -> bool:
        """Whether `acl` is this plan's to keep or remove (see the module's docstring)."""
        own = set(service_principals(self.instance).values())
        if acl.resource is Resource.CLUSTER:  # the one cluster right is our own service's
            return acl.principal in own
        if acl.name.startswith(f"{self.names.prefix}."):
            return True
        return (acl.principal, acl.operation is Operation.WRITE) in self._mailbox_parts(
            acl.name, own
        )

    def _mailbox_parts(self, topic: str, own: set[str]) -> set[tuple[str, bool]]:
        """Who this plan binds on a far peer's acks mailbox, and whether to write: several
        instances of one cluster may share a far peer, so each owns only its own part (its
        services write; the peer's carriers through it read), never another plan's."""
        parts: set[tuple[str, bool]] = set()
        for peer in self.peers:
            if peer.far and Names(peer.instance).acks == topic:
                parts |= {(p, True) for p in own}
                carriers = set(peer.via) | ({peer.instance} if peer.direct else set())
                roles = {
                    c: Role.TRANSPORT if c == peer.instance else Role.FORWARDER for c in carriers
                }
                parts |= {(service_principal(c, r), False) for c, r in roles.items()}
        return parts

    def lines(self) -> list[str]:
        """The plan as text (``ksb acl plan``)."""
        out = [f"instance {self.instance}", "principals:"]
        out += [f"  {p}" for p in self.principals]
        out.append("topics:")
        out += [f"  {t.name} ({t.partitions} partitions)" for t in self.topics]
        out.append("kafka acls:")
        out += [f"  {a}" for a in self.kafka_acls]
        out.append("redis users:")
        for p, rules in sorted(self.redis.items()):
            out.append(f"  {p}: {' '.join(rules.acl())}")
        return out


def plan_instance(
    settings: KsbSettings,
    catalog: Catalog,
    *,
    owners: Iterable[str] = (),
) -> SecurityPlan:
    """The plan of `settings.instance` for `catalog`.

    `owners` may do all the operator does and RECEIVE from every queue.
    """
    names = Names(settings.instance)
    accesses = tuple(access_of(settings.instance, catalog, owners))
    peers = tuple(peers_of(settings.instance, catalog))
    acls = instance_acls(names, accesses, peers)
    principals = sorted({a.principal for a in accesses} | {a.principal for a in acls})
    return SecurityPlan(
        instance=settings.instance,
        accesses=accesses,
        peers=peers,
        principals=tuple(principals),
        topics=tuple(_topics(names, settings, catalog, accesses, peers)),
        kafka_acls=tuple(acls),
        redis=instance_rules(settings.instance, accesses),
    )


def _topics(
    names: Names,
    settings: KsbSettings,
    catalog: Catalog,
    accesses: Iterable[Access],
    peers: Iterable[Peer],
) -> list[TopicSpec]:
    shards = settings.request_partitions
    specs = {t.name: t for t in core_topics(names, settings)}
    specs[names.relay] = TopicSpec(names.relay, shards)
    specs[names.sla] = TopicSpec(names.sla, 1)
    for a in accesses:
        if a.sends:
            specs[names.requests_of(a.principal)] = TopicSpec(
                names.requests_of(a.principal), shards
            )
            specs[names.errors_of(a.principal)] = TopicSpec(names.errors_of(a.principal), 1)
    carriers = set()
    for peer in peers:
        carriers |= ({peer.instance} if peer.direct else set()) | set(peer.via)
        if peer.far:  # the mailbox of its acks on our cluster, which its plan cannot reach
            acks = Names(peer.instance).acks
            specs.setdefault(acks, TopicSpec(acks, 1))
    for spec in inbound_topics(names, settings, carriers):
        specs[spec.name] = spec
    for q in catalog.queues:
        for spec in (queue_topic(names, q), dead_letter_topic(names, q)):
            specs[spec.name] = spec
    return sorted(specs.values(), key=lambda t: t.name)
