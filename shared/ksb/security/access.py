"""What each principal of an instance may reach, before it is written as Kafka or Redis ACLs.

The catalog's grants and the deployment say who there is and which queues each application may
RECEIVE from; the catalog's routes say which other instances exchange messages with this one.
`access_of` folds them into one `Access` per principal, which `ksb.security.kafka_acls` and
`ksb.security.redis_acls` turn into rules. Pure: no I/O, unit-tested.

Choices the issue left open, made here:

* Service principals get what their role needs for *every* queue of the instance (prefixed
  rules): a queue created by ``ksb sql`` is served at once, without re-applying the ACLs. An
  application gets exactly the queues its RECEIVE grants name, so a grant or a revoke takes
  effect on the next ``ksb acl apply``.
* SEND needs nothing at the ACL level beyond the principal's own requests topic: the dispatcher
  checks SEND against the grants, knowing the sender from the topic. Any grant makes a
  principal an application with a requests topic and an errors topic.
* RECEIVE needs nothing at the ACL level either: an application RECEIVEs through the queue
  service, which checks the grant; it reads no queue topic and has no Redis user, so no lock
  key or queue flag is within reach of anything it may call.
* Activated tasks run as the activation service that starts them, and the external activator's
  readers as the external activator (their ``EXECUTE AS`` is not mapped to other principals):
  the activation principal may RECEIVE from any queue, the external activator from the queues
  with an event notification.
* An owner (a deployment's choice, like SQL Server's ``db_owner``) may do what the operator does
  and RECEIVE from every queue: the tests, the demo and the benchmarks drive an instance as one.
* A grant to PUBLIC is refused: Kafka's ``User:*`` would reach every principal of the cluster,
  other instances' included.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ksb.catalog.model import Catalog
from ksb.errors import SecurityError
from ksb.security.principals import PEER_PREFIX, Role, check_principal, service_principals

__all__ = ["ALL_QUEUES", "Access", "Peer", "access_of", "applications", "peers_of"]

ALL_QUEUES = "*"
"""In `Access.receives`: every queue of the instance, present and future."""


@dataclass(frozen=True)
class Access:
    """One principal's reach in one instance, by kind of use."""

    principal: str
    role: Role | None = None
    """The service role it plays, or None for an application or an owner."""
    sends: bool = False
    """Writes requests (its own requests topic) and reads its own error records."""
    receives: frozenset[str] = field(default_factory=frozenset)
    """Queues it may RECEIVE from (`ALL_QUEUES` for all), through the queue service: the
    service checks the grant, and only the queue service reads queue topics and lock keys."""
    owner: bool = False

    @property
    def receives_all(self) -> bool:
        return ALL_QUEUES in self.receives


@dataclass(frozen=True)
class Peer:
    """Another instance this one exchanges messages with, as its catalog's routes say."""

    instance: str
    direct: bool
    """Some route reaches it with no forwarder: its transport and ours connect directly."""
    via: frozenset[str] = frozenset()
    """Instances whose forwarders carry messages between it and us."""
    far: bool = False
    """Some route reaches it on another Kafka cluster (an address, not LOCAL), or through a
    forwarder (behind which it may be on any cluster): its own plan may not reach ours, so the
    mailbox of its acks here is ours to make and bind."""


def applications(catalog: Catalog) -> dict[str, frozenset[str]]:
    """Principal -> queues it may RECEIVE from, for every principal the grants name."""
    out: dict[str, set[str]] = {}
    for g in catalog.grants:
        if g.principal.lower() == "public":
            raise SecurityError(
                f"GRANT {g.permission} ON {g.target} TO PUBLIC: grants to PUBLIC are not mapped "
                "to ACLs (they would reach every principal of the cluster); grant to named "
                "principals"
            )
        if g.principal.startswith(PEER_PREFIX):
            if g.permission == "RECEIVE":
                raise SecurityError(
                    f"GRANT RECEIVE ON [{g.target}] TO [{g.principal}]: {PEER_PREFIX}<instance> "
                    "is another broker instance, which sends (GRANT SEND) but never receives"
                )
            continue  # a peer's grant: checked on arrival, no login to make
        queues = out.setdefault(check_principal(g.principal), set())
        if g.permission == "RECEIVE":
            queues.add(g.target)
    return {p: frozenset(q) for p, q in out.items()}


def access_of(instance: str, catalog: Catalog, owners: Iterable[str] = ()) -> list[Access]:
    """Every principal of `instance` with its reach (services, operator, owners, applications)."""
    notified = frozenset(n.queue for n in catalog.event_notifications)
    found: dict[str, Access] = {}
    for role, name in service_principals(instance).items():
        receives: frozenset[str] = frozenset()
        if role in (Role.ACTIVATION, Role.QUEUE):
            receives = frozenset({ALL_QUEUES})
        elif role is Role.EXTERNAL_ACTIVATOR:
            receives = notified
        sends = role in (Role.ACTIVATION, Role.EXTERNAL_ACTIVATOR, Role.OPERATOR, Role.QUEUE)
        found[name] = Access(name, role, sends=sends, receives=receives)
    for name in owners:
        found[check_principal(name)] = Access(
            name, sends=True, receives=frozenset({ALL_QUEUES}), owner=True
        )
    for name, queues in applications(catalog).items():
        known = found.get(name)
        if known is None:
            found[name] = Access(name, sends=True, receives=queues)
        else:  # a service or an owner granted more: it keeps its role and gains the queues
            found[name] = Access(name, known.role, True, known.receives | queues, owner=known.owner)
    return sorted(found.values(), key=lambda a: a.principal)


def peers_of(instance: str, catalog: Catalog) -> list[Peer]:
    """The instances our routes lead to, and the forwarders between them and us.

    Routes are declared on both sides (replies and acknowledgements need the way back), so a
    route to B through F also says that B's messages reach us through F and that B acknowledges
    ours.
    """
    direct: set[str] = set()
    far: set[str] = set()
    via: dict[str, set[str]] = {}
    for r in catalog.routes:
        if r.broker_instance == instance:
            continue
        hops = via.setdefault(r.broker_instance, set())
        if r.next_hop == r.broker_instance:
            direct.add(r.broker_instance)
        elif r.next_hop != instance:
            hops.add(r.next_hop)
        if r.address != "LOCAL" or r.next_hop != r.broker_instance:
            far.add(r.broker_instance)
    return [
        Peer(name, name in direct, frozenset(hops), far=name in far)
        for name, hops in sorted(via.items())
    ]
