"""Service Broker's permissions, enforced by the dispatcher: who may act as a service, who may
send to one, and who may receive from a queue.

Kafka's ACLs confine each principal to its own requests topic (``requests.<principal>``), so the
topic a request arrives on names its sender and no other client can forge it (`ksb.names`). The
ACLs cannot see inside a request, though: which service a BEGIN starts from and goes to, whose
endpoint a SEND uses, which queue a receipt names. That is checked here, against the catalog's
grants, with SQL Server's meanings:

* acting as a service (BEGIN from it, SEND, END and set timers on its endpoints) is for whoever
  owns it: RECEIVE on its queue (the application that reads a service's messages is the one that
  answers them), or its owner (``CREATE SERVICE s AUTHORIZATION p``);
* ``GRANT SEND ON SERVICE::t TO p``: p may begin dialogs *to* t (SQL Server: the principal that
  owns the initiating service needs SEND on the target service). A target on another instance
  checks that on arrival, against the grant to the peer instance's principal
  (``GRANT SEND ON SERVICE::t TO [peer-<instance>]``, the remote service binding's part);
* ``GRANT RECEIVE ON q TO p``: p may RECEIVE from q through the queue service, commit receipts
  on q, and act as q's services.

Trusted without grants: a request with no principal (the shared ``requests`` topic of a stack
without security, writable by no one but the admin on a secured one), the deployment's owners
(``ksb acl apply --owner``, like SQL Server's db_owner), and the service principals that send for
others: the activation service and the external activator (activated tasks run as them), the
queue service (its dead letters and fences) and the operator. A revoke takes effect with the
catalog version that carries it, on every dispatcher, without a restart.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ksb.catalog.model import Catalog
from ksb.dialog.sources import Source
from ksb.errors import NotAuthorized
from ksb.security.principals import Role, peer_principal, role_of, service_principal

__all__ = ["OPEN", "Permissions"]

_TRUSTED_ROLES = (Role.ACTIVATION, Role.EXTERNAL_ACTIVATOR, Role.OPERATOR, Role.QUEUE)
_ROLE_SOURCES = {
    Role.ACTIVATION: Source.SERVICE,
    Role.EXTERNAL_ACTIVATOR: Source.SERVICE,
    Role.OPERATOR: Source.OPERATOR,
    Role.QUEUE: Source.QUEUE_SERVICE,
}


@dataclass(frozen=True)
class Permissions:
    """The grants of one catalog version, by principal, and who needs none."""

    send: frozenset[tuple[str, str]] = frozenset()
    """(principal, service) pairs granted SEND."""
    receive: frozenset[tuple[str, str]] = frozenset()
    """(principal, queue) pairs granted RECEIVE."""
    trusted: frozenset[str] = frozenset()
    enforced: bool = True
    instance: str = ""
    owners: frozenset[str] = frozenset()
    acting: frozenset[tuple[str, str]] = frozenset()
    """(principal, service) pairs: who may act as each local service (its owner, and whoever
    may RECEIVE from its queue)."""

    @classmethod
    def of(cls, catalog: Catalog, instance: str, owners: Iterable[str] = ()) -> Permissions:
        by_kind: dict[str, set[tuple[str, str]]] = {"SEND": set(), "RECEIVE": set()}
        for g in catalog.grants:
            by_kind[g.permission].add((g.principal, g.target))
        trusted = {service_principal(instance, role) for role in _TRUSTED_ROLES} | set(owners)
        acting = {(p, s.name) for s in catalog.services for p in (s.owner,) if p is not None}
        acting |= {
            (p, s.name) for s in catalog.services for p, q in by_kind["RECEIVE"] if q == s.queue
        }
        return cls(
            frozenset(by_kind["SEND"]),
            frozenset(by_kind["RECEIVE"]),
            frozenset(trusted),
            instance=instance,
            owners=frozenset(owners),
            acting=frozenset(acting),
        )

    def source_of(self, principal: str | None) -> Source:
        """What a requests topic's principal may write (`ksb.dialog.sources`)."""
        if principal is None:
            return Source.SHARED
        if principal in self.owners:
            return Source.OPERATOR
        role = role_of(self.instance, principal) if self.instance else None
        if role is None:
            return Source.APPLICATION
        return _ROLE_SOURCES.get(role, Source.NONE)

    def check_acts_as(self, principal: str | None, service: str, queue: str, what: str) -> None:
        """Refuse `what` (a BEGIN from `service`, a SEND on its endpoint, ...) unless `principal`
        owns `service`, whose queue is `queue`."""
        if self._free(principal) or (principal, service) in self.acting:
            return
        raise NotAuthorized(
            f"principal {principal!r} may not {what} as service {service!r}: it neither owns "
            f"the service nor may RECEIVE from its queue (GRANT RECEIVE ON [{queue}] TO "
            f"{principal}, or CREATE SERVICE [{service}] AUTHORIZATION {principal})"
        )

    def check_send(self, principal: str | None, target: str, what: str) -> None:
        """Refuse `what` (a BEGIN) unless `principal` may send to the `target` service."""
        if self._free(principal) or (principal, target) in self.send:
            return
        raise NotAuthorized(
            f"principal {principal!r} may not {what} to service {target!r}: it lacks SEND on "
            f"SERVICE::[{target}] (GRANT SEND ON SERVICE::[{target}] TO {principal})"
        )

    def check_peer_send(self, instance: str, target: str) -> None:
        """Refuse a dialog that broker instance `instance` begins with our `target` service
        unless the catalog grants that instance SEND on it."""
        peer = peer_principal(instance)
        if not self.enforced or (peer, target) in self.send:
            return
        raise NotAuthorized(
            f"broker instance {instance!r} may not begin dialogs with service {target!r}: it "
            f"lacks SEND on SERVICE::[{target}] (GRANT SEND ON SERVICE::[{target}] TO [{peer}])"
        )

    def check_receive(self, principal: str | None, queue: str, what: str) -> None:
        """Refuse `what` on `queue` unless `principal` may RECEIVE from it."""
        if self._free(principal) or (principal, queue) in self.receive:
            return
        raise NotAuthorized(
            f"principal {principal!r} may not {what} on queue {queue!r}: it lacks RECEIVE "
            f"on {queue} (GRANT RECEIVE ON [{queue}] TO {principal})"
        )

    def _free(self, principal: str | None) -> bool:
        return not self.enforced or principal is None or principal in self.trusted


OPEN = Permissions(enforced=False)
"""No checks: an engine before its dispatcher gives it the catalog's permissions (unit tests)."""
